"""Streaming training data: webdataset tar shards -> decoded, tokenized, full micro-batches.

Full guide: docs/data.md. In short:

Shards. ``data.train_shards`` is one or more sources joined by '::'; each is a brace pattern, a
glob, a .txt list (one url per line) or a url (local path, ``pipe:aws s3 cp s3://bucket/x.tar -``,
http(s)://, gs://). ``data.train_weights`` weighs the sources. Sample counts per shard come from
an index JSON (make-shards, make-synthetic), img2dataset ``*_stats.json`` or counting local tars.

Split. Rank r of W ranks and DataLoader worker w of that rank's K workers read one *stream*.
Policy 'exact': epoch e shuffles the shard list with seed (seed, e), the same on every rank;
rank r takes shards[r::W], worker w takes [w::K]. Every rank delivers the same number N_e of
batches in epoch e: the largest N that every stream can fill, given that the DataLoader takes
batch i of the rank from worker i % K. What a fuller stream holds beyond its share is dropped for
that epoch (less than about one shard per stream); the next epoch's reshuffle drops other
samples. Policy 'resampled': every worker draws shards with replacement from its own seeded
generator, and an epoch is ``data.epoch_batches`` batches per rank. Both never run a rank dry, so
no collective hangs.

Within a stream. Raw samples (undecoded bytes) pass a shuffle buffer reseeded every epoch, then
are decoded with PIL (JPEG ``Image.draft``), augmented (random resized crop, flips, 90 degree
rotations; off by default), normalised with the model's mean/std, and batched; one of the
image's captions is drawn. Augmentation and caption draws use a generator seeded by the sample
(seed, epoch, shard, key), so they do not depend on what came before.

Bad data. Missing or unreadable shard files, truncated tars, empty shards, corrupt images and
samples without an image or caption are skipped and counted by kind (``loader.bad_data()``);
the first examples of each kind are logged with their path, then one line per power of ten.
More than ``data.max_bad_fraction`` bad samples or shards stops the run with ``DataError``.

Resume. ``loader.state_dict()`` is the position after the last batch handed to the trainer
(not after the batches the workers prefetched): per worker the epoch, the samples taken from its
shuffle buffer, the batches delivered, the shards opened, its bad-data counts. A loader built
with ``state=`` replays each worker's current epoch up to that point without decoding and then
continues; it yields exactly the batches an uninterrupted loader would have yielded.
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import io
import itertools
import json
import logging
import random
import signal
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import braceexpand
import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from rsclip_ds.config import DataConfig
from rsclip_ds.tokenizer import tokenize

log = logging.getLogger(__name__)
_REMOTE_PREFIXES = ("pipe:", "http://", "https://", "gs://", "hf://", "ais://")
SHARD_KINDS = ("missing_shard", "unreadable_shard", "truncated_tar", "empty_shard")
SAMPLE_KINDS = ("corrupt_image", "missing_image", "missing_caption")
BAD_KINDS = SHARD_KINDS + SAMPLE_KINDS
STATE_VERSION = 1


class DataError(RuntimeError):
    """The training data is too broken to go on (see data.max_bad_fraction)."""


# --------------------------------------------------------------------------- shard lists

def _read_list(path: Path) -> list[str]:
    """A shard list: one url per line, '#' comments; relative paths are relative to the list."""
    lines = (ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines())
    return [ln if ln.startswith(_REMOTE_PREFIXES + ("file:",)) or Path(ln).is_absolute()
            else str(path.parent / ln) for ln in lines if ln]


def _expand_one(item: str, spec: str) -> list[str]:
    """One brace-expanded entry -> urls (glob, list file, remote url or existing local file)."""
    if item.startswith(_REMOTE_PREFIXES + ("file:",)):   # 'file:' opts out of the existence check
        return [item]
    local = item
    if any(c in local for c in "*?["):
        found = sorted(glob.glob(local))
    elif not Path(local).is_file():
        found = []
    elif local.endswith(".txt"):
        found = [url for line in _read_list(Path(local)) for url in _expand_one(line, spec)]
    else:
        found = [item]
    if not found:
        raise ValueError(f"data.train_shards {spec!r}: {item!r} matches no file; check the path "
                         "(a brace pattern, a glob, a .txt shard list or a pipe:/http(s): url)")
    return found


def expand_sources(spec: str) -> list[list[str]]:
    """'a-{000..009}.tar::more/*.tar' -> one url list per '::'-separated source."""
    sources = [[url for item in braceexpand.braceexpand(part.strip()) for url in _expand_one(item, spec)]
               for part in spec.split("::") if part.strip()]
    if not sources:
        raise ValueError(f"data.train_shards {spec!r} names no shards")
    return sources


def expand_urls(spec: str) -> list[str]:
    """'a-{000..009}.tar::more/*.tar::list.txt::pipe:cat x.tar' -> list of shard urls, in order."""
    return [url for source in expand_sources(spec) for url in source]


def derive_seed(*parts) -> int:
    """Stable 63-bit seed from ints/strings (Python's hash() of str is salted per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def shards_for_epoch(urls: Sequence[str], epoch: int, *, seed: int, rank: int, world_size: int,
                     worker: int = 0, num_workers: int = 1) -> list[str]:
    """The shards worker ``worker`` of rank ``rank`` reads in ``epoch``; disjoint, covering all."""
    order = list(urls)
    random.Random(derive_seed(seed, "shards", epoch)).shuffle(order)  # same on every rank
    return order[rank::world_size][worker::num_workers]


# --------------------------------------------------------------------------- shard sample counts

def _local(url: str) -> Path | None:
    return None if url.startswith(_REMOTE_PREFIXES) else Path(url.removeprefix("file:"))


def _index_entries(path: Path) -> dict[str, int]:
    """{shard file name: num_samples} from any [{"url", "num_samples"}] list in an index JSON."""
    data = json.loads(path.read_text())
    lists = [v for v in (data.values() if isinstance(data, dict) else [data]) if isinstance(v, list)]
    return {Path(e["url"]).name: int(e["num_samples"]) for lst in lists for e in lst
            if isinstance(e, dict) and "url" in e and "num_samples" in e}


def count_tar_samples(path: Path) -> int:
    """Distinct sample keys in a local tar (seeks over member data: headers only); a broken tar
    counts what precedes the break (reading it reports the break)."""
    keys = set()
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                if member.isfile():
                    keys.add(_split_member(member.name)[0])
    except (tarfile.TarError, EOFError, OSError):
        pass
    return len(keys)


def shard_counts(urls: Sequence[str], shard_index: str | None = None) -> dict[str, int]:
    """{url: samples}; from shard_index JSON(s), index.json beside a shard, img2dataset's
    <shard>_stats.json, or by counting a local tar (a missing file counts 0: it is reported as
    missing_shard when read)."""
    named: dict[str, int] = {}
    for part in (shard_index or "").split("::"):
        if part.strip():
            named.update(_index_entries(Path(part.strip())))
    beside: dict[Path, dict[str, int]] = {}
    counts = {}
    for url in urls:
        name = url.rstrip("/").rsplit("/", 1)[-1].split(" ")[-1]
        local = _local(url)
        if name in named:
            counts[url] = named[name]
            continue
        if local is None:
            raise ValueError(f"no sample count for {url!r}: name an index JSON in data.shard_index "
                             "(make-shards writes one), or use data.policy=resampled with "
                             "data.epoch_batches")
        if local.parent not in beside:
            idx = local.parent / "index.json"
            beside[local.parent] = _index_entries(idx) if idx.is_file() else {}
        stats = local.with_name(local.stem + "_stats.json")
        if local.name in beside[local.parent]:
            counts[url] = beside[local.parent][local.name]
        elif stats.is_file():
            counts[url] = int(json.loads(stats.read_text())["successes"])
        elif local.is_file():
            counts[url] = count_tar_samples(local)
        else:
            counts[url] = 0
    return counts


# --------------------------------------------------------------------------- the epoch plan

def _share(start: int, n: int, k: int, w: int) -> int:
    """How many of the batch indices start..start+n-1 fall to worker w of k (i % k == w)."""
    def below(x: int) -> int:
        return max(0, (x - w + k - 1) // k)
    return below(start + n) - below(start)


@dataclass
class EpochPlan:
    """Which shards each (rank, worker) stream reads and how many batches it delivers, per epoch.
    Pure and rank-independent: every rank computes the same plan."""

    sources: list[list[str]]
    weights: list[float]
    policy: str
    seed: int
    world_size: int
    num_workers: int            # requested per rank; 'exact' clamps it per rank (workers_of)
    micro: int
    counts: dict[str, int] | None = None
    epoch_batches: int | None = None
    _starts: list[int] = field(default_factory=lambda: [0])   # first batch index of each epoch
    _orders: dict[int, list[str]] = field(default_factory=dict)  # epoch -> shuffled shard list

    def __post_init__(self):
        if self.policy == "exact":   # whole-number weights repeat a source's shards
            self.urls = [u for src, wt in zip(self.sources, self.weights) for _ in range(int(wt)) for u in src]
        else:
            self.urls = [u for src in self.sources for u in src]

    def workers_of(self, rank: int) -> int:
        """Worker streams of ``rank`` (1 when the rank loads in its main process)."""
        k = max(1, self.num_workers)
        if self.policy == "exact":
            return max(1, min(k, len(range(rank, len(self.urls), self.world_size))))
        return k

    def shards(self, epoch: int, rank: int, worker: int) -> list[str]:
        """'exact' only: the shards of this stream in this epoch (as ``shards_for_epoch``, with
        the epoch's shuffle computed once: the plan asks for every rank and worker)."""
        if epoch not in self._orders:
            if len(self._orders) > 2:
                self._orders.pop(min(self._orders))
            order = list(self.urls)
            random.Random(derive_seed(self.seed, "shards", epoch)).shuffle(order)
            self._orders[epoch] = order
        return self._orders[epoch][rank::self.world_size][worker::self.workers_of(rank)]

    def draw(self, epoch: int, rank: int, worker: int) -> Iterator[str]:
        """'resampled' only: endless shard draws, source by weight, then uniform within it."""
        rng = random.Random(derive_seed(self.seed, "resample", epoch, rank, worker))
        cum = list(itertools.accumulate(self.weights))
        while True:
            src = self.sources[bisect.bisect_right(cum, rng.random() * cum[-1])]
            yield src[rng.randrange(len(src))]

    def batches(self, epoch: int) -> int:
        """Batches every rank delivers in ``epoch``."""
        return self.start(epoch + 1) - self.start(epoch)

    def _rank_batches(self, epoch: int, rank: int, start: int) -> int:
        k = self.workers_of(rank)
        caps = [sum(self.counts[u] for u in self.shards(epoch, rank, w)) // self.micro for w in range(k)]
        lo, hi = 0, sum(caps)        # largest n such that every worker can fill its share
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if all(_share(start, mid, k, w) <= caps[w] for w in range(k)):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def start(self, epoch: int) -> int:
        """Index (within the rank) of the first batch of ``epoch``."""
        while len(self._starts) <= epoch:
            e = len(self._starts) - 1
            n = self.epoch_batches if self.policy == "resampled" else \
                min(self._rank_batches(e, r, self._starts[e]) for r in range(self.world_size))
            if n == 0:
                raise DataError(f"epoch {e}: some rank/worker stream holds fewer than micro_batch_size="
                                f"{self.micro} samples; write more or smaller shards, lower "
                                "data.num_workers or the micro batch")
            self._starts.append(self._starts[e] + n)
        return self._starts[epoch]

    def worker_batches(self, epoch: int, rank: int, worker: int) -> int:
        n = self.start(epoch + 1) - self.start(epoch)
        return _share(self.start(epoch), n, self.workers_of(rank), worker)

    def digest(self) -> str:
        counts = [self.counts.get(u) for u in self.urls] if self.counts else None
        return hashlib.blake2b(json.dumps([self.sources, self.weights, counts]).encode(),
                               digest_size=8).hexdigest()


# --------------------------------------------------------------------------- bad data

def check_bad_fraction(bad: dict[str, int], samples: int, shards: int, limit: float, min_samples: int,
                       who: str, examples: dict[str, str]) -> None:
    """Raise DataError when more than ``limit`` of the samples or shards read were bad."""
    if samples < min_samples or limit >= 1:
        return
    bad_samples, bad_shards = sum(bad[k] for k in SAMPLE_KINDS), sum(bad[k] for k in SHARD_KINDS)
    for what, n, total in (("samples", bad_samples, samples), ("shards", bad_shards, shards)):
        if total and n / total > limit:
            counts = ", ".join(f"{k} {v}" for k, v in bad.items() if v)
            example = next((f"{k} at {p}" for k, p in examples.items()), "none logged")
            raise DataError(
                f"{who}: {n} of {total} {what} read were bad ({n / total:.1%} > data.max_bad_fraction="
                f"{limit}); counts: {counts}; e.g. {example}. Repair or drop those inputs, or raise "
                "data.max_bad_fraction (--set data.max_bad_fraction=0.2)")


# --------------------------------------------------------------------------- reading tars

def _split_member(name: str) -> tuple[str, str | None]:
    """'dir/key.ext.more' -> ('dir/key', 'ext.more') as webdataset groups (first dot of the base)."""
    head, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), (ext.lower() if dot else None)


class _Counter:
    """Bad-data counts and positions of one stream; `events` are examples for the main process."""

    EXAMPLES = 3   # examples per kind a worker sends (the counts are always complete)

    def __init__(self, state: dict):
        self.bad = {k: int(state.get("bad", {}).get(k, 0)) for k in BAD_KINDS}
        self.samples = int(state.get("samples", 0))   # samples taken from the buffer, good or bad
        self.shards = int(state.get("shards", 0))     # shards opened (for the bad-shard fraction)
        self.opened = 0                               # shards opened in this epoch
        self.closed = 0                               # ... and read to the end (errors reported)
        self.quiet_opened = self.quiet_closed = 0     # replay: shards already counted before resume
        self.events: list[tuple[str, str, str]] = []
        self.examples: dict[str, str] = {}
        self._sent = dict.fromkeys(BAD_KINDS, 0)

    def shard_opened(self) -> bool:
        """Count a newly opened shard; False while replaying a shard whose errors were counted
        before a resume (a shard's errors are known when it has been read to its end)."""
        self.opened += 1
        self.shards += self.opened > self.quiet_opened
        return self.opened > self.quiet_closed

    def report(self, kind: str, where: str, detail: str) -> None:
        self.bad[kind] += 1
        self.examples.setdefault(kind, f"{where} ({detail[:200]})")
        if self._sent[kind] < self.EXAMPLES:
            self._sent[kind] += 1
            self.events.append((kind, where, detail[:200]))


def _open(url: str):
    from webdataset.gopen import gopen   # local files, pipe:, http(s):, gs:, ...
    return gopen(url.removeprefix("file:"))


def read_shard(url: str, counter: _Counter) -> Iterator[dict]:
    """Samples ({"__key__", "__url__", ext: bytes}) of one tar; errors are counted, never raised."""
    count = counter.shard_opened()
    report = counter.report if count else (lambda *a: None)
    try:
        stream = _open(url)
    except FileNotFoundError as err:
        report("missing_shard", url, str(err))
        counter.closed = counter.opened
        return
    except OSError as err:
        report("unreadable_shard", url, str(err))
        counter.closed = counter.opened
        return
    status = [None, ""]    # (kind, detail) set by _tar_samples when the tar ends badly
    try:
        yield from _tar_samples(url, stream, status)
    finally:   # also when the consumer stopped early (GeneratorExit): then nothing is reported
        try:
            stream.close()
        except OSError as err:   # a pipe: command that failed (or was killed when we stopped early)
            if status[0] in (None, "empty_shard"):
                status[:] = ["unreadable_shard", str(err)]
    if status[0] is not None:
        report(status[0], url, status[1])
    counter.closed = counter.opened


def _tar_samples(url: str, stream, status: list) -> Iterator[dict]:
    """Group tar members into samples by key. A plain ustar/GNU/pax reader: ~5x less Python
    per member than tarfile's stream mode, which matters next to a 2 ms JPEG decode."""
    sample, yielded = None, 0
    try:
        for name, data in _tar_members(stream):
            key, ext = _split_member(name)
            if ext is None:
                continue
            if sample is not None and sample["__key__"] != key:
                yielded += 1
                yield sample
                sample = None
            if sample is None:
                sample = {"__key__": key, "__url__": url}
            sample[ext] = data
        if sample is not None:
            yielded += 1
            yield sample
        elif yielded == 0:
            status[:] = ["empty_shard", "no samples"]
    except (tarfile.TarError, EOFError, OSError, ValueError) as err:
        # the sample being read when the tar broke is dropped with it
        status[:] = ["truncated_tar" if yielded or sample else "unreadable_shard", f"{type(err).__name__}: {err}"]


def _read_exactly(stream, n: int) -> bytes:
    data = stream.read(n)
    while len(data) < n:    # pipes and sockets return short reads
        more = stream.read(n - len(data))
        if not more:
            raise EOFError(f"unexpected end of data ({len(data)} of {n} bytes)")
        data += more
    return data


def _tar_members(stream) -> Iterator[tuple[str, bytes]]:
    """(name, data) of the regular files in a tar stream; raises on a broken or truncated tar."""
    long_name = None
    while True:
        header = stream.read(512)
        if len(header) < 512:
            if not header:
                return          # end without the zero blocks (still a complete tar for us)
            header += _read_exactly(stream, 512 - len(header))
        if header.count(0) == 512:
            return              # end-of-archive block
        if sum(header[:148]) + 256 + sum(header[156:]) != int(header[148:156].strip(b"\0 ") or b"-1", 8):
            raise tarfile.ReadError("bad tar header checksum (not a tar file, or corrupt)")
        size_field = header[124:136]
        size = int.from_bytes(size_field[1:], "big") if size_field[0] & 0x80 else int(size_field.strip(b"\0 ") or b"0", 8)
        kind = header[156:157]
        data = _read_exactly(stream, size) if size else b""
        if size % 512:
            _read_exactly(stream, 512 - size % 512)
        if kind == b"L":                                     # GNU long name of the next member
            long_name = data.rstrip(b"\0").decode("utf-8")
        elif kind == b"x":                                   # pax header: path= overrides the name
            for record in data.decode("utf-8").split("\n"):
                _, _, kv = record.partition(" ")
                if kv.startswith("path="):
                    long_name = kv[5:]
        elif kind in (b"0", b"\0", b"7"):
            name = header[:100].rstrip(b"\0").decode("utf-8")
            prefix = header[345:500].rstrip(b"\0") if header[257:262] == b"ustar" else b""
            if prefix:
                name = prefix.decode("utf-8") + "/" + name
            yield (long_name or name), data
            long_name = None
        else:                                                # directories, links, global pax: skip
            long_name = None if kind != b"g" else long_name


def _shuffled(src: Iterator[dict], bufsize: int, rng: random.Random) -> Iterator[dict]:
    """Reservoir-style shuffle buffer: hold ``bufsize`` samples, emit a random one per new one."""
    if bufsize <= 1:
        yield from src
        return
    buf: list[dict] = []
    for sample in src:
        buf.append(sample)
        if len(buf) >= bufsize:
            i = rng.randrange(len(buf))
            buf[i], buf[-1] = buf[-1], buf[i]
            yield buf.pop()
    rng.shuffle(buf)
    yield from buf


# --------------------------------------------------------------------------- samples

@dataclass
class Preprocess:
    """Raw sample bytes -> (uint8 (S, S, 3) pixels, caption) or None (counted as bad)."""

    size: int
    image_keys: list[str]
    caption_keys: list[str]
    crop: tuple[float, float] | None = None
    hflip: bool = False
    vflip: bool = False
    rot90: bool = False

    def captions(self, sample: dict) -> list[str]:
        key = next((k for k in self.caption_keys if k in sample), None)
        if key is None:
            return []
        text = sample[key].decode("utf-8", errors="replace")
        if key.endswith("json"):
            obj = json.loads(text)
            caps = obj.get("captions") or ([obj["caption"]] if obj.get("caption") else [])
            return [c.strip() for c in caps if c and c.strip()]
        return [line.strip() for line in text.splitlines() if line.strip()]

    def image(self, data: bytes, rng: random.Random) -> np.ndarray:
        img = Image.open(io.BytesIO(data))
        # JPEG: decode at the smallest 1/2^k scale still >= what the crop needs (~2x faster)
        need = self.size if self.crop is None else int(np.ceil(self.size / np.sqrt(self.crop[0])))
        img.draft("RGB", (need, need))
        img.load()                 # decodes: a corrupt file raises here
        if img.mode != "RGB":      # (JPEG drafts decode straight to RGB: no copy then)
            img = img.convert("RGB")
        box = None
        if self.crop is not None:
            w, h = img.size
            area = w * h * rng.uniform(*self.crop)
            aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
            cw = min(w, max(1, round(np.sqrt(area * aspect))))
            ch = min(h, max(1, round(np.sqrt(area / aspect))))
            x0, y0 = rng.randint(0, w - cw), rng.randint(0, h - ch)
            box = (x0, y0, x0 + cw, y0 + ch)
        if box is not None or img.size != (self.size, self.size):
            img = img.resize((self.size, self.size), Image.Resampling.BICUBIC, box=box)  # squash
        if self.hflip and rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if self.vflip and rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_TOP_BOTTOM)
        if self.rot90:
            turn = rng.randrange(4)
            if turn:
                img = img.transpose([Image.Transpose.ROTATE_90, Image.Transpose.ROTATE_180,
                                     Image.Transpose.ROTATE_270][turn - 1])
        return np.asarray(img, dtype=np.uint8)   # (S, S, 3)

    def __call__(self, sample: dict, rng: random.Random, counter: _Counter) -> tuple | None:
        where = f"{sample['__url__']}:{sample['__key__']}"
        key = next((k for k in self.image_keys if k in sample), None)
        if key is None:
            members = sorted(k for k in sample if not k.startswith("__"))
            counter.report("missing_image", where, f"members {members}; data.image_key is "
                           f"{';'.join(self.image_keys)}")
            return None
        try:
            captions = self.captions(sample)
        except (ValueError, AttributeError) as err:
            captions, detail = [], f"unreadable caption: {err}"
        else:
            detail = (f"members {sorted(k for k in sample if not k.startswith('__'))}; "
                      f"data.caption_key is {';'.join(self.caption_keys)}")
        if not captions:
            counter.report("missing_caption", where, detail)
            return None
        caption = captions[rng.randrange(len(captions))] if len(captions) > 1 else captions[0]
        try:
            pixels = self.image(sample[key], rng)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
            counter.report("corrupt_image", where, f"{type(err).__name__}: {err}")
            return None
        return pixels, caption, sample["__key__"]


# --------------------------------------------------------------------------- one stream

def _worker() -> tuple[int, int]:
    """(worker id, worker count) of the calling DataLoader worker; (0, 1) in the main process."""
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


_FRESH = {"epoch": 0, "taken": 0, "done": 0, "opened": 0, "closed": 0}


class StreamDataset(IterableDataset):
    """The endless batch stream of every worker of one rank (one DataLoader worker each).

    Worker ``pid`` plays stream ``(pid + offset) % k``: a resumed DataLoader starts its round
    robin at worker 0, the uninterrupted one would continue with stream ``batches % k``."""

    def __init__(self, plan: EpochPlan, rank: int, prep: Preprocess, collate: "Collate",
                 cfg: DataConfig, starts: list[dict | None], offset: int):
        super().__init__()
        self.plan, self.rank, self.prep, self.collate = plan, rank, prep, collate
        # a shard's place in the shard list, not its path, seeds its samples' draws: the same
        # data under another folder (another machine, a test's tmp dir) gives the same run
        self.shard_ids = {url: i for i, url in enumerate(plan.urls)}
        self.cfg, self.starts, self.offset = cfg, starts, offset

    def __iter__(self) -> Iterator[dict]:
        pid, k = _worker()
        stream = (pid + self.offset) % k
        start = self.starts[stream] or _FRESH
        counter = _Counter(start)
        epoch, taken, done, opened, closed = (int(start[x]) for x in ("epoch", "taken", "done", "opened", "closed"))
        while True:
            quota = self.plan.worker_batches(epoch, self.rank, stream)
            if done < quota:
                yield from self._epoch(epoch, stream, quota, (taken, done, opened, closed), counter)
            epoch, taken, done, opened, closed = epoch + 1, 0, 0, 0, 0

    def _raw(self, epoch: int, stream: int, counter: _Counter, rng: random.Random) -> Iterator[dict]:
        """Shuffled, undecoded samples of this stream's epoch. 'exact' reads its shards again
        (after the buffer drained the first pass) when bad data left them short of the quota;
        'resampled' draws shards forever."""
        plan, bufsize = self.plan, self.cfg.shuffle_buffer
        if plan.policy == "resampled":
            yield from _shuffled(self._read(plan.draw(epoch, self.rank, stream), 2 * len(plan.urls) + 10,
                                            stream, counter), bufsize, rng)
            return
        shards = plan.shards(epoch, self.rank, stream)
        while True:
            yield from _shuffled(self._read(shards, len(shards), stream, counter), bufsize, rng)

    def _read(self, shards, limit: int, stream: int, counter: _Counter) -> Iterator[dict]:
        empty_run = 0
        for url in shards:
            got = 0
            for sample in read_shard(url, counter):
                got += 1
                yield sample
            empty_run = 0 if got else empty_run + 1
            if empty_run >= limit:
                raise DataError(f"rank {self.rank} stream {stream}: the last {empty_run} shards it read "
                                f"held no readable sample (last: {url}); counts so far: "
                                f"{ {k: v for k, v in counter.bad.items() if v} }. Check data.train_shards")

    def _epoch(self, epoch: int, stream: int, quota: int, position: tuple[int, int, int, int],
               counter: _Counter) -> Iterator[dict]:
        """Batches of one epoch from ``position`` = (samples taken from the buffer, batches done,
        shards opened, shards read to their end) on."""
        (taken, done, opened, closed), seed, batch = position, self.plan.seed, []
        counter.opened = counter.closed = 0
        counter.quiet_opened, counter.quiet_closed = opened, closed
        rng = random.Random(derive_seed(seed, "buffer", epoch, self.rank, stream))
        raw = self._raw(epoch, stream, counter, rng)
        cfg, who = self.cfg, f"rank {self.rank} stream {stream}"
        try:
            for n, sample in enumerate(raw, start=1):
                if n <= taken:
                    continue   # resume: replayed without decoding
                counter.samples += 1
                sample_rng = random.Random(derive_seed(seed, "sample", epoch,
                                                       self.shard_ids.get(sample["__url__"], sample["__url__"]),
                                                       sample["__key__"]))
                item = self.prep(sample, sample_rng, counter)
                if item is None:   # the stream checks too: a rank may never see a batch otherwise
                    check_bad_fraction(counter.bad, counter.samples, counter.shards, cfg.max_bad_fraction,
                                       cfg.bad_data_min_samples, who, counter.examples)
                    continue
                batch.append(item)
                if len(batch) == self.collate.micro:
                    done += 1
                    meta = {"stream": stream, "epoch": epoch, "taken": n, "done": done,
                            "opened": counter.opened, "closed": counter.closed, "bad": dict(counter.bad), "samples": counter.samples,
                            "shards": counter.shards, "events": counter.events}
                    counter.events = []
                    yield {**self.collate(batch), "_meta": meta}
                    batch = []
                    if done == quota:
                        return
        finally:
            raw.close()


class Collate:
    """[(pixels uint8 (S,S,3), caption, key)] -> {"pixel_values": (B,3,S,S) float32 normalised,
    "input_ids": (B,L) int64[, "keys"]}. Runs in the worker: the float32 conversion (~10% of a
    decode) stays off the trainer's process, which drives the GPU."""

    def __init__(self, tokenizer, max_text_length: int, micro: int, mean, std, return_keys: bool = False):
        self.tokenizer, self.max_text_length, self.micro = tokenizer, max_text_length, micro
        std = np.asarray(std, np.float32).reshape(1, 3, 1, 1)
        self.scale = (1.0 / (255.0 * std)).astype(np.float32)                 # (x/255 - mean) / std
        self.shift = (-np.asarray(mean, np.float32).reshape(1, 3, 1, 1) / std).astype(np.float32)
        self.return_keys = return_keys

    def __call__(self, items: list[tuple]) -> dict:
        pixels = np.ascontiguousarray(np.stack([it[0] for it in items]).transpose(0, 3, 1, 2))  # (B,3,S,S) u8
        tensor = torch.empty(pixels.shape, dtype=torch.float32)
        if get_worker_info() is not None:   # written once, straight into memory the main process maps
            storage = tensor._typed_storage()._new_shared(tensor.numel(), device="cpu")   # as default_collate
            tensor = tensor.new(storage).resize_(pixels.shape)
        out = tensor.numpy()
        # numpy: one pass uint8 -> scaled float32, one add (this CPU's torch takes ~1.3x longer)
        np.multiply(pixels, self.scale, out=out, casting="unsafe")
        out += self.shift
        batch = {"pixel_values": tensor,                                          # (B, 3, S, S)
                 "input_ids": tokenize(self.tokenizer, [it[1] for it in items], self.max_text_length)}
        if self.return_keys:
            batch["keys"] = [it[2] for it in items]
        return batch


# --------------------------------------------------------------------------- the loader

def _split_keys(keys: str) -> list[str]:
    return [k.strip().lower() for k in keys.split(";") if k.strip()]


class TrainLoader:
    """Iterable of micro-batches for one rank, with a resumable position and bad-data counts."""

    def __init__(self, plan: EpochPlan, rank: int, cfg: DataConfig, prep: Preprocess, collate: Collate,
                 state: dict | None = None):
        self.plan, self.rank, self.cfg, self.prep, self.collate = plan, rank, cfg, prep, collate
        self.streams = plan.workers_of(rank)
        self.num_workers = self.streams if cfg.num_workers > 0 else 0   # DataLoader processes
        self.batches = 0                                   # handed to the trainer
        self._streams: list[dict | None] = [None] * self.streams
        self.examples: dict[str, str] = {}                 # kind -> a path where it happened
        if state is not None:
            self._check(state)
            self.batches, self._streams = int(state["batches"]), list(state["streams"])

    # ---- position
    def _identity(self) -> dict:
        return {"version": STATE_VERSION, "policy": self.plan.policy, "seed": self.plan.seed,
                "rank": self.rank, "world_size": self.plan.world_size, "micro_batch_size": self.plan.micro,
                "streams": self.streams, "shards": self.plan.digest(), "epoch_batches": self.plan.epoch_batches}

    def state_dict(self) -> dict:
        """JSON-serialisable position after the last batch handed out (see the module doc)."""
        done = [s for s in self._streams if s]
        return {**self._identity(), "batches": self.batches, "streams": [dict(s) if s else None for s in self._streams],
                "epoch": max((s["epoch"] for s in done), default=0), "bad": self.bad_data(),
                "samples_seen": self.samples_seen}

    def _check(self, state: dict) -> None:
        fixes = {"seed": "run with the seed of the saved run", "world_size": "launch as many ranks as the "
                 "saved run", "rank": "load the state saved by this rank", "micro_batch_size": "keep "
                 "batch.micro_batch_size", "streams": "keep data.num_workers (streams per rank)",
                 "shards": "keep data.train_shards / data.train_weights and the shard sample counts (index JSON)", "policy": "keep data.policy",
                 "epoch_batches": "keep data.epoch_batches", "version": "resume with the same rsclip_ds"}
        saved = {k: state.get(k) for k in fixes}
        saved["streams"] = len(state.get("streams") or [])
        mine = self._identity()
        diffs = [f"{k}: saved {saved[k]!r}, now {mine[k]!r} ({fixes[k]})" for k in fixes if saved[k] != mine[k]]
        if diffs:
            raise ValueError("cannot resume the data position: " + "; ".join(diffs) +
                             ". Or start the data from scratch without the saved data state.")

    # ---- bad data
    def bad_data(self) -> dict[str, int]:
        """Bad inputs skipped on this rank so far, by kind (every kind listed, zeros included)."""
        return {k: sum(s["bad"].get(k, 0) for s in self._streams if s) for k in BAD_KINDS}

    @property
    def samples_seen(self) -> int:
        """Samples this rank's streams took from their buffers (good and bad), as of the last batch."""
        return sum(s["samples"] for s in self._streams if s)

    def _on_batch(self, meta: dict) -> None:
        before = self.bad_data()
        for kind, where, detail in meta.pop("events"):
            self.examples.setdefault(kind, f"{where} ({detail})")
            log.warning("rank %d skipped bad data (%s) %s: %s", self.rank, kind, where, detail)
        self._streams[meta.pop("stream")] = meta
        self.batches += 1
        after = self.bad_data()
        for kind in BAD_KINDS:   # one line per power of ten, whatever the examples were
            crossed = [p for p in (10 ** i for i in range(1, 12)) if before[kind] < p <= after[kind]]
            if crossed:
                log.warning("rank %d: %d %s so far (%d samples read)", self.rank, after[kind], kind,
                            self.samples_seen)
        self._check_fraction(after)

    def _check_fraction(self, bad: dict[str, int]) -> None:
        shards = sum(s["shards"] for s in self._streams if s)
        check_bad_fraction(bad, self.samples_seen, shards, self.cfg.max_bad_fraction,
                           self.cfg.bad_data_min_samples, f"rank {self.rank}", self.examples)

    # ---- iteration
    def __iter__(self) -> Iterator[dict]:
        """Batches from the current position on (a second iter() continues, it does not restart)."""
        dataset = StreamDataset(self.plan, self.rank, self.prep, self.collate, self.cfg,
                                starts=list(self._streams), offset=self.batches % self.streams)
        # batch_size=None: batching happens in the stream (one tokenizer call per batch); the
        # DataLoader takes batch i from worker i % workers, which the epoch plan relies on.
        loader = DataLoader(dataset, batch_size=None, num_workers=self.num_workers,
                            persistent_workers=False, pin_memory=torch.cuda.is_available(),
                            prefetch_factor=2 if self.num_workers else None,
                            worker_init_fn=_ignore_sigterm if self.num_workers else None)
        for batch in loader:
            self._on_batch(batch.pop("_meta"))
            yield batch


def _ignore_sigterm(_worker_id: int) -> None:
    """Workers outlive the first SIGTERM: the launcher and schedulers signal a rank's whole
    process tree, and a worker dying of it made the rank raise instead of saving its
    pre-emption checkpoint (docs/checkpoints.md). A second SIGTERM -- the DataLoader's or
    multiprocessing's terminate() at shutdown -- ends the worker as usual."""
    def first(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    signal.signal(signal.SIGTERM, first)


def build_epoch_plan(cfg: DataConfig, *, micro_batch_size: int, world_size: int, seed: int) -> EpochPlan:
    """Shard list, weights and counts -> the plan every rank shares (validates the combination)."""
    if cfg.train_shards is None:
        raise ValueError("data.train_shards is not set; point it at tar shards "
                         "(e.g. --set data.train_shards='data/train-{000000..000007}.tar')")
    sources = expand_sources(cfg.train_shards)
    weights = list(cfg.train_weights) if cfg.train_weights is not None else [1.0] * len(sources)
    if len(weights) != len(sources) or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"data.train_weights {cfg.train_weights} needs one non-negative weight per "
                         f"'::'-separated source of data.train_shards ({len(sources)}), not all zero")
    if cfg.policy == "exact" and any(w != int(w) for w in weights):
        raise ValueError(f"data.train_weights {weights}: with data.policy=exact a weight is how often a "
                         "source's shards appear per epoch, a whole number; use data.policy=resampled "
                         "for fractional weights")
    plan = EpochPlan(sources, weights, cfg.policy, seed, world_size, cfg.num_workers, micro_batch_size)
    if cfg.policy == "exact" or cfg.epoch_batches is None:
        plan.counts = shard_counts(plan.urls, cfg.shard_index)
    if cfg.policy == "resampled":
        plan.epoch_batches = cfg.epoch_batches or sum(plan.counts.values()) // (world_size * micro_batch_size)
        if plan.epoch_batches < 1:
            raise ValueError(f"{sum(plan.counts.values())} samples make no batch of {micro_batch_size} per "
                             f"rank on {world_size} ranks; set data.epoch_batches")
    elif len(plan.urls) < world_size:
        raise ValueError(f"{len(plan.urls)} training shard(s) cannot feed {world_size} ranks: each rank "
                         "needs at least one. Write more, smaller shards (`rsclip-ds make-shards "
                         "--shard-size` / `make-synthetic --shard-size` smaller), use data.policy=resampled, "
                         "or launch fewer ranks.")
    return plan


def build_train_loader(cfg: DataConfig, *, tokenizer, image_size: int, image_mean, image_std,
                       max_text_length: int, micro_batch_size: int, rank: int, world_size: int,
                       seed: int, return_keys: bool = False, flip: bool = False,
                       state: dict | None = None) -> TrainLoader:
    """Endless iterable of full micro-batches for ``rank`` (see the module docstring).

    ``flip=True`` forces data.hflip on. ``state``: a ``loader.state_dict()`` to resume from;
    a state saved with another seed, world size, worker count, shard list or micro batch is a
    ValueError that names the difference."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    plan = build_epoch_plan(cfg, micro_batch_size=micro_batch_size, world_size=world_size, seed=seed)
    if plan.policy == "exact" and cfg.num_workers > plan.workers_of(rank):
        log.warning("rank %d has %d shard(s) for data.num_workers=%d; using %d worker(s) so that "
                    "none idles", rank, len(range(rank, len(plan.urls), world_size)), cfg.num_workers,
                    plan.workers_of(rank))
    prep = Preprocess(image_size, _split_keys(cfg.image_key), _split_keys(cfg.caption_key),
                      crop=cfg.random_resized_crop, hflip=cfg.hflip or flip, vflip=cfg.vflip, rot90=cfg.rot90)
    collate = Collate(tokenizer, max_text_length, micro_batch_size, image_mean, image_std, return_keys)
    return TrainLoader(plan, rank, cfg, prep, collate, state=state)

"""Streaming training data: webdataset tar shards -> decoded, tokenized, full micro-batches.

Full guide: docs/guides/data.md. In short:

The parts: shard specs and counts (sources.py), which samples each rank and worker reads per
epoch and how many batches it delivers (schedule.py: under 'exact' an epoch is every sample less
than one global batch), tar reading (tar.py), decoding and augmentation (transforms.py), bad-data
counting (bad.py). This module runs them: one stream per DataLoader worker.

Within a stream. Raw samples (undecoded bytes) pass a shuffle buffer reseeded every epoch, then
are decoded (transforms.py: simplejpeg at a reduced DCT scale and torch's uint8 bicubic for
JPEGs, PIL for the rest), augmented (random resized crop, flips, 90 degree rotations; off by
default) and batched as uint8 pixels, a quarter of float32's bytes through
shared memory and to the device: the model normalises them there (model.normalize_pixels); one
of the image's captions is drawn. Augmentation and caption draws use a generator seeded by the sample
(seed, epoch, shard, key), so they do not depend on what came before.

Bad data. Missing or unreadable shard files, truncated tars, empty shards, corrupt images and
samples without an image or caption are skipped and counted by kind (``loader.bad_data()``);
the first examples of each kind are logged with their path, then one line per power of ten.
More than ``data.max_bad_fraction`` bad samples or shards stops the run with ``DataError``.

Workers and shared memory. ``data.num_workers=auto`` shares the node's cores among its ranks
(resolve.loader_workers); worker batches travel through /dev/shm, whose free space the Trainer checks
at start-up against what the loaders of the node can hold (check_shared_memory, shm.py). A worker
that dies (the OOM killer's SIGKILL) is named and replaced at the same position (workers.py).

Resume. ``loader.state_dict()`` is the position after the last batch handed to the trainer
(not after the batches the workers prefetched): per worker the epoch, the samples taken from its
shuffle buffer, the batches delivered, the pieces (shard parts) opened, its bad-data counts. A
loader built with ``state=`` replays each worker's current epoch up to that point without
decoding and then continues; it yields exactly the batches an uninterrupted loader would have
yielded. A loader built with ``state={"remap_from": [every old rank's state]}`` continues a run
saved on another number of ranks (workers, micro batch): remap.py says what it keeps.

What was delivered. ``loader.tap(index, epoch, keys)``, when set, hears every batch handed out:
its index on the rank, its epoch and its samples' ``__key__``s (``loader.schedule.coverage(e)``
says the same from the counts).
"""

from __future__ import annotations

import logging
import random
import signal
from functools import partial
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from rsclip_ds.config import ConfigError, DataConfig
from rsclip_ds.data.bad import BAD_KINDS, DataError, StreamCounter, check_bad_fraction
from rsclip_ds.data.filter_counts import kept_counts, kept_counts_over_ranks
from rsclip_ds.data.remap import READABLE_VERSIONS, STATE_VERSION, Remap, remap_state
from rsclip_ds.data.schedule import EpochSchedule, Piece, build_epoch_schedule, derive_seed
from rsclip_ds.data.shm import PREFETCH_FACTOR
from rsclip_ds.data.sources import shard_counts, shard_counts_from_rank0
from rsclip_ds.data.tar import read_piece
from rsclip_ds.data.tokenizer import tokenize
from rsclip_ds.data.transforms import ImageTransform, SampleDecoder
from rsclip_ds.data.where import Where, json_columns
from rsclip_ds.data.workers import LoaderWorkerDied, Supervisor, WorkerDeath, available_cores

log = logging.getLogger("rsclip_ds.data")


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


# --------------------------------------------------------------------------- one stream

def _worker() -> tuple[int, int]:
    """(worker id, worker count) of the calling DataLoader worker; (0, 1) in the main process."""
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class _Keep:
    """data.where on a sample's raw .json member, as filter_counts.py counts it (SampleDecoder.keep)."""

    def __init__(self, where: Where):
        self.where = where

    def __call__(self, raw: bytes | None) -> bool:
        return self.where(json_columns(raw))


_FRESH = {"epoch": 0, "taken": 0, "done": 0, "opened": 0, "closed": 0}


class StreamDataset(IterableDataset):
    """The endless batch stream of every worker of one rank (one DataLoader worker each).

    Worker ``pid`` plays stream ``(pid + offset) % k``: a resumed DataLoader starts its round
    robin at worker 0, the uninterrupted one would continue with stream ``batches % k``."""

    def __init__(self, schedule: EpochSchedule, rank: int, prep: SampleDecoder, collate: "Collate",
                 cfg: DataConfig, starts: list[dict | None], offset: int):
        super().__init__()
        self.schedule, self.rank, self.prep, self.collate = schedule, rank, prep, collate
        # a shard's place in the shard list, not its path, seeds its samples' draws: the same
        # data under another folder (another machine, a test's tmp dir) gives the same run
        self.shard_ids = {url: i for i, url in enumerate(schedule.urls)}
        self.cfg, self.starts, self.offset = cfg, starts, offset
        self._filter_limit = max(1000, 2 * sum((schedule.counts or {}).values()))
        # 'exact' + data.where: the streams' ranges count kept samples, so the filter runs as the
        # shards are read (build_train_loader's SampleDecoder then has none)
        self.keep = _Keep(Where.parse(cfg.where)) if schedule.policy == "exact" and cfg.where else None

    def __iter__(self) -> Iterator[dict]:
        pid, k = _worker()
        stream = (pid + self.offset) % k
        start = self.starts[stream] or {**_FRESH, "epoch": self.schedule.first}
        counter = StreamCounter(start)
        epoch, taken, done, opened, closed = (int(start[x]) for x in ("epoch", "taken", "done", "opened", "closed"))
        while True:
            quota = self.schedule.worker_batches(epoch, self.rank, stream)
            if done < quota:
                yield from self._epoch(epoch, stream, quota, (taken, done, opened, closed), counter)
            epoch, taken, done, opened, closed = epoch + 1, 0, 0, 0, 0

    def _raw(self, epoch: int, stream: int, counter: StreamCounter, rng: random.Random) -> Iterator[dict]:
        """Shuffled, undecoded samples of this stream's epoch. 'exact' reads its pieces again
        (after the buffer drained the first pass) when bad data used up more than its slack;
        'resampled' draws shards forever."""
        schedule, bufsize = self.schedule, self.cfg.shuffle_buffer
        moved = schedule.transition if schedule.transition and schedule.transition.epoch == epoch else None
        if schedule.policy == "resampled":
            salt = moved.salt if moved else ()
            draws = (Piece(url, 0, 0, True) for url in schedule.draw(epoch, self.rank, stream, salt))
            yield from _shuffled(self._read(draws, 2 * len(schedule.urls) + 10, stream, counter, counted=False),
                                 bufsize, rng)
            return
        if moved:   # a remap's transition epoch: what the old streams left (remap.py)
            yield from moved.samples(self.rank, stream, counter, rng, bufsize, _shuffled, self.keep)
            return
        pieces = schedule.pieces(epoch, self.rank, stream)
        limit = max(1, sum(p.take > 0 for p in pieces))
        while True:
            yield from _shuffled(self._read(pieces, limit, stream, counter), bufsize, rng)

    def _read(self, pieces: Iterable[Piece], limit: int, stream: int, counter: StreamCounter,
              counted: bool = True) -> Iterator[dict]:
        """Raw samples of ``pieces`` ('resampled': whole drawn shards, ``counted`` False). ``limit``
        pieces in a row without a readable sample are a DataError; a piece that should hold none
        by the counts (an empty shard, one data.where keeps nothing of) is not one of them."""
        empty_run, carry = 0, [0]     # carry: data.where's rejects after the last sample yielded
        for p in pieces:
            got = 0
            for sample in read_piece(p.url, counter, p.skip, p.take, p.last, self.keep, carry):
                got += 1
                yield sample
            if got or p.take or not counted:
                empty_run = 0 if got else empty_run + 1
            if empty_run >= limit:
                raise DataError(f"rank {self.rank} stream {stream}: the last {empty_run} shards it read "
                                f"held no readable sample (last: {p.url}); counts so far: "
                                f"{ {k: v for k, v in counter.bad.items() if v} }. Check data.train_shards")

    def _epoch(self, epoch: int, stream: int, quota: int, position: tuple[int, int, int, int],
               counter: StreamCounter) -> Iterator[dict]:
        """Batches of one epoch from ``position`` = (samples taken from the buffer, batches done,
        shards opened, shards read to their end) on."""
        (taken, done, opened, closed), seed, batch = position, self.schedule.seed, []
        counter.opened = counter.closed = 0
        counter.quiet_opened, counter.quiet_closed = opened, closed
        rng = random.Random(derive_seed(seed, "buffer", epoch, self.rank, stream))
        raw = self._raw(epoch, stream, counter, rng)
        cfg, who = self.cfg, f"rank {self.rank} stream {stream}"
        try:
            for n, sample in enumerate(raw, start=1):
                if n <= taken:
                    continue   # resume: replayed without decoding
                filtered = sample.pop("__filtered__", 0)   # 'exact' + data.where: dropped as read, counted here
                counter.samples += 1 + filtered
                counter.bad["filtered_out"] += filtered
                sample_rng = random.Random(derive_seed(seed, "sample", epoch,
                                                       self.shard_ids.get(sample["__url__"], sample["__url__"]),
                                                       sample["__key__"]))
                item = self.prep(sample, sample_rng, counter)
                if item is None:   # the stream checks too: a rank may never see a batch otherwise
                    if counter.filtered_run > self._filter_limit:
                        raise DataError(f"{who}: data.where={cfg.where!r} dropped the last {counter.filtered_run} "
                                        "samples in a row (more than the whole shard list twice): it keeps "
                                        "nothing here. Check the filter against the samples' JSON")
                    check_bad_fraction(counter.bad, counter.samples, counter.shards, cfg.max_bad_fraction,
                                       cfg.bad_data_min_samples, who, counter.examples)
                    continue
                batch.append(item)
                if len(batch) == self.collate.micro:
                    done += 1
                    meta = {"stream": stream, "epoch": epoch, "taken": n, "done": done, "opened": counter.opened,
                            "closed": counter.closed, "bad": dict(counter.bad), "samples": counter.samples,
                            "shards": counter.shards, "events": counter.events, "keys": [it[2] for it in batch]}
                    counter.events = []
                    yield {**self.collate(batch), "_meta": meta}
                    batch = []
                    if done == quota:
                        return
        finally:
            raw.close()


class Collate:
    """[(pixels uint8 (S,S,3), caption, key)] -> {"pixel_values": (B,3,S,S) uint8 RGB,
    "input_ids": (B,L) int64[, "keys"]}.

    The pixels are stacked as decoded, channels last, once, straight into memory the main
    process maps (in a worker), and handed over as the (B,3,S,S) view of that (B,S,S,3) storage:
    the model normalises uint8 on the device and makes it contiguous there. Measured for 128 x
    256 px on this CPU: 18 ms per batch, against 22 ms for writing (B,3,S,S) (a strided copy) and
    80 ms for the normalised float32 this replaced (4x the bytes: 96 MiB a batch instead of 24)."""

    def __init__(self, tokenizer, max_text_length: int, micro: int, return_keys: bool = False, teacher=None):
        self.tokenizer, self.max_text_length, self.micro = tokenizer, max_text_length, micro
        self.return_keys, self.teacher = return_keys, teacher   # teacher: distill.teacher.TeacherInputs

    def __call__(self, items: list[tuple]) -> dict:
        captions = [it[1] for it in items]
        batch = {"pixel_values": _stack([it[0] for it in items]),                  # (B, 3, S, S) view
                 "input_ids": tokenize(self.tokenizer, captions, self.max_text_length)}
        if self.teacher is not None:   # the same views at the teacher's size (SampleDecoder.views)
            batch["teacher_pixel_values"] = _stack([it[3] for it in items])       # (B, 3, T, T) view
            batch["teacher_input_ids"] = tokenize(self.teacher.tokenizer, captions, self.teacher.max_text_length)
        if self.return_keys:
            batch["keys"] = [it[2] for it in items]
        return batch


def _stack(arrays: list[np.ndarray]) -> torch.Tensor:
    """[(S, S, 3) uint8] -> the (B, 3, S, S) view of one (B, S, S, 3) tensor (shared in a worker)."""
    b, (s, s2, _) = len(arrays), arrays[0].shape
    tensor = torch.empty((b, s, s2, 3), dtype=torch.uint8)
    if get_worker_info() is not None:   # written once, straight into memory the main process maps
        storage = tensor._typed_storage()._new_shared(tensor.numel(), device="cpu")   # as default_collate
        tensor = tensor.new(storage).resize_((b, s, s2, 3))
    np.stack(arrays, out=tensor.numpy())                                          # (B, S, S, 3) u8
    return tensor.permute(0, 3, 1, 2)


# --------------------------------------------------------------------------- the loader

def _split_keys(keys: str) -> list[str]:
    return [k.strip().lower() for k in keys.split(";") if k.strip()]


class TrainLoader:
    """Iterable of micro-batches for one rank, with a resumable position and bad-data counts."""

    def __init__(self, schedule: EpochSchedule, rank: int, cfg: DataConfig, prep: SampleDecoder, collate: Collate,
                 state: dict | None = None, pin_memory: bool = False):
        self.schedule, self.rank, self.cfg, self.prep, self.collate = schedule, rank, cfg, prep, collate
        self.pin_memory = pin_memory
        self.streams = schedule.workers_of(rank)
        self.num_workers = self.streams if schedule.num_workers > 0 else 0   # DataLoader processes
        self.batches = 0                                   # handed to the trainer
        self._streams: list[dict | None] = [None] * self.streams
        self.examples: dict[str, str] = {}                 # kind -> a path where it happened
        self.remap: Remap | None = None                    # set when the run was remapped (remap.py)
        self.carried = {"bad": dict.fromkeys(BAD_KINDS, 0), "samples": 0, "shards": 0}   # old ranks' counts
        self.deaths: list[WorkerDeath] = []                # workers that died (workers.py)
        self.on_worker_death: Callable[[str], None] | None = None   # the Trainer's: ask for an agreed stop
        # tap(batch index, epoch, sample keys) after each batch handed out: what the rank delivered,
        # read back by tests (and any caller that logs coverage) without return_keys in the batches
        self.tap: Callable[[int, int, list[str]], None] | None = None
        self._supervisor: Supervisor | None = None
        self.local_world_size = 1                          # for the numbers of a worker death (set by the builder)
        if state is not None and "remap_from" in state:
            self.remap, self.carried = remap_state(state["remap_from"], schedule, rank, cfg.shuffle_buffer)
            self.remap.apply(schedule)
            self.batches = self.remap.start
            if rank == 0:
                log.info(self.remap.describe())
        elif state is not None:
            self._check(state)
            self.batches, self._streams = int(state["batches"]), list(state["streams"])
            self.carried = state.get("carried", self.carried)
            if state.get("remap"):
                self.remap = Remap.from_state(state["remap"])
                self.remap.apply(schedule)

    # ---- position
    def _identity(self) -> dict:
        return {"version": STATE_VERSION, "policy": self.schedule.policy, "seed": self.schedule.seed,
                "rank": self.rank, "world_size": self.schedule.world_size, "micro_batch_size": self.schedule.micro,
                "streams": self.streams, "shards": self.schedule.digest(), "epoch_batches": self.schedule.epoch_batches}

    def state_dict(self) -> dict:
        """JSON-serialisable position after the last batch handed out (see the module doc)."""
        done = [s for s in self._streams if s]
        return {**self._identity(), "batches": self.batches, "streams": [dict(s) if s else None for s in self._streams],
                "epoch": max((s["epoch"] for s in done), default=self.schedule.first), "bad": self.bad_data(),
                "samples_seen": self.samples_seen, "shuffle_buffer": self.cfg.shuffle_buffer,
                "remap": self.remap.to_state() if self.remap else None, "carried": self.carried}

    def _check(self, state: dict) -> None:
        fixes = {"seed": "run with the seed of the saved run", "world_size": "launch as many ranks as the "
                 "saved run", "rank": "load the state saved by this rank", "micro_batch_size": "keep "
                 "batch.micro_batch_size", "streams": "keep data.num_workers (streams per rank), or set it "
                 "to auto, which takes the saved count",
                 "shards": "keep data.train_shards / data.train_weights / data.where and the shard sample counts (index JSON)", "policy": "keep data.policy",
                 "epoch_batches": "keep data.epoch_batches", "version": "resume with the rsclip_ds that saved it; "
                 "before version 3 the exact policy split whole shards, so a saved position means other samples",
                 "shuffle_buffer": "keep data.shuffle_buffer"}
        saved = {k: state.get(k) for k in fixes}
        saved["streams"] = len(state.get("streams") or [])
        mine = {**self._identity(), "shuffle_buffer": self.cfg.shuffle_buffer}
        if saved["version"] in READABLE_VERSIONS:
            saved["version"] = STATE_VERSION
        if saved["shuffle_buffer"] is None:   # version 1 did not save it
            saved["shuffle_buffer"] = mine["shuffle_buffer"]
        diffs = [f"{k}: saved {saved[k]!r}, now {mine[k]!r} ({fixes[k]})" for k in fixes if saved[k] != mine[k]]
        if diffs:
            raise ConfigError("cannot resume the data position: " + "; ".join(diffs) +
                             ". Or start the data from scratch without the saved data state.")

    # ---- bad data
    def bad_data(self) -> dict[str, int]:
        """Bad inputs skipped on this rank so far, by kind (every kind listed, zeros included);
        on rank 0 of a remapped run also the old ranks' (remap.py)."""
        return {k: self.carried["bad"].get(k, 0) + sum(s["bad"].get(k, 0) for s in self._streams if s)
                for k in BAD_KINDS}

    @property
    def samples_seen(self) -> int:
        """Samples this rank's streams took from their buffers (good and bad), as of the last batch;
        on rank 0 of a remapped run also the old ranks'."""
        return self.carried["samples"] + sum(s["samples"] for s in self._streams if s)

    def _on_batch(self, meta: dict) -> None:
        before = self.bad_data()
        for kind, where, detail in meta.pop("events"):
            self.examples.setdefault(kind, f"{where} ({detail})")
            log.warning("rank %d skipped bad data (%s) %s: %s", self.rank, kind, where, detail)
        keys = meta.pop("keys")
        self._streams[meta.pop("stream")] = meta
        self.batches += 1
        if self.tap is not None:
            self.tap(self.batches - 1, meta["epoch"], keys)
        after = self.bad_data()
        for kind in BAD_KINDS:   # one line per power of ten, whatever the examples were
            crossed = [p for p in (10 ** i for i in range(1, 12)) if before[kind] < p <= after[kind]]
            if crossed:
                log.warning("rank %d: %d %s so far (%d samples read)", self.rank, after[kind], kind,
                            self.samples_seen)
        self._check_fraction(after)

    def _check_fraction(self, bad: dict[str, int]) -> None:
        shards = self.carried["shards"] + sum(s["shards"] for s in self._streams if s)
        check_bad_fraction(bad, self.samples_seen, shards, self.cfg.max_bad_fraction,
                           self.cfg.bad_data_min_samples, f"rank {self.rank}", self.examples)

    @property
    def batch_bytes(self) -> int:
        """Bytes of one batch in shared memory: uint8 pixels (B,3,S,S) and int64 token ids (B,L), and
        a distillation teacher's (B,3,T,T) and (B,L_t)."""
        sizes, teacher = self.prep.views or (self.prep.transform.size,), self.collate.teacher
        lengths = self.collate.max_text_length + (teacher.max_text_length if teacher is not None else 0)
        return self.collate.micro * (sum(3 * s * s for s in sizes) + 8 * lengths)

    # ---- iteration
    def _dataloader(self) -> DataLoader:
        """A DataLoader from the current position (after the last batch handed out)."""
        dataset = StreamDataset(self.schedule, self.rank, self.prep, self.collate, self.cfg,
                                starts=list(self._streams), offset=self.batches % self.streams)
        # batch_size=None: batching happens in the stream (one tokenizer call per batch); the
        # DataLoader takes batch i from worker i % workers, which the epoch schedule relies on.
        return DataLoader(dataset, batch_size=None, num_workers=self.num_workers,
                          persistent_workers=False, pin_memory=self.pin_memory,
                          prefetch_factor=PREFETCH_FACTOR if self.num_workers else None,
                          worker_init_fn=_ignore_sigterm if self.num_workers else None)

    def __iter__(self) -> Iterator[dict]:
        """Batches from the current position on (a second iter() continues, it does not restart).
        A worker that dies is named and replaced at the same position once (workers.py); the
        `on_worker_death` callback hears of it; a second death raises LoaderWorkerDied."""
        self.schedule.start(self.schedule.epoch_of(self.batches) + 1)   # too little data: DataError here
        self._supervisor = Supervisor(self._dataloader, self.rank, self._worker_died)
        for batch in self._supervisor:
            self._on_batch(batch.pop("_meta"))
            yield batch

    def worker_pids(self) -> list[int]:
        """The pids of the live DataLoader workers of the current iteration."""
        return self._supervisor.pids() if self._supervisor is not None else []

    def _worker_died(self, death: WorkerDeath) -> None:
        """Said once in full (cause, numbers, fix); the callback and the exit lines carry the headline."""
        self.deaths.append(death)
        message = death.message(workers=self.num_workers, batch_bytes=self.batch_bytes, prefetch=PREFETCH_FACTOR,
                                local_ranks=self.local_world_size, shuffle_buffer=self.cfg.shuffle_buffer)
        if len(self.deaths) > 1 or self.on_worker_death is None:
            again = " (the second death of a worker of this rank)" if len(self.deaths) > 1 else ""
            raise LoaderWorkerDied(f"{message}{again}. This rank cannot go on; no checkpoint was saved (the last "
                                   "one is intact): fix the cause, then `rsclip-ds train ... --resume latest`")
        log.warning("%s. Its workers start again at the same data position; the run stops at the next sync "
                    "point, saving a checkpoint there, and exits with code 7", message)
        self.on_worker_death(f"{death.headline()} (the likely cause and the fix: rank {self.rank}'s warning)")


def _ignore_sigterm(_worker_id: int) -> None:
    """Workers outlive the first SIGTERM: the launcher and schedulers signal a rank's whole
    process tree, and a worker dying of it made the rank raise instead of saving its
    pre-emption checkpoint (docs/guides/checkpoints.md). A second SIGTERM -- the DataLoader's or
    multiprocessing's terminate() at shutdown -- ends the worker as usual."""
    def first(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    signal.signal(signal.SIGTERM, first)


def _is_rank_of_group(rank: int, world_size: int) -> bool:
    """Whether the caller is ``rank`` of a started process group of ``world_size`` > 1 ranks (a
    training run): then rank 0 reads the shard counts for all. Tests that play several ranks in
    one process have no group, and read them themselves."""
    import torch.distributed as dist

    return (world_size > 1 and dist.is_available() and dist.is_initialized()
            and (dist.get_rank(), dist.get_world_size()) == (rank, world_size))


def build_train_loader(cfg: DataConfig, *, tokenizer, image_size: int, max_text_length: int,
                       micro_batch_size: int, rank: int, world_size: int, seed: int,
                       return_keys: bool = False, state: dict | None = None, local_world_size: int = 1,
                       cores: int | None = None, workers: int | None = None, pin_memory: bool = False,
                       cache_dir: str | Path | None = None, teacher=None) -> TrainLoader:
    """Endless iterable of full micro-batches for ``rank`` (see the module docstring).

    ``workers``: workers per rank as the run resolved them (resolve.py's HostPlan); None: data.num_workers
    sized here by the same rule (resolve.loader_workers), from ``local_world_size`` (ranks on this node) and
    ``cores`` (default: this process's available_cores()). ``pin_memory``: batches in page-locked memory for
    the copy to a GPU -- the caller's accelerator decides (torch.cuda.is_available() would pin, and
    open a CUDA context on GPU 0, for CPU ranks on a GPU host). Batches carry uint8 pixels: the model
    normalises them with its own mean/std. ``state``: a ``loader.state_dict()`` to resume from;
    a state saved with another seed, world size, worker count, shard list or micro batch is a
    ValueError that names the difference. ``state={"remap_from": [s_0, ..., s_{W-1}]}`` (every
    old rank's state, by old rank) continues a run saved on W ranks on ``world_size`` ranks, with
    any workers and micro batch (remap.py; seed, shards, policy must match). ``cache_dir`` (the
    run's output_dir): where 'exact' + data.where caches the kept counts (filter_counts.py). ``teacher``
    (distill.teacher.TeacherInputs): batches also carry ``teacher_pixel_values`` (the same views at the
    teacher's image size) and ``teacher_input_ids`` (the teacher's tokenizer and text length)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    why = ""
    if workers is None:
        from rsclip_ds.resolve import loader_workers

        saved = len(state["streams"]) if state is not None and "streams" in state else None   # remap: any count
        workers, why = loader_workers(cfg.num_workers, available_cores() if cores is None else cores,
                                      local_world_size, saved)
    group = _is_rank_of_group(rank, world_size)
    kept = partial(kept_counts_over_ranks if group else kept_counts,
                   cache_dir=None if cache_dir is None else Path(cache_dir))
    schedule = build_epoch_schedule(cfg, micro_batch_size=micro_batch_size, world_size=world_size, seed=seed,
                                    num_workers=workers, read_counts=shard_counts_from_rank0 if group else shard_counts,
                                    read_kept=kept)
    if why and rank == 0:
        log.info("data.num_workers=auto: %d worker(s) per rank (%s)", workers, why)
    views = (image_size, teacher.image_size) if teacher is not None else None
    where = Where.parse(cfg.where) if cfg.where and cfg.policy == "resampled" else None   # 'exact': the stream's
    prep = SampleDecoder(ImageTransform.from_config(max(views or (image_size,)), cfg), _split_keys(cfg.image_key),
                         _split_keys(cfg.caption_key), where, views)
    collate = Collate(tokenizer, max_text_length, micro_batch_size, return_keys, teacher)
    loader = TrainLoader(schedule, rank, cfg, prep, collate, state=state, pin_memory=pin_memory)
    loader.local_world_size = local_world_size
    return loader

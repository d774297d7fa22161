"""Every sample in every epoch (issue 37): under data.policy=exact an epoch delivers all of its
samples but fewer than one global batch (W x micro), for any world size, worker count, micro
batch and shard size, with equal batches on every rank; data smaller than one global batch is
refused with the numbers and the fix. The schedule is checked over a grid without reading a
sample; the loader is then played in this process (ranks and workers simulated) and its batches
read back through the tap."""

from __future__ import annotations

import io
import json
import random
import re
import tarfile
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from rsclip_ds.config import DataConfig
from rsclip_ds.data import DataError, EpochSchedule, StreamCounter, build_epoch_schedule, build_train_loader
from rsclip_ds.data import loader as loader_mod
from rsclip_ds.data.loader import StreamDataset
from rsclip_ds.data.tar import read_piece, read_shard
from tests.helpers import deadline

# training images of the field's caption sets (Karpathy splits)
SETS = {"RSICD": 8734, "RSITMD": 4291, "UCM-captions": 1680, "Sydney-captions": 497}


def _shards(n: int, size: int, prefix: str = "s") -> dict[str, int]:
    """make-shards' layout: shards of ``size`` samples, the last one uneven."""
    sizes = [size] * (n // size) + ([n % size] if n % size else [])
    return {f"{prefix}{i:04d}.tar": c for i, c in enumerate(sizes)}


def _check_epoch(schedule: EpochSchedule, epoch: int) -> int:
    """Equal batches on every rank, each stream's range holding its batches, every sample of the
    epoch in exactly one range -> the samples the epoch delivers."""
    n, k, micro, world = schedule.batches(epoch), schedule.workers_of(0), schedule.micro, schedule.world_size
    held: dict[str, list[int]] = {}                     # url -> how often each sample is in a range
    for r in range(world):
        assert sum(schedule.worker_batches(epoch, r, w) for w in range(k)) == n
        for w in range(k):
            pieces = schedule.pieces(epoch, r, w)
            assert sum(p.take for p in pieces) >= schedule.worker_batches(epoch, r, w) * micro
            for p in pieces:
                marks = held.setdefault(p.url, [0] * schedule.sizes[p.url])
                assert p.last == (p.skip + p.take == len(marks))
                for i in range(p.skip, p.skip + p.take):
                    marks[i] += 1
    repeats = Counter(schedule.urls)                     # a whole-number weight lists a shard again
    assert {u: set(m) for u, m in held.items() if m} == {u: {repeats[u]} for u in repeats if schedule.sizes[u]}
    return n * world * micro


@pytest.mark.parametrize("name", list(SETS))
def test_every_epoch_delivers_all_but_less_than_one_global_batch(name):
    """The grid: world 1-8, workers 1-8, micro 32-256, make-shards' shard sizes 50-1,000."""
    total, cases, refused = SETS[name], 0, 0
    for size in (50, 100, 333, 1000):
        counts = _shards(total, size)
        for world in range(1, 9):
            for workers in (1, 2, 3, 5, 8):
                for micro in (32, 64, 100, 128, 256):
                    schedule = EpochSchedule([list(counts)], [1.0], "exact", seed=world, world_size=world,
                                             num_workers=workers, micro=micro, counts=counts)
                    if total < world * micro:
                        with pytest.raises(DataError, match=f"the {total:,} training samples hold no global batch"):
                            schedule.start(1)
                        refused += 1
                        continue
                    for epoch in (0, 1):
                        delivered = _check_epoch(schedule, epoch)
                        assert 0 <= total - delivered < world * micro
                        assert schedule.coverage(epoch)["coverage"] == delivered / total
                        assert delivered / total >= 0.99 - world * micro / total
                    cases += 1
    assert cases + refused == 4 * 8 * 5 * 5 and cases >= 450


def test_uneven_shards_weighted_sources_and_where():
    """Two sources, shards of random sizes (and an empty one), weights [2, 1]: the first source's
    shards twice per epoch; data.where's kept counts size the epoch."""
    rng = random.Random(0)
    a = {f"a{i}.tar": rng.randint(0, 300) for i in range(17)}
    b = {f"b{i}.tar": rng.randint(1, 90) for i in range(5)}
    kept = {u: rng.randint(0, c) for u, c in {**a, **b}.items()}
    for world, workers, micro in [(1, 8, 256), (3, 2, 64), (8, 8, 32), (5, 3, 100), (2, 7, 48)]:
        schedule = EpochSchedule([list(a), list(b)], [2, 1], "exact", seed=1, world_size=world,
                                 num_workers=workers, micro=micro, counts={**a, **b}, kept=kept, where="x > 0")
        total = 2 * sum(kept[u] for u in a) + sum(kept[u] for u in b)
        assert schedule.total == total
        for epoch in range(3):
            delivered = _check_epoch(schedule, epoch)
            assert 0 <= total - delivered < world * micro
        assert "kept by data.where" in schedule.describe(0)


def test_the_start_up_line_and_the_epoch_of_a_batch():
    counts = _shards(SETS["RSICD"], 1000)
    one = EpochSchedule([list(counts)], [1.0], "exact", 0, 1, 8, 256, counts=counts)
    assert one.describe(0) == "epoch 0: 34 batches per rank = 8,704 of 8,734 samples (99.7 %)"
    eight = one.rescaled(8, 8, 128)
    assert eight.coverage(0) == {"epoch": 0, "policy": "exact", "batches_per_rank": 8, "global_batch": 1024,
                                 "samples": 8192, "epoch_samples": 8734, "transition": False,
                                 "coverage": 8192 / 8734, "refused": None}
    assert [eight.epoch_of(i) for i in (0, 7, 8, 15, 16)] == [0, 0, 1, 1, 2]
    assert eight.start(3) == 24
    resampled = EpochSchedule([list(counts)], [1.0], "resampled", 0, 2, 4, 128, counts=counts, epoch_batches=50)
    assert resampled.describe(0) == ("epoch 0: 50 batches per rank = 12,800 samples drawn with replacement "
                                     "from 8,734 (146.6 %, data.policy=resampled)")


def test_too_little_data_is_refused_before_any_batch_naming_the_numbers_and_the_fix(tmp_path, tiny_tokenizer):
    """UCM-captions' 1,680 training images on 8 ranks at micro 256: coverage says it, and the
    loader refuses before its first batch, in the rank's own process."""
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"shards": [{"url": u, "num_samples": n} for u, n in _shards(1680, 1000).items()]}))
    spec = f"pipe:cat {tmp_path}/s{{0000..0001}}.tar"   # counted from the index, never opened
    cfg = DataConfig(train_shards=spec, shard_index=str(index), num_workers=8)
    said = (r"the 1,680 training samples hold no global batch of 8 rank\(s\) x micro batch 256 = 2,048 samples.*"
            r"set batch.micro_batch_size to 210 or less \(1,680 // 8 rank\(s\)\), or launch 6 rank\(s\) or fewer")
    cover = build_epoch_schedule(cfg, micro_batch_size=256, world_size=8, seed=0).coverage(0)
    assert cover["batches_per_rank"] == 0 and re.search(said, cover["refused"])
    loader = build_train_loader(cfg, tokenizer=tiny_tokenizer, image_size=8, max_text_length=16,
                                micro_batch_size=256, rank=7, world_size=8, seed=0)
    with pytest.raises(DataError, match=said):
        next(iter(loader))
    fits = build_epoch_schedule(cfg, micro_batch_size=210, world_size=8, seed=0)   # the fix it names
    assert fits.describe(0) == "epoch 0: 1 batches per rank = 1,680 of 1,680 samples (100.0 %)"


# --------------------------------------------------------------------------- reading pieces

def _jpeg(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def _write(path, name: str, n: int, score=lambda i: 1.0) -> str:
    """A tar of n samples (jpg, txt, json {"score"}), written with tarfile as make-shards does."""
    image = _jpeg(n)
    with tarfile.open(path / f"{name}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(n):
            for ext, data in (("jpg", image), ("txt", f"{name} {i}".encode()),
                              ("json", json.dumps({"score": score(i)}).encode())):
                info = tarfile.TarInfo(f"{name}_{i:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path / f"{name}.tar")


def _keys(samples) -> list[str]:
    return [s["__key__"] for s in samples]


def test_pieces_of_a_shard_read_its_samples_once_from_a_file_and_a_pipe(tmp_path):
    url = _write(tmp_path, "p", 23)
    whole = _keys(read_shard(url, StreamCounter({})))
    for source in (url, f"pipe:cat {url}"):      # seeking over the skipped samples, or reading past them
        for cuts in ([0, 23], [0, 1, 22, 23], [0, 7, 8, 16, 23], [0, 11, 23]):
            got = []
            for skip, end in zip(cuts, cuts[1:]):
                got += _keys(read_piece(source, StreamCounter({}), skip, end - skip, end == 23))
            assert got == whole, (source, cuts)
    keep = (lambda raw: json.loads(raw)["score"] > 0)   # data.where: skip and take count the kept samples
    filtered = _write(tmp_path, "f", 10, score=lambda i: i % 3)   # kept: 1 2 4 5 7 8
    carry = [0]
    first = list(read_piece(filtered, StreamCounter({}), 0, 4, False, keep, carry))
    rest = list(read_piece(filtered, StreamCounter({}), 4, 2, True, keep, carry))
    assert _keys(first) == ["f_0001", "f_0002", "f_0004", "f_0005"] and _keys(rest) == ["f_0007", "f_0008"]
    assert [s.get("__filtered__", 0) for s in first + rest] == [1, 0, 1, 0, 1, 0]   # the rejects before each
    assert carry == [1]                                   # f_0009, after the last: for the next piece


def test_a_broken_or_missing_shard_read_in_parts_is_counted_once(tmp_path):
    url = _write(tmp_path, "t", 12)
    data = open(url, "rb").read()
    open(url, "wb").write(data[: len(data) * 2 // 3])     # breaks off in sample 7 or 8
    counter, got = StreamCounter({}), []
    for skip, take in ((0, 4), (4, 4), (8, 4)):
        got += _keys(read_piece(url, counter, skip, take, skip == 8))
    assert got == _keys(read_shard(url, StreamCounter({})))
    assert counter.bad["truncated_tar"] == 1 and counter.shards == 1 and counter.opened == 3
    gone = StreamCounter({})
    for skip, take in ((0, 4), (4, 8)):
        assert not list(read_piece(str(tmp_path / "gone.tar"), gone, skip, take, skip == 4))
    assert gone.bad["missing_shard"] == 1 and gone.shards == 1


# --------------------------------------------------------------------------- the loader, played here

@pytest.fixture(scope="module")
def small_set(tmp_path_factory):
    """190 samples in make-shards' layout of 50 (the last 40), the JSON score of sample i: i % 4."""
    root = tmp_path_factory.mktemp("small")
    urls = [_write(root, f"c{s}", n, score=lambda i, s=s: (s * 50 + i) % 4) for s, n in enumerate([50, 50, 50, 40])]
    return "::".join(urls)


def _cfg(spec: str, **data) -> DataConfig:
    return DataConfig(**{"train_shards": spec, "shuffle_buffer": 6, "num_workers": 0, **data})


def _play_streams(spec, world, workers, micro, epochs, monkeypatch, tokenizer, **data):
    """Every (rank, worker) stream of ``epochs`` epochs in this process -> {epoch: [keys]}, schedule."""
    cfg = _cfg(spec, num_workers=workers, **data)
    got: dict[int, list[str]] = {}
    for rank in range(world):
        ld = build_train_loader(cfg, tokenizer=tokenizer, image_size=8, max_text_length=16, micro_batch_size=micro,
                                rank=rank, world_size=world, seed=5, return_keys=True)
        for w in range(workers):
            monkeypatch.setattr(loader_mod, "_worker", lambda w=w, k=workers: (w, k))
            stream = iter(StreamDataset(ld.schedule, rank, ld.prep, ld.collate, cfg, [None] * workers, offset=0))
            with deadline(60):
                for _ in range(sum(ld.schedule.worker_batches(e, rank, w) for e in range(epochs))):
                    batch = next(stream)
                    got.setdefault(batch["_meta"]["epoch"], []).extend(batch["keys"])
    return got, ld.schedule


@pytest.mark.parametrize("world,workers,micro", [(3, 4, 8), (2, 8, 16), (4, 3, 5)])
def test_streams_deliver_every_sample_once_per_epoch(small_set, world, workers, micro, monkeypatch, tiny_tokenizer):
    """More streams than shards: the shards are split, every worker has its share."""
    got, schedule = _play_streams(small_set, world, workers, micro, 2, monkeypatch, tiny_tokenizer)
    assert any(p.skip for r in range(world) for w in range(workers) for p in schedule.pieces(0, r, w))
    for epoch in (0, 1):
        keys = got[epoch]
        assert len(keys) == len(set(keys)) == schedule.batches(epoch) * world * micro
        assert 190 - len(keys) < world * micro


def test_under_where_the_epoch_covers_the_kept_samples(small_set, monkeypatch, tiny_tokenizer):
    got, schedule = _play_streams(small_set, 3, 2, 4, 1, monkeypatch, tiny_tokenizer, where="score > 0")
    kept = {f"c{s}_{i:04d}" for s, n in enumerate([50, 50, 50, 40]) for i in range(n) if (s * 50 + i) % 4}
    assert schedule.total == len(kept) == 142
    assert len(got[0]) == len(set(got[0])) == 11 * 3 * 4 and set(got[0]) <= kept   # 142 // 12 = 11 batches


def test_the_tap_reads_back_what_each_rank_delivered(small_set, tiny_tokenizer):
    """Two ranks in the main process: the tap's keys are the batches' keys, unique over the ranks in
    each epoch and covering the set but less than a global batch; the tap says each batch's epoch."""
    world, micro, seen = 2, 16, {}
    for rank in range(world):
        ld = build_train_loader(_cfg(small_set), tokenizer=tiny_tokenizer, image_size=8, max_text_length=16,
                                micro_batch_size=micro, rank=rank, world_size=world, seed=5, return_keys=True)
        taps = []
        ld.tap = lambda index, epoch, keys: taps.append((index, epoch, keys))
        n = ld.schedule.batches(0)
        with deadline(60):
            batches = [b for _, b in zip(range(2 * n), ld)]
        assert [t[2] for t in taps] == [b["keys"] for b in batches]
        assert [(t[0], t[1]) for t in taps] == [(i, ld.schedule.epoch_of(i)) for i in range(2 * n)]
        for _, epoch, keys in taps:
            seen.setdefault(epoch, []).extend(keys)
    for epoch in (0, 1):
        assert len(seen[epoch]) == len(set(seen[epoch])) == 5 * world * micro   # 190 // 32 = 5 batches


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker processes")
def test_one_shard_feeds_every_worker_of_a_rank(tmp_path, tiny_tokenizer, monkeypatch):
    """Four DataLoader workers on one shard of 60 samples (the workers used to be cut to one): the
    rank's batches over two epochs are every sample once per epoch."""
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")   # workers fork after the tokenizer ran
    ld = build_train_loader(_cfg(_write(tmp_path, "one", 60), num_workers=4), tokenizer=tiny_tokenizer,
                            image_size=8, max_text_length=16, micro_batch_size=4, rank=0, world_size=1, seed=5)
    epochs: dict[int, list[str]] = {}
    ld.tap = lambda index, epoch, keys: epochs.setdefault(epoch, []).extend(keys)
    with deadline(60):
        for _, _ in zip(range(30), ld):
            pass
    assert ld.num_workers == 4 and {len(ld.schedule.pieces(0, 0, w)) for w in range(4)} == {1}
    assert [sorted(epochs[e]) for e in (0, 1)] == [[f"one_{i:04d}" for i in range(60)]] * 2


def test_the_data_guide_s_examples_are_what_the_schedule_computes():
    """docs/guides/data.md, section 4: each row of the example table, computed again."""
    from pathlib import Path

    guide = (Path(__file__).parents[2] / "docs" / "guides" / "data.md").read_text()
    table = guide[guide.index("| set (training images) |"):].split("\n\n")[0].splitlines()[2:]
    assert len(table) == 5
    last = None
    for row in table:
        name, setup, batches, delivered = (c.strip() for c in row.strip("|").split("|"))
        last = name.split(" (")[0] if name.split(" (")[0] in SETS else last
        world, micro = (int(x) for x in setup.split(" × "))
        counts = _shards(SETS[last], 1000)
        cover = EpochSchedule([list(counts)], [1.0], "exact", 0, world, 8, micro, counts=counts).coverage(0)
        if batches.startswith("refused"):
            assert cover["refused"] and f"{SETS[last]:,} < {world * micro:,}" in batches
            assert f"micro {SETS[last] // world} or less, or {SETS[last] // micro} ranks or fewer" == delivered
            continue
        assert (int(batches), delivered) == (cover["batches_per_rank"],
                                             f"{cover['samples']:,} ({100 * cover['coverage']:.1f} %)"), row


def test_plan_says_each_rows_epoch_coverage_from_the_shards_counts(tmp_path, capsys):
    """`rsclip-ds plan --shards`: the share of the data one epoch delivers at each row's micro-batch
    (or --micro's) on the plan's ranks, in the table and as `coverage` in --json, from the shards'
    counts (nothing decoded); data.* keys without --shards are refused."""
    from rsclip_ds.cli import main
    from tests.helpers import write_shards

    pattern = write_shards(tmp_path, [100, 100, 100, 37])   # 337 samples, an uneven last shard
    base = ["plan", "--model", "git-rsclip-base", "--gpus", "2", "--gpu-mem", "24GiB", "--global-batch", "64",
            "--shards", pattern]
    assert main([*base, "--micro", "16", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    fits = [r for r in doc["rows"] if r["fits"]]
    assert fits and all(r["coverage"] == (337 // 32) * 32 / 337 for r in fits)           # 10 batches of 2 x 16
    assert doc["recommended"]["epoch"]["batches_per_rank"] == 10 and doc["recommended"]["epoch"]["epoch_samples"] == 337
    assert all(r["coverage"] is None for r in doc["rows"] if not r["fits"])
    assert main([*base, "--json"]) == 0                      # each row's own micro-batch: 32 x 1 on 2 ranks
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {(r["micro"], r["coverage"]) for r in rows if r["fits"]} == {(32, (337 // 64) * 64 / 337)}
    assert main([*base, "--set", "data.train_weights=[2]", "--micro", "16"]) == 0   # the table; the source twice
    out = capsys.readouterr().out
    assert "epoch coverage" in out and "epoch 0: 21 batches per rank = 672 of 674 samples (99.7 %)" in out
    assert main(["plan", "--model", "git-rsclip-base", "--gpus", "2", "--gpu-mem", "24GiB", "--global-batch", "64",
                 "--set", "data.policy=resampled"]) == 2
    assert "needs --shards PATTERN" in capsys.readouterr().err


class _Loader:
    """What reporting/epochs.py reads of a loader: its schedule and the batches handed out so far."""

    def __init__(self, schedule, batches=0):
        self.schedule, self.batches = schedule, batches


def test_the_run_says_each_epochs_size_and_end_from_the_batches_handed_out():
    """RSICD's 8,734 samples on 4 ranks at micro 64 (a global batch of 256): 34 batches per rank an
    epoch. The start-up line, an epoch_end per finished epoch after the step that finished it (with
    accumulation an epoch ends inside a step), summary.json's epochs with the part of the current one."""
    from rsclip_ds.reporting.epochs import EpochWatch, epochs_record, startup_lines

    counts = _shards(8734, 1000)
    schedule = EpochSchedule([list(counts)], [1.0], "exact", 0, 4, 8, 64, counts=counts)
    loader = _Loader(schedule)
    assert startup_lines(loader) == ["epoch 0: 34 batches per rank = 8,704 of 8,734 samples (99.7 %)"]
    watch, ends = EpochWatch(loader), []
    for step in range(1, 41):       # 2 micro-batches per optimizer step: epoch 0 ends inside step 17
        loader.batches += 2
        ends += [(step, e["epoch"], e["samples"]) for e in watch.ended()]
    assert ends == [(17, 0, 8704), (34, 1, 8704)]
    record = epochs_record(loader)
    assert [(e["epoch"], e["delivered"], e["complete"]) for e in record] == \
        [(0, 8704, True), (1, 8704, True), (2, 12 * 256, False)]
    assert record[0]["coverage"] == 8704 / 8734 and record[0]["batches_per_rank"] == 34
    resumed = _Loader(schedule, batches=40)   # a resume in epoch 1, its 6th batch
    assert startup_lines(resumed) == ["epoch 1: 34 batches per rank = 8,704 of 8,734 samples (99.7 %) "
                                      "(resumed at its batch 6 per rank)"]
    assert EpochWatch(resumed).ended() == []
    assert startup_lines(_Loader(None)) == [] and epochs_record(_Loader(None)) is None

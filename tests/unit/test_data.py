"""Streaming loader: url specs, shard split across ranks/workers, batches, determinism."""

from __future__ import annotations

import itertools
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rsclip_ds.config import DataConfig
from rsclip_ds.data import DataError, EpochSchedule, build_train_loader, expand_urls
from rsclip_ds.resolve import auto_num_workers
from tests.helpers import wait_for

B = 8  # micro-batch; tiny_shards has 8 train shards of 8 samples


def _loader(index, *, rank=0, world_size=1, seed=0, flip=True, state=None, cores=None, local_world_size=1,
            **data):
    cfg = DataConfig(**{"train_shards": index["train_pattern"], "num_workers": 0, "shuffle_buffer": 16,
                        "hflip": flip, **data})
    return build_train_loader(cfg, tokenizer=index["tokenizer"], image_size=16, max_text_length=40,
                              micro_batch_size=B, rank=rank, world_size=world_size, seed=seed,
                              return_keys=True, state=state, cores=cores, local_world_size=local_world_size)


def _take(loader, n):
    return list(itertools.islice(iter(loader), n))


def _keys(batches):
    return [k for b in batches for k in b["keys"]]


@pytest.fixture
def index(tiny_shards, tiny_tokenizer):
    return {**tiny_shards, "tokenizer": tiny_tokenizer}


# --------------------------------------------------------------------------- expand_urls

def test_expand_urls_brace_glob_list_and_pipe(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("t-0.tar", "t-1.tar", "t-2.tar", "sub/v-0.tar", "sub/v-1.tar"):
        (tmp_path / name).write_bytes(b"")  # expand_urls only checks that local files exist
    listing = tmp_path / "sub" / "shards.txt"
    listing.write_text("# relative to this file\nv-1.tar\n\nv-*.tar  # globs work too\npipe:cat y.tar\n")
    urls = expand_urls(f"{tmp_path}/t-{{0..1}}.tar::{tmp_path}/sub/v-*.tar::{listing}::pipe:cat x.tar")
    sub = tmp_path / "sub"
    assert urls == [f"{tmp_path}/t-0.tar", f"{tmp_path}/t-1.tar", f"{sub}/v-0.tar", f"{sub}/v-1.tar",
                    f"{sub}/v-1.tar", f"{sub}/v-0.tar", f"{sub}/v-1.tar", "pipe:cat y.tar",
                    "pipe:cat x.tar"]


def test_expand_urls_checks_list_entries(tmp_path):
    (tmp_path / "list.txt").write_text("missing.tar\n")
    with pytest.raises(ValueError, match="missing.tar"):
        expand_urls(str(tmp_path / "list.txt"))


@pytest.mark.parametrize("spec", ["missing-{0..1}.tar", "nothing-*.tar", "gone.txt", "::"])
def test_expand_urls_errors_name_the_spec(tmp_path, spec):
    full = spec if spec == "::" else str(tmp_path / spec)
    with pytest.raises(ValueError, match="train_shards"):
        expand_urls(full)


# --------------------------------------------------------------------------- shard assignment

def test_epoch_schedule_splits_the_samples_every_epoch():
    """Pieces of the epoch's shuffled shard list: every sample once over all streams, a shard
    split between streams where a range ends, reshuffled every epoch."""
    urls = [f"s{i}.tar" for i in range(11)]
    counts = {u: 5 + i for i, u in enumerate(urls)}             # 5..15 samples, 110 in all
    schedule = EpochSchedule([urls], [1.0], "exact", seed=5, world_size=2, num_workers=2, micro=4, counts=counts)
    orders = []
    for epoch in range(4):
        parts = [schedule.pieces(epoch, r, w) for r in range(2) for w in range(2)]
        samples = [(p.url, i) for part in parts for p in part for i in range(p.skip, p.skip + p.take)]
        assert sorted(samples) == sorted((u, i) for u in urls for i in range(counts[u]))   # disjoint, covering
        assert any(p.skip for part in parts for p in part)                                  # a shard was split
        assert schedule.batches(epoch) == 110 // (2 * 4)
        orders.append(tuple(schedule.order(epoch)))
    assert len(set(orders)) == 4  # reshuffled every epoch


def test_fewer_shards_than_ranks_train_and_too_little_data_is_refused_with_the_numbers(index):
    assert _loader(index, rank=7, world_size=8).schedule.batches(0) == 1   # 8 shards, 8 ranks of micro 8
    three = f"{index['dir']}/train-{{000000..000002}}.tar"                 # 24 samples
    assert _loader(index, rank=2, world_size=3, train_shards=three).schedule.batches(0) == 1
    with pytest.raises(DataError, match=r"the 64 training samples hold no global batch of 9 rank\(s\) x micro "
                                        r"batch 8 = 72 samples.*Fix: set batch.micro_batch_size to 7 or less "
                                        r"\(64 // 9 rank\(s\)\), or launch 8 rank\(s\) or fewer"):
        next(iter(_loader(index, rank=0, world_size=9)))


def test_workers_are_kept_when_the_shards_are_fewer(index, caplog):
    spec = f"{index['dir']}/train-{{000000..000002}}.tar"  # 3 shards over 2 ranks
    with caplog.at_level(logging.WARNING, logger="rsclip_ds.data"):
        loaders = [_loader(index, rank=r, world_size=2, train_shards=spec, num_workers=4) for r in (0, 1)]
    assert [ld.num_workers for ld in loaders] == [4, 4] and not caplog.records
    plan = loaders[0].schedule                              # 24 samples: 1 batch per rank, from worker 0
    assert plan.batches(0) == 1 and [plan.worker_batches(0, 0, w) for w in range(4)] == [1, 0, 0, 0]
    assert [plan.worker_batches(1, 0, w) for w in range(4)] == [0, 1, 0, 0]   # epoch 1: batch index 1


@pytest.mark.parametrize("cores, local_ranks, workers", [
    (2, 2, 1),     # this machine under the demo: nothing to spare, still one worker
    (16, 8, 1),    # 8 GPUs, 16 cores: 2 per rank, one of them the rank's own
    (96, 8, 11),
    (64, 1, 63),
    (7, 2, 2),     # 3 cores per rank (rounded down)
    (1, 1, 1),
])
def test_auto_workers_share_the_cores_of_the_node(cores, local_ranks, workers):
    assert auto_num_workers(cores, local_ranks) == workers


def test_auto_workers_are_sized_and_logged_once(index, caplog):
    """data.num_workers=auto with 8 cores for 2 ranks: 3 per rank, also with 3 shards over 2
    ranks; one INFO line from rank 0, no warning."""
    spec = f"{index['dir']}/train-{{000000..000002}}.tar"
    with caplog.at_level(logging.INFO, logger="rsclip_ds.data"):
        many = _loader(index, num_workers="auto", cores=8, local_world_size=2)
        few = [_loader(index, rank=r, world_size=2, train_shards=spec, num_workers="auto", cores=8,
                       local_world_size=2) for r in (0, 1)]
    assert many.num_workers == many.streams == 3
    assert [ld.num_workers for ld in few] == [3, 3]
    lines = [r for r in caplog.records if "data.num_workers=auto" in r.getMessage()]
    assert [r.levelname for r in lines] == ["INFO", "INFO"]   # one per loader built as rank 0
    assert "3 worker(s) per rank (8 core(s) for 2 rank(s) on this node" in lines[0].getMessage()
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert _loader(index, num_workers="auto", cores=2, local_world_size=1).num_workers == 1


def test_auto_workers_keep_the_saved_streams_on_resume(index, monkeypatch, caplog):
    """A run saved with 2 streams per rank resumes with auto on a machine that would pick 7:
    it keeps 2 (exact resume needs them) and says so; an explicit other count is refused."""
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    first = _loader(index, num_workers="auto", cores=3, local_world_size=1)
    assert first.num_workers == 2
    want = _take(first, 3)
    state = first.state_dict()
    with caplog.at_level(logging.INFO, logger="rsclip_ds.data"):
        resumed = _loader(index, num_workers="auto", cores=8, local_world_size=1, state=state)
    assert resumed.num_workers == 2
    assert "the saved data position's count" in caplog.text and "would give 7" in caplog.text
    assert _keys(_take(resumed, 2)) == _keys(_take(_loader(index, num_workers=2), 5)[3:])
    assert _keys(want) == _keys(_take(_loader(index, num_workers=2), 3))
    with pytest.raises(ValueError, match=r"streams: saved 2, now 3 \(keep data.num_workers.*or set it to auto"):
        _loader(index, num_workers=3, state=state)


# --------------------------------------------------------------------------- batches

def test_batches_have_shapes_and_dtypes(index):
    """uint8 pixels (the model normalises them: tests/unit/test_pixels.py) and token ids."""
    for r in _take(_loader(index), 3):
        assert r["pixel_values"].shape == (B, 3, 16, 16) and r["pixel_values"].dtype == torch.uint8
        assert r["input_ids"].shape == (B, 40) and r["input_ids"].dtype == torch.int64
        assert r["pixel_values"].float().std() > 12  # not blank (0..255 grey levels)
        assert (r["input_ids"] == index["tokenizer"].eos_token_id).sum(1).eq(1).all()


def test_same_seed_same_batches_other_seed_differs(index):
    a, b = _take(_loader(index), 12), _take(_loader(index), 12)  # 12 batches > 1 epoch of 8
    for x, y in zip(a, b):
        assert x["keys"] == y["keys"]
        assert torch.equal(x["pixel_values"], y["pixel_values"])
        assert torch.equal(x["input_ids"], y["input_ids"])
    assert _keys(_take(_loader(index, seed=1), 12)) != _keys(a)


def test_flip_is_seeded(index):
    plain = {k: p for b in _take(_loader(index, flip=False, shuffle_buffer=0), 8)
             for k, p in zip(b["keys"], b["pixel_values"])}
    flipped = [torch.equal(p, plain[k].flip(-1)) and not torch.equal(p, plain[k])
               for b in _take(_loader(index, shuffle_buffer=0), 8)
               for k, p in zip(b["keys"], b["pixel_values"])]
    assert 0.2 < sum(flipped) / len(flipped) < 0.8


def test_two_ranks_see_disjoint_halves_each_epoch(index):
    # shuffle_buffer=0 keeps epochs apart, so each rank's first 32 samples are exactly its epoch 0
    seen = [_keys(_take(_loader(index, rank=r, world_size=2, shuffle_buffer=0), 4)) for r in (0, 1)]
    assert len(set(seen[0])) == len(seen[0]) == 32 == len(set(seen[1]))
    assert not set(seen[0]) & set(seen[1])
    assert set(seen[0]) | set(seen[1]) == {f"train_{i:07d}" for i in range(64)}


def test_two_workers_split_the_shards_deterministically(index, monkeypatch):
    # the session tokenizer was trained with rayon threads; say so before forking workers
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    runs = [_keys(_take(_loader(index, num_workers=2, shuffle_buffer=0), 8)) for _ in range(2)]
    assert runs[0] == runs[1]
    assert sorted(runs[0]) == [f"train_{i:07d}" for i in range(64)]  # one epoch, no repeats


def test_wrong_member_key_names_the_setting(index):
    with pytest.raises(DataError, match=r"64 of 64 samples.*missing_image 64.*data.image_key is png"):
        _take(_loader(index, image_key="png", bad_data_min_samples=64), 1)


def _children(pid: int) -> list[int]:
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir()
            for c in (t / "children").read_text().split()]


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler installed for SIGTERM (the SigCgt mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def _started_workers(index) -> tuple[Iterator[dict], dict, list[int]]:
    """A 2-worker loader's iterator, its first batch, and the workers' pids, both workers past
    worker_init_fn (batch i comes from worker i % 2, so two batches mean both have started)."""
    it = iter(_loader(index, num_workers=2))
    first, _ = next(it), next(it)
    workers = _children(os.getpid())
    assert len(workers) == 2
    assert all(_catches_sigterm(pid) for pid in workers)   # the first-SIGTERM handler is installed
    return it, first, workers


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task"), reason="needs /proc")
def test_workers_survive_sigterm_so_the_rank_can_save(index):
    """The launcher / a scheduler SIGTERMs a rank's whole process tree; the rank saves a
    checkpoint and exits 75, which needs its loader workers to keep delivering meanwhile."""
    it, first, workers = _started_workers(index)
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
    # the handler resets SIGTERM to the default once it has run: only then has the signal landed
    for pid in workers:
        wait_for(lambda pid=pid: not _catches_sigterm(pid), f"worker {pid} to handle the SIGTERM")
    later = [next(it) for _ in range(3)]   # raised "DataLoader worker ... killed by signal" before
    assert all(b["pixel_values"].shape == first["pixel_values"].shape for b in later)


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task"), reason="needs /proc")
def test_a_second_sigterm_still_ends_a_worker(index):
    """terminate() at shutdown must work: only the first SIGTERM is absorbed. (Whether the rank
    then notices the dead worker depends on the process's SIGCHLD handler -- torch's raises, ours
    in data/workers.py only notes it -- so this checks the worker itself: it ends.)"""
    import psutil

    it, _, workers = _started_workers(index)   # keep `it`: dropping it shuts the workers down
    pid = workers[0]
    os.kill(pid, signal.SIGTERM)
    # a second SIGTERM sent while the first is still pending would merge with it
    wait_for(lambda: not _catches_sigterm(pid), f"worker {pid} to handle the first SIGTERM")
    assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE   # the first one was absorbed
    os.kill(pid, signal.SIGTERM)

    def ended() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:   # already reaped
            return True
    try:
        wait_for(ended, f"worker {pid} to end on the second SIGTERM")
    except RuntimeError as err:   # torch's SIGCHLD handler, where it is still the process's, says so here
        assert f"pid {pid}" in str(err) and "Terminated" in str(err)

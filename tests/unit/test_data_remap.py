"""Resuming a data position on another number of ranks (rsclip_ds/data/remap.py): old ranks stop
mid-epoch with samples in their buffers and shards half read, the new ones continue. Ranks and
their workers are simulated in-process; keys identify the samples."""

from __future__ import annotations

import io
import json
import logging

import numpy as np

import pytest
import torch

from rsclip_ds.config import DataConfig
from rsclip_ds.data import build_train_loader
from PIL import Image
from webdataset import TarWriter

from tests.helpers import deadline, write_shards

B = 2
COUNTS = [7, 9, 8, 6, 10, 5, 9, 8]   # 62 samples in 8 uneven shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("remap"), COUNTS)


@pytest.fixture(scope="module")
def bad_shards(tmp_path_factory):
    """COUNTS' shards, sample 1 of shards 0, 2, 4, 6 a corrupt image (4 bad samples)."""
    root = tmp_path_factory.mktemp("remap_bad")
    spec = write_shards(root, COUNTS)
    buf = io.BytesIO()
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(buf, "JPEG")
    for s in (0, 2, 4, 6):
        with TarWriter(str(root / f"s-{s:02d}.tar"), encoder=False, mtime=0) as sink:
            for i in range(COUNTS[s]):
                sink.write({"__key__": f"s{s}_{i:03d}", "jpg": b"garbage" if i == 1 else buf.getvalue(),
                            "txt": b"a caption"})
    return spec


@pytest.fixture(autouse=True)
def _no_tokenizer_threads(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")   # workers fork after the tokenizer ran


def make(spec, tok, world, rank, workers, state=None, micro=B, seed=3, **data):
    cfg = DataConfig(**{"train_shards": spec, "num_workers": workers, "shuffle_buffer": 5, "hflip": True,
                        "rot90": True, **data})
    return build_train_loader(cfg, tokenizer=tok, image_size=8, max_text_length=16, micro_batch_size=micro,
                              rank=rank, world_size=world, seed=seed, return_keys=True, state=state)


def play(loader, n):
    """n batches and, after each, the epoch the loader's position is in."""
    got, epochs, it = [], [], iter(loader)
    with deadline(60):
        for _ in range(n):
            got.append(next(it))
            epochs.append(loader.state_dict()["epoch"])
    return got, epochs


def keys(batches):
    return [k for b in batches for k in b["keys"]]


def saved(loader):
    return json.loads(json.dumps(loader.state_dict()))   # as a checkpoint stores it


def old_run(spec, tok, world, workers, stop, **data):
    """Every old rank stops after `stop` batches: (their states, the keys they delivered)."""
    states, seen = [], []
    for rank in range(world):
        loader = make(spec, tok, world, rank, workers, **data)
        seen += keys(play(loader, stop)[0])
        states.append(saved(loader))
    return states, seen


def all_keys():
    return {f"s{s}_{i:03d}" for s, n in enumerate(COUNTS) for i in range(n)}


def same_batches(a, b):
    assert [x["keys"] for x in a] == [x["keys"] for x in b]
    for x, y in zip(a, b):   # same crops, flips, rotations and caption draws
        assert torch.equal(x["pixel_values"], y["pixel_values"]) and torch.equal(x["input_ids"], y["input_ids"])


@pytest.mark.parametrize("world,workers,new_world,new_workers,stop,new_micro", [
    (2, 2, 3, 1, 3, B), (2, 1, 1, 2, 4, B), (3, 2, 2, 2, 2, 3)])
def test_exact_remap_delivers_the_rest_of_the_epoch_once_then_the_fresh_schedule(
        shards, tiny_tokenizer, caplog, world, workers, new_world, new_workers, stop, new_micro):
    states, old_keys = old_run(shards, tiny_tokenizer, world, workers, stop)
    # the intended situation: every old stream has taken samples, none has read all its shards
    streams = [s for st in states for s in st["streams"]]
    assert all(s and s["epoch"] == 0 and s["taken"] > 0 for s in streams)
    assert any(s["opened"] > s["closed"] for s in streams)
    caplog.set_level(logging.INFO, logger="rsclip_ds.data")
    new_keys, quotas = [], []
    for rank in range(new_world):
        loader = make(shards, tiny_tokenizer, new_world, rank, new_workers,
                      state={"remap_from": states}, micro=new_micro)
        n_t, n_next = loader.schedule.batches(0), loader.schedule.batches(1)
        got, epochs = play(loader, n_t + n_next)
        quotas.append(epochs.count(0))                      # (c) batches of the transition epoch
        new_keys += keys(got[:n_t])
        fresh = make(shards, tiny_tokenizer, new_world, rank, new_workers, micro=new_micro)
        assert fresh.schedule.batches(1) == n_next
        ref, _ = play(fresh, fresh.schedule.start(2))
        same_batches(got[n_t:], ref[-n_next:])               # (d) epoch 1 is a fresh run's
    kept = loader.state_dict()["remap"]["kept"]
    assert len(set(quotas)) == 1 and quotas[0] == n_t > 0   # (c)
    cover = loader.schedule.coverage(0)                     # what the start-up line says of it
    assert cover["transition"] and cover["epoch_samples"] == kept["remaining"] and cover["samples"] == kept["used"]
    epoch0 = old_keys + new_keys
    assert len(epoch0) == len(set(epoch0))                 # (a) nothing twice in the epoch
    missing = all_keys() - set(epoch0)
    assert len(missing) == kept["dropped"] < new_world * new_micro   # (b) only the evenness drop
    assert kept["seen"] == len(old_keys) and kept["remaining"] == len(all_keys()) - len(old_keys)
    assert f"{kept['dropped']} dropped for evenness" in caplog.text
    assert f"{len(old_keys)} samples of the epoch already seen" in caplog.text


def test_resume_inside_the_transition_epoch_and_the_counts_carried(shards, tiny_tokenizer):
    states, _ = old_run(shards, tiny_tokenizer, 2, 1, 3)
    remap = {"remap_from": states}
    for rank in range(3):
        loader = make(shards, tiny_tokenizer, 3, rank, 2, state=remap)
        # the old ranks' samples and bad-data counts ride on new rank 0
        assert loader.samples_seen == (sum(st["samples_seen"] for st in states) if rank == 0 else 0)
        assert loader.bad_data() == ({k: sum(st["bad"][k] for st in states) for k in loader.bad_data()}
                                     if rank == 0 else dict.fromkeys(loader.bad_data(), 0))
        total = loader.schedule.batches(0) + 3
        ref, _ = play(loader, total)
        stop = loader.schedule.batches(0) // 2 + rank % 2  # inside the transition epoch
        first = make(shards, tiny_tokenizer, 3, rank, 2, state=remap)
        head, _ = play(first, stop)
        state = saved(first)
        assert state["epoch"] == 0 and state["remap"]["batches"] == loader.schedule.batches(0)
        again = make(shards, tiny_tokenizer, 3, rank, 2, state=state)
        tail, _ = play(again, total - stop)
        same_batches(head + tail, ref)                      # (e) exact on the new world size
        assert again.samples_seen == loader.samples_seen


def test_bad_data_counts_of_old_and_new_ranks_add_up(bad_shards, tiny_tokenizer):
    states, old_keys = old_run(bad_shards, tiny_tokenizer, 2, 1, 3)
    old_bad = sum(st["bad"]["corrupt_image"] for st in states)
    assert old_bad == 2                                     # the setting: the old ranks met two of them
    total, new_keys = 0, []
    for rank in range(3):
        loader = make(bad_shards, tiny_tokenizer, 3, rank, 1, state={"remap_from": states})
        assert loader.bad_data()["corrupt_image"] == (old_bad if rank == 0 else 0)
        new_keys += keys(play(loader, loader.schedule.batches(0))[0])
        total += loader.bad_data()["corrupt_image"]
    assert total == 4                                       # each corrupt sample counted once
    epoch0 = old_keys + new_keys
    # a new stream whose ranges hold more bad samples than its slack reads them again: it repeats
    # at most as many samples as it met bad ones (remap.py)
    assert len(epoch0) - len(set(epoch0)) <= total - old_bad
    good = {k for k in all_keys() if not (k.endswith("_001") and int(k[1]) % 2 == 0)}
    assert len(good - set(epoch0)) <= loader.remap.kept["dropped"]


def test_a_second_remap_after_the_transition_epoch(shards, tiny_tokenizer):
    states, _ = old_run(shards, tiny_tokenizer, 2, 2, 3)
    middle, seen = [], []
    for rank in range(3):                                   # 2 -> 3, into epoch 1
        loader = make(shards, tiny_tokenizer, 3, rank, 1, state={"remap_from": states})
        n_t = loader.schedule.batches(0)
        got, _ = play(loader, n_t + 2)
        seen += keys(got[n_t:])
        middle.append(saved(loader))
    assert sum(s["samples_seen"] for s in middle) == sum(s["samples_seen"] for s in states) + 3 * (n_t + 2) * B
    loader = make(shards, tiny_tokenizer, 1, 0, 2, state={"remap_from": middle})   # 3 -> 1 in epoch 1
    assert loader.schedule.first == 1
    n_t = loader.schedule.batches(1)
    got, epochs = play(loader, n_t + 1)
    assert epochs == [1] * n_t + [2]
    epoch1 = seen + keys(got[:n_t])
    assert len(epoch1) == len(set(epoch1))
    assert len(all_keys() - set(epoch1)) == loader.remap.kept["dropped"] < 1 * B
    assert loader.samples_seen == sum(s["samples_seen"] for s in middle) + (n_t + 1) * B


def test_what_cannot_be_remapped_is_refused_with_the_fix(shards, tiny_tokenizer):
    states, _ = old_run(shards, tiny_tokenizer, 2, 0, 2)
    remap = {"remap_from": states}
    with pytest.raises(ValueError, match=r"seed: saved 3 \(rank 0\), now 4 \(run with the seed of the saved run"):
        make(shards, tiny_tokenizer, 3, 0, 1, state=remap, seed=4)
    with pytest.raises(ValueError, match=r"shards: saved .* \(keep data.train_shards"):
        make(shards.replace("{00..07}", "{00..06}"), tiny_tokenizer, 3, 0, 1, state=remap)
    with pytest.raises(ValueError, match=r"policy: saved 'exact' \(rank 0\), now 'resampled' \(keep data.policy"):
        make(shards, tiny_tokenizer, 3, 0, 1, state=remap, policy="resampled", epoch_batches=5)
    future = [{**st, "version": 99} for st in states]
    with pytest.raises(ValueError, match=r"version: saved 99 .*reads it"):
        make(shards, tiny_tokenizer, 3, 0, 1, state={"remap_from": future})
    with pytest.raises(ValueError, match=r"pass all 2 old ranks' states in rank order"):
        make(shards, tiny_tokenizer, 3, 0, 1, state={"remap_from": states[::-1]})
    # states saved inside a transition epoch (one batch into it) resume on 3 ranks, never remap again
    middle = []
    for rank in range(3):
        inside = make(shards, tiny_tokenizer, 3, rank, 1, state=remap)
        play(inside, 1)
        middle.append(saved(inside))
    with pytest.raises(ValueError, match=r"inside epoch 0, the transition epoch .* resume on 3 rank\(s\) until "
                                         r"epoch 0 ends, then remap"):
        make(shards, tiny_tokenizer, 2, 0, 1, state={"remap_from": middle})


def test_remap_at_an_epoch_boundary_plays_the_next_epoch_as_a_fresh_run(shards, tiny_tokenizer):
    plan = make(shards, tiny_tokenizer, 2, 0, 1).schedule
    states, _ = old_run(shards, tiny_tokenizer, 2, 1, plan.batches(0))   # epoch 0 complete
    for rank in range(3):
        loader = make(shards, tiny_tokenizer, 3, rank, 2, state={"remap_from": states})
        assert loader.remap.batches is None and loader.schedule.first == 1
        fresh = make(shards, tiny_tokenizer, 3, rank, 2)
        n = fresh.schedule.batches(1)
        got, epochs = play(loader, n)
        same_batches(got, play(fresh, fresh.schedule.start(2))[0][-n:])
        assert epochs == [1] * n


def test_resampled_remap_gives_every_new_rank_the_same_batches(shards, tiny_tokenizer):
    states, _ = old_run(shards, tiny_tokenizer, 2, 2, 3, policy="resampled", epoch_batches=7)
    counts = []
    for rank in range(3):
        loader = make(shards, tiny_tokenizer, 3, rank, 1, state={"remap_from": states}, policy="resampled",
                      epoch_batches=7)
        n_t = loader.schedule.batches(0)
        assert n_t == (7 - 3) * 2 * B // (3 * B)             # the old ranks' remaining samples, re-cut
        got, epochs = play(loader, n_t + 7 + 1)
        counts.append([epochs.count(e) for e in (0, 1)])
        assert all(len(b["keys"]) == B for b in got)
    assert counts == [[n_t, 7]] * 3                          # (g)

"""Exact mid-epoch resume and the two epoch policies, on shard counts that do not divide
ranks x workers (5 uneven shards, 2 ranks, 2 workers each), ranks simulated in-process."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from rsclip_ds.config import DataConfig
from rsclip_ds.data import build_epoch_schedule, build_train_loader
from tests.helpers import deadline, write_shards

B, WORLD = 2, 2
COUNTS = [7, 9, 8, 6, 10]   # 40 samples in 5 shards: 4 streams cannot be equal


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("uneven"), COUNTS)


def make_loader(spec, tokenizer, rank, state=None, **data):
    cfg = DataConfig(**{"train_shards": spec, "num_workers": 2, "shuffle_buffer": 5, "hflip": True,
                        "rot90": True, "random_resized_crop": (0.5, 1.0), **data})
    return build_train_loader(cfg, tokenizer=tokenizer, image_size=8, max_text_length=16, micro_batch_size=B,
                              rank=rank, world_size=WORLD, seed=3, return_keys=True, state=state)


def take(loader_iter, n):
    with deadline(60):
        return list(itertools.islice(loader_iter, n))


@pytest.fixture(autouse=True)
def _no_tokenizer_threads(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")   # workers fork after the tokenizer ran


def test_exact_epochs_equal_batches_on_every_rank(shards):
    plan = build_epoch_schedule(DataConfig(train_shards=shards, num_workers=2), micro_batch_size=B,
                                world_size=WORLD, seed=3)
    for epoch in range(3):
        n, start = plan.batches(epoch), plan.start(epoch)
        assert n == sum(COUNTS) // (WORLD * B) == 10          # every batch the 40 samples hold
        # batch i of a rank comes from worker i % 2: each stream's range holds its batches, and
        # the ranges together hold every sample of the epoch once
        held = {}
        for r in range(WORLD):
            for w in range(2):
                pieces = plan.pieces(epoch, r, w)
                share = len([i for i in range(start, start + n) if i % 2 == w])
                assert plan.worker_batches(epoch, r, w) == share
                assert sum(p.take for p in pieces) >= share * B
                for p in pieces:
                    for i in range(p.skip, p.skip + p.take):
                        held[(p.url, i)] = held.get((p.url, i), 0) + 1
        assert sorted(held.values()) == [1] * sum(COUNTS)
        assert any(p.skip for r in range(WORLD) for w in range(2) for p in plan.pieces(epoch, r, w))  # split shards


@pytest.mark.parametrize("policy", ["exact", "resampled"])
def test_every_rank_gets_the_same_batches_per_epoch_and_no_hang(shards, tiny_tokenizer, policy):
    extra = {"epoch_batches": 7} if policy == "resampled" else {}
    epochs = []
    for rank in range(WORLD):
        loader = make_loader(shards, tiny_tokenizer, rank, policy=policy, **extra)
        it = iter(loader)
        per_epoch = []
        for _ in range(40):
            take(it, 1)
            per_epoch.append(loader.state_dict()["epoch"])
        epochs.append(per_epoch)
    # the epoch of batch i is the same on both ranks: same number of batches per epoch
    assert epochs[0] == epochs[1]
    counts = [epochs[0].count(e) for e in range(max(epochs[0]))]
    if policy == "resampled":
        assert counts == [7] * len(counts)
    plan = build_epoch_schedule(DataConfig(train_shards=shards, policy=policy, num_workers=2, **extra),
                            micro_batch_size=B, world_size=WORLD, seed=3)
    assert counts == [plan.batches(e) for e in range(len(counts))]


def test_exact_epoch_reads_each_sample_at_most_once_per_rank(shards, tiny_tokenizer):
    plan = build_epoch_schedule(DataConfig(train_shards=shards, num_workers=2), micro_batch_size=B,
                            world_size=WORLD, seed=3)
    n0 = plan.batches(0)
    seen = []
    for rank in range(WORLD):
        keys = [k for b in take(iter(make_loader(shards, tiny_tokenizer, rank)), n0) for k in b["keys"]]
        assert len(keys) == len(set(keys)) == n0 * B
        seen.append(set(keys))
    assert not seen[0] & seen[1]                    # ranks read disjoint samples
    assert len(seen[0] | seen[1]) == 40             # 40 = 10 global batches: nothing left out


@pytest.mark.parametrize("policy,stops", [("exact", [3, 6, 8]), ("resampled", [5])])
def test_stop_and_resume_sees_exactly_the_uninterrupted_batches(shards, tiny_tokenizer, policy, stops):
    extra = {"epoch_batches": 6} if policy == "resampled" else {}
    total = 22   # more than two epochs
    for rank in range(WORLD):
        ref = take(iter(make_loader(shards, tiny_tokenizer, rank, policy=policy, **extra)), total)
        for stop in stops:
            first = make_loader(shards, tiny_tokenizer, rank, policy=policy, **extra)
            head = take(iter(first), stop)           # the workers have prefetched beyond `stop`
            state = json.loads(json.dumps(first.state_dict()))
            assert state["batches"] == stop
            tail = take(iter(make_loader(shards, tiny_tokenizer, rank, state=state, policy=policy,
                                         **extra)), total - stop)
            got = head + tail
            assert [b["keys"] for b in got] == [b["keys"] for b in ref], (rank, stop)
            for a, b in zip(got, ref):   # same crops, flips, rotations and caption draws
                assert torch.equal(a["pixel_values"], b["pixel_values"])
                assert torch.equal(a["input_ids"], b["input_ids"])


def test_resume_in_the_main_process_and_a_second_iter_continues(shards, tiny_tokenizer):
    ref = take(iter(make_loader(shards, tiny_tokenizer, 1, num_workers=0)), 9)
    loader = make_loader(shards, tiny_tokenizer, 1, num_workers=0)
    head = take(iter(loader), 4)
    tail = take(iter(loader), 5)    # a new iterator continues from the position
    assert [b["keys"] for b in head + tail] == [b["keys"] for b in ref]


def test_resume_mismatch_names_what_differs_and_the_fix(shards, tiny_tokenizer):
    loader = make_loader(shards, tiny_tokenizer, 0, num_workers=0)
    take(iter(loader), 2)
    state = loader.state_dict()
    with pytest.raises(ValueError, match=r"seed: saved 3, now 4 \(run with the seed"):
        cfg = DataConfig(train_shards=shards, num_workers=0)
        build_train_loader(cfg, tokenizer=tiny_tokenizer, image_size=8, max_text_length=16, micro_batch_size=B,
                           rank=0, world_size=WORLD, seed=4, state=state)
    with pytest.raises(ValueError, match=r"streams: saved 1, now 2 \(keep data.num_workers"):
        make_loader(shards, tiny_tokenizer, 0, state=state, num_workers=2)
    with pytest.raises(ValueError, match=r"shards: saved .* \(keep data.train_shards"):
        make_loader(shards.replace("{00..04}", "{00..03}"), tiny_tokenizer, 0, state=state, num_workers=0)

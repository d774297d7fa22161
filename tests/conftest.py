"""Shared fixtures: one tiny synthetic dataset and a tokenizer trained on it, per test session."""

from __future__ import annotations

import pytest

from rsclip_ds.data.synthetic import make_synthetic
from rsclip_ds.data.tokenizer import iter_captions, train_tokenizer


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory):
    """64 train / 16 val samples of 32 px in 8-sample shards -> the index dict (with patterns)."""
    out = tmp_path_factory.mktemp("synthetic")
    index = make_synthetic(out, num_train=64, num_val=16, shard_size=8, image_size=32, seed=0,
                           progress=False)
    index["dir"] = out
    return index


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_shards, tmp_path_factory):
    urls = [str(tiny_shards["dir"] / s["url"]) for s in tiny_shards["train"]]
    return train_tokenizer(iter_captions(urls), tmp_path_factory.mktemp("tokenizer"), vocab_size=300,
                           max_length=40)


@pytest.fixture
def one_rank_group(tmp_path):
    """DeepSpeed's monitors ask deepspeed.comm for the rank: a 1-process gloo group."""
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, init_method=f"file://{tmp_path}/store",
                               rank=0, world_size=1, verbose=False)
    yield
    dist.destroy_process_group()

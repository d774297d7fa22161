"""Real launches: the `deepspeed` launcher starting CPU ranks over gloo, as users launch."""

from __future__ import annotations

import pytest

from rsclip_ds.data.synthetic import make_synthetic
from rsclip_ds.data.tokenizer import iter_captions, train_tokenizer
from tests.integration.helpers import launch_summary


@pytest.fixture(scope="session")
def launch_data(tmp_path_factory):
    """8 train shards of 128 samples at 64 px, and a tokenizer trained on their captions."""
    out = tmp_path_factory.mktemp("launch_data")
    index = make_synthetic(out, num_train=1024, num_val=64, shard_size=128, image_size=64, seed=0,
                           progress=False)
    urls = [str(out / s["url"]) for s in index["train"]]
    train_tokenizer(iter_captions(urls), out / "tokenizer", vocab_size=500, max_length=64)
    return {"shards": index["train_pattern"], "tokenizer": str(out / "tokenizer")}


@pytest.fixture
def launch(launch_data, tmp_path):
    """launch(*overrides, nproc=2) -> summary dict of a `deepspeed --num_gpus N` run."""
    def _launch(*overrides: str, nproc: int = 2, name: str = "run") -> dict:
        return launch_summary(launch_data, tmp_path / name, list(overrides), nproc)
    return _launch


@pytest.fixture(scope="session")
def published_folder(tmp_path_factory):
    """A folder of the published Git-RSCLIP shape (tests/published_like.py)."""
    from tests.published_like import write_published_like

    return write_published_like(tmp_path_factory.mktemp("published"))


@pytest.fixture(scope="session")
def published_data(tmp_path_factory):
    """Shards for the fine-tunes from that folder, and an evaluation layout."""
    out = tmp_path_factory.mktemp("published_data")
    index = make_synthetic(out, num_train=256, num_val=16, shard_size=64, image_size=64, seed=0,
                           progress=False, eval_layout=True)
    return {"train": index["train_pattern"], "classes": str(out / "eval" / "classes"),
            "captions": str(out / "eval" / "captions.json")}

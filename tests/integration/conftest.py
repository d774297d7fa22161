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


@pytest.fixture(scope="session")
def launch_teacher(launch_data, tmp_path_factory):
    """A distillation teacher folder unlike `tiny`: 96 wide, 48 px images (the loader resizes the
    student's 64 px view for it), 32 text tokens, the launch data's tokenizer."""
    from transformers import SiglipConfig

    from rsclip_ds.model import load_tokenizer, new_dual_encoder, save_pretrained

    tokenizer = load_tokenizer(launch_data["tokenizer"])
    shape = dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2)
    config = SiglipConfig(text_config=dict(shape, max_position_embeddings=32, vocab_size=len(tokenizer), pad_token_id=1,
                                           bos_token_id=None, eos_token_id=1),
                          vision_config=dict(shape, image_size=48, patch_size=8))
    folder = tmp_path_factory.mktemp("teacher")
    save_pretrained(new_dual_encoder(config, seed=3), tokenizer, folder)
    return str(folder)


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

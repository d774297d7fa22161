"""uint8 pixels from the loader to the model: the model's normalisation on the device equals
the numpy float32 path it replaced, bit for bit; batches carry a quarter of the bytes; a train
step sees the same numbers as before; the start-up check of /dev/shm counts those bytes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from rsclip_ds.config import ConfigError, DataConfig
from rsclip_ds.data import Normalize, build_train_loader, check_shared_memory
from rsclip_ds.losses import siglip_loss
from rsclip_ds.model import ModelBundle, new_dual_encoder, normalize_pixels, preset_config
from rsclip_ds.loop import micro_batch_step, global_optimizer_step
from tests.helpers import LocalEngine

CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
STATS = [((0.5,) * 3, (0.5,) * 3), (CLIP_MEAN, CLIP_STD), ((0.0,) * 3, (1.0,) * 3),
         ((0.1, 0.2, 0.3), (0.11, 0.07, 0.9))]


def _random_batch(b=4, size=64, length=48, seed=0):
    """uint8 pixels as the loader hands them over ((B,3,S,S) view of (B,S,S,3) storage), token ids."""
    g = np.random.default_rng(seed)
    hwc = g.integers(0, 256, (b, size, size, 3), dtype=np.uint8)
    ids = torch.from_numpy(g.integers(0, 1000, (b, length)))
    return torch.from_numpy(hwc).permute(0, 3, 1, 2), ids


def _old_float(pixels: torch.Tensor, mean, std) -> torch.Tensor:
    """What the loader sent before: numpy float32 normalisation of the (B,S,S,3) pixels."""
    return torch.from_numpy(Normalize(mean, std)(pixels.permute(0, 2, 3, 1).numpy()))


@pytest.mark.parametrize("mean, std", STATS)
def test_device_normalisation_equals_the_numpy_reference_bit_for_bit(mean, std):
    every = torch.arange(256, dtype=torch.uint8).view(1, 1, 1, 256).expand(2, 3, 5, 256)   # all values, 3 channels
    want = _old_float(every, mean, std)
    got = normalize_pixels(every, mean, std)
    assert got.dtype == torch.float32 and got.is_contiguous() and got.shape == (2, 3, 5, 256)
    assert torch.equal(got, want)
    for dtype in (torch.bfloat16, torch.float16):   # the old path cast the float32 result
        assert torch.equal(normalize_pixels(every, mean, std, dtype), want.to(dtype))


def _bundle(model, mean, std):
    return ModelBundle(model, None, 64, mean, std, 48)


def test_model_normalises_uint8_with_the_bundle_mean_and_std_and_keeps_a_siglip_state_dict():
    from transformers import SiglipModel

    config = preset_config("tiny")
    model = _bundle(new_dual_encoder(config).eval(), CLIP_MEAN, CLIP_STD).model
    assert (model.image_mean, model.image_std) == (CLIP_MEAN, CLIP_STD)
    pixels, ids = _random_batch()
    with torch.no_grad():
        ours = model(pixels, ids)
        old = model(_old_float(pixels, CLIP_MEAN, CLIP_STD), ids)   # float pixels pass unchanged
        other = model(_old_float(pixels, (0.5,) * 3, (0.5,) * 3), ids)
    assert torch.equal(ours[0], old[0]) and torch.equal(ours[1], old[1])
    assert not torch.allclose(ours[0], other[0])   # the mean/std are used, not SigLIP's defaults
    # mean/std are plain attributes: export and DeepSpeed see exactly SiglipModel's tensors
    siglip = SiglipModel(config)
    assert set(model.state_dict()) == set(siglip.state_dict())
    assert {n for n, _ in model.named_buffers()} == {n for n, _ in siglip.named_buffers()}


def test_a_16bit_tower_gets_the_old_paths_pixels():
    """bf16 engine: the old path normalised in float32 on the CPU and cast; so does the model."""
    model = new_dual_encoder(preset_config("tiny")).eval().to(torch.bfloat16)
    pixels, ids = _random_batch()
    assert model.vision_dtype() == torch.bfloat16
    with torch.no_grad():
        ours = model(pixels, ids)
        old = model(_old_float(pixels, (0.5,) * 3, (0.5,) * 3).to(torch.bfloat16), ids)
    assert ours[0].dtype == torch.bfloat16
    assert torch.equal(ours[0], old[0])


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_train_step_on_uint8_gives_the_loss_and_gradients_of_the_float_batch(accumulation):
    config = preset_config("tiny")
    grads, losses = [], []
    for as_uint8 in (True, False):
        engine = LocalEngine(new_dual_encoder(config, seed=3))
        batches = []
        for i in range(accumulation):
            pixels, ids = _random_batch(seed=i)
            batches.append({"pixel_values": pixels if as_uint8 else _old_float(pixels, (0.5,) * 3, (0.5,) * 3),
                            "input_ids": ids})
        if accumulation == 1:
            loss = micro_batch_step(engine, batches[0], siglip_loss, torch.float32)
        else:
            loss = global_optimizer_step(engine, batches, siglip_loss, torch.float32)
        losses.append(loss)
        grads.append([p.grad for p in engine.module.parameters()])
    assert torch.equal(losses[0], losses[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.fixture
def index(tiny_shards, tiny_tokenizer):
    return {**tiny_shards, "tokenizer": tiny_tokenizer}


def _loader(index, workers, size=16, micro=8, cores=None):
    cfg = DataConfig(train_shards=index["train_pattern"], num_workers=workers, shuffle_buffer=16)
    return build_train_loader(cfg, tokenizer=index["tokenizer"], image_size=size, max_text_length=40,
                              micro_batch_size=micro, rank=0, world_size=1, seed=0, cores=cores)


def test_worker_batches_are_uint8_in_shared_memory_with_a_quarter_of_the_bytes(index, monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")   # the session tokenizer used threads; forking follows
    from_worker = list(itertools.islice(iter(_loader(index, 1)), 2))
    in_process = list(itertools.islice(iter(_loader(index, 0)), 2))
    for w, p in zip(from_worker, in_process):
        pixels = w["pixel_values"]
        assert pixels.dtype == torch.uint8 and pixels.shape == (8, 3, 16, 16)
        # the batch is its one uint8 storage, written once, in shared memory: 8 x 3 x 16 x 16 bytes
        assert pixels.untyped_storage().nbytes() == 8 * 3 * 16 * 16 and pixels.is_shared()
        assert pixels.float().std() > 10   # real images, not blank
        assert torch.equal(pixels, p["pixel_values"]) and torch.equal(w["input_ids"], p["input_ids"])

        assert pixels.untyped_storage().nbytes() + w["input_ids"].untyped_storage().nbytes() == \
            _loader(index, 1).batch_bytes   # what the /dev/shm check counts per batch


MIB = 2 ** 20


def test_a_64_mb_dev_shm_is_refused_before_training_with_the_fixes(index, tmp_path):
    """Docker's default /dev/shm (64 MiB) against micro 128 at 256 px with one worker (auto on
    2 cores): 3 batches of 24 MiB in flight, with the margin ~90 MiB, is refused and the message
    names the fixes; micro 32 fits; no workers, no shared memory; float32 pixels would have
    needed 4x (what the bus errors came from)."""
    docker_default = lambda path: 64 * MIB   # noqa: E731
    big = _loader(index, "auto", size=256, micro=128, cores=2)
    assert big.num_workers == 1
    pixel_bytes = 128 * 3 * 256 * 256
    assert pixel_bytes <= big.batch_bytes < 1.01 * pixel_bytes   # token ids are the rest
    with pytest.raises(ConfigError) as err:
        check_shared_memory(big, held=1, local_ranks=1, path=str(tmp_path), free_bytes=docker_default)
    message = str(err.value)
    assert "needs ~90 MiB of shared memory on this node" in message and "has 64 MiB free" in message
    for fix in ("docker run --shm-size=1g", "batch.micro_batch_size", "--set data.num_workers=0"):
        assert fix in message
    # 2 ranks on the node, 2 micro-batches held by an accumulating step: twice the ranks, 4 batches
    with pytest.raises(ConfigError, match="~240 MiB"):
        check_shared_memory(big, held=2, local_ranks=2, path=str(tmp_path), free_bytes=docker_default)
    small = _loader(index, "auto", size=256, micro=32, cores=2)
    need = check_shared_memory(small, held=1, local_ranks=1, path=str(tmp_path), free_bytes=docker_default)
    assert 20 * MIB < need < 25 * MIB
    nothing = _loader(index, 0, size=256, micro=128)
    assert check_shared_memory(nothing, held=1, local_ranks=8, path=str(tmp_path), free_bytes=lambda p: 0) == 0
    assert check_shared_memory(big, held=1, local_ranks=1, path=str(tmp_path / "absent"), free_bytes=lambda p: 0) > 0


def test_the_message_says_how_many_workers_fit(index, tmp_path):
    loader = _loader(index, 8, size=256, micro=32)   # 8 shards: 8 workers
    with pytest.raises(ConfigError, match=r"--set data.num_workers=3 \(fits\)"):
        # 1.25 x 6.3 MiB x (2 x 3 + 1) = 55 MiB fits in 64, 4 workers (71 MiB) would not
        check_shared_memory(loader, held=1, local_ranks=1, path=str(tmp_path), free_bytes=lambda p: 64 * MIB)

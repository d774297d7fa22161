"""rsclip_ds.planning.flops against a hand count and against torch.utils.flop_counter on real towers."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rsclip_ds.planning.flops import encoder_layer_flops, flops_per_sample, mfu, text_flops, vision_flops
from rsclip_ds.model import new_dual_encoder, preset_config


def eager(config):
    """flop_counter has no formula for CPU's fused attention kernel; eager attention is plain bmm."""
    config = copy.deepcopy(config)
    for c in (config, config.vision_config, config.text_config):
        c._attn_implementation = "eager"
    return config


def test_encoder_layer_by_hand():
    # n=4 tokens, d=2, f=3: projections 4*2*4*2*2=128, attention 2*2*4*4*2=128, MLP 2*2*4*2*3=96
    assert encoder_layer_flops(4, 2, 3) == 128 + 128 + 96


def test_git_rsclip_base_by_hand():
    """ViT-B/16 at 224 px: 196 patches; 12 layers of width 768, MLP 3072; text 64 tokens."""
    config = preset_config("git-rsclip-base")
    n, d, f = 196, 768, 3072
    layer = 8 * n * d * d + 4 * n * n * d + 4 * n * d * f
    vision = 2 * n * 3 * 16 * 16 * d + 12 * layer + (4 * d * d + 4 * n * d * d + 4 * n * d + 4 * d * f)
    assert vision_flops(config.vision_config).total == vision
    t = 64
    text = 12 * (8 * t * d * d + 4 * t * t * d + 4 * t * d * f) + 2 * d * d
    assert text_flops(config.text_config).total == text
    # about 2 x parameters x tokens: 86M vision params x 196 tokens ~ 35 GFLOP per image
    assert 30e9 < vision < 40e9


@pytest.mark.parametrize("batch", [1, 3])
def test_forward_matches_torch_flop_counter(batch):
    config = eager(preset_config("tiny"))
    model = new_dual_encoder(config).eval()
    v, t = config.vision_config, config.text_config
    pixels = torch.randn(batch, 3, v.image_size, v.image_size)
    ids = torch.randint(0, t.vocab_size, (batch, t.max_position_embeddings))
    counted = {}
    for name, run in (("vision", lambda: model.vision_model(pixel_values=pixels)),
                      ("text", lambda: model.text_model(input_ids=ids))):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            run()
        counted[name] = counter.get_total_flops()
    expected = flops_per_sample(config)
    assert counted["vision"] == batch * expected.vision_forward
    assert counted["text"] == batch * expected.text_forward


def test_training_step_is_about_three_forwards():
    """Backward = 2 x forward except where no input gradient is needed (the patch conv): the
    real count sits a little under 3 x."""
    config = eager(preset_config("tiny"))
    model = new_dual_encoder(config)
    v, t = config.vision_config, config.text_config
    pixels = torch.randn(2, 3, v.image_size, v.image_size)
    ids = torch.randint(0, t.vocab_size, (2, t.max_position_embeddings))
    with FlopCounterMode(display=False) as counter:
        image, text, _, _ = model(pixels, ids)
        (image.sum() + text.sum()).backward()
    predicted = 2 * flops_per_sample(config).train()
    assert 0.95 * predicted < counter.get_total_flops() <= predicted


def test_checkpointing_and_mfu():
    f = flops_per_sample(preset_config("tiny"))
    assert f.train(activation_checkpointing=True) == 3 * f.forward          # model FLOPs
    assert f.train(activation_checkpointing=True, hardware=True) == 4 * f.forward
    assert mfu(10**12, 100.0, 10**15) == pytest.approx(0.1)

"""Fine-tuning controls on the tiny model, in one process: what trains under each lock, the
optimizer groups' learning rates, LoRA (outputs unchanged at start, merge = adapted model, the
adapter alone loads with peft), the interpolated image size, checkpointed blocks behind frozen
embeddings still getting gradients."""

from __future__ import annotations

import math

import pytest
import torch

from rsclip_ds.config import ConfigError, FinetuneConfig, LoraConfig, OptimConfig, load_config
from rsclip_ds.finetune import (apply_finetune, apply_image_size, apply_lora, apply_trainability, layer_of,
                                merge_lora_state, param_groups, save_adapter)
from rsclip_ds.model import apply_activation_checkpointing, new_dual_encoder, preset_config


def _model(seed: int = 0):
    return new_dual_encoder(preset_config("tiny"), seed=seed)   # 2 blocks per tower


def _batch(model, size=None, n=3):
    vc, tc = model.config.vision_config, model.config.text_config
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(n, 3, size or vc.image_size, size or vc.image_size, generator=g)
    ids = torch.randint(3, tc.vocab_size, (n, tc.max_position_embeddings), generator=g)
    return pixels, ids


def _trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_layer_numbering():
    assert layer_of("vision_model.embeddings.patch_embedding.weight", 2) == 0
    assert layer_of("vision_model.encoder.layers.0.mlp.fc1.weight", 2) == 1
    assert layer_of("text_model.encoder.layers.1.self_attn.q_proj.weight", 2) == 2
    assert layer_of("vision_model.head.mlp.fc1.weight", 2) == 3
    assert layer_of("text_model.final_layer_norm.weight", 2) == 3


@pytest.mark.parametrize("unlocked,want", [
    (0, set()),
    (1, {"encoder.layers.1.", "post_layernorm", "head."}),
    (2, {"encoder.layers.0.", "encoder.layers.1.", "post_layernorm", "head.", "embeddings."})])
def test_lock_image_keeps_the_last_blocks(unlocked, want):
    model = _model()
    apply_trainability(model, FinetuneConfig(lock_image=True, lock_image_unlocked_layers=unlocked))
    on = _trainable(model)
    vision = {n for n in on if n.startswith("vision_model.")}
    assert {part for n in vision for part in want if part in n} == want
    assert all(any(part in n for part in want) for n in vision)
    assert {n for n, _ in model.named_parameters() if n.startswith("text_model.")} <= on   # text trains
    assert {"logit_scale", "logit_bias"} <= on


def test_a_lock_deeper_than_the_tower_is_an_error():
    with pytest.raises(ConfigError, match="has 2 blocks"):
        apply_trainability(_model(), FinetuneConfig(lock_text=True, lock_text_unlocked_layers=3))


def test_wrong_combinations_fail_at_config_time():
    with pytest.raises(ConfigError, match="needs finetune.lock_image=true"):
        load_config(None, ["finetune.lock_image_unlocked_layers=1"])
    with pytest.raises(ConfigError, match="LoRA already freezes"):
        load_config(None, ["finetune.lock_text=true", "finetune.lora.towers=[text]"])


def test_param_groups_carry_tower_lrs_layer_decay_and_weight_decay():
    model = _model()
    optim = OptimConfig(lr=1e-3, image_lr=2e-4, logit_lr=1e-2, text_layer_decay=0.5, weight_decay=0.1)
    apply_trainability(model, FinetuneConfig(lock_image=True, lock_image_unlocked_layers=1))
    groups = param_groups(model, optim, lr_factor=2.0)
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    wd_of = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    names = dict(model.named_parameters())
    assert set(lr_of) == {id(p) for p in names.values() if p.requires_grad}    # frozen: not in the optimizer
    assert lr_of[id(names["logit_scale"])] == pytest.approx(2 * 1e-2)
    assert lr_of[id(names["vision_model.encoder.layers.1.mlp.fc1.weight"])] == pytest.approx(2 * 2e-4)
    assert lr_of[id(names["vision_model.head.mlp.fc1.weight"])] == pytest.approx(2 * 2e-4)
    depth = 3   # text: embeddings 0, blocks 1-2, final norm / head 3
    for name, layer in (("text_model.embeddings.token_embedding.weight", 0),
                        ("text_model.encoder.layers.0.mlp.fc1.weight", 1),
                        ("text_model.encoder.layers.1.mlp.fc1.weight", 2), ("text_model.head.weight", 3)):
        assert lr_of[id(names[name])] == pytest.approx(2 * 1e-3 * 0.5 ** (depth - layer)), name
    for name, p in names.items():
        if p.requires_grad:
            assert wd_of[id(p)] == (0.1 if p.ndim >= 2 else 0.0), name


def test_a_plain_run_has_the_two_groups_it_always_had():
    model = _model()
    groups = param_groups(model, OptimConfig(lr=1e-3, weight_decay=0.05))
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(1e-3, 0.05), (1e-3, 0.0)]
    assert [p for g in groups for p in g["params"]] == \
        [p for p in model.parameters() if p.ndim >= 2] + [p for p in model.parameters() if p.ndim < 2]


def test_lora_trains_only_adapters_and_merges_to_the_adapted_model(tmp_path):
    from peft import PeftModel
    from transformers import SiglipModel

    model = _model()
    pixels, ids = _batch(model)
    with torch.no_grad():
        before = model.eval()(pixels, ids)
    cfg = FinetuneConfig(lora=LoraConfig(towers=["image"], rank=4, alpha=8, mlp=True))
    assert apply_lora(model, cfg.lora) == 2 * 6   # 2 blocks x (q, k, v, out, fc1, fc2)
    apply_trainability(model, cfg)
    vision_on = {n for n in _trainable(model) if n.startswith("vision_model.")}
    assert vision_on and all(".lora_A." in n or ".lora_B." in n for n in vision_on)
    assert any(n.startswith("text_model.") for n in _trainable(model))
    with torch.no_grad():
        start = model.eval()(pixels, ids)
        torch.testing.assert_close(start[0], before[0], atol=1e-6, rtol=0)   # B = 0: unchanged at start
        for name, p in model.named_parameters():                      # "train" the adapters
            if ".lora_B." in name:
                p.normal_(0, 0.05)
        adapted = model(pixels, ids)
    assert not torch.allclose(adapted[0], start[0], atol=1e-4)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plain = SiglipModel(model.config).eval()
    plain.load_state_dict(merge_lora_state(state, cfg.lora), strict=True)
    merged = new_dual_encoder(model.config)
    merged.load_state_dict(plain.state_dict())
    with torch.no_grad():
        got = merged.eval()(pixels, ids)
    torch.testing.assert_close(got[0], adapted[0], atol=2e-6, rtol=0)
    torch.testing.assert_close(got[1], adapted[1], atol=0, rtol=0)
    # the adapter alone, in peft's format, on the untrained base
    save_adapter(state, cfg.lora, tmp_path)
    base = SiglipModel(model.config)
    base.load_state_dict(merge_lora_state({k: v for k, v in state.items() if ".lora_B." not in k}
                                          | {k: torch.zeros_like(v) for k, v in state.items() if ".lora_B." in k},
                                          cfg.lora))
    peft_model = PeftModel.from_pretrained(base, str(tmp_path)).eval()
    with torch.no_grad():
        image = peft_model.get_image_features(pixel_values=pixels).pooler_output
    torch.testing.assert_close(torch.nn.functional.normalize(image, dim=-1), adapted[0], atol=2e-6, rtol=0)


def test_a_new_image_size_interpolates_the_position_embeddings():
    model = _model()                       # 64 px, patch 8: an 8 x 8 grid
    table = model.vision_model.embeddings.position_embedding.weight
    rows, cols = torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="ij")
    with torch.no_grad():                  # a smooth table: 3 * row + col in every channel
        table.copy_((3 * rows + cols).reshape(64, 1).expand(64, table.shape[1]))
    assert apply_image_size(model, 96)     # -> 12 x 12
    assert not apply_image_size(model, 96)
    new = model.vision_model.embeddings.position_embedding.weight
    assert new.shape == (144, table.shape[1]) and model.config.vision_config.image_size == 96
    grid = new[:, 0].reshape(12, 12)
    # bicubic reproduces a linear ramp away from the border: cell centres map back as 8/12 of a cell
    centre = (torch.arange(12.0) + 0.5) * 8 / 12 - 0.5
    want = 3 * centre[:, None] + centre[None, :]
    torch.testing.assert_close(grid[2:-2, 2:-2], want[2:-2, 2:-2], atol=1e-4, rtol=0)
    image, text, _, _ = model.eval()(*_batch(model, size=96))
    assert image.shape == (3, 64) and torch.isfinite(image).all()
    with pytest.raises(ConfigError, match="multiple of the patch size"):
        apply_image_size(model, 100)


def test_checkpointed_blocks_behind_frozen_embeddings_still_get_gradients():
    cfg = FinetuneConfig(lock_image=True, lock_image_unlocked_layers=1)

    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        from rsclip_ds.model import ModelBundle

        model = _model()
        bundle = ModelBundle(model, None, 64, (0.5,) * 3, (0.5,) * 3, 48)
        apply_finetune(bundle, cfg, "siglip", checkpointing=checkpointing)
        if checkpointing:
            apply_activation_checkpointing(model)
        model.train()
        image, text, scale, bias = model(*_batch(model))
        (image @ text.T * scale.exp() + bias).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    plain, checkpointed = grads(False), grads(True)
    name = "vision_model.encoder.layers.1.mlp.fc1.weight"
    assert name in checkpointed and checkpointed[name].abs().sum() > 0
    for key in plain:
        torch.testing.assert_close(checkpointed[key], plain[key], atol=1e-5, rtol=1e-4)
    assert math.isclose(sum(v.abs().sum().item() for v in plain.values()),
                        sum(v.abs().sum().item() for v in checkpointed.values()), rel_tol=1e-4)

"""Patch dropout (apply_patch_dropout in rsclip_ds/model.py), in one process on the tiny preset: the kept-token
count, evaluation and p = 0 untouched, 'global' accumulation against a big batch with the same
masks, the switch-off for the last steps in the real train loop, and the planner's counts."""

from __future__ import annotations

import logging

import pytest
import torch

from rsclip_ds.losses import siglip_loss
from rsclip_ds.model import new_dual_encoder, preset_config
from rsclip_ds.model import PatchDropout, PatchDropoutSwitch, apply_patch_dropout, kept_tokens
from rsclip_ds.loop import global_optimizer_step
from tests.helpers import LocalEngine, planned_zero2

N = 64   # tiny: 64 px / 8 px patches = 8 x 8


def _inputs(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (n, 3, 64, 64), dtype=torch.uint8, generator=g),
            torch.randint(0, 1000, (n, 48), generator=g))


def _pixels(model, pixels):
    from rsclip_ds.model import normalize_pixels

    return normalize_pixels(pixels, model.image_mean, model.image_std)


def test_kept_token_count():
    assert [kept_tokens(196, p) for p in (0.0, 0.5, 0.75)] == [196, 98, 49]
    assert kept_tokens(256, 0.75) == 64 and kept_tokens(10, 0.99) == 1   # at least one
    pixels, _ = _inputs(4)
    for p, kept in ((0.5, 32), (0.75, 16)):
        model = new_dual_encoder(preset_config("tiny"), seed=1).train()
        assert apply_patch_dropout(model, p) is model.patch_dropout
        out = model.vision_model(pixel_values=_pixels(model, pixels))
        assert out.last_hidden_state.shape == (4, kept, 64)    # the encoder ran on the kept tokens
        assert out.pooler_output.shape == (4, 64) and torch.isfinite(out.pooler_output).all()

    # what the encoder gets: the kept rows of the position-embedded tokens, a subset per image
    model = new_dual_encoder(preset_config("tiny"), seed=1).train()
    full = model.vision_model.embeddings(_pixels(model, pixels))                     # (4, 64, 64)
    recorder = _Recording(0.5)
    model.vision_model.embeddings.register_forward_hook(recorder)
    seen = []
    model.vision_model.encoder.register_forward_hook(
        lambda m, args, kwargs, out: seen.append(kwargs["inputs_embeds"]), with_kwargs=True)
    model.vision_model(pixel_values=_pixels(model, pixels))
    keep = recorder.masks[0]                                                         # (4, 32)
    assert torch.equal(seen[0], full.gather(1, keep.unsqueeze(-1).expand(-1, -1, 64)))
    assert all(len(set(row.tolist())) == 32 for row in keep)                         # no patch twice
    assert len({frozenset(row.tolist()) for row in keep}) == 4                       # per image


def test_evaluation_and_p0_are_the_model_itself():
    """model.eval() never drops (the evaluation hook and `rsclip-ds eval` run in eval mode): the
    output equals the unmodified model's exactly; p = 0 adds no hook, so training forwards stay
    bit for bit the model's own (the demo's losses depend on it)."""
    pixels, ids = _inputs(3)
    plain = new_dual_encoder(preset_config("tiny"), seed=1)
    dropped = new_dual_encoder(preset_config("tiny"), seed=1)
    apply_patch_dropout(dropped, 0.75)
    with torch.no_grad():
        for a, b in zip(plain.eval()(pixels, ids), dropped.eval()(pixels, ids)):
            assert torch.equal(a, b)
        assert not torch.equal(plain.train()(pixels, ids)[0], dropped.train()(pixels, ids)[0])
    zero = new_dual_encoder(preset_config("tiny"), seed=1).train()
    assert apply_patch_dropout(zero, 0.0) is None and not zero.vision_model.embeddings._forward_hooks
    apply_patch_dropout(dropped, 0.0)   # applying again replaces the hook: here with none
    assert not dropped.vision_model.embeddings._forward_hooks
    for a, b in zip(plain.train()(pixels, ids), zero(pixels, ids)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="0 <= p < 1"):
        apply_patch_dropout(zero, 1.0)


class _Recording(PatchDropout):
    def __init__(self, p):
        super().__init__(p)
        self.masks = []

    def draw(self, batch, n, device):
        self.masks.append(super().draw(batch, n, device))
        return self.masks[-1]


class _Replaying(PatchDropout):
    def __init__(self, p, masks):
        super().__init__(p)
        self.masks = masks

    def draw(self, batch, n, device):
        assert (batch, n) == (len(self.masks), N)
        return self.masks


def test_global_accumulation_equals_the_big_batch_with_the_same_masks():
    """global_optimizer_step's replayed pass keeps the cached pass's patches (the RNG replay), and its
    loss and gradients equal one big-batch forward/backward over the same kept patches."""
    k, micro, p = 3, 4, 0.5
    pixels, ids = _inputs(k * micro)
    batches = [{"pixel_values": a, "input_ids": b} for a, b in zip(pixels.split(micro), ids.split(micro))]
    model = new_dual_encoder(preset_config("tiny"), seed=1).train()
    recorder = _Recording(p)
    model.vision_model.embeddings.register_forward_hook(recorder)
    engine = LocalEngine(model)
    loss = global_optimizer_step(engine, batches, siglip_loss, torch.float32)
    cached, replayed = recorder.masks[:k], recorder.masks[k:]
    assert len(recorder.masks) == 2 * k and all(m.shape == (micro, N // 2) for m in replayed)
    assert all(torch.equal(a, b) for a, b in zip(cached, replayed))
    assert not torch.equal(cached[0], cached[1])   # each micro-batch draws its own

    reference = new_dual_encoder(preset_config("tiny"), seed=1).train()
    reference.vision_model.embeddings.register_forward_hook(_Replaying(p, torch.cat(replayed)))
    ref_loss = siglip_loss(*reference(pixels, ids))
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert (a.grad - b.grad).abs().max() < 2e-5, name
    # other masks give another loss: the equality above is not blind to the masks
    other = new_dual_encoder(preset_config("tiny"), seed=1).train()
    other.vision_model.embeddings.register_forward_hook(_Replaying(p, torch.cat(replayed).flip(0)))
    assert abs(siglip_loss(*other(pixels, ids)).item() - ref_loss.item()) > 1e-4


class _TrainEngine(LocalEngine):
    """LocalEngine plus what train() reads of an engine; SGD so the steps do something."""
    global_steps = micro_steps = 0
    monitor = None

    def step(self):
        with torch.no_grad():
            for q in self.module.parameters():
                if q.grad is not None:
                    q -= 1e-3 * q.grad
                    q.grad = None
        self.global_steps += 1
        self.micro_steps += 1

    def get_lr(self):
        return [1e-3]

    def fp16_enabled(self):
        return False

    def bfloat16_enabled(self):
        return False

    def get_global_grad_norm(self):
        return None


def test_switch_off_for_the_last_steps_in_the_train_loop(caplog):
    """steps=6, patch_dropout_off_last_steps=2: steps 1-4 masked, 5-6 on every patch; the log
    names the step. A run resumed past the switch point starts unmasked."""
    from rsclip_ds.reporting.progress import ProgressReporter
    from tests.unit.fake_engine import run_loop

    model = new_dual_encoder(preset_config("tiny"), seed=1)
    dropout = apply_patch_dropout(model, 0.75)
    tokens = []
    model.vision_model.encoder.register_forward_hook(
        lambda m, args, kwargs, out: tokens.append(kwargs["inputs_embeds"].shape[1]), with_kwargs=True)
    pixels, ids = _inputs(2)
    batches = iter(lambda: {"pixel_values": pixels, "input_ids": ids}, None)
    with caplog.at_level(logging.INFO, logger="rsclip_ds"):
        switch = PatchDropoutSwitch(dropout, steps=6, off_last_steps=2)
        run_loop(_TrainEngine(model), batches, 6, 3, reporter=ProgressReporter(6, "plain"), hooks=[switch],
                 loss=siglip_loss)
    assert tokens == [16] * 4 + [64] * 2
    assert "patch dropout 0.75 off after step 4: steps 5.. run on every patch" in caplog.text

    resumed = apply_patch_dropout(model, 0.75)
    PatchDropoutSwitch(resumed, steps=6, off_last_steps=2)(5)   # what Trainer.build does with the resumed step
    assert not resumed.enabled
    early = apply_patch_dropout(model, 0.75)
    PatchDropoutSwitch(early, steps=6, off_last_steps=2)(3)
    assert early.enabled


def test_planner_counts_the_kept_tokens():
    """git-rsclip-base at p = 0.5: the image tower's encoder FLOPs are those of 98 tokens (the
    patch embedding still sees all 196), its activations about half; the text tower unchanged;
    `rsclip-ds plan` takes --set model.patch_dropout and carries it into the launch command."""
    from rsclip_ds.planning.dropout import with_patch_dropout
    from rsclip_ds.planning.flops import encoder_layer_flops, text_flops, vision_flops
    from rsclip_ds.planning.activations import activation_bytes_per_sample
    from rsclip_ds.planning.memory import _config, preset_spec
    from rsclip_ds.planning.planner import train_flops

    spec = preset_spec("git-rsclip-base")
    half = with_patch_dropout(spec, 0.5)
    assert with_patch_dropout(spec, 0.0) is spec
    full_v, half_v = vision_flops(_config(spec).vision_config), vision_flops(_config(half).vision_config)
    assert half_v.embed == full_v.embed
    assert half_v.layers / full_v.layers == pytest.approx(encoder_layer_flops(98, 768, 3072)
                                                          / encoder_layer_flops(196, 768, 3072), rel=1e-12)
    assert 0.48 < half_v.layers / full_v.layers < 0.5   # the n^2 attention term drops 4x
    assert text_flops(_config(half).text_config) == text_flops(_config(spec).text_config)
    saved = (train_flops(spec, 1, False, False) - train_flops(half, 1, False, False)) / 3
    assert saved == full_v.total - half_v.total
    full_a = activation_bytes_per_sample(_config(spec), "bf16")
    half_a = activation_bytes_per_sample(_config(half), "bf16")
    assert half_a["text"] == full_a["text"]
    assert 0.5 < half_a["vision"] / full_a["vision"] < 0.52   # + the embeddings of all 196 patches


def test_plan_takes_patch_dropout(capsys):
    """`rsclip-ds plan --set model.patch_dropout=0.5`: a larger micro-batch fits, the step computes
    less, and the launch command carries the setting."""
    base = ["plan", "--model", "git-rsclip-base", "--gpus", "8", "--gpu-mem", "40GiB", "--global-batch", "4096",
            "--json"]

    def planned(*sets):
        return planned_zero2(capsys, base, *sets)

    (_, full), (doc, half) = planned(), planned("model.patch_dropout=0.5")
    assert half["max_micro"] > full["max_micro"] and half["compute_s"] < 0.75 * full["compute_s"]
    assert "--set model.patch_dropout=0.5" in doc["command"]

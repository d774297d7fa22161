"""The memory model under stage 0 (the ddp profile) and the autocast precisions (amp_bf16, amp), against
hand arithmetic, a real forward under torch.autocast, and the committed measurements of real engines
(benchmarks/memory/per_rank.py: benchmarks/results/memory_peak_base_{ddp,amp_bf16}.json, git-rsclip-base
at micro 2; memory_amp_bf16.json, tiny)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rsclip_ds.model import new_dual_encoder, preset_config
from rsclip_ds.planning.activations import _probe_parts, saved_storages
from rsclip_ds.planning.memory import (GiB, autocast_elements, model_state_bytes, peak, preset_spec, state_bytes,
                                       wire_elements)
from rsclip_ds.profiles import load_profile
from rsclip_ds.runtime.integrity import checkpoint_bytes

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
PEAK_TOL, MODEL_TOL = 0.15, 0.10   # benchmarks/memory/per_rank.py's tolerances
PSI = 10**9


@pytest.fixture(scope="module")
def base():
    return preset_spec("git-rsclip-base")


# --------------------------------------------------------------------------- model states

def test_stage0_keeps_no_master_copy_of_fp32_weights():
    """Stage 0 steps torch's AdamW on the module's fp32 weights (m and v: 8 bytes); 16-bit weights get
    DeepSpeed's FP16_UnfusedOptimizer and its fp32 copy (12). Under ZeRO every precision keeps an fp32
    master partition: amp_bf16 is fp32's 4 + 4 + 12."""
    assert [state_bytes(p, stage=0) for p in ("fp32", "amp_bf16", "amp", "bf16", "fp16")] == [
        (4, 4, 8), (4, 4, 8), (4, 4, 8), (2, 2, 12), (2, 2, 12)]
    assert state_bytes("amp_bf16", stage=2) == state_bytes("fp32") == (4, 4, 12)
    # whole on every GPU, whatever their number: 16 bytes a parameter
    for gpus in (1, 8):
        assert model_state_bytes(PSI, 0, False, False, "amp_bf16", gpus, gpus).gpu == 16 * PSI
        assert model_state_bytes(PSI, 0, False, False, "bf16", gpus, gpus).gpu == 16 * PSI
    # a locked tower: weights for all, gradients and m, v for the trainable ones
    assert model_state_bytes(PSI, 0, False, False, "fp32", 4, 4, trainable=PSI // 4).gpu == 4 * PSI + 12 * PSI // 4
    # ZeRO-2 under amp_bf16: fp32 weights whole, 16 bytes a trainable parameter / G
    assert model_state_bytes(PSI, 2, False, False, "amp_bf16", 4, 4).gpu == 4 * PSI + 16 * PSI // 4
    with pytest.raises(ValueError, match="need ZeRO"):
        state_bytes("bf16", "bf16", stage=0)
    with pytest.raises(ValueError, match="offload needs ZeRO"):
        model_state_bytes(PSI, 0, True, False, "fp32", 1, 1)


def test_checkpoint_bytes_per_stage():
    """Stage 0 writes the module once and torch's AdamW state (fp32: 4 + 8 bytes a parameter; measured on
    tiny's 198,274 parameters: 2,379,640 bytes of tensors, 12 a parameter), bf16 the FP16_UnfusedOptimizer's
    fp32 copy too (2 + 12); ZeRO under amp_bf16 as fp32 (4 + 12)."""
    assert checkpoint_bytes(PSI, PSI, "fp32", stage=0) == checkpoint_bytes(PSI, PSI, "amp_bf16", stage=0) == 12 * PSI
    assert checkpoint_bytes(PSI, PSI, "bf16", stage=0) == 14 * PSI
    assert checkpoint_bytes(PSI, PSI, "amp_bf16", stage=2) == 16 * PSI
    assert checkpoint_bytes(PSI, PSI // 2, "amp_bf16", stage=3) == 4 * (PSI - PSI // 2) + 12 * (PSI // 2)


def test_the_measured_states_under_amp_bf16():
    """tiny under amp_bf16 on 2 ranks (memory_amp_bf16.json): ddp holds 16 bytes a parameter whole; ZeRO-3
    keeps its fp32 master partition beside the fp32 weight partition (12 bytes / 2 of optimizer: stage3.py's
    alias branch does not run), as the model says."""
    rep = json.loads((RESULTS / "memory_amp_bf16.json").read_text())
    psi, world = rep["config"]["parameters"], rep["environment"]["world_size"]
    assert rep["config"]["precision"] == "amp_bf16" and world == 2
    rows = {r["profile"]: r for r in rep["profiles"]}
    for name, row in rows.items():
        prof = load_profile(name)
        states = model_state_bytes(psi, prof.stage, False, False, "amp_bf16", world, world)
        assert row["gpu"]["measured"] == pytest.approx(states.gpu, rel=MODEL_TOL), (name, row["measured"])
    assert rows["ddp"]["measured"]["optimizer_gpu"] == pytest.approx(8 * psi, rel=1e-3)   # + a step scalar each
    assert rows["zero3"]["measured"]["optimizer_gpu"] == pytest.approx(12 * psi / world, rel=1e-3)


# --------------------------------------------------------------------------- autocast's activations

@pytest.mark.parametrize("precision, dtype", [("amp_bf16", torch.bfloat16), ("amp", torch.float16)])
def test_the_autocast_probe_matches_a_real_autocast_forward(precision, dtype):
    """The meta-device probe makes autocast's casts itself; a real CPU forward of tiny under torch.autocast
    saves the same bytes (within 1%: 1,455,248 against 1,450,896 at 2 samples), ~1.6x bf16's activations,
    of which the 16-bit weight copies are ~2 bytes per Linear/Conv parameter."""
    cfg = preset_config("tiny")
    model = new_dual_encoder(cfg).train()
    params = list(model.parameters())
    vc, tc = cfg.vision_config, cfg.text_config
    pixels = torch.randn(2, 3, vc.image_size, vc.image_size)
    ids = torch.randint(0, tc.vocab_size, (2, tc.max_position_embeddings))
    with torch.autocast("cpu", dtype=dtype):
        real = (sum(saved_storages(lambda: model.vision_model(pixel_values=pixels), params).values())
                + sum(saved_storages(lambda: model.text_model(input_ids=ids), params).values()))
    vision, text, weights = _probe_parts(cfg.to_json_string(), precision, False, 2)
    assert vision + text + weights == pytest.approx(real, rel=0.01)
    linear = sum(p.numel() for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))
                 for p in m.parameters(recurse=False))
    assert weights == pytest.approx(2 * linear, rel=0.05)
    bf16 = sum(_probe_parts(cfg.to_json_string(), "bf16", False, 2)[:2])
    assert 1.2 * bf16 < vision + text < 2 * bf16   # fp32 residual stream and LayerNorm inputs, a cast per q, k, v


def test_autocast_elements_follow_deepspeeds_exact_class_match(base):
    """Ψ_a: the trainable elements of exactly nn.Linear / nn.Conv2d modules (DeepSpeed's comm_dtype): 86.6% of
    git-rsclip-base; the pooling head's in_proj_weight and NonDynamicallyQuantizableLinear stay fp32."""
    assert base.autocast_params == 175_938_816 and base.autocast_all == base.autocast_params
    assert 0.86 < base.autocast_params / base.params < 0.87
    head = torch.nn.MultiheadAttention(64, 4)
    assert autocast_elements(head) == 0 and autocast_elements(torch.nn.Linear(64, 8)) == 64 * 8 + 8
    assert wire_elements(base, "amp_bf16") == {2: base.autocast_params, 4: base.params - base.autocast_params}
    assert wire_elements(base, "bf16") == {2: base.params}


# --------------------------------------------------------------------------- the peak's terms

def test_stage0_peak_terms(base):
    """ddp: the states hold the whole gradients (no separate term) and no ZeRO buckets; on several ranks
    rsclip_ds.gradients holds a copy of every gradient in its wire dtype at the end of the step's last
    backward (2Ψ_a + 4(Ψ_t - Ψ_a) under amp_bf16), a phase of its own like the step's; the step: nothing for
    fused AdamW on fp32 weights, the fp32 copy of every 16-bit gradient under bf16; autocast's weight copies
    in forward/backward."""
    ddp = load_profile("ddp")
    kw = dict(micro=8, accumulation_steps=1)
    one, two = (peak(base, ddp, "amp_bf16", g, g, **kw) for g in (1, 8))
    assert one.states == two.states == 16 * base.params and one.gradients == one.buckets == two.buckets == 0
    assert (one.step, two.step) == (0, 2 * base.autocast_params + 4 * (base.trainable - base.autocast_params))
    assert one.autocast_weights > 1.9 * base.autocast_params
    assert one.train == one.activations + one.loss + one.inputs + one.autocast_weights
    fp32 = peak(base, ddp, "fp32", 8, 8, **kw)
    assert fp32.step == 4 * base.trainable and fp32.autocast_weights == 0 == peak(base, ddp, "fp32", 1, 1, **kw).step
    bf16 = peak(base, ddp, "bf16", 8, 8, **kw)   # the step's fp32 copy (4) over the bf16 buckets (2)
    assert bf16.step == 4 * base.trainable and bf16.states == 16 * base.params


def test_zero_buckets_per_wire_dtype_under_autocast(base):
    """DeepSpeed keeps a reduce bucket per wire dtype: ZeRO-2 two of each (overlap_comm) in the fp32 gradient
    dtype, and a bf16 copy of one in flight; ZeRO-3 one in each wire dtype."""
    z2, z3 = load_profile("zero2"), load_profile("zero3")
    bucket = int(z2.strategy["zero_optimization"]["reduce_bucket_size"])
    kw = dict(micro=8, accumulation_steps=1)
    assert peak(base, z2, "amp_bf16", 4, 4, **kw).buckets == 2 * 2 * bucket * 4 + bucket * 2
    assert peak(base, z2, "fp32", 4, 4, **kw).buckets == 2 * bucket * 4
    amp3 = peak(base, z3, "amp_bf16", 4, 4, **kw)
    assert amp3.buckets == bucket * (2 + 4) and amp3.gathered == 4 * base.params   # gathered weights are fp32


@pytest.mark.parametrize("name", ["memory_peak_base_ddp.json", "memory_peak_base_amp_bf16.json"])
def test_the_model_is_within_15_percent_of_the_measured_peaks(name):
    """Every measured peak (ddp on one rank, and in fp32 on two, where the all-reduce's buckets -- a copy of
    every gradient at the end of the backward -- set the peak; zero2 on two; accumulation 1 and 4) against the
    model evaluated now, on the benchmark's batch (float32 pixels, int64 token ids) on CPU ranks."""
    rep = json.loads((RESULTS / name).read_text())
    c = rep["config"]
    spec = preset_spec(c["preset"])
    vc, tc = preset_config(c["preset"]).vision_config, preset_config(c["preset"]).text_config
    input_bytes = 4 * 3 * vc.image_size ** 2 + 8 * tc.max_position_embeddings
    checked = 0
    for row in rep["profiles"]:
        prof = load_profile(row["profile"])
        for p in row["peaks"]:
            w, k = p["world_size"], p["accumulation"]
            model = peak(spec, prof, c["precision"], w, w, micro=c["micro"], accumulation_steps=k,
                         checkpointing=prof.activation_checkpointing, accumulation="plain", device="cpu",
                         input_bytes=input_bytes)
            assert abs(p["measured"] / model.host - 1) <= PEAK_TOL, (row["profile"], w, k, p["measured"] / GiB,
                                                                      model.host / GiB)
            checked += 1
    assert checked == (3 if "ddp" in name else 4)


def test_amp_bf16_costs_autocasts_copies_and_larger_activations(base):
    """ddp at one micro-batch: bf16 (2 + 2 + 12) and amp_bf16 (4 + 4 + 8) hold the same 16 bytes a parameter;
    amp_bf16 adds autocast's weight copies and larger activations in forward/backward, bf16 the fp32
    gradient copy in its step."""
    ddp = load_profile("ddp")
    kw = dict(micro=64, accumulation_steps=1)
    bf16, amp = (peak(base, ddp, p, 1, 1, **kw) for p in ("bf16", "amp_bf16"))
    assert bf16.states == amp.states == 16 * base.params
    assert amp.activations > 1.2 * bf16.activations and amp.autocast_weights > 0 == bf16.autocast_weights
    assert math.isclose(amp.train - bf16.train, amp.activations - bf16.activations + amp.autocast_weights)

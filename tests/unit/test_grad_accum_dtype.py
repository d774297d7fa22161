"""bf16.grad_accum_dtype -> DeepSpeed's data_types.grad_accum_dtype, and the errors where
DeepSpeed 0.19.8 would refuse the pair; and what 'auto' puts into a ZeRO-2 engine (2 forked ranks).
Its parity bound against the fp32 big batch was measured by the removed
benchmarks/precision/grad_accum.py (docs/results/training.md#grad-accum)."""

from __future__ import annotations

import json

import pytest

from rsclip_ds.config import ConfigError, load_config
from rsclip_ds.profiles import load_profile
from rsclip_ds.resolve import build_ds_config

# 'auto' by profile, as docs/guides/precision.md states it: fp32 where it costs at most 2 bytes per
# trainable parameter / G of GPU memory (ZeRO-2, ZeRO-3, ZeRO-3 with offload), bf16 at ZeRO-1
# (BF16_Optimizer: a whole fp32 gradient copy) and ZeRO-2 with offload (a new GPU buffer)
AUTO = {"zero1": "bf16", "zero2": "fp32", "zero2_offload": "bf16", "zero3": "fp32", "zero3_offload": "fp32"}


def ds(profile: str, *sets: str) -> dict:
    return build_ds_config(load_config(None, [f"profile={profile}", *sets]), load_profile(profile), 2, on_gpu=False)


@pytest.mark.parametrize("profile", sorted(AUTO))
def test_auto_follows_the_documented_rule(profile):
    """At k > 1 micro-batches a step; at k = 1 there is nothing to sum, and every profile keeps bf16 (the same
    numbers: a bf16 value is exact in fp32, for a cast and an add per gradient tensor less)."""
    assert ds(profile, "precision=bf16", "batch.gradient_accumulation_steps=4")["data_types"] == {
        "grad_accum_dtype": AUTO[profile]}
    assert ds(profile, "precision=bf16")["data_types"] == {"grad_accum_dtype": "bf16"}


@pytest.mark.parametrize("choice", ("fp32", "bf16"))
@pytest.mark.parametrize("profile", sorted(AUTO))
def test_an_explicit_choice_reaches_the_ds_config(profile, choice):
    assert ds(profile, "precision=bf16", f"bf16.grad_accum_dtype={choice}")["data_types"] == \
        {"grad_accum_dtype": choice}


@pytest.mark.parametrize("precision", ("fp32", "fp16"))
def test_other_precisions_accumulate_in_their_own_dtype(precision):
    assert ds("zero2", f"precision={precision}")["data_types"] == {"grad_accum_dtype": precision}


def test_the_setting_is_for_bf16_runs_only():
    with pytest.raises(ConfigError, match="applies to precision=bf16 only"):
        load_config(None, ["precision=fp32", "bf16.grad_accum_dtype=fp32"])


def test_unknown_value_is_rejected():
    with pytest.raises(ConfigError, match="bf16.grad_accum_dtype"):
        load_config(None, ["bf16.grad_accum_dtype=fp64"])


def _custom_profile(tmp_path, zero: dict) -> str:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"zero_optimization": zero}))
    return str(path)


def test_bf16_without_zero_names_the_fix(tmp_path):
    """bf16 weights at stage 0 run DeepSpeed's FP16_UnfusedOptimizer (and it raises 'unsupported mix' for fp32
    accumulation): refused, naming amp_bf16 (fp32 weights, autocast) and the ZeRO profiles."""
    profile = _custom_profile(tmp_path, {"stage": 0})
    for sets in (["bf16.grad_accum_dtype=fp32"], []):
        run = load_config(None, [f"profile={profile}", "precision=bf16", *sets])
        with pytest.raises(ConfigError, match="at stage 0.*precision=amp_bf16.*zero1, zero2"):
            build_ds_config(run, load_profile(profile), 2, on_gpu=False)


def test_zero1_fp32_without_the_gradient_norm_names_the_fix(tmp_path):
    """ZeRO-1 + bf16 + fp32 accumulation is DeepSpeed's BF16_Optimizer, which refuses
    compute_grad_norm=false."""
    profile = _custom_profile(tmp_path, {"stage": 1, "compute_grad_norm": False})
    run = load_config(None, [f"profile={profile}", "precision=bf16", "bf16.grad_accum_dtype=fp32"])
    with pytest.raises(ConfigError, match="BF16_Optimizer.*compute_grad_norm"):
        build_ds_config(run, load_profile(profile), 2, on_gpu=False)


def test_a_profile_may_not_set_data_types_itself(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "data_types": {"grad_accum_dtype": "fp32"}}))
    run = load_config(None, [f"profile={path}", "precision=bf16"])
    with pytest.raises(ConfigError, match="data_types.*bf16.grad_accum_dtype"):
        build_ds_config(run, load_profile(str(path)), 2, on_gpu=False)


def _accumulation_buffer_on_rank(rank: int, world: int, out: str) -> dict:
    """A bf16 ZeRO-2 run as the Trainer builds it with bf16.grad_accum_dtype=auto; one micro-batch
    of two (no step yet), then the partition DeepSpeed accumulates this rank's gradients in."""
    import torch

    from rsclip_ds.model import preset_bundle
    from rsclip_ds.loop import micro_batch_step
    from rsclip_ds.assembly import Trainer

    run = load_config(None, ["profile=zero2", "precision=bf16", "model.preset=tiny", "batch.micro_batch_size=2",
                             "batch.gradient_accumulation_steps=2", "steps=1", "optim.warmup_steps=0",
                             f"output_dir={out}", "checkpoint.at_end=false"])
    g = torch.Generator().manual_seed(rank)
    batch = {"pixel_values": torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8, generator=g),
             "input_ids": torch.randint(0, 1000, (2, 48), generator=g)}
    bundle = preset_bundle("tiny", None, run.seed, own_vocabulary=True)
    trainable = sum(p.numel() for p in bundle.model.parameters() if p.requires_grad)
    with Trainer(run, model=bundle, loader=iter([batch])) as trainer:
        parts = trainer.build()
        micro_batch_step(parts.engine, batch, parts.loss_fn, torch.bfloat16)
        opt = parts.engine.optimizer
        # ZeRO-1/2 with fp32 accumulation: the fp32 partition per group; otherwise the 16-bit one
        groups = [g.flat_partition for g in opt.averaged_gradients.values() if hasattr(g, "flat_partition")]
        buffer = torch.cat([g.view(-1) for g in groups]) if groups else opt.grads_in_partition
        return {"optimizer": type(opt).__name__, "trainable": trainable,
                "dtype": None if buffer is None else str(buffer.dtype),
                "bytes": None if buffer is None else buffer.numel() * buffer.element_size()}


@pytest.mark.slow   # 2 forked ranks, ~15 s: not for the quick loop
def test_auto_accumulates_zero2_gradients_in_an_fp32_partition(tmp_path):
    """What the DeepSpeed config above does in the engine: ZeRO-2's gradient partition is fp32,
    4 bytes per trainable parameter / W (what planning/memory.py counts for fp32 accumulation)."""
    from tests.unit.forked_ranks import run_ranks

    ranks = run_ranks(_accumulation_buffer_on_rank, 2, tmp_path / "ranks", str(tmp_path / "run"),
                      launcher_env=True, timeout=300)
    assert all("error" not in r for r in ranks), [r.get("traceback") for r in ranks]
    for r in (r["value"] for r in ranks):
        assert (r["optimizer"], r["dtype"]) == ("DeepSpeedZeroOptimizer", "torch.float32"), r
        assert r["bytes"] == pytest.approx(4 * r["trainable"] / 2, rel=0.01), r

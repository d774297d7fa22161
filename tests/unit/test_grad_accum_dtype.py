"""bf16.grad_accum_dtype -> DeepSpeed's data_types.grad_accum_dtype, and the errors where
DeepSpeed 0.19.8 would refuse the pair. What the setting does in the engine, and its parity
bound, is tests/integration/test_benchmark_grad_accum.py."""

from __future__ import annotations

import json

import pytest

from rsclip_ds.config import ConfigError, load_config
from rsclip_ds.profiles import build_ds_config, load_profile

# 'auto' by profile, as docs/guides/precision.md states it: fp32 where it costs at most 2 bytes per
# trainable parameter / G of GPU memory (ZeRO-2, ZeRO-3, ZeRO-3 with offload), bf16 at ZeRO-1
# (BF16_Optimizer: a whole fp32 gradient copy) and ZeRO-2 with offload (a new GPU buffer)
AUTO = {"zero1": "bf16", "zero2": "fp32", "zero2_offload": "bf16", "zero3": "fp32", "zero3_offload": "fp32"}


def ds(profile: str, *sets: str) -> dict:
    return build_ds_config(load_config(None, [f"profile={profile}", *sets]), load_profile(profile), 2, on_gpu=False)


@pytest.mark.parametrize("profile", sorted(AUTO))
def test_auto_follows_the_documented_rule(profile):
    assert ds(profile, "precision=bf16")["data_types"] == {"grad_accum_dtype": AUTO[profile]}


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


def test_fp32_without_zero_names_the_fix(tmp_path):
    """DeepSpeed without ZeRO raises 'unsupported mix' for bf16 weights with fp32 accumulation."""
    profile = _custom_profile(tmp_path, {"stage": 0})
    run = load_config(None, [f"profile={profile}", "precision=bf16", "bf16.grad_accum_dtype=fp32"])
    with pytest.raises(ConfigError, match="needs ZeRO.*bf16.grad_accum_dtype=bf16"):
        build_ds_config(run, load_profile(profile), 2, on_gpu=False)
    auto = load_config(None, [f"profile={profile}", "precision=bf16"])
    assert build_ds_config(auto, load_profile(profile), 2, on_gpu=False)["data_types"] == {"grad_accum_dtype": "bf16"}


def test_zero1_fp32_without_the_gradient_norm_names_the_fix(tmp_path):
    """ZeRO-1 + bf16 + fp32 accumulation is DeepSpeed's BF16_Optimizer, which refuses
    compute_grad_norm=false."""
    profile = _custom_profile(tmp_path, {"stage": 1, "compute_grad_norm": False})
    run = load_config(None, [f"profile={profile}", "precision=bf16", "bf16.grad_accum_dtype=fp32"])
    with pytest.raises(ConfigError, match="BF16_Optimizer.*compute_grad_norm"):
        build_ds_config(run, load_profile(profile), 2, on_gpu=False)


def test_a_profile_may_not_set_data_types_itself(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "data_types": {"grad_accum_dtype": "bf16"}}))
    run = load_config(None, [f"profile={path}", "precision=bf16"])
    with pytest.raises(ConfigError, match="data_types.*bf16.grad_accum_dtype"):
        build_ds_config(run, load_profile(str(path)), 2, on_gpu=False)

"""bf16.master_weights -> DeepSpeed's bf16 block, and the errors where DeepSpeed 0.19.8 refuses the
mode or would silently keep fp32 masters. What the engine then holds (bf16 master partitions and
AdamW states), that training moves the weights and that a checkpoint resumes is
tests/integration/test_bf16_master_weights.py."""

from __future__ import annotations

import json

import pytest

from rsclip_ds.config import ConfigError, load_config
from rsclip_ds.profiles import load_profile
from rsclip_ds.resolve import build_ds_config

BOTH = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True,
        "check_grad_overflow": False}   # (the step's gradient norm guards it: tests/unit/test_step_overhead.py)
PROFILES = ("zero1", "zero2", "zero2_offload", "zero3", "zero3_offload")
OFFLOAD = ("zero2_offload", "zero3_offload")


def ds(profile: str, *sets: str, on_gpu: bool = False) -> dict:
    run = load_config(None, [f"profile={profile}", "precision=bf16", *sets])
    return build_ds_config(run, load_profile(profile), 2, on_gpu=on_gpu)


def masters(profile: str, *sets: str, on_gpu: bool = False) -> dict:
    impl = ["optim.impl=deepspeed"] if profile in OFFLOAD and not on_gpu else []
    return ds(profile, "bf16.master_weights=bf16", *impl, *sets, on_gpu=on_gpu)


def test_the_default_keeps_deepspeeds_fp32_masters():
    assert load_config(None, []).bf16.master_weights == "fp32"
    assert ds("zero2")["bf16"] == {"enabled": True, "check_grad_overflow": False}   # no master keys


@pytest.mark.parametrize("profile", PROFILES)
def test_bf16_masters_set_both_deepspeed_flags_and_accumulate_in_bf16(profile):
    """auto accumulates in bf16 with bf16 masters, whatever the profile's fp32 rule says."""
    config = masters(profile)
    assert config["bf16"] == BOTH
    assert config["data_types"] == {"grad_accum_dtype": "bf16"}


@pytest.mark.parametrize("profile", ("zero2", "zero2_offload", "zero3", "zero3_offload"))
def test_an_explicit_fp32_sum_is_kept_at_zero2_and_zero3(profile):
    config = masters(profile, "bf16.grad_accum_dtype=fp32")
    assert config["bf16"] == BOTH and config["data_types"] == {"grad_accum_dtype": "fp32"}


def test_zero1_with_an_fp32_sum_is_refused():
    """DeepSpeed would build its BF16_Optimizer, which keeps fp32 masters and states (measured)."""
    with pytest.raises(ConfigError, match=r"ZeRO-1.*BF16_Optimizer.*bf16.grad_accum_dtype=auto"):
        masters("zero1", "bf16.grad_accum_dtype=fp32")


@pytest.mark.parametrize("profile", OFFLOAD)
def test_offload_with_torchs_adamw_names_the_fix(profile):
    """DeepSpeed asserts that offloaded bf16 masters run on DeepSpeedCPUAdam; on CPU ranks
    optim.impl=auto picks torch's AdamW."""
    with pytest.raises(ConfigError, match="optim.impl=deepspeed"):
        ds(profile, "bf16.master_weights=bf16")
    with pytest.raises(ConfigError, match="optim.impl=deepspeed"):
        ds(profile, "bf16.master_weights=bf16", "optim.impl=torch", on_gpu=True)


@pytest.mark.parametrize("profile", OFFLOAD)
def test_offload_on_gpus_gets_deepspeeds_cpu_adam_by_default(profile):
    config = masters(profile, on_gpu=True)
    assert config["bf16"] == BOTH and config["optimizer"]["params"]["torch_adam"] is False


def test_stage_0_is_refused(tmp_path):
    path = tmp_path / "ddp.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    run = load_config(None, [f"profile={path}", "precision=bf16", "bf16.master_weights=bf16"])
    # bf16 at stage 0 at all: DeepSpeed's FP16_UnfusedOptimizer (a host sync per gradient, AdamW a step ahead)
    with pytest.raises(ConfigError, match="precision=bf16 at stage 0.*precision=amp_bf16.*ZeRO profile"):
        build_ds_config(run, load_profile(str(path)), 2, on_gpu=False)


@pytest.mark.parametrize("precision", ("fp32", "fp16"))
def test_the_setting_is_for_bf16_runs_only(precision):
    with pytest.raises(ConfigError, match="bf16.master_weights=bf16 applies to precision=bf16 only.*set precision=bf16"):
        load_config(None, [f"precision={precision}", "bf16.master_weights=bf16"])


def test_unknown_value_is_rejected():
    with pytest.raises(ConfigError, match="bf16.master_weights"):
        load_config(None, ["bf16.master_weights=fp16"])


def test_a_profile_may_not_set_the_flags_itself(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": BOTH}))
    run = load_config(None, [f"profile={path}", "precision=bf16"])
    with pytest.raises(ConfigError, match="bf16.master_weights"):
        build_ds_config(run, load_profile(str(path)), 2, on_gpu=False)

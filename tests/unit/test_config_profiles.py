import json

import pytest

from rsclip_ds.config import ConfigError, load_config
from rsclip_ds.profiles import RUN_KEYS, available_profiles, load_profile
from rsclip_ds.resolve import activation_checkpointing_enabled, build_ds_config, derive_batch, scaled_lr

REQUIRED_PROFILES = {"zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"}


def test_precedence_defaults_file_then_set(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("steps: 50\nbatch:\n  micro_batch_size: 4\noptim:\n  lr: 0.01\n")
    run = load_config(cfg, ["batch.micro_batch_size=8", "optim.betas=[0.9, 0.95]"])
    assert run.steps == 50                      # file over default
    assert run.batch.micro_batch_size == 8      # --set over file
    assert run.optim.lr == 0.01
    assert run.optim.betas == (0.9, 0.95)
    assert run.precision == "auto"              # default: made concrete per profile (profiles.resolve_run_precision)


@pytest.mark.parametrize("override, fragment", [
    ("model.presett=tiny", "model.presett: unknown key; allowed here: activation_checkpointing, patch_dropout, patch_dropout_off_last_steps, preset, pretrained"),
    ("precision=fp8", "precision: Input should be 'auto', 'fp32', 'bf16', 'fp16', 'amp_bf16' or 'amp'"),
    ("batch.micro_batch_size=0", "batch.micro_batch_size"),
    ("optim.lr_scaling=cubic", "optim.lr_scaling"),
    ("bogus=1", "bogus: unknown key; allowed here:"),
    ("steps", "--set expects key=value"),
])
def test_bad_config_names_the_key_and_what_is_allowed(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert fragment in str(err.value)


def test_json_config_and_missing_file(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"profile": "zero3", "loss": {"name": "clip"}}))
    assert load_config(path).loss.name == "clip"
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_every_required_profile_loads_and_is_documented():
    names = set(available_profiles())
    assert REQUIRED_PROFILES <= names
    readme = (load_profile("zero1").path.parent / "README.md").read_text()
    expect = {"zero1": (1, False, False), "zero2": (2, False, False), "zero2_offload": (2, True, False),
              "zero3": (3, False, False), "zero3_offload": (3, True, True)}
    for name, (stage, opt, param) in expect.items():
        p = load_profile(name)
        assert (p.stage, p.offload_optimizer, p.offload_param) == (stage, opt, param)
        assert f"`{name}`" in readme, f"{name} has no line in ds_profiles/README.md"
        for block in ("offload_optimizer", "offload_param"):   # pin_memory explicit (default changed in 0.19.5)
            if block in p.strategy["zero_optimization"]:
                assert "pin_memory" in p.strategy["zero_optimization"][block]


def test_batch_arithmetic_is_written_into_the_ds_config():
    run = load_config(None, ["batch.micro_batch_size=8", "batch.gradient_accumulation_steps=3"])
    plan = derive_batch(run, 4)
    assert (plan.global_batch, str(plan)) == (96, "8 x 3 x 4 = 96")
    ds = build_ds_config(run, load_profile("zero2"), 4, on_gpu=False)
    assert ds["train_batch_size"] == 96
    assert ds["train_micro_batch_size_per_gpu"] == 8
    assert ds["gradient_accumulation_steps"] == 3
    # explicit (DeepSpeed's default is 1.0 since 0.19.3): ZeRO-2 clips in rsclip_ds's step guard (finite.StepGuard,
    # at optim.gradient_clipping), ZeRO-3 in DeepSpeed
    assert ds["gradient_clipping"] == 0.0
    zero3 = load_config(None, ["batch.micro_batch_size=8", "batch.gradient_accumulation_steps=3"])
    assert build_ds_config(zero3, load_profile("zero3"), 4, on_gpu=False)["gradient_clipping"] == 1.0
    assert ds["optimizer"]["params"]["torch_adam"] is True  # CPU ranks: no fused_adam JIT build
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]


def test_lr_scaling_with_world_size():
    for mode, expected in (("none", 1e-3), ("linear", 4e-3), ("sqrt", 2e-3)):
        run = load_config(None, ["optim.lr=1e-3", f"optim.lr_scaling={mode}"])
        assert scaled_lr(run, 4) == pytest.approx(expected)
        ds = build_ds_config(run, load_profile("zero1"), 4, on_gpu=False)
        assert ds["optimizer"]["params"]["lr"] == pytest.approx(expected)


def _write_profile(tmp_path, body):
    path = tmp_path / "custom.json"
    path.write_text(json.dumps(body))
    return str(path)


def test_profile_with_conflicting_run_value_names_both(tmp_path):
    path = _write_profile(tmp_path, {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4})
    run = load_config(None, ["batch.micro_batch_size=8"])
    with pytest.raises(ConfigError) as err:
        build_ds_config(run, load_profile(path), 2, on_gpu=False)
    msg = str(err.value)
    assert "train_micro_batch_size_per_gpu=4" in msg and "8" in msg and "batch.micro_batch_size" in msg
    # the same value is accepted
    build_ds_config(load_config(None, ["batch.micro_batch_size=4"]), load_profile(path), 2, on_gpu=False)


def test_inconsistent_batch_in_profile_is_an_error(tmp_path):
    path = _write_profile(tmp_path, {"zero_optimization": {"stage": 1}, "train_batch_size": 100})
    run = load_config(None, ["batch.micro_batch_size=8"])
    with pytest.raises(ConfigError, match=r"train_batch_size=100 .* 16 \(from batch\.\* x world size\)"):
        build_ds_config(run, load_profile(path), 2, on_gpu=False)


@pytest.mark.parametrize("body, fragment", [
    ({"zero_optimization": {"stage": 2}, "zero_optimisation": {}}, "unknown key(s) ['zero_optimisation']"),
    ({"zero_optimization": {"stage": 2, "overlap_com": True}}, "zero_optimization is invalid: overlap_com"),
    ({"zero_optimization": {"stage": 2}, "rsclip": {"act_ckpt": True}}, "unknown key(s) ['act_ckpt'] in 'rsclip'"),
])
def test_bad_profile_is_rejected_with_the_key(tmp_path, body, fragment):
    with pytest.raises(ConfigError) as err:
        load_profile(_write_profile(tmp_path, body))
    assert fragment in str(err.value)


def test_unknown_profile_lists_the_available_ones():
    with pytest.raises(ConfigError, match="available: .*zero2_offload"):
        load_profile("zero4")


def test_activation_checkpointing_run_config_overrides_profile():
    assert activation_checkpointing_enabled(load_config(), load_profile("zero3_offload")) is True
    assert activation_checkpointing_enabled(load_config(), load_profile("zero2")) is False
    run = load_config(None, ["model.activation_checkpointing=true"])
    assert activation_checkpointing_enabled(run, load_profile("zero2")) is True


def test_run_keys_cover_every_per_run_value():
    ds = build_ds_config(load_config(None, ["precision=fp16"]), load_profile("zero2"), 1, on_gpu=False)
    # the schedule goes to deepspeed.initialize, not the dict; torch_autocast only under the amp precisions
    assert set(RUN_KEYS) - {"scheduler", "torch_autocast"} <= set(ds)
    assert ds["fp16"]["enabled"] and ds["fp16"]["initial_scale_power"] == 16
    amp = build_ds_config(load_config(None, ["precision=amp_bf16"]), load_profile("zero2"), 1, on_gpu=False)
    assert amp["torch_autocast"]["enabled"] and amp["torch_autocast"]["dtype"] == "bfloat16"
    assert not amp["bf16"]["enabled"] and not amp["fp16"]["enabled"]
    assert amp["data_types"] == {"grad_accum_dtype": "fp32"} and amp["communication_data_type"] == "fp32"


def test_auto_optimizer_uses_deepspeed_cpu_adam_only_for_gpu_offload():
    run = load_config()
    torch_adam = lambda name, gpu: build_ds_config(run, load_profile(name), 2, on_gpu=gpu)[
        "optimizer"]["params"]["torch_adam"]
    assert torch_adam("zero2", gpu=True) is True            # no FusedAdam JIT build (needs nvcc)
    assert torch_adam("zero2_offload", gpu=True) is False   # DeepSpeedCPUAdam for offloaded states
    assert torch_adam("zero2_offload", gpu=False) is True   # CPU ranks: no cpu_adam build
    forced = load_config(None, ["optim.impl=deepspeed"])
    assert build_ds_config(forced, load_profile("zero2"), 2, on_gpu=False)["optimizer"]["params"][
        "torch_adam"] is False


def test_train_weights_are_checked_against_the_sources_when_the_config_loads():
    shards = "data.train_shards=a-{000..003}.tar::b/*.tar"
    assert load_config(None, [shards, "data.train_weights=[3,1]"]).data.train_weights == [3.0, 1.0]
    with pytest.raises(ConfigError, match=r"one non-negative weight per '::'-separated source .*\(2: "):
        load_config(None, [shards, "data.train_weights=[1,2,3]"])
    with pytest.raises(ConfigError, match="not all zero"):
        load_config(None, [shards, "data.train_weights=[0,0]"])
    with pytest.raises(ConfigError, match="data.policy=exact a weight is how often"):
        load_config(None, [shards, "data.train_weights=[0.5,1]"])
    load_config(None, [shards, "data.train_weights=[0.5,1]", "data.policy=resampled"])


def test_precision_auto_is_amp_bf16_at_stage_0_and_bf16_under_zero():
    """The default, decided from the op census (docs/results/throughput.md#census): the lighter step of the two per
    stage; fp16 and amp on GPUs without bf16; bf16 wherever a bf16.* setting asks for it."""
    from rsclip_ds.resolve import resolve_run_precision

    run = load_config(None, [])
    assert run.precision == "auto"
    picks = {name: resolve_run_precision(run, load_profile(name))[0].precision for name in ("ddp", "zero1", "zero3")}
    assert picks == {"ddp": "amp_bf16", "zero1": "bf16", "zero3": "bf16"}
    assert resolve_run_precision(run, load_profile("ddp"), bf16_supported=False)[0].precision == "amp"
    assert resolve_run_precision(run, load_profile("zero2"), bf16_supported=False)[0].precision == "fp16"
    masters = load_config(None, ["bf16.master_weights=bf16"])
    assert resolve_run_precision(masters, load_profile("zero2"))[0].precision == "bf16"
    explicit = load_config(None, ["precision=fp32"])
    assert resolve_run_precision(explicit, load_profile("ddp")) == (explicit, "as set")
    ds = build_ds_config(run, load_profile("ddp"), 2, on_gpu=False)   # what the engine gets: concrete
    assert ds["torch_autocast"]["dtype"] == "bfloat16" and not ds["bf16"]["enabled"]

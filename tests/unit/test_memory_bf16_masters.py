"""The memory model with bf16 master weights (bf16.master_weights=bf16): 2 + 2 + 6 bytes per
trainable parameter where mixed precision holds 2 + 2 + 12. The numbers were measured on 2 CPU
ranks by benchmarks/memory/per_rank.py --precision bf16 --set bf16.master_weights=bf16; what the engine
holds in a real run is tests/integration/test_bf16_master_weights.py."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from rsclip_ds.cli.plan import register as add_plan_parser
from rsclip_ds.cli.plan import run as cmd_plan
from rsclip_ds.config import ConfigError, load_config
from rsclip_ds.planning.memory import model_state_bytes, peak, preset_spec, state_bytes
from rsclip_ds.planning.planner import Budget, plan
from rsclip_ds.profiles import load_profile
from rsclip_ds.resolve import build_ds_config

PSI = 10**9


def test_bytes_per_parameter():
    assert state_bytes("bf16") == (2, 2, 12)                  # bf16 weight, gradient; fp32 master, m, v
    assert state_bytes("bf16", "bf16") == (2, 2, 6)           # bf16 master, m, v: no 4-byte copy
    with pytest.raises(ValueError, match="bf16 training only"):
        state_bytes("fp16", "bf16")


@pytest.mark.parametrize("gpus", [1, 4, 8])
def test_model_states_per_gpu(gpus):
    """ZeRO-1/2: 2Ψ + 8Ψ/G instead of 2Ψ + 14Ψ/G; ZeRO-3: 10Ψ/G instead of 16Ψ/G (DeepSpeed 0.19.8
    keeps a bf16 master partition beside the weights' at ZeRO-3 too); offload leaves the GPU's 2Ψ
    (2Ψ/G at ZeRO-3) as they were."""
    part = math.ceil(PSI / gpus)

    def gpu(stage, offload=False, master="bf16"):
        return model_state_bytes(PSI, stage, offload, False, "bf16", gpus, gpus, master=master).gpu

    for stage in (1, 2):
        assert gpu(stage) == 2 * PSI + 8 * part
        assert gpu(stage, master="fp32") - gpu(stage) == 6 * part
        assert gpu(stage, offload=True) == gpu(stage, offload=True, master="fp32") == 2 * PSI
    assert gpu(3) == 10 * part
    assert gpu(3, master="fp32") - gpu(3) == 6 * part
    assert gpu(3, offload=True) == gpu(3, offload=True, master="fp32") == 2 * part


def test_offloaded_states_on_the_cpu():
    """On one GPU (the offloaded states outgrow the fp32 model every rank builds, 4Ψ): ZeRO-2
    offload holds master + m + v + the master's gradient, 6 + 2 bytes instead of 12 + 4; ZeRO-3
    offload + the flat bf16 gradient partition, 10 instead of 18."""
    z2 = model_state_bytes(PSI, 2, True, False, "bf16", 1, 1, master="bf16")
    z3 = model_state_bytes(PSI, 3, True, False, "bf16", 1, 1, master="bf16")
    assert (z2.cpu_node, z3.cpu_node) == (8 * PSI, 10 * PSI)
    assert model_state_bytes(PSI, 2, True, False, "bf16", 1, 1).cpu_node == 16 * PSI


def test_the_step_casts_nothing_and_auto_accumulates_in_bf16():
    """ZeRO-2: the bf16 gradient partition is the masters' gradient (no 4-byte cast), AdamW's
    temporaries are bf16; 'auto' is bf16 accumulation, an explicit fp32 sum adds its 2 bytes / G
    and a cast back to bf16 at the step."""
    spec, G = preset_spec("git-rsclip-base"), 4
    tpart = math.ceil(spec.trainable / G)
    z2, kw = load_profile("zero2"), dict(micro=8, accumulation_steps=4)
    fp32 = peak(spec, z2, "bf16", G, G, grad_accum="bf16", **kw)
    bf16 = peak(spec, z2, "bf16", G, G, master="bf16", **kw)
    assert fp32.step == (2 + 4 + 4) * tpart                  # flat copy, fp32 cast, AdamW temporary (cuda)
    assert bf16.step == (2 + 0 + 2) * tpart
    assert fp32.states - bf16.states == 6 * tpart
    assert bf16 == peak(spec, z2, "bf16", G, G, master="bf16", grad_accum="bf16", **kw)
    summed = peak(spec, z2, "bf16", G, G, master="bf16", grad_accum="fp32", **kw)
    assert summed.states - bf16.states == 2 * tpart and summed.step - bf16.step == 2 * tpart


def test_the_planner_fits_more_with_bf16_masters():
    spec = preset_spec("git-rsclip-large")
    budget = Budget(4, 1, 24 * 2**30)
    mixed, pure = (plan(spec, budget, 256, profiles=["zero2"], master=m) for m in ("fp32", "bf16"))
    by = {(r.profile, r.checkpointing): r for r in mixed}
    for row in pure:
        assert row.gpu_gib < by[row.profile, row.checkpointing].gpu_gib


def test_plan_cli_passes_the_setting_to_the_command(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="command"))
    base = ["plan", "--model", "git-rsclip-base", "--gpus", "2", "--gpu-mem", "24", "--global-batch", "256", "--json"]
    out = tmp_path / "ds.json"
    assert cmd_plan(parser.parse_args(base + ["--master-weights", "bf16", "--write-config", str(out)])) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["master_weights"] == "bf16" and "--set bf16.master_weights=bf16" in doc["command"]
    assert json.loads(out.read_text())["bf16"]["bf16_master_weights_and_grads"] is True
    with pytest.raises(ConfigError, match="--precision bf16 only"):
        cmd_plan(parser.parse_args(base + ["--master-weights", "bf16", "--precision", "fp32"]))


def test_the_run_config_and_the_memory_model_name_the_same_mode():
    """The planner's `master` is the run config's bf16.master_weights, and its 'bf16' is the
    DeepSpeed flags the run gets."""
    run = load_config(None, ["profile=zero2", "precision=bf16", "bf16.master_weights=bf16"])
    ds = build_ds_config(run, load_profile("zero2"), 4, on_gpu=True)
    assert ds["bf16"]["bf16_optimizer_states"] and ds["data_types"]["grad_accum_dtype"] == "bf16"
    assert state_bytes(run.precision, run.bf16.master_weights) == (2, 2, 6)

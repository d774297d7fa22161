"""bf16.master_weights=bf16 in real 2-rank launches: ZeRO-2, tiny model, 8 steps, micro 16 x 2 ranks,
a checkpoint every 4 steps (~45 s: two launches).

The first run trains 8 steps; its checkpoints show what the optimizer held (each rank's master
partition and AdamW's m and v, all bf16: no fp32 copy anywhere), the loss falls, and the weights
move, except those an update below half a bf16 step never moves (the LayerNorm gains at 1.0, the
logit scale at log 10 and bias at -10, at lr <= 1e-3: docs/guides/precision.md). The second run resumes
from step 4 and must repeat steps 5-8 exactly, losses and weights."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from rsclip_ds.checkpoint import consolidated_state_dict
from tests.integration.helpers import launch_run, summary

pytestmark = pytest.mark.slow
MASTERS = ("precision=bf16", "bf16.master_weights=bf16")
W = 2


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc


def weights(path: Path) -> dict[str, torch.Tensor]:
    return consolidated_state_dict(path)[1]


def optimizer_shard(step_dir: Path, rank: int) -> dict:
    path = step_dir / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    return torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]


@pytest.fixture(scope="module")
def first(launch_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bf16_masters") / "run"
    ok(launch_run(launch_data, out, *MASTERS))
    return out


def test_the_engine_gets_both_flags_and_accumulates_in_bf16(first):
    ds = json.loads((first / "ds_config.json").read_text())
    assert ds["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True,
                          "check_grad_overflow": False}
    assert ds["data_types"] == {"grad_accum_dtype": "bf16"} and ds["zero_optimization"]["stage"] == 2


def test_the_optimizer_holds_no_fp32_copy(first):
    """Every rank's master partition and AdamW's m and v are bf16 and cover the same elements (the
    saved master leaves out its partition's padding, DeepSpeed's group_paddings)."""
    for rank in range(W):
        shard = optimizer_shard(first / "checkpoints" / "step00000004", rank)
        masters = shard["single_partition_of_fp32_groups"]       # DeepSpeed's name, whatever the dtype
        states = shard["base_optimizer_state"]["state"]
        assert [t.dtype for t in masters] == [torch.bfloat16] * len(masters)
        for group, master in enumerate(masters):
            for key in ("exp_avg", "exp_avg_sq"):
                assert states[group][key].dtype == torch.bfloat16
                assert states[group][key].numel() == master.numel() + shard["group_paddings"][group]


def test_the_loss_falls_and_the_matrices_move(first):
    s = summary(first)
    assert s["optimizer_steps"] == 8 and s["checkpoints"] == ["step00000004", "step00000008"]
    assert sum(s["losses"][-2:]) / 2 < s["losses"][0] - 2    # measured: 10.77 -> 5.90, 5.60
    a, b = (weights(first / "checkpoints" / tag) for tag in ("step00000004", "step00000008"))
    matrices = [k for k in a if a[k].ndim >= 2]
    moved = sum(int((a[k] != b[k]).sum()) for k in matrices) / sum(a[k].numel() for k in matrices)
    assert moved > 0.5, moved                                 # measured: 0.76 of all elements
    # bf16 rounding swallows an update below half a bf16 step of its weight: 2^-9 = 0.002 below
    # 1.0 (the LayerNorm gains), 2^-7 = 0.008 at log 10 (logit scale), 2^-5 = 0.03 at -10 (logit
    # bias); AdamW's update is ~lr, and lr <= 7.5e-4 in steps 5-8: those never move
    frozen = [k for k in a if k.startswith("logit_") or
              (("layer_norm" in k or "layernorm" in k) and k.endswith(".weight"))]
    assert len(frozen) == 13 and all(torch.equal(a[k], b[k]) for k in frozen)


def test_resume_repeats_the_run_exactly(first, launch_data):
    """From step 4's checkpoint (bf16 masters and states loaded back), steps 5-8 again."""
    reference, final = summary(first), weights(first / "checkpoints" / "step00000008")
    ok(launch_run(launch_data, first, *MASTERS, "checkpoint.resume=step00000004"))
    s = summary(first)
    assert s["resumed_from"] == [4] and s["losses"] == reference["losses"]
    again = weights(first / "checkpoints" / "step00000008")
    assert all(torch.equal(final[k], again[k]) for k in final)

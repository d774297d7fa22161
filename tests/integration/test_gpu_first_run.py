"""benchmarks/gpu/first_run.py --smoke on CPU ranks, so the first GPU run's script cannot rot: every
step runs in order (environment, parity, one ddp and one ZeRO-1/2/3 step each at the run's default
precision, the planner check) and its JSON holds what each measured and what only a GPU can confirm."""

from __future__ import annotations

import pytest

from tests.integration.benchmark_helpers import run_benchmark

pytestmark = pytest.mark.slow


def test_first_run_smoke_runs_every_step_and_names_the_gpu_checks(tmp_path):
    report = run_benchmark("gpu.first_run", "--smoke", out=tmp_path / "first_run.json", ranks=None, timeout=400)
    assert report["ok"], [s["output_tail"] for s in report["steps"] if not s["ok"]]
    assert [s["step"] for s in report["steps"]] == ["parity", "zero_steps", "plan"]
    zero = report["steps"][1]["result"]["cases"]
    # --precisions auto: what a run does by default, amp_bf16 on ddp and bf16 under ZeRO
    assert [(r["profile"], r["precision"], r["ok"]) for r in zero] == [
        ("ddp", "amp_bf16", True), ("zero1", "bf16", True), ("zero2", "bf16", True), ("zero3", "bf16", True)]
    # one seeded model and batch: the stages start alike (ZeRO-3's bf16 forward rounds apart in the 5th digit),
    # ddp's fp32 weights under autocast to bf16 rounding
    firsts = [r["first_loss"] for r in zero]
    assert firsts[1:] == pytest.approx([firsts[1]] * 3, rel=1e-4) and firsts[0] == pytest.approx(firsts[1], rel=2e-3)
    assert all(r["final_loss"] > 0 and r["mfu"] is None for r in zero)   # no peak for a CPU: no made-up MFU
    assert report["steps"][2]["result"]["recommended"]["profile"]
    assert report["environment"]["gpus"] == [] and report["environment"]["cores"] >= 1
    assert any("qgZ" in c for c in report["gpu_checks"]) and any("MFU" in c for c in report["gpu_checks"])
    assert any("ddp's overlapped bucketed all-reduce" in c for c in report["gpu_checks"])

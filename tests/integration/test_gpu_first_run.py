"""benchmarks/gpu_first_run.py --smoke on CPU ranks, so the first GPU run's script cannot rot: every
step runs in order (environment, parity, one ZeRO-1/2/3 step each, the planner check) and its JSON
holds what each measured and what only a GPU can confirm."""

from __future__ import annotations

import pytest

from tests.integration.benchmark_helpers import run_benchmark

pytestmark = pytest.mark.slow


def test_first_run_smoke_runs_every_step_and_names_the_gpu_checks(tmp_path):
    report = run_benchmark("gpu_first_run", "--smoke", out=tmp_path / "first_run.json", ranks=None, timeout=400)
    assert report["ok"], [s["output_tail"] for s in report["steps"] if not s["ok"]]
    assert [s["step"] for s in report["steps"]] == ["parity", "zero_steps", "plan"]
    zero = report["steps"][1]["result"]["cases"]
    assert [(r["profile"], r["ok"]) for r in zero] == [("zero1", True), ("zero2", True), ("zero3", True)]
    assert all(r["final_loss"] > 0 and r["mfu"] is None for r in zero)   # no peak for a CPU: no made-up MFU
    assert report["steps"][2]["result"]["recommended"]["profile"]
    assert report["environment"]["gpus"] == [] and report["environment"]["cores"] >= 1
    assert any("qgZ" in c for c in report["gpu_checks"]) and any("MFU" in c for c in report["gpu_checks"])

"""benchmarks/memory/step_faults.py --tiny: the engine as rsclip_ds configures it now (glibc keeping
freed memory, torch's fused AdamW) touches far less fresh host memory per step than the engine
as it was configured before (glibc's default, foreach AdamW): DeepSpeed's per-step buffers are
reused instead of page-faulted in again. Two launches of 2 CPU ranks, ~1.5 minutes."""

from __future__ import annotations

import pytest

from tests.integration.benchmark_helpers import run_benchmark

pytestmark = pytest.mark.slow


def test_the_engine_reuses_its_per_step_host_memory(tmp_path):
    report = run_benchmark("memory.step_faults", "--tiny", "--cases", "zero2_before", "zero2_after",
                           out=tmp_path / "faults.json", ranks=None)
    before, after = report["cases"]["zero2_before"], report["cases"]["zero2_after"]
    assert before.get("ok", True) and after.get("ok", True), report["cases"]
    assert before["parameters"] == after["parameters"] > 3_000_000   # the 49,408-token table included
    # before: the reduce bucket, the gradient copies and AdamW's temporaries come fresh every step
    assert before["faults_per_step"]["backward"] + before["faults_per_step"]["step"] > 3000
    assert after["mb_per_step"] < 0.5 * before["mb_per_step"], (before, after)

"""benchmarks/memory/step_faults.py --tiny: the engine as rsclip_ds configures it now (glibc keeping
freed memory, torch's fused AdamW) against the engine as it was configured before (glibc's default,
foreach AdamW). Two launches of 2 CPU ranks, ~1.5 minutes.

How much less fresh memory the tuned engine faults in per step is a measurement of the machine
(the kernel's page size and transparent huge pages, glibc's version, the load): the ratio is in
benchmarks/results/step_faults.json, not asserted here. Asserted is what holds on any Linux
machine with glibc: each case's process ran the settings it names, glibc then served a large
block where those settings say (the brk heap, which is kept, or a mapping of its own, which is
unmapped at free: the mechanism behind the faults), and the fault counts are counts: non-negative
per phase, summing to the step's."""

from __future__ import annotations

import pytest

from tests.integration.benchmark_helpers import run_benchmark

pytestmark = pytest.mark.slow
PHASES = {"forward", "loss", "backward", "step"}


def test_the_cases_run_the_allocator_and_optimizer_they_name_and_count_faults_per_phase(tmp_path):
    report = run_benchmark("memory.step_faults", "--tiny", "--cases", "zero2_before", "zero2_after",
                           out=tmp_path / "faults.json", ranks=None)
    before, after = report["cases"]["zero2_before"], report["cases"]["zero2_after"]
    assert before.get("ok", True) and after.get("ok", True), report["cases"]
    if after["allocator_applied"] is False:
        pytest.skip("not glibc: keep_freed_memory changes nothing here")
    assert before["parameters"] == after["parameters"] > 3_000_000   # the 49,408-token table included
    # before: glibc's default, DeepSpeed's foreach AdamW; after: mallopt applied, torch's fused AdamW
    assert (before["allocator"], before["allocator_applied"], before["adamw_fused"]) == ("default", None, False)
    assert (after["allocator"], after["allocator_applied"], after["adamw_fused"]) == ("keep", True, True)
    assert before["optimizer"] == after["optimizer"] == "AdamW"
    # a 64 MiB block: its own mapping by default (unmapped at free, faulted in afresh next time),
    # from the heap that is never trimmed once glibc keeps freed memory
    assert before["large_block_in_heap"] is False and after["large_block_in_heap"] is True
    for case in (before, after):
        faults = case["faults_per_step"]
        assert set(faults) == PHASES and all(v >= 0 for v in faults.values()), case
        assert sum(faults.values()) == pytest.approx(case["faults_total_per_step"], rel=1e-9), case
    # glibc's default hands the step's freed buffers back: the next step faults fresh pages in
    assert before["faults_total_per_step"] > 0, before

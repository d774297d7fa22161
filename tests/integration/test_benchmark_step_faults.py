"""benchmarks/memory/step_faults.py --tiny: the engine as rsclip_ds configures it now (glibc keeping
freed memory, torch's fused AdamW) against the engine as it was configured before (glibc's default,
foreach AdamW), and with torch's huge pages as `rsclip-ds train` runs it now. Three launches of 2 CPU
ranks, ~2 minutes.

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
    from rsclip_ds.runtime.host_memory import thp_mode

    report = run_benchmark("memory.step_faults", "--tiny", "--cases", "zero2_before", "zero2_after", "zero2_huge",
                           out=tmp_path / "faults.json", ranks=None)
    before, after, huge = (report["cases"][k] for k in ("zero2_before", "zero2_after", "zero2_huge"))
    assert all(c.get("ok", True) for c in (before, after, huge)), report["cases"]
    # huge pages: the launch asked torch for them, and the rank ended with memory in them (the
    # tiny model's flat buffers and DeepSpeed's 50M-element reduce buckets are above 2 MiB)
    assert (before["THP_MEM_ALLOC_ENABLE"], huge["THP_MEM_ALLOC_ENABLE"]) == ("0", "1")
    if thp_mode() == "madvise":
        assert huge["anon_huge_pages_bytes"] > before["anon_huge_pages_bytes"], (before, huge)
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

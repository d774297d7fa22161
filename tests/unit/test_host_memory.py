"""CPU ranks keep freed host memory: buffers the size DeepSpeed allocates per step (above glibc's
32 MiB mmap ceiling) are page-faulted in while the heap settles, not again on every step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = r"""
import json, resource, sys, torch
from rsclip_ds.runtime.host_memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
faults_per_step = []
for _ in range(12):   # a "step" as DeepSpeed's: a bucket, a flat partition, temporaries; all freed
    before = faults()
    bucket = torch.empty(12_500_000)    # 50 MB
    bucket.fill_(1.0)
    flat = torch.empty(20_000_000)      # 80 MB
    flat.fill_(2.0)
    tmp = flat * 2
    tmp2 = tmp + 1
    del bucket, flat, tmp, tmp2
    faults_per_step.append(faults() - before)
print(json.dumps({"kept": kept, "faults": faults_per_step}))
"""


def _rounds(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings: Linux only")
def test_freed_buffers_are_reused_instead_of_faulted_in_every_step():
    pages = (50 + 3 * 80) * 10**6 // 4096                # what one step writes
    default = _rounds("default")["faults"]
    assert min(default[1:]) > 0.9 * pages                # glibc's default: fresh pages every step
    kept = _rounds("keep")
    if not kept["kept"]:
        pytest.skip("not glibc: keep_freed_memory changes nothing here")
    assert kept["faults"][0] > 0.9 * pages               # the first step touches new memory
    assert sum(kept["faults"][-4:]) < 0.3 * pages        # once the heap has settled, steps reuse it

"""CPU ranks keep freed host memory: buffers the size DeepSpeed allocates per step (above glibc's
32 MiB mmap ceiling) come from the heap, which freeing does not shrink, instead of from mappings
of their own that are unmapped at free and page-faulted in afresh every step.

Asserted through where glibc puts the blocks (/proc/self/maps), which holds on any glibc
machine. How many faults that saves per step depends on the machine (page size, transparent huge
pages): the removed benchmarks/memory/step_faults.py measured it on the engine
(docs/results/memory.md#step-faults)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, resource, sys, torch
from rsclip_ds.runtime.host_memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None

def mapping(address):
    # the /proc/self/maps entry holding address: "[heap]", "anonymous" (a mapping of its own) or None
    for line in open("/proc/self/maps"):
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5] if len(fields) > 5 else "anonymous"
    return None

def heap_bytes():
    # the size of the brk heap ([heap] in /proc/self/maps), 0 without one
    return sum(int(hi, 16) - int(lo, 16) for lo, hi in
               (line.split()[0].split("-") for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]")))

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
steps = []
for _ in range(6):   # a "step" as DeepSpeed's: a bucket, a flat partition, temporaries; all freed
    before = faults()
    bucket = torch.empty(12_500_000)    # 50 MB
    bucket.fill_(1.0)
    flat = torch.empty(20_000_000)      # 80 MB
    flat.fill_(2.0)
    tmp = flat * 2
    tmp2 = tmp + 1
    held_in, heap_at_peak = mapping(bucket.data_ptr()), heap_bytes()
    del bucket, flat, tmp, tmp2
    steps.append({"faults": faults() - before, "held_in": held_in, "heap_at_peak": heap_at_peak,
                  "heap_after_free": heap_bytes()})
print(json.dumps({"kept": kept, "steps": steps}))
"""


def _rounds(mode: str) -> dict:
    # glibc's own defaults: no malloc tunables or torch huge-page switch from the calling shell
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MALLOC_", "GLIBC_TUNABLES")) and k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings: Linux only")
def test_freed_buffers_stay_in_the_heap_instead_of_being_unmapped_every_step():
    default = _rounds("default")["steps"]
    kept = _rounds("keep")
    if not kept["kept"]:
        pytest.skip("not glibc: keep_freed_memory changes nothing here")
    # glibc's default: every 50 MB bucket is a mapping of its own, faulted in fresh each step
    assert all(s["held_in"] == "anonymous" and s["faults"] > 0 for s in default), default
    # kept: from the heap, which holds the step's 290 MB at its peak and keeps them after the free
    # (never trimmed) for the next step
    for s in kept["steps"]:
        assert s["held_in"] == "[heap]" and s["heap_after_free"] == s["heap_at_peak"] >= 290 * 10**6, kept
    assert kept["steps"][0]["faults"] > 0   # the first step grows the heap: new memory is faulted in


def test_release_leaves_glibc_defaults_and_keep_is_the_default(monkeypatch):
    """distributed.host_memory: run_training keeps freed memory on CPU ranks unless told release."""
    import rsclip_ds.assembly as trainer
    from rsclip_ds.config import load_config

    calls = []

    class NoTraining:   # run_training's Trainer, without building a run
        def __init__(self, run, hooks=()):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def train(self):
            return {}

    monkeypatch.setattr(trainer, "keep_freed_memory", lambda: calls.append("keep") or True)
    monkeypatch.setattr(trainer, "accelerator_is_gpu", lambda: False)
    monkeypatch.setattr(trainer, "Trainer", NoTraining)
    assert load_config(None, []).distributed.host_memory == "keep"
    for setting, expected in (("keep", ["keep"]), ("release", [])):
        calls.clear()
        trainer.run_training(load_config(None, [f"distributed.host_memory={setting}"]))
        assert calls == expected, setting


def test_huge_pages_are_asked_for_train_on_cpu_ranks_only():
    """THP_MEM_ALLOC_ENABLE=1 for `rsclip-ds train` under DS_ACCELERATOR=cpu (with or without the
    launcher's --local_rank), never over a value the user set, another command or a GPU."""
    from rsclip_ds.runtime.host_memory import ask_for_huge_pages

    def asked(argv, mode="madvise", **env):
        env = dict(env)
        return ask_for_huge_pages(argv, env, mode), env.get("THP_MEM_ALLOC_ENABLE")

    cpu = {"DS_ACCELERATOR": "cpu"}
    assert asked(["train", "--set", "steps=5"], **cpu) == (True, "1")
    assert asked(["--local_rank=1", "train"], **cpu) == (True, "1")
    assert asked(["--local_rank", "1", "train"], mode="always", **cpu) == (True, "1")
    assert asked(["train"], **cpu, THP_MEM_ALLOC_ENABLE="0") == (False, "0")   # the user's value wins
    assert asked(["train"]) == (False, None)                                     # no DS_ACCELERATOR=cpu
    assert asked(["train"], DS_ACCELERATOR="cuda") == (False, None)
    assert asked(["eval", "--set", "train=1"], **cpu) == (False, None)
    assert asked(["train"], mode="never", **cpu) == (False, None)               # the kernel has none to give
    assert asked([], **cpu) == (False, None)


HUGE_PROBE = r"""
import json, os
from rsclip_ds.runtime.host_memory import anon_huge_bytes, ask_for_huge_pages, keep_freed_memory
asked = ask_for_huge_pages(["--local_rank=0", "train"])   # as the entry point does, before torch
import torch
keep_freed_memory()
before = anon_huge_bytes()
block = torch.empty(64 * 2**20)   # 256 MiB, the size of a DeepSpeed reduce bucket
block.fill_(1.0)
print(json.dumps({"asked": asked, "value": os.environ.get("THP_MEM_ALLOC_ENABLE"),
                  "huge": anon_huge_bytes() - before}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages: Linux only")
def test_big_tensors_get_huge_pages_when_asked_for():
    from rsclip_ds.runtime.host_memory import thp_mode

    mode = thp_mode()
    if mode not in ("always", "madvise"):
        pytest.skip(f"the kernel's transparent huge pages are {mode}")

    def probe(**extra):
        env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE" and not k.startswith("MALLOC_")}
        out = subprocess.run([sys.executable, "-c", HUGE_PROBE], capture_output=True, text=True, check=True,
                             env={**env, "DS_ACCELERATOR": "cpu", **extra})
        return json.loads(out.stdout.strip().splitlines()[-1])

    asked = probe()
    assert asked["asked"] and asked["value"] == "1"
    # the kernel may fall back to small pages where it finds no free 2 MiB frame; most of the block
    # is in huge pages on an idle machine
    assert asked["huge"] >= 128 * 2**20, asked
    declined = probe(THP_MEM_ALLOC_ENABLE="0")
    assert not declined["asked"] and declined["value"] == "0"
    if mode == "madvise":   # only advised memory gets huge pages: none of this block
        assert declined["huge"] < 16 * 2**20, declined

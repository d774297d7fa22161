"""benchmarks/gpu.py on CPU with the tiny preset, so the GPU script cannot rot.

Two cases (ZeRO-2 and ZeRO-3, both with activation checkpointing), each in its own process as on
a GPU: ~1.5 minutes on 2 busy cores, mostly imports and engine builds. Checks the rows' FLOP
counts against rsclip_ds.flops and that every case trained (finite loss, timed steps).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from rsclip_ds.flops import flops_per_sample
from rsclip_ds.model import preset_config
from tests.integration.conftest import ROOT, launch_env

pytestmark = pytest.mark.slow
BENCH = ROOT / "benchmarks" / "gpu.py"


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu") / "gpu_tiny.json"
    cmd = [sys.executable, str(BENCH), "--model", "tiny", "--profiles", "zero2", "zero3", "--ac", "on",
           "--warmup", "1", "--seconds", "0.5", "--max-steps", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=400)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)}\nexit {proc.returncode}\n--- output tail ---\n"
                    f"{(proc.stdout + proc.stderr)[-6000:]}")
    return json.loads(out.read_text())


def test_every_case_ran(report):
    rows = report["cases"]
    assert [(r["profile"], r["checkpointing"]) for r in rows] == [("zero2", True), ("zero3", True)]
    for r in rows:
        assert r["ok"], r
        assert r["precision"] == "bf16" and r["world_size"] == 1
        assert 1 <= r["timed_steps"] <= 2
        assert r["samples_per_s"] > 0 and math.isfinite(r["final_loss"])


def test_flops_and_mfu_fields(report):
    expected = flops_per_sample(preset_config("tiny"))
    for r in report["cases"]:
        assert r["flops_per_sample"]["forward"] == expected.forward
        assert r["flops_per_sample"]["train_model_flops"] == 3 * expected.forward
        assert r["achieved_tflops"] == pytest.approx(3 * expected.forward * r["samples_per_s"] / 1e12)
        assert r["mfu"] is None and r["peak_memory_bytes"] is None   # CPU: no peak FLOP/s, no CUDA memory

"""benchmarks/loader.py at a tiny size (~20 s): it runs by path, measures both worker counts
against both bare loops in alternation, and writes the JSON the README quotes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.conftest import ROOT, launch_env

pytestmark = pytest.mark.slow


def test_loader_benchmark_writes_its_report(tmp_path):
    out = tmp_path / "loader.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "loader.py"), "--out", str(out), "--num-images", "64",
           "--shard-size", "16", "--micro", "8", "--samples", "64", "--repeats", "2", "--workers", "1", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(out.read_text())
    assert report["target_ratio"] == 0.9
    assert report["setup"]["num_images"] == 64 and report["setup"]["source_px"] == 256
    assert [r["workers"] for r in report["results"]] == [1, 2]
    for row in report["results"]:
        assert len(row["loader_per_worker"]) == len(row["bare_per_process"]) == 2
        assert row["ratios"] == [a / b for a, b in zip(row["loader_per_worker"], row["bare_per_process"])]
        assert all(v > 0 for v in row["loader_per_worker"] + row["bare_per_process"]
                   + row["bare_to_tensor_per_process"])
        assert row["pass"] == (row["ratio_median"] >= 0.9)
        assert len(row["ratios_cpu"]) == 2 and row["ratio_cpu_median"] > 0
    assert "loader vs bare PIL decode+resize" in proc.stdout

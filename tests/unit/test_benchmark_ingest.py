"""benchmarks/data/ingest.py --tiny (seconds, in this process): it checks that the bare loop and
make-shards wrote the same bytes before it reports a ratio; timings are facts of the moment, so
only their shape and arithmetic are asserted."""

from __future__ import annotations

import json

import pytest

from benchmarks.data.ingest import main


def test_tiny_ingest_benchmark_reports_ratios_and_a_projection(tmp_path):
    out = tmp_path / "ingest.json"
    assert main(["--tiny", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "ingest" and report["bytes_identical"] is True and report["rows"] == 240
    assert report["isolated_processes"] is False and report["target_ratio"] == 0.9
    res = report["results"]
    assert set(res) == {"bare", "workers_1", "workers_2"}
    for r in res.values():
        assert r["rows_per_cpu_s"]["median"] > 0 and len(r["cpu_s"]) == len(r["startup_cpu_s"]) == 1
        assert r["rows_per_cpu_s"]["median"] == pytest.approx(240 / r["cpu_s"][0], rel=1e-2)
    for name in ("workers_1", "workers_2"):   # equal rows: the ratio of rates is bare's CPU / ours
        assert res[name]["ratio_to_bare"]["median"] == pytest.approx(res["bare"]["cpu_s"][0] / res[name]["cpu_s"][0],
                                                                     rel=1e-2)
    p = report["git10m_projection"]
    assert p["rows"] == 10_500_000 and p["hours"] > 0 and p["bound_by"] in ("cores", "main process")
    bound = min(p["cores_bound_rows_per_s"], p["main_process_rows_per_cpu_s"])
    assert p["hours"] == pytest.approx(10_500_000 / bound / 3600, abs=0.01)

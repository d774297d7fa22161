"""benchmarks/data/ingest.py --tiny (seconds): it checks that the bare loop and make-shards wrote
the same bytes before it reports a ratio; timings are facts of the moment, so only their shape
and signs are asserted."""

from __future__ import annotations

import json

from benchmarks.data.ingest import main


def test_tiny_ingest_benchmark_reports_ratios_and_a_projection(tmp_path):
    out = tmp_path / "ingest.json"
    assert main(["--tiny", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "ingest" and report["bytes_identical"] is True and report["rows"] == 240
    res = report["results"]
    assert set(res) == {"bare", "workers_1", "workers_2"}
    assert all(r["rows_per_s"] > 0 and r["per_core"] > 0 for r in res.values())
    assert res["workers_2"]["processes"] == 3
    for name in ("workers_1", "workers_2"):
        assert res[name]["ratio_to_bare"] == round(res[name]["per_core"] / res["bare"]["per_core"], 3)
    assert report["git10m_projection"]["rows"] == 10_500_000 and report["git10m_projection"]["hours"] > 0

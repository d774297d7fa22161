"""benchmarks/loader.py at a tiny size (~10 s): it runs by path, measures both worker counts
against both bare loops in alternation, and writes the JSON the README quotes. The rates are
timing, so the assertions are floors that only a gross regression breaks."""

from __future__ import annotations

import pytest

from tests.integration.benchmark_helpers import run_benchmark

pytestmark = pytest.mark.slow
REPEATS = 2


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("loader") / "loader.json"
    return run_benchmark("loader.py", "--num-images", "64", "--shard-size", "16", "--micro", "8", "--samples", "64",
                         "--repeats", str(REPEATS), "--workers", "1", "2", out=out, ranks=None, timeout=300)


def test_measured_every_worker_count_in_alternation(report):
    assert report["setup"]["num_images"] == 64 and report["setup"]["source_px"] == 256
    assert [r["workers"] for r in report["results"]] == [1, 2]
    for row in report["results"]:
        for key in ("loader_per_worker", "bare_per_process", "bare_to_tensor_per_process",
                    "loader_per_cpu_second", "bare_per_cpu_second"):
            assert len(row[key]) == REPEATS and all(v > 0 for v in row[key]), (key, row[key])


def test_the_loader_is_within_reach_of_a_bare_decode(report):
    """Per CPU-second (steadier than wall time on a shared machine) the loader, which also
    shuffles, tokenises and normalises, made ~0.5 of the bare decode+resize at this size when
    written; under 0.2 it would have lost most of its speed (e.g. decoding at full size)."""
    for row in report["results"]:
        assert row["ratio_cpu_median"] > 0.2, row

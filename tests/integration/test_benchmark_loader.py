"""benchmarks/data/loader.py at its smallest size, one worker (~10 s): it runs as a module, measures
the loader against the bare loops in alternation, splits a sample's time by stage, and writes the
JSON the docs quote. The rates and how they compare are this machine's (benchmarks/results/
loader.json has them), so they are not asserted; asserted are what each loop ran (the loader
the fast transform, loader_pil PIL's), the form of the measurements, and the arithmetic the
report derives from them (ratios, cores per GPU, the hand-over's share), exactly."""

from __future__ import annotations

import math
import statistics

import pytest

from tests.integration.benchmark_helpers import run_benchmark

pytestmark = pytest.mark.slow
REPEATS = 2
LOOPS = ("bare_pil", "bare_fast", "loader", "loader_pil", "bare_tensor")


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("loader") / "loader.json"
    return run_benchmark("data.loader", "--num-images", "64", "--shard-size", "16", "--micro", "8", "--samples", "64",
                         "--repeats", str(REPEATS), "--workers", "1", "--image-sizes", "224",
                         out=out, ranks=None, timeout=300)


def test_measured_every_loop_in_alternation(report):
    assert report["setup"]["num_images"] == 64 and report["setup"]["source_px"] == 256
    assert [(r["image_size"], r["workers"]) for r in report["results"]] == [(224, 1)]
    for row in report["results"]:
        for loop in LOOPS:
            for key in ("per_cpu_second", "per_worker_wall"):
                assert len(row[loop][key]) == REPEATS and all(v > 0 for v in row[loop][key]), (loop, key)
        assert all(0 < s < 1 for s in row["loader"]["main_cpu_share"])
        assert len(row["ratios"]["loader/bare_pil"]["per_repeat"]) == REPEATS


def test_cores_per_gpu_follow_from_the_measured_rate(report):
    """base is fed at 224 px (2,000 samples/s per GPU); this run has no 256 px row, so no large."""
    cores = report["cores_per_gpu"]
    assert set(cores) == {"git-rsclip-base"}
    base = cores["git-rsclip-base"]
    assert base["cores_per_gpu"] == pytest.approx(2000 / base["loader_per_core"])
    lo, hi = base["cores_per_gpu_range"]
    assert lo <= base["cores_per_gpu"] <= hi


def test_the_stage_split_adds_up(report):
    """Every stage measured; the hand-over is what the loader's CPU per sample (1 worker) leaves
    beyond the in-process stream; batches hand over uint8 pixels (B, 3, S, S)."""
    split = report["breakdown"]["224"]
    us = split["us_per_sample"]
    assert all(math.isfinite(v) and v > 0 for v in us.values()), us
    row = next(r for r in report["results"] if r["workers"] == 1)
    loader_us = 1e6 / statistics.median(row["loader"]["per_cpu_second"])
    assert split["loader_us_per_sample_1_worker"] == pytest.approx(loader_us, rel=1e-12)
    assert split["hand-over + main process (loader minus stream)"] == pytest.approx(
        loader_us - us["stream in-process (all of the above, no workers)"], rel=1e-9, abs=1e-6)
    assert (split["pixel_dtype"], split["pixel_bytes_per_sample"]) == ("torch.uint8", 224 * 224 * 3)


def test_the_loader_runs_the_fast_transform_and_loader_pil_does_not(report):
    """The speed difference the JSON records comes from here: the loader's default config decodes
    at the draft scale and resizes with torch, data.jpeg_draft=false (loader_pil) is PIL's path."""
    for row in report["results"]:
        assert row["loader"]["fast_transform"] is True and row["loader_pil"]["fast_transform"] is False, row


def test_ratios_are_the_quotients_of_the_rates_of_each_repeat(report):
    for row in report["results"]:
        for name, ratio in row["ratios"].items():
            pair, wall = name.removesuffix(" (wall)"), name.endswith(" (wall)")
            num, den = pair.split("/")
            unit = "per_worker_wall" if wall else "per_cpu_second"
            assert ratio["per_repeat"] == pytest.approx(
                [a / b for a, b in zip(row[num][unit], row[den][unit])], rel=1e-12), name
            assert ratio["min"] <= ratio["median"] <= ratio["max"]
        assert row["pass"] == (row["ratios"]["loader/bare_pil"]["median"] >= report["target_ratio"])

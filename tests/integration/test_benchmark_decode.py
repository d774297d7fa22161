"""benchmarks/data/decode.py at a tiny size (~15 s): it runs by path, times every method that is
installed in alternation, and measures each one's pixels against the evaluation transform. The
pixel differences are exact facts (the same libjpeg-turbo decode, the same draft scale); the
rates are timing, so only a gross regression breaks their assertion."""

from __future__ import annotations

import pytest

from tests.integration.benchmark_helpers import run_benchmark

pytestmark = pytest.mark.slow
REPEATS = 2


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("decode") / "decode.json"
    return run_benchmark("data.decode", "--num-images", "6", "--sources", "64", "600", "--sizes", "224",
                         "--repeats", str(REPEATS), "--min-seconds", "0.05", out=out, ranks=None, timeout=300)


def test_every_method_ran_or_says_why_not(report):
    for combo in report["results"]:
        ran, skipped = set(combo["methods"]), set(combo["skipped"])
        assert ran | skipped == set(report["setup"]["methods"]) and not ran & skipped
        assert {"pil", "pil-draft", "rsclip-train"} <= ran
        assert "pillow-simd" in skipped                    # no --simd-python given
        for row in combo["methods"].values():
            assert len(row["per_core"]) == REPEATS and all(v > 0 for v in row["per_core"])


def test_pixels_against_the_evaluation_transform(report):
    """PIL's own path is the reference; simplejpeg at the draft scale decodes exactly as PIL's
    draft; 64 px never takes the draft scale, so only the torch resize differs (<= 2 levels)."""
    small, large = report["results"]
    assert small["methods"]["pil"]["pixels"]["max"] == 0
    assert small["methods"]["rsclip-train"]["pixels"]["max"] <= 2
    draft = large["methods"]["pil-draft"]["pixels"]
    assert draft["max"] > 2                                   # 600 -> 224 decodes at 1/2 scale
    if "simplejpeg" in large["methods"]:
        assert large["methods"]["simplejpeg"]["pixels"] == draft


def test_the_training_transform_beats_the_evaluation_transform(report):
    """~3-4x per core when written (600 px); under 1.5x it would have lost the fast path."""
    _, large = report["results"]
    assert large["methods"]["rsclip-train"]["ratio_to_pil_summary"]["median"] > 1.5

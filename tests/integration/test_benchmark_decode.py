"""benchmarks/data/decode.py at a tiny size (~15 s): it runs as a module, times every method that
is installed in alternation, and measures each one's pixels against the evaluation transform. The
pixel differences are exact facts (the same libjpeg-turbo decode, the same draft scale) and are
asserted; the rates are this machine's (benchmarks/results/decode.json has them, and how much
faster training's transform is), so only their form is: one positive rate per repeat, and ratios
that are the quotients of those rates."""

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


def test_the_training_transform_takes_the_fast_path(report):
    """What makes training's transform faster than the evaluation transform: at 600 -> 224 px it
    decodes at the draft scale (a quarter of the pixels) and squashes with torch's bicubic, so its
    pixels are, to the last grey level, those of the draft decode + torch resize (and of simplejpeg
    + torch, the decoder it uses); neither PIL's full decode nor PIL's resize gives them."""
    for combo in report["results"]:
        methods = combo["methods"]
        train = methods["rsclip-train"]["pixels"]
        assert train == methods["pil-draft+torch"]["pixels"], combo["source_px"]
        if "simplejpeg+torch" in methods:
            assert train == methods["simplejpeg+torch"]["pixels"], combo["source_px"]
    _, large = report["results"]
    train = large["methods"]["rsclip-train"]["pixels"]
    assert train != large["methods"]["pil"]["pixels"] and train != large["methods"]["pil-draft"]["pixels"]


def test_ratios_are_the_quotients_of_the_rates_of_each_repeat(report):
    for combo in report["results"]:
        methods = combo["methods"]
        for name, row in methods.items():
            for base in ("pil", "pil-draft"):
                assert row[f"ratio_to_{base}"] == pytest.approx(
                    [a / b for a, b in zip(row["per_core"], methods[base]["per_core"])], rel=1e-12), (name, base)
                summary = row[f"ratio_to_{base}_summary"]
                assert summary["min"] <= summary["median"] <= summary["max"]

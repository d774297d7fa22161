"""benchmarks/precision/pure_bf16.py --tiny on 2 CPU ranks (~30 s: three Trainer runs of 6 steps of the tiny
preset, each evaluated at step 0 and 6): the report has every mode with finite numbers, each mode
ran the precision and master dtype it names, and only bf16 masters leave masters unmoved.
The full run's numbers are in docs/guides/precision.md."""

from __future__ import annotations

import math

import pytest

from tests.integration.benchmark_helpers import run_benchmark

pytestmark = pytest.mark.slow
MODES = {"fp32": ("fp32", "float32"), "bf16": ("bf16", "float32"), "bf16_masters": ("bf16", "bfloat16")}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("bench_pure_bf16")
    return run_benchmark("precision.pure_bf16", "--tiny", "--data", str(tmp / "data"), out=tmp / "pure_bf16.json",
                         ranks=2, timeout=240)


def test_every_mode_ran_with_finite_numbers(report):
    assert report["environment"]["world_size"] == 2 and set(report["modes"]) == set(MODES)
    steps = report["config"]["steps"]
    for row in report["runs"]:
        assert len(row["losses"]) == steps and all(math.isfinite(x) for x in row["losses"])
        for key in ("retrieval/i2t_R@1", "retrieval/t2i_R@1", "retrieval/i2t_R@5", "retrieval/t2i_R@5",
                    "retrieval/mean_recall", "zero_shot/top1", "final_train_loss", "samples_per_s"):
            assert math.isfinite(row[key]), (row["mode"], key)
        assert 0 <= row["retrieval/mean_recall"] <= 1 and row["samples_per_s"] > 0
    for mode, means in report["modes"].items():
        assert all(math.isfinite(means[k]) for k in means if k not in ("spread", "seeds")), mode


@pytest.mark.parametrize("mode", sorted(MODES))
def test_each_mode_is_what_it_names_and_learns(report, mode):
    row = next(r for r in report["runs"] if r["mode"] == mode)
    precision, master = MODES[mode]
    assert row["precision"] == precision and row["master_dtype"] == master
    assert row["losses"][-1] < row["losses"][0]
    # fp32 masters move wherever the gradient is not 0; bf16 masters keep the updates below half a
    # bf16 step out: the LayerNorm gains at 1.0, the logit scale and bias (measured: 15.6%)
    if master == "float32":
        assert row["unchanged_fraction"] < 0.01
    else:
        assert row["unchanged_fraction"] > 0.05
        assert {"logit_scale", "logit_bias"} <= set(row["unchanged_tensors"])

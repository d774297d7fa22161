"""benchmarks/precision/grad_accum.py on 2 CPU ranks: bf16 gradient accumulation in bf16 and fp32 against
the fp32 big-batch gradient, and what bf16.grad_accum_dtype puts into the engine.

One launch (~1 minute: 20 engine builds of the `tiny` preset) runs one optimizer step of
k = 8 micro-batches of 4 samples per rank ('global' accumulation: one SigLIP loss over all 64
samples) on every profile, with a client SGD at lr 1 so the change of the fp32 masters is the
gradient, and compares it with the gradient of the same loss on the whole batch in fp32 (one
process). Measured on 2 cores (docs/guides/precision.md): the towers' relative error is 1.10e-2 with
bf16 accumulation and 1.05-1.06e-2 with fp32, on every stage; the 3.2e-3 between the two is
what the accumulation dtype makes.
"""

from __future__ import annotations

import pytest

from tests.integration.benchmark_helpers import run_benchmark

pytestmark = pytest.mark.slow
# the documented 'auto' (docs/guides/precision.md), and the engine it gives
AUTO = {"zero1": "bf16", "zero2": "fp32", "zero2_offload": "bf16", "zero3": "fp32", "zero3_offload": "fp32"}
ZERO_OPT = {1: "DeepSpeedZeroOptimizer", 2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}
BOUND = 0.015   # parity bound of the default at k = 8: relative L2 error of the towers' gradient


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("bench_grad_accum")
    return run_benchmark("precision.grad_accum", "--k", "8", "--micro", "4", out=tmp / "grad_accum.json", ranks=2,
                         timeout=300)


def _row(report, profile, case):
    return next(r for r in report["rows"] if r["profile"] == profile and r["case"] == case)


@pytest.mark.parametrize("profile", sorted(AUTO))
def test_the_default_reaches_the_engine(report, profile):
    """auto -> the documented dtype in the DeepSpeed config, and in the engine: ZeRO-1 keeps its
    ZeRO optimizer (no fp32 gradient copy); ZeRO-2 and -3 accumulate in an fp32 partition of
    4 bytes per trainable parameter / 2 ranks."""
    row = _row(report, profile, "auto")
    assert row["data_types"] == {"grad_accum_dtype": AUTO[profile]}
    stage = int(profile[4])
    assert row["optimizer"] == ZERO_OPT[stage]
    if AUTO[profile] == "fp32":
        assert row["buffer_dtype"] == "float32"
        assert row["buffer_bytes_per_trainable_param"] == pytest.approx(4 / 2, rel=0.01)
    else:
        assert row["buffer_dtype"] != "float32"


def test_fp32_at_zero1_is_deepspeeds_bf16_optimizer_with_a_whole_fp32_copy(report):
    row = _row(report, "zero1", "accum fp32")
    assert row["optimizer"] == "BF16_Optimizer"
    assert row["buffer_dtype"] == "float32"
    assert row["buffer_bytes_per_trainable_param"] == pytest.approx(4.0, rel=1e-3)   # not divided by the ranks


@pytest.mark.parametrize("profile", sorted(AUTO))
def test_the_default_is_within_its_parity_bound(report, profile):
    assert _row(report, profile, "auto")["rel_err_towers"] < BOUND


@pytest.mark.parametrize("profile", ("zero2", "zero3", "zero3_offload"))
def test_fp32_accumulation_is_closer_to_the_big_batch(report, profile):
    bf16, fp32 = (_row(report, profile, case)["rel_err_towers"] for case in ("accum bf16", "accum fp32"))
    assert fp32 < 0.99 * bf16
    # the part the accumulation dtype makes: a quarter to a third of the bf16 step's error
    assert 0.1 * bf16 < _row(report, profile, "accum bf16")["accum_err"] < 0.5 * bf16


@pytest.mark.parametrize("profile", sorted(AUTO))
def test_fp32_communication_changes_little_beyond_fp32_accumulation(report, profile):
    fp32, comm = (_row(report, profile, case)["rel_err_towers"] for case in ("accum fp32", "accum fp32/comm fp32"))
    assert comm == pytest.approx(fp32, rel=0.05)


# (profile, case) where the update of logit_scale and logit_bias is exactly 0: the 'global' loop
# (train_step_global) adds their gradient once per step, in the last micro-batch: DeepSpeed
# 0.19.8's optimizer-offload paths drop a gradient given in an earlier one (the first, as it
# was, lost it on zero2_offload and zero3_offload), and its BF16_Optimizer (ZeRO-1 + fp32
# accumulation, not the default) drops it either way.
LOST = [("zero1", "accum fp32")]


@pytest.mark.parametrize("profile, case", [(p, c) for p in sorted(AUTO) for c in ("accum bf16", "accum fp32", "auto")
                                           if (p, c) not in LOST])
def test_every_parameter_gets_its_gradient(report, profile, case):
    assert _row(report, profile, case)["zero_update"] == []


@pytest.mark.parametrize("profile, case", LOST)
@pytest.mark.xfail(strict=True, reason="the logit scale and bias get no update: DeepSpeed 0.19.8's "
                   "BF16_Optimizer (ZeRO-1 with fp32 accumulation; bf16.grad_accum_dtype=auto does not pick "
                   "it) loses the gradient train_step_global gives them once per step")
def test_every_parameter_gets_its_gradient_known_loss(report, profile, case):
    assert _row(report, profile, case)["zero_update"] == []

"""benchmarks/comms/traffic.py on 2 CPU ranks, launched the way users launch it: bytes per optimizer step
that DeepSpeed's comms logger recorded on real engines, against hand arithmetic here.

One launch (~1.5 minutes on 2 cores: six engine builds) runs ZeRO-1, -2 and -3 in bf16 at
accumulation 1 and 4 ('global', the default loop) on a SigLIP of two 2-layer towers of width 256
(~5M parameters; its 256 x 1024 matrices are above ZeRO-3's persistence threshold, its biases
and norms below it). The test counts Ψ (all parameters), Ψ_p (those of at most 1e5 elements,
kept gathered by ZeRO-3) on a model of the same shape it builds itself, and expects, per
optimizer step of one rank in the logger's convention (the tensor argument's bytes, 2 per
bf16 element, an all-gather's own shard S/2 on 2 ranks):
  ZeRO-1  all-reduce 2Ψ once (at the accumulation boundary, whatever k) + all-gather 2Ψ/2
  ZeRO-2  all-reduce 2Ψ per micro-batch + all-gather 2Ψ/2
  ZeRO-3  reduce-scatter 2Ψ per micro-batch; all-gather 2(Ψ - Ψ_p)/2 per forward, 3 per
          micro-batch under 'global' accumulation at k > 1; + 2Ψ_p/2 after the step, and
          under 'global' up to k-1 times more (ZeRO-3 re-records its trace)
and the SigLIP ring loss's fp32 text features: 2 sends forward + 2 back of (k x micro, D) per
step on 2 ranks, seen by the torch profiler.

A second launch (~1 min: one engine build on 4 ranks) runs ZeRO-3 with hpZ over groups of 2
(`zero_hpz_partition_size: 2`, two "nodes" of 2 ranks) at k = 2: the step's first forward gathers
from the primary partition over the 4 ranks (this rank logs 2(Ψ - Ψ_p)/4), the second from hpZ's
secondary partition inside the group (2(Ψ - Ψ_p)/2); the reduce-scatters stay over the world.
qwZ and qgZ are not run: their int8/int4 kernels are DeepSpeed's CUDA QuantizerBuilder op; MiCS is
not in DeepSpeed 0.19.8 (`mics_shard_size` is a DeepSpeedConfigError there).
"""

from __future__ import annotations

import pytest

from tests.integration.benchmark_helpers import run_benchmark

pytestmark = pytest.mark.slow
W, MICRO, HIDDEN = 2, 2, 256
PROFILES = ("zero1", "zero2", "zero3")


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("bench_comms")
    return run_benchmark("comms.traffic", "--profiles", *PROFILES, "--accumulation", "1", "4", "--modes", "global",
                         "--hidden", str(HIDDEN), "--micro", str(MICRO), "--steps", "2", out=tmp / "comms.json",
                         ranks=W, timeout=300)


@pytest.fixture(scope="module")
def counts() -> tuple[int, int]:
    """(Ψ, Ψ_p) of the benchmark's model shape, built here."""
    from transformers import SiglipConfig, SiglipModel

    shape = dict(hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=2, num_attention_heads=4)
    config = SiglipConfig(text_config={**shape, "max_position_embeddings": 16, "vocab_size": 1000,
                                       "pad_token_id": 1, "bos_token_id": None, "eos_token_id": 1},
                          vision_config={**shape, "image_size": 32, "patch_size": 8})
    sizes = [p.numel() for p in SiglipModel(config).parameters()]
    return sum(sizes), sum(n for n in sizes if n <= 100_000)


def _row(report, profile, k):
    return next(r for r in report["rows"] if r["profile"] == profile and r["accumulation"] == k)


def expected(profile: str, k: int, psi: int, persistent: int) -> float:
    if profile == "zero1":
        return 2 * psi + 2 * psi / W
    if profile == "zero2":
        return k * 2 * psi + 2 * psi / W
    if k == 1:
        return 2 * psi + 2 * (psi - persistent) / W + 2 * persistent / W
    # 'global': 3 passes per micro-batch, and the persistent ones up to k-1 times more
    return k * 2 * psi + 3 * k * 2 * (psi - persistent) / W + k * 2 * persistent / W


def test_ran_every_case_on_two_ranks_with_the_counted_model(report, counts):
    assert report["environment"]["world_size"] == W
    assert [(r["profile"], r["accumulation"]) for r in report["rows"]] == [(p, k) for p in PROFILES for k in (1, 4)]
    psi, persistent = counts
    for r in report["rows"]:
        assert (r["parameters"], r["trainable"]) == (psi, psi)
        assert r["persistent"] == (persistent if r["stage"] == 3 else 0)
        assert r["optimizer"] == ("DeepSpeedZeroOptimizer_Stage3" if r["stage"] == 3 else "DeepSpeedZeroOptimizer")
    assert 0.1 < persistent / psi < 0.5   # both kinds of parameters are there (0.29)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("k", (1, 4))
def test_logged_bytes_match_the_hand_count(report, counts, profile, k):
    row = _row(report, profile, k)
    assert row["engine"]["logged"] == pytest.approx(expected(profile, k, *counts), rel=0.05), row["engine"]["by_op"]
    assert row["engine"]["pass"] and row["c10d"]["pass"], (row["engine"]["ratio"], row["c10d"]["ratio"])


def test_zero1_reduces_at_the_boundary_only(report):
    one, four = (_row(report, "zero1", k)["engine"]["by_op"]["all_reduce"] for k in (1, 4))
    assert four["logged"] == pytest.approx(one["logged"], rel=1e-6)
    assert four["calls_logged"] == one["calls_logged"]


def test_zero2_reduces_every_micro_batch(report):
    one, four = (_row(report, "zero2", k)["engine"]["by_op"]["all_reduce"] for k in (1, 4))
    assert four["logged"] == pytest.approx(4 * one["logged"], rel=1e-5)   # partitions' padding


def test_gloo_runs_zero3_reduce_scatter_as_an_all_reduce(report):
    """The logger records reduce_scatter_tensor; on gloo the profiler sees an all-reduce of the
    same bytes (so a CPU run moves twice a ring reduce-scatter's bytes)."""
    ops = _row(report, "zero3", 4)["c10d"]["by_op"]
    logged = _row(report, "zero3", 4)["engine"]["by_op"]
    assert ops.get("reduce_scatter", {}).get("seen", 0) == 0
    assert ops["all_reduce"]["seen"] == pytest.approx(logged["reduce_scatter"]["logged"], rel=1e-4)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("k", (1, 4))
def test_the_loss_sends_its_features_round_the_ring(report, profile, k):
    """4 fp32 blocks of (k x micro, D) per step on 2 ranks: forward and backward, both neighbours."""
    seen = _row(report, profile, k)["c10d"]["by_op"]["send"]["seen"]
    assert seen == 4 * k * MICRO * HIDDEN * 4


W4, HPZ = 4, 2


@pytest.fixture(scope="module")
def hpz_report(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("bench_comms_hpz")
    return run_benchmark("comms.traffic", "--profiles", f"zero3+hpz{HPZ}", "--accumulation", "2", "--modes", "plain",
                         "--hidden", str(HIDDEN), "--micro", str(MICRO), "--steps", "1", out=tmp / "comms.json",
                         ranks=W4, timeout=300)


def test_hpz_gathers_the_second_forward_inside_its_group(hpz_report, counts):
    psi, persistent = counts
    (row,) = hpz_report["rows"]
    assert (row["hpz"], row["accumulation"], hpz_report["environment"]["world_size"]) == (HPZ, 2, W4)
    gathered = psi - persistent
    ops = row["engine"]["by_op"]
    assert ops["reduce_scatter"]["logged"] == pytest.approx(2 * 2 * psi, rel=1e-4)
    # primary over 4 ranks, secondary over 2; plain ZeRO-3 would log 2 x 2(Ψ - Ψ_p)/4
    expected_gathers = 2 * gathered / W4 + 2 * gathered / HPZ + 2 * persistent / W4
    assert ops["all_gather"]["logged"] == pytest.approx(expected_gathers, rel=1e-3)
    assert ops["all_gather"]["logged"] > 1.4 * (2 * 2 * gathered / W4 + 2 * persistent / W4)
    assert row["engine"]["pass"] and row["c10d"]["pass"], (row["engine"]["ratio"], row["c10d"]["ratio"])

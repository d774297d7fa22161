"""Hybrid ZeRO-3 (hpZ, ZeRO++, MiCS) in the memory model and the planner, against hand arithmetic.

git-rsclip-large (Ψ = 652,150,786) on nodes of 8 GPUs, bf16 with fp32 masters (p = g = 2, k = 12).
"""

from __future__ import annotations

import argparse
import json
import math

import pytest

from rsclip_ds.planning import comms
from rsclip_ds.cli.plan import register as add_plan_parser
from rsclip_ds.cli.plan import run as cmd_plan
from rsclip_ds.planning.memory import model_state_bytes, peak, preset_spec, quantisation_buffers
from rsclip_ds.planning.planner import HYBRID, Budget, Hardware, candidacy, hybrid_profile, plan, recommend
from rsclip_ds.profiles import load_profile

PSI = 652_150_786
H200 = 141 * 10**9


def test_hpz_adds_a_16_bit_secondary_partition_over_the_node():
    z3 = model_state_bytes(PSI, 3, False, False, "bf16", 32, 8)
    hpz = model_state_bytes(PSI, 3, False, False, "bf16", 32, 8, hpz=8)
    assert z3.gpu == 16 * math.ceil(PSI / 32)                 # 0.33 GB
    assert hpz.gpu - z3.gpu == 2 * math.ceil(PSI / 8)         # + 2Ψ/8 = 0.16 GB


def test_mics_shards_the_states_over_its_group_not_the_world():
    mics = model_state_bytes(PSI, 3, False, False, "bf16", 32, 8, shard=8)
    assert mics.gpu == 16 * math.ceil(PSI / 8)                # 16Ψ/8 = 1.30 GB, 4x zero3's on 4 nodes
    assert mics.gpu == model_state_bytes(PSI, 3, False, False, "bf16", 8, 8).gpu   # = zero3 on one node
    with pytest.raises(ValueError, match="ZeRO-3"):
        model_state_bytes(PSI, 2, False, False, "bf16", 32, 8, hpz=8)


def test_zeropp_buffers_are_small():
    # qwZ: one 5e7-element prefetch bucket in int8 + scales; qgZ: 1.5 bytes per element of the
    # largest parameter (the 32,000 x 1024 token embedding)
    zero = hybrid_profile("zero3_zeropp", 8).strategy["zero_optimization"]
    assert quantisation_buffers(zero, 32_768_000) == int(5e7 * (1 + 4 / 8000)) + int(1.5 * 32_768_000)
    assert quantisation_buffers(load_profile("zero3").strategy["zero_optimization"], 32_768_000) == 0


def test_peak_reads_the_hybrid_keys():
    spec = preset_spec("git-rsclip-large")
    kw = dict(micro=8, accumulation_steps=4)   # k > 1: bf16 accumulates in fp32 at ZeRO-3 (auto)
    z3 = peak(spec, load_profile("zero3"), "bf16", 32, 8, **kw)
    hpz = peak(spec, hybrid_profile("zero3_hpz", 8), "bf16", 32, 8, **kw)
    mics = peak(spec, hybrid_profile("zero3_mics", 8), "bf16", 32, 8, **kw)
    pp = peak(spec, hybrid_profile("zero3_zeropp", 8), "bf16", 32, 8, **kw)
    assert hpz.states - z3.states == 2 * math.ceil(spec.params / 8)
    # MiCS: every state on 8 ranks (+ the fp32 gradient partition of bf16 accumulation: 2 more bytes)
    assert mics.states == 16 * math.ceil(spec.params / 8) + 2 * math.ceil(spec.params / 8)
    assert pp.buckets - hpz.buckets == quantisation_buffers(pp_zero := hybrid_profile("zero3_zeropp", 8)
                                                            .strategy["zero_optimization"], spec.largest_layer) > 0
    assert pp_zero["zero_hpz_partition_size"] == 8 and pp_zero["stage"] == 3


def test_hybrids_are_candidates_across_nodes_only_and_mics_not_on_0_19_8():
    one, four = Budget(8, 1, H200), Budget(8, 4, H200)
    assert candidacy("zero3", one) == (True, "")
    assert not candidacy("zero3_hpz", one)[0] and candidacy("zero3_hpz", four)[0]
    ok, why = candidacy("zero3_mics", four)
    assert not ok and "mics_shard_size" in why         # DeepSpeed 0.19.8 removed MiCS
    assert set(HYBRID) == {"zero3_hpz", "zero3_zeropp", "zero3_mics"}


@pytest.fixture(scope="module")
def large():
    return preset_spec("git-rsclip-large")


def hardware(node_gbps: float) -> Hardware:
    return Hardware(flops=0.4 * 989e12, inter_bw=comms.network_bw(node_gbps) / 8)


def test_on_4_nodes_over_100_gbit_a_hybrid_beats_zero3(large):
    """4 x 8 H200, 100 Gb/s per node (1.4 GB/s per GPU), global batch 32768 (1024 per GPU).
    Without checkpointing (micro 256 x 4, 'global' accumulation: 12 gathers per step) ZeRO-3 sends
    4 reduce-scatters + 12 gathers across; hpZ keeps 11 gathers inside; ZeRO++ also quantises."""
    rows = plan(large, Budget(8, 4, H200), 32768, profiles=["zero3", "zero3_hpz", "zero3_zeropp"],
                hw=hardware(100))
    by = {(r.profile, r.checkpointing): r for r in rows}
    z3, hpz, pp = (by[(name, False)] for name in ("zero3", "zero3_hpz", "zero3_zeropp"))
    assert (z3.micro, z3.accumulation) == (hpz.micro, hpz.accumulation) == (256, 4)
    # across nodes, per GPU: (N-1)/N x S/n per collective, S = 2Ψ_np per gather, 2Ψ per reduce-scatter
    n, N, inter = 8, 4, comms.network_bw(100) / 8
    gather, scatter, small = 2 * (large.params - large.small_params), 2 * large.params, 2 * large.small_params
    across = (N - 1) / N / n / inter
    loss_send = 4 * 16 * 256 * 4 * large.embed_dim * 4 / 2   # the ring's features, half across on an edge GPU
    z3_inter = across * (12 * gather + 4 * scatter + 4 * small) + loss_send / inter
    assert z3.comm_inter_s == pytest.approx(z3_inter, rel=1e-6)
    hpz_inter = across * (gather + 4 * scatter + small) + loss_send / inter   # re-recorded persistent: inside
    assert hpz.comm_inter_s == pytest.approx(hpz_inter, rel=1e-6)
    assert pp.step_s < hpz.step_s < z3.step_s
    best = recommend(rows)
    assert best.profile in ("zero3_hpz", "zero3_zeropp") and best.step_s < min(r.step_s for r in rows
                                                                               if r.profile == "zero3")


def test_one_node_never_recommends_a_hybrid(large):
    rows = plan(large, Budget(8, 1, H200), 8192, hw=hardware(100))
    best = recommend(rows)
    assert best.profile not in HYBRID
    by = {(r.profile, r.checkpointing): r for r in rows}
    for ac in (False, True):   # hpZ's group is the world: zero3's traffic, more memory
        assert by[("zero3_hpz", ac)].step_s == pytest.approx(by[("zero3", ac)].step_s)
        assert by[("zero3_hpz", ac)].gpu_gib >= by[("zero3", ac)].gpu_gib


def test_plan_cli_takes_nodes_and_node_bandwidth(capsys):
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "--model", "git-rsclip-base", "--nodes", "2", "--gpus-per-node", "8",
                              "--inter-node-gbps", "100", "--gpu-mem", "80GB", "--global-batch", "4096", "--json"])
    assert cmd_plan(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["inter_bw_gbs"] == pytest.approx(100 / 8 * 0.9 / 8)    # a GPU's share of 100 Gb/s
    assert {r["profile"] for r in doc["rows"]} >= set(HYBRID)
    row = doc["recommended"]
    assert row["comm_inter_s"] > 0 and row["comm_intra_s"] > 0 and row["step_s"] >= row["compute_s"]

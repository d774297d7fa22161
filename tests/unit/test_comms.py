"""rsclip_ds.planning.comms against hand arithmetic on a small case.

Ψ = 1000 parameters of which Ψ_t = 600 train, G = 4 ranks, k = 3 micro-batches, bf16 (2 bytes a
weight, 2 a gradient on the wire). The numbers below are worked out by hand from what DeepSpeed
0.19.8 sends (the module docstring; benchmarks/comms/traffic.py checks them against its comms logger).
"""

from __future__ import annotations

import pytest

from rsclip_ds.planning import comms
from rsclip_ds.planning.comms import LossTraffic, by_collective, comm_seconds, persistent_elements, step_traffic
from rsclip_ds.profiles import load_profile

PSI, PSI_T, G, K = 1000, 600, 4, 3


def totals(traffic, convention):
    return by_collective(traffic, G, convention)


def test_zero1_reduces_once_per_step_whatever_the_accumulation():
    # all-reduce of 600 bf16 gradients = 1200 B once; all-gather of the 600 updated weights
    # (this rank logs its quarter, 300 B); a ring sends 2*3/4 of 1200 and 3/4 of 1200.
    for k in (1, K):
        t = step_traffic(PSI, PSI_T, stage=1, world=G, accumulation=k)
        assert totals(t, "message") == {"all_reduce": 1200, "all_gather": 300}
        assert totals(t, "ring") == {"all_reduce": 1800, "all_gather": 900}
        assert totals(t, "size") == {"all_reduce": 1200, "all_gather": 1200}


def test_zero2_reduces_every_micro_batch():
    t = step_traffic(PSI, PSI_T, stage=2, world=G, accumulation=K)
    assert totals(t, "message") == {"all_reduce": 3 * 1200, "all_gather": 300}
    assert totals(t, "ring") == {"all_reduce": 3 * 1800, "all_gather": 900}


def test_communication_dtype_sets_the_gradient_bytes_only():
    # fp32 on the wire: 4 bytes a gradient; the weights gathered stay bf16
    t = step_traffic(PSI, PSI_T, stage=2, world=G, accumulation=K, comm_dtype="fp32")
    assert totals(t, "message") == {"all_reduce": 3 * 2400, "all_gather": 300}
    t = step_traffic(PSI, PSI_T, stage=3, world=G, accumulation=1, comm_dtype="fp32")
    assert totals(t, "size")["reduce_scatter"] == 2400


def test_fp32_training_moves_four_bytes_everywhere():
    t = step_traffic(PSI, None, stage=1, world=G, precision="fp32")
    assert totals(t, "message") == {"all_reduce": 4000, "all_gather": 1000}


def test_zero3_gathers_per_forward_and_reduce_scatters_per_backward():
    # 100 persistent elements stay gathered: 900 gathered in each of the 3 forwards (2*900*3 =
    # 5400 B whole, 1350 logged by this rank), 2*600*3 = 3600 B reduce-scattered, then the
    # 100 persistent ones gathered once after the step (200 B whole, 50 logged).
    t = step_traffic(PSI, PSI_T, stage=3, world=G, accumulation=K, persistent=100)
    assert totals(t, "size") == {"all_gather": 5400 + 200, "reduce_scatter": 3600}
    assert totals(t, "message") == {"all_gather": 1350 + 50, "reduce_scatter": 3600}
    assert totals(t, "ring") == {"all_gather": (5400 + 200) * 3 / 4, "reduce_scatter": 3600 * 3 / 4}


def test_zero3_global_accumulation_gathers_three_times_per_micro_batch():
    # cached forward, forward, backward re-gather: 9 passes of 900 elements; the 100 persistent
    # ones once after the step and k-1 = 2 times more with the re-recorded trace
    t = step_traffic(PSI, PSI_T, stage=3, world=G, accumulation=K, persistent=100, accumulation_mode="global")
    assert totals(t, "size")["all_gather"] == 2 * 900 * 9 + 200 + 2 * 200
    # with 400 elements in checkpointed layers: half of them once more per micro-batch
    ckpt = step_traffic(PSI, PSI_T, stage=3, world=G, accumulation=K, persistent=100, accumulation_mode="global",
                        checkpointed=400)
    assert totals(ckpt, "size")["all_gather"] == 2 * 900 * 9 + 2 * 200 * 3 + 200 + 2 * 200
    plain = step_traffic(PSI, PSI_T, stage=3, world=G, accumulation=K, persistent=100, checkpointed=400)
    assert totals(plain, "size")["all_gather"] == 2 * 900 * 3 + 200
    # at k = 1 the global loop is the plain one
    one = step_traffic(PSI, PSI_T, stage=3, world=G, accumulation=1, persistent=100, accumulation_mode="global")
    assert totals(one, "size")["all_gather"] == 2 * 900 + 200


def test_buckets_change_calls_not_bytes():
    big = step_traffic(PSI, PSI_T, stage=2, world=G, accumulation=K, zero={"reduce_bucket_size": 5e8})
    small = step_traffic(PSI, PSI_T, stage=2, world=G, accumulation=K, zero={"reduce_bucket_size": 100})
    assert totals(big, "message") == totals(small, "message")
    assert [t.calls for t in big if t.op == "all_reduce"] == [3]          # one bucket per backward
    assert [t.calls for t in small if t.op == "all_reduce"] == [3 * 6]    # 600 / 100 per backward


def test_reduce_to_owners_when_multi_rank_bucket_allreduce_is_off():
    t = step_traffic(PSI, PSI_T, stage=2, world=G, accumulation=1, zero={"use_multi_rank_bucket_allreduce": False})
    assert totals(t, "message") == {"reduce": 1200, "all_gather": 300}


def test_one_rank_sends_nothing():
    assert step_traffic(PSI, PSI_T, stage=3, world=1, accumulation=K, loss=LossTraffic(micro=8, embed_dim=16)) == []


@pytest.mark.parametrize("world, tensors", [(2, 4), (3, 4), (4, 8), (5, 8)])
def test_siglip_ring_sends(world, tensors):
    # 8 samples x 3 micro-batches x 16 dims x 4 bytes = 1536 B per feature block. The ring runs
    # ceil((W-1)/2) exchanges, each sending a block to both neighbours; backward sends the
    # gradients back: W=2, 3: 2 + 2 blocks; W=4, 5: 4 + 4.
    loss = LossTraffic("siglip", "global", micro=8, embed_dim=16)
    for mode in ("plain", "global"):
        (t,) = comms.loss_traffic(loss, world, K, mode)
        assert (t.op, t.size, t.message(world), t.ring(world)) == ("send", tensors * 1536, tensors * 1536,
                                                                    tensors * 1536)


def test_clip_gathers_both_features():
    # forward: all-gather of image and text (this rank's 1536 B each); backward: a reduce-scatter
    # of the gradients of all 4 ranks' rows (4 x 1536 B each)
    t = comms.loss_traffic(LossTraffic("clip", "global", micro=8, embed_dim=16), G, K)
    assert totals(t, "message") == {"all_gather": 2 * 1536, "reduce_scatter": 2 * 4 * 1536}


def test_local_negatives_send_nothing():
    assert comms.loss_traffic(LossTraffic("siglip", "local", 8, 16), G, K) == []


def test_persistent_elements_follow_both_thresholds():
    sizes = [10, 200, 100_001, 50, 100_000]
    assert persistent_elements(sizes, 100_000) == 10 + 200 + 50 + 100_000
    # a model-wide cap of 300 elements: 10, 200 and 50 fit, 100_000 would not
    assert persistent_elements(sizes, 100_000, model_threshold=300) == 260


def test_comm_seconds_on_one_node_is_a_ring():
    # 8 GB all-reduced by 8 GPUs at 400 GB/s: 2 * 7/8 * 8e9 / 4e11 = 35 ms
    assert comm_seconds({"all_reduce": 8e9}, 1, 8, intra_bw=400e9, inter_bw=1.0) == pytest.approx(0.035)


def test_comm_seconds_across_nodes_takes_the_slower_level():
    # 2 nodes x 8: inside 35 ms as above; across, each GPU all-reduces its 1 GB eighth over 2
    # nodes: 2 * 1/2 * 1e9 / 50e9 = 20 ms -> 35 ms. At 10 GB/s per GPU across: 100 ms.
    assert comm_seconds({"all_reduce": 8e9}, 2, 8, intra_bw=400e9, inter_bw=50e9) == pytest.approx(0.035)
    assert comm_seconds({"all_reduce": 8e9}, 2, 8, intra_bw=400e9, inter_bw=10e9) == pytest.approx(0.100)
    # one GPU per node, 4 nodes: an all-gather is a ring over the network, 3/4 * 4e9 / 10e9
    assert comm_seconds({"all_gather": 4e9}, 4, 1, intra_bw=400e9, inter_bw=10e9) == pytest.approx(0.3)
    # the ring loss sends to both neighbours: on a node's edge GPU half of it crosses the network
    # (0.5e9 / 10e9), all of it with one GPU per node
    assert comm_seconds({"send": 1e9}, 2, 8, intra_bw=400e9, inter_bw=10e9) == pytest.approx(0.05)
    assert comm_seconds({"send": 1e9}, 2, 1, intra_bw=400e9, inter_bw=10e9) == pytest.approx(0.1)


def test_comm_seconds_of_a_planned_step():
    # ZeRO-2, 652M parameters, bf16, k = 1, 2 nodes x 8 GPUs at the default bandwidths
    # (NVLink 4: 360 GB/s, NDR: 45 GB/s per GPU): all-reduce and all-gather of 1.304 GB each.
    # All-reduce: inside 2*7/8*1.304e9/360e9 = 6.3 ms, across 2*1/2*1.304e9/8/45e9 = 3.6 ms;
    # all-gather: 3.2 ms inside, 1.8 ms across: the node's NVLink is the bottleneck.
    t = step_traffic(652_000_000, stage=2, world=16)
    seconds = comm_seconds(by_collective(t, 16, "size"), 2, 8)
    assert seconds == pytest.approx((2 * 7 / 8 + 7 / 8) * 1.304e9 / 360e9)
    # on 100 Gb/s Ethernet shared by 8 GPUs the network is: (2*1/2 + 1/2) * 1.304e9/8 / (11.25e9/8)
    slow = comm_seconds(by_collective(t, 16, "size"), 2, 8, inter_bw=comms.ETH_100G_PER_NODE / 8)
    assert slow == pytest.approx(1.5 * 1.304e9 / 11.25e9)


def test_unknown_collective_is_an_error():
    with pytest.raises(ValueError, match="unknown collective"):
        comm_seconds({"allreduce": 1.0}, 1, 8)


# --------------------------------------------------------------------------- hybrid ZeRO-3 and the link split
# 4 nodes x 8 GPUs (G = 32), Ψ = 1000 of which Ψ_p = 100 persistent, all trainable, bf16, k = 3.
N, n = 4, 8
HPZ, QW, QG, MICS = ({"zero_hpz_partition_size": 8}, {"zero_quantized_weights": True},
                     {"zero_quantized_gradients": True}, {"mics_shard_size": 8})


def split(traffic, nodes=N, per_node=n):
    t = comms.comm_time(traffic, nodes, per_node, intra_bw=1.0, inter_bw=1.0)   # seconds = bytes
    return pytest.approx(t.intra_bytes), pytest.approx(t.inter_bytes)


def z3(zero=None, k=K, mode="plain", world=N * n, per_node=n):
    return step_traffic(PSI, None, stage=3, world=world, accumulation=k, persistent=100, zero=zero,
                        accumulation_mode=mode, gpus_per_node=per_node)


def test_zero1_and_zero2_split_hierarchically():
    # ZeRO-2: all-reduce 2 x 1000 B per micro-batch (k = 3): inside 2 x 7/8 x 6000, across
    # 2 x 3/4 x 6000 / 8; the all-gather of 2000 B once: 7/8 x 2000 inside, 3/4 x 2000 / 8 across
    t = step_traffic(PSI, None, stage=2, world=32, accumulation=K, gpus_per_node=n)
    assert split(t) == (2 * 7 / 8 * 6000 + 7 / 8 * 2000, 2 * 3 / 4 * 6000 / 8 + 3 / 4 * 2000 / 8)
    t = step_traffic(PSI, None, stage=1, world=32, accumulation=K, gpus_per_node=n)
    assert split(t) == (2 * 7 / 8 * 2000 + 7 / 8 * 2000, 2 * 3 / 4 * 2000 / 8 + 3 / 4 * 2000 / 8)


def test_zero3_split():
    # gathers: 900 elements x 2 B x 3 forwards = 5400 B, + 200 B persistent; reduce-scatter 2000 x 3
    inside, across = 7 / 8, 3 / 4 / 8
    assert split(z3()) == ((5400 + 200 + 6000) * inside, (5400 + 200 + 6000) * across)


def test_hpz_crosses_nodes_once_per_step():
    # the first forward's 1800 B from the primary partition over the world; forwards 2 and 3
    # (3600 B) from the secondary inside the node (7/8 of it); gradients and persistent as ZeRO-3
    inside, across = 7 / 8, 3 / 4 / 8
    assert split(z3(HPZ)) == ((1800 + 3600 + 200 + 6000) * inside, (1800 + 200 + 6000) * across)
    # at k = 1 with prefetching (no backward re-gather) hpZ saves nothing
    assert split(z3(HPZ, k=1)) == split(z3(k=1))
    # 'global' accumulation: 3k = 9 passes, one across; the persistent re-gathers (2 x 200 B) inside
    g = z3(HPZ, mode="global")
    assert split(g) == ((9 * 1800 + 400 + 200 + 6000) * inside, (1800 + 200 + 6000) * across)


def test_qwz_sends_int8_weights_with_block_scales():
    q = by_collective(z3(QW), 32, "size")
    assert q["all_gather"] == pytest.approx(3 * 900 * (1 + 4 / 8000) + 200)   # persistent ones stay bf16


def test_qgz_two_int4_all_to_alls_across_nodes_only():
    t = z3(QG)
    a2a = [x for x in t if x.op == "all_to_all"]
    # 900 2-D elements x 3 micro-batches at 0.5 B + scales: inside 7/8 of it, across 3/4 of its eighth
    q = 900 * 3 * comms.QGZ_BYTES
    assert [(x.group, x.size) for x in a2a] == [("node", pytest.approx(q)), ("rail", pytest.approx(q / 8))]
    grads = [x for x in t if x.op in ("all_to_all", "reduce_scatter")]
    assert split(grads) == (7 / 8 * q + 7 / 8 * 2 * 100 * 3, 3 / 4 * q / 8 + 3 / 4 / 8 * 2 * 100 * 3)
    # one node: DeepSpeed reduce-scatters as usual
    assert by_collective(z3(QG, world=8), 8, "size") == by_collective(z3(world=8), 8, "size")


def test_mics_keeps_everything_inside_but_the_replica_all_reduce():
    # all gathers and the reduce-scatter inside the node; at the boundary 2 x 1000 / 8 B
    # all-reduced across the 4 replicas: 2 x 3/4 x 250 B across
    assert split(z3(MICS)) == (7 / 8 * (5400 + 200 + 6000), 2 * 3 / 4 * 250)
    # logged: a gather's message is this rank's share of its group (1/8), not of the world
    msg = by_collective(z3(MICS), 32, "message")
    assert msg["all_gather"] == pytest.approx((5400 + 200) / 8)


def test_hybrid_options_are_zero3_only_and_groups_inside_a_node():
    with pytest.raises(ValueError, match="ZeRO-3"):
        step_traffic(PSI, stage=2, world=32, zero=HPZ, gpus_per_node=n)
    with pytest.raises(ValueError, match="divide"):
        step_traffic(PSI, stage=3, world=32, zero={"zero_hpz_partition_size": 16}, gpus_per_node=n)


def test_comm_time_splits_seconds_by_link():
    # ZeRO-3 at k = 3 on 4 x 8: 11600 B through the world group; 100 B/s inside, 10 B/s across
    t = comms.comm_time(z3(), N, n, intra_bw=100.0, inter_bw=10.0)
    assert t.intra_s == pytest.approx(11600 * 7 / 8 / 100) and t.inter_s == pytest.approx(11600 * 3 / 32 / 10)
    assert t.total_s == pytest.approx(max(t.intra_s, t.inter_s))   # pipelined levels: the slower
    m = comms.comm_time(z3(MICS), N, n, intra_bw=100.0, inter_bw=10.0)
    assert m.total_s == pytest.approx(m.intra_s + m.inter_s)       # separate collectives add


def test_network_bandwidth_choices():
    assert comms.network_bw(100) == pytest.approx(11.25e9) and comms.network_bw(400) == pytest.approx(45e9)


# --------------------------------------------------------------------------- stage 0 and autocast
# Ψ = 1000, Ψ_t = 600 of which Ψ_a = 500 are Linear/Conv elements (bf16 on the wire under amp_bf16), G = 4, k = 3.
LOW = 500


def test_stage0_all_reduces_the_gradients_once_per_step_and_gathers_nothing():
    # rsclip_ds.gradients at the boundary: 600 bf16 gradients = 1200 B whatever k; no all-gather (every rank
    # steps the whole model); a ring sends 2 * 3/4 of it
    for k in (1, K):
        t = step_traffic(PSI, PSI_T, stage=0, world=G, accumulation=k)
        assert totals(t, "size") == totals(t, "message") == {"all_reduce": 1200}
        assert totals(t, "ring") == {"all_reduce": 1800}
    assert step_traffic(PSI, PSI_T, stage=0, world=1) == []
    fp32 = step_traffic(PSI, PSI_T, stage=0, world=G, precision="fp32")
    assert totals(fp32, "size") == {"all_reduce": 2400}
    # against ZeRO-1 at the same precision: the same all-reduce, less the all-gather of the updated weights
    z1 = step_traffic(PSI, PSI_T, stage=1, world=G, precision="fp32")
    assert totals(z1, "ring")["all_reduce"] == totals(fp32, "ring")["all_reduce"] and "all_gather" in totals(z1, "ring")


def test_autocast_sends_linear_and_conv_gradients_in_16_bits():
    # stage 0 under amp_bf16: 500 x 2 B + 100 x 4 B = 1400 B once per step, one all-reduce per wire dtype and bucket
    t = step_traffic(PSI, PSI_T, stage=0, world=G, accumulation=K, precision="amp_bf16", autocast=LOW,
                     zero={"reduce_bucket_size": 100})
    assert [(x.what, x.size, x.calls) for x in t] == [("gradients, bf16 (Linear/Conv)", 1000, 5),
                                                      ("gradients, fp32 (the rest)", 400, 1)]
    amp = step_traffic(PSI, PSI_T, stage=0, world=G, precision="amp", autocast=LOW)
    assert [x.what for x in amp] == ["gradients, fp16 (Linear/Conv)", "gradients, fp32 (the rest)"]
    # ZeRO-2: the same bytes per micro-batch; the updated weights are fp32 (4 B) in the all-gather
    z2 = step_traffic(PSI, PSI_T, stage=2, world=G, accumulation=K, precision="amp_bf16", autocast=LOW)
    assert totals(z2, "size") == {"all_reduce": 3 * 1400, "all_gather": 4 * 600}
    # ZeRO-3 gathers each parameter in its wire dtype too: 800 Linear/Conv elements (frozen ones too) of which 50
    # persistent; per forward 750 x 2 + 150 x 4 = 2100 B; the persistent ones after the step 50 x 2 + 50 x 4
    z3 = step_traffic(PSI, PSI_T, stage=3, world=G, accumulation=K, precision="amp_bf16", autocast=LOW,
                      autocast_all=800, autocast_persistent=50, persistent=100)
    assert totals(z3, "size") == {"all_gather": pytest.approx(3 * 2100 + 300), "reduce_scatter": 3 * 1400}
    with pytest.raises(ValueError, match="per parameter|own dtype"):
        step_traffic(PSI, PSI_T, stage=2, world=G, precision="amp_bf16", comm_dtype="fp32", autocast=LOW)


def test_the_autocast_model_matches_the_measured_bytes():
    """benchmarks/results/comms_w2_amp_bf16.json (2 ranks, amp_bf16): DeepSpeed's logged bytes at ZeRO-1/2/3
    (the reduction split by wire dtype, ZeRO-3's gathers in bf16 for the Linear weights) and, for ddp,
    rsclip_ds's all-reduce seen by the torch profiler, against the model evaluated now on counts made here on
    the benchmark's model shape."""
    import json
    from pathlib import Path

    from benchmarks.comms.traffic import siglip_config
    from rsclip_ds.model import new_dual_encoder
    from rsclip_ds.planning.memory import autocast_elements

    rep = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/results/comms_w2_amp_bf16.json").read_text())
    c, world = rep["config"], rep["environment"]["world_size"]
    model = new_dual_encoder(siglip_config(c["hidden"]), c["loss"], seed=0)
    sizes = [p.numel() for p in model.parameters()]
    psi, low = sum(sizes), autocast_elements(model)
    assert psi == c["parameters"]
    for row in rep["rows"]:
        zero = load_profile(row["profile"]).strategy["zero_optimization"]
        persistent = comms.persistent_elements(sizes) if row["stage"] == 3 else 0
        small = autocast_elements(model, trainable=False, at_most=100_000) if row["stage"] == 3 else 0
        t = step_traffic(psi, psi, stage=row["stage"], world=world, accumulation=row["accumulation"],
                         precision="amp_bf16", zero=zero, persistent=persistent, autocast=low,
                         autocast_persistent=small)
        if row["stage"] == 0:   # not DeepSpeed's: the profiler's all-reduce bytes
            assert row["engine"]["logged"] == 0
            seen = row["c10d"]["by_op"]["all_reduce"]["seen"]
            assert seen == pytest.approx(by_collective(t, world, "message")["all_reduce"], rel=0.01)
        else:
            assert row["engine"]["logged"] == pytest.approx(sum(by_collective(t, world, "message").values()), rel=0.01)

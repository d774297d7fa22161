"""rsclip_ds.comms against hand arithmetic on a small case.

Ψ = 1000 parameters of which Ψ_t = 600 train, G = 4 ranks, k = 3 micro-batches, bf16 (2 bytes a
weight, 2 a gradient on the wire). The numbers below are worked out by hand from what DeepSpeed
0.19.8 sends (the module docstring; benchmarks/comms.py checks them against its comms logger).
"""

from __future__ import annotations

import pytest

from rsclip_ds import comms
from rsclip_ds.comms import LossTraffic, by_collective, comm_seconds, persistent_elements, step_traffic

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
    # sends between nodes run at the network rate
    assert comm_seconds({"send": 1e9}, 2, 8, intra_bw=400e9, inter_bw=10e9) == pytest.approx(0.1)


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

"""The communication model: bytes each rank sends per optimizer step, by collective (pure functions).

What DeepSpeed 0.19.8 sends (read in stage_1_and_2.py, stage3.py, bf16_optimizer.py, and measured
with its comms logger by benchmarks/comms.py), for Ψ parameters of which Ψ_t train (locked towers
and LoRA's frozen weights have no gradients), G ranks, k micro-batches per optimizer step, p bytes
per 16-bit/32-bit weight and c bytes per gradient element on the wire (`communication_data_type`,
by default the training precision):

    ZeRO-1  all-reduce  cΨ_t once per step, at the accumulation boundary (`reduce_gradients`; the
            backward hooks reduce nothing before it: accumulation 1 and 4 send the same); then
            all-gather of the updated 16-bit partitions pΨ_t (`all_gather_dp_groups`).
            bf16 with grad_accum_dtype fp32 swaps in the BF16_Optimizer: same two collectives.
    ZeRO-2  all-reduce  cΨ_t per micro-batch (every backward), then the same all-gather once per
            step. 0.19.8's "reduce_scatter": true is not a reduce-scatter: with the default
            `use_multi_rank_bucket_allreduce` it all-reduces each bucket and keeps its partition
            (`average_tensor` -> `allreduce_and_scatter`); false sends a `reduce` to each owner.
    ZeRO-3  all-gather  pΨ_np per forward (Ψ_np: parameters above stage3_param_persistence_threshold;
            the persistent ones stay gathered), none in backward: with a complete trace the
            parameters fetched in forward stay until their backward use (measured: also with
            stage3_max_reuse_distance 0 and a 1e6 prefetch bucket);
            reduce-scatter cΨ_t per micro-batch (every backward);
            all-gather pΨ_p of the persistent parameters after each step.
            Without prefetching (`stage3_prefetch_bucket_size` 0, the zero3_offload profile) a
            module's parameters are released after its forward: backward gathers them again
            (2k all-gathers per step, 3k under 'global' accumulation) and a checkpointed layer's
            recomputation once more.
            'global' accumulation (k > 1) runs k forwards without a graph before the k forward +
            backward passes; ZeRO-3 resets its trace at every top-level forward, so the trace
            never repeats and the coordinator releases every module after use: 3k all-gathers
            per step (k cached forwards, k forwards, k backward re-gathers), not k; each
            re-recording also re-gathers the persistent parameters: up to k-1 times pΨ_p more
            per step (measured 1.5 and 2.9 times at k = 4, on 1% and 29% persistent). With
            activation checkpointing on top, half of the checkpointed layers' parameters are
            gathered once more per micro-batch (the recomputation; measured with 2+2 and 2+4
            checkpointed layers: 2 and 3 layers' worth, an empirical rule). 'plain' accumulation
            with checkpointing gathers nothing extra (the trace keeps the parameters).
    Offload changes none of this (optimizer offload moves the step to the CPU over PCIe;
    parameter offload keeps the partitions in CPU memory): the same collectives, measured.

Bucket sizes (reduce_bucket_size, allgather_bucket_size, stage3_prefetch_bucket_size) change
how many calls carry these bytes, never the bytes. The one exception: allgather_bucket_size is
read only when the backend lacks all_gather_into_tensor (gloo and NCCL both have it).

The loss sends its own features (fp32, `losses.py`), per step k x micro rows of D per rank:
    siglip (ring)   send 4 ceil((G-1)/2) x rows x D x 4 bytes: text features both ways round the
                    ring in forward, their gradients back in backward (p2p, not a collective);
    clip (gather)   all-gather of image and text features (2 x rows x D x 4 per rank in forward),
                    reduce-scatter of their gradients in backward (gloo: an all-to-all).
'global' accumulation sends the same bytes in one call per step instead of k.

Two conventions for a collective over a tensor of S bytes (S: the whole tensor, every rank's
share together), both exposed by `by_collective`:
    message  what DeepSpeed's comms logger records (`get_msg_size_from_args`): all-reduce and
             reduce-scatter S (the input), all-gather S/G (this rank's input), broadcast and
             send the tensor. benchmarks/comms.py compares logged bytes with this one.
    ring     bytes a rank sends in a bandwidth-optimal ring: all-reduce 2(G-1)/G S,
             reduce-scatter and all-gather (G-1)/G S, broadcast (pipelined) (G-1)/G S, send S.
On gloo, reduce_scatter_tensor runs as an all-reduce of the whole input (seen by the torch
profiler in benchmarks/comms.py), so a CPU run moves twice the ring bytes of that collective.
Left out: scalar all-reduces (gradient norm, overflow flag: bytes), ZeRO-3's trace checks
(broadcasts of a few KiB per step while it re-records) and the train loop's loss sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OPS = ("all_reduce", "reduce_scatter", "all_gather", "reduce", "broadcast", "all_to_all", "send")

# Achieved bus bandwidth (bytes/s, per GPU, one direction) for `comm_seconds`. Assumptions:
# NVLink 4 (H100/H200 SXM): 18 links x 25 GB/s = 450 GB/s per direction (900 GB/s is both
# directions, NVIDIA's data sheet); nccl-tests all_reduce reaches about 80% of it without NVLS.
NVLINK4_BW = 360 * GB
# NVLink 3 (A100 SXM): 12 links x 25 GB/s = 300 GB/s per direction; ~195 GB/s measured for
# sendrecv on 8 x A100 (nccl-tests), all_reduce bus bandwidth ~230 GB/s.
NVLINK3_BW = 230 * GB
# GPUs on PCIe 4.0 x16 without NVLink: 32 GB/s per direction, ~20 GB/s through the CPU root complex.
PCIE4_BW = 20 * GB
# InfiniBand, one NIC per GPU (rail-optimised DGX/HGX nodes): NDR 400 Gb/s = 50 GB/s line rate,
# HDR 200 Gb/s = 25 GB/s; ~90% achieved (2 x 8 H100 on 8 x 200 Gb/s NICs per node:
# all_reduce_perf reached 339 GB/s bus bandwidth at 8 GB, i.e. the hierarchical model below
# at 90% of line rate).
IB_NDR_PER_GPU = 45 * GB
IB_HDR_PER_GPU = 22.5 * GB
# 100 Gb/s Ethernet, one NIC per node: 12.5 GB/s line, ~90% achieved, shared by the node's GPUs:
# pass ETH_100G_PER_NODE / gpus_per_node as inter_bw.
ETH_100G_PER_NODE = 11.25 * GB


@dataclass(frozen=True)
class Traffic:
    """One kind of traffic in one optimizer step of one rank."""
    op: str          # one of OPS
    what: str        # "gradients", "parameters after step", "parameters in forward", ... "loss features"
    size: int        # bytes of the whole tensors, summed over the step's calls (send: bytes this rank sends)
    calls: int       # calls per step (from the bucket sizes; an estimate, never used for bytes)

    def message(self, world: int) -> float:
        """Bytes as the comms logger records them (the module docstring's 'message')."""
        return self.size / world if self.op == "all_gather" else float(self.size)

    def ring(self, world: int) -> float:
        """Bytes this rank sends in a bandwidth-optimal ring (the module docstring's 'ring')."""
        if world == 1 and self.op != "send":
            return 0.0
        factor = {"all_reduce": 2 * (world - 1) / world, "send": 1.0}.get(self.op, (world - 1) / world)
        return self.size * factor


@dataclass(frozen=True)
class LossTraffic:
    """What the contrastive loss exchanges: rows per rank per micro-batch and embedding width."""
    name: str = "siglip"        # 'siglip' (ring exchange) or 'clip' (all-gather)
    negatives: str = "global"   # 'local' sends nothing
    micro: int = 16
    embed_dim: int = 768


def _calls(elements: int, bucket: float) -> int:
    return max(1, math.ceil(elements / max(1, int(bucket))))


def persistent_elements(param_sizes, threshold: int = 100_000, model_threshold: int | None = None) -> int:
    """Elements ZeRO-3 keeps gathered: every parameter of at most `threshold` elements
    (`stage3_param_persistence_threshold`), in model order while their sum stays within
    `stage3_model_persistence_threshold` (as `mark_persistent_parameters` decides)."""
    total = 0
    for n in param_sizes:
        if model_threshold is not None and n + total > model_threshold:
            continue
        if n <= threshold:
            total += n
    return total


def loss_traffic(loss: LossTraffic, world: int, accumulation: int, mode: str = "plain") -> list[Traffic]:
    """The loss's feature exchange per optimizer step (fp32 features; the module docstring)."""
    if loss.negatives == "local" or world == 1:
        return []
    rows = loss.micro * accumulation   # plain: k calls of micro rows; global: one of k x micro
    block = rows * loss.embed_dim * 4                                # (rows, D) fp32
    calls = 1 if mode == "global" else accumulation                 # loss calls per step
    if loss.name == "siglip":
        exchanges = math.ceil((world - 1) / 2)   # rounds; each sends one tensor to each neighbour
        # forward: the text features; backward: their gradients, the other way
        return [Traffic("send", "loss features (ring)", 2 * 2 * exchanges * block, 2 * 2 * exchanges * calls)]
    if loss.name == "clip":
        return [Traffic("all_gather", "loss features", 2 * world * block, 2 * calls),
                Traffic("reduce_scatter", "loss feature gradients", 2 * world * block, 2 * calls)]
    raise ValueError(f"loss {loss.name!r} is not modelled ('siglip' or 'clip')")


def step_traffic(params: int, trainable: int | None = None, *, stage: int, world: int, accumulation: int = 1,
                 precision: str = "bf16", comm_dtype: str | None = None, zero: dict | None = None,
                 persistent: int = 0, accumulation_mode: str = "plain", checkpointed: int = 0,
                 loss: LossTraffic | None = None) -> list[Traffic]:
    """Traffic of one rank per optimizer step (formulas in the module docstring).

    params, trainable: Ψ and Ψ_t (None: all train); stage: ZeRO stage of the profile; zero: its
    zero_optimization block (bucket sizes, for the call counts only); comm_dtype: DeepSpeed's
    communication_data_type (None: the precision); persistent: Ψ_p, elements ZeRO-3 keeps
    gathered (`persistent_elements`); accumulation_mode: the run's batch.accumulation;
    checkpointed: elements of the non-persistent parameters inside activation-checkpointed layers
    (the encoder layers of both towers when checkpointing is on; ZeRO-3 'global' only)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage {stage} is not modelled (1, 2 or 3)")
    if accumulation_mode not in ("plain", "global"):
        raise ValueError(f"accumulation mode {accumulation_mode!r}: 'plain' or 'global'")
    zero, t, k = zero or {}, params if trainable is None else trainable, accumulation
    p, c = DTYPE_BYTES[precision], DTYPE_BYTES[comm_dtype or precision]
    out = loss_traffic(loss, world, k, accumulation_mode) if loss is not None else []
    if world == 1:
        return out
    reduce_bucket = zero.get("reduce_bucket_size", 5e8)
    if stage < 3:
        reductions = 1 if stage == 1 else k            # ZeRO-1 at the boundary only
        op = "all_reduce" if zero.get("use_multi_rank_bucket_allreduce", True) or \
            not zero.get("reduce_scatter", True) else "reduce"
        calls = _calls(t, reduce_bucket) * (world if op == "reduce" else 1)
        out.append(Traffic(op, "gradients", c * t * reductions, calls * reductions))
        out.append(Traffic("all_gather", "parameters after step", p * t, 1))
        return out
    gathered = params - persistent                    # Ψ_np, frozen parameters included
    prefetch = zero.get("stage3_prefetch_bucket_size", 5e7)
    if not prefetch:   # nothing keeps a module's parameters past its forward: backward gathers them again
        passes = 3 if accumulation_mode == "global" and k > 1 else 2
        out.append(Traffic("all_gather", "parameters in forward and backward", p * gathered * passes * k,
                           _calls(gathered, 1) * passes * k))
        if checkpointed:   # and the recomputation of every checkpointed layer once more
            out.append(Traffic("all_gather", "recomputed layers' parameters", p * checkpointed * k, k))
    elif accumulation_mode == "global" and k > 1:   # the trace never holds: see the module docstring
        out.append(Traffic("all_gather", "parameters in forward/backward", p * gathered * 3 * k,
                           _calls(gathered, prefetch) * 3 * k))
        if checkpointed:
            out.append(Traffic("all_gather", "recomputed layers' parameters", p * checkpointed * k // 2, k))
        if persistent:
            out.append(Traffic("all_gather", "persistent parameters, re-recorded trace", p * persistent * (k - 1),
                               k - 1))
    else:
        out.append(Traffic("all_gather", "parameters in forward", p * gathered * k, _calls(gathered, prefetch) * k))
    out.append(Traffic("reduce_scatter", "gradients", c * t * k, _calls(t, reduce_bucket) * k))
    if persistent:
        out.append(Traffic("all_gather", "persistent parameters after step", p * persistent, 1))
    return out


def by_collective(traffic: list[Traffic], world: int, convention: str = "ring") -> dict[str, float]:
    """Bytes per step by collective: 'ring' (sent by a rank), 'message' (as logged) or 'size'
    (whole tensors, the input of `comm_seconds`)."""
    out: dict[str, float] = {}
    for tr in traffic:
        value = {"ring": tr.ring(world), "message": tr.message(world), "size": float(tr.size)}[convention]
        out[tr.op] = out.get(tr.op, 0.0) + value
    return out


def comm_seconds(bytes_by_collective: dict[str, float], nodes: int, gpus_per_node: int,
                 intra_bw: float = NVLINK4_BW, inter_bw: float = IB_NDR_PER_GPU) -> float:
    """Seconds per step spent in collectives, not overlapped with compute.

    `bytes_by_collective`: whole-tensor bytes per op, `by_collective(..., convention="size")`.
    intra_bw: a GPU's achieved bus bandwidth inside a node; inter_bw: its share of the node's
    network (bytes/s, one direction; constants above). The model is NCCL's hierarchical one,
    which is what it runs across nodes: a collective over S bytes on N nodes of n GPUs moves
    f (n-1)/n S per GPU inside the node and f (N-1)/N S/n per GPU across nodes (each GPU owns
    1/n of the tensor on its own NIC), f = 2 for all-reduce and 1 for reduce-scatter,
    all-gather, reduce and broadcast; the two levels are pipelined, so the slower one counts.
    One node is a plain ring, one GPU per node a ring over the network. An all-to-all sends
    (n-1)/G of S inside and (G-n)/G of S across; a point-to-point send crosses the network at
    inter_bw when there are several nodes. Latency per call is left out (bandwidth-bound
    sizes: gradient buckets are 10^7-10^8 elements)."""
    n, N = gpus_per_node, nodes
    G = n * N
    total = 0.0
    for op, size in bytes_by_collective.items():
        if op == "send":
            total += size / (intra_bw if N == 1 else min(intra_bw, inter_bw))
        elif op == "all_to_all":
            total += max((n - 1) / G * size / intra_bw, (G - n) / G * size / inter_bw)
        elif op in OPS:
            f = 2.0 if op == "all_reduce" else 1.0
            total += max(f * (n - 1) / n * size / intra_bw, f * (N - 1) / N * size / n / inter_bw)
        else:
            raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")
    return total

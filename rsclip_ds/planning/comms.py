"""The communication model: bytes each rank sends per optimizer step, by collective (pure functions).

What DeepSpeed 0.19.8 sends (read in stage_1_and_2.py, stage3.py, bf16_optimizer.py, and measured
with its comms logger by benchmarks/comms/traffic.py), for Ψ parameters of which Ψ_t train (locked towers
and LoRA's frozen weights have no gradients), G ranks, k micro-batches per optimizer step, p bytes
per 16-bit/32-bit weight and c bytes per gradient element on the wire (`communication_data_type`,
by default the training precision). Under the autocast precisions (amp_bf16, amp) the weights are fp32
(p = 4) and c is per parameter (DeepSpeed's `comm_dtype`, set by its torch_autocast setup): 2 bytes for
the Ψ_a trainable elements of Linear and Conv modules (exact classes: the attention pooling head's
in_proj_weight and NonDynamicallyQuantizableLinear are not among them), 4 for the rest; ZeRO keeps a
reduce bucket per wire dtype, so each gradient collective below splits into a 16-bit and an fp32 one.
ZeRO-3 all-gathers each parameter in its comm_dtype too (`get_allgather_dtype`, partition_parameters.py;
the gathered weight is cast back to fp32): the Ψ_A elements of all Linear/Conv parameters (frozen ones
included) at 2 bytes, the rest at 4; ZeRO-1/2 all-gather their updated fp32 partitions at 4. Measured at
ZeRO-1/2/3 and stage 0 with amp_bf16: benchmarks/results/comms_w2_amp_bf16.json.

    stage 0 all-reduce  cΨ_t once per step, at the accumulation boundary: rsclip_ds.gradients'
            overlapped reduction (the ddp profile; in buckets of reduce_bucket_size elements per wire
            dtype, launched as the backward fills them), c per parameter as above under autocast, else
            communication_data_type or the training precision. No all-gather: every rank steps the
            whole model. One rank sends nothing. It goes through torch.distributed: DeepSpeed's comms
            logger does not see it, the benchmark's torch profiler does (comms_w2_amp_bf16.json).

    ZeRO-1  all-reduce  cΨ_t once per step, at the accumulation boundary (`reduce_gradients`; the
            backward hooks reduce nothing before it: accumulation 1 and 4 send the same); then
            all-gather of the updated 16-bit partitions pΨ_t (`all_gather_dp_groups`).
            bf16 with grad_accum_dtype fp32 swaps in the BF16_Optimizer: same two collectives.
    ZeRO-2  all-reduce  cΨ_t per micro-batch (every backward), then the same all-gather once per
            step. 0.19.8's "reduce_scatter": true is not a reduce-scatter: with the default
            `use_multi_rank_bucket_allreduce` it all-reduces each bucket and keeps its partition
            (`average_tensor` -> `allreduce_and_scatter`, after flattening it); false (the
            profiles') all-reduces the contiguous bucket in place (`gradient_reduction_w_predivide`);
            only use_multi_rank_bucket_allreduce false sends a `reduce` to each owner.
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
             send the tensor. benchmarks/comms/traffic.py compares logged bytes with this one.
    ring     bytes a rank sends in a bandwidth-optimal ring: all-reduce 2(G-1)/G S,
             reduce-scatter and all-gather (G-1)/G S, broadcast (pipelined) (G-1)/G S, send S.
On gloo, reduce_scatter_tensor runs as an all-reduce of the whole input (seen by the torch
profiler in benchmarks/comms/traffic.py), so a CPU run moves twice the ring bytes of that collective.
Left out: scalar all-reduces (gradient norm, overflow flag: bytes), ZeRO-3's trace checks
(broadcasts of a few KiB per step while it re-records) and the train loop's loss sync.

Hybrid ZeRO-3 (read from the zero_optimization block; n = GPUs per node, N = nodes):
    hpZ     zero_hpz_partition_size h (= n): after a parameter's first release in a step DeepSpeed
            keeps a secondary copy of it sharded over the h ranks of the node
            (`_partition_param_sec`, pΨ/h per GPU) and gathers from it inside the node
            (`zero_param_process_group`); the optimizer step drops it (`invalidate_secondary_tensor`).
            So the first all-gather of each parameter in a step spans the world, every later one
            (forwards 2..k, backward re-gathers, recomputation) only the node. The ZeRO++ paper's
            "hpZ removes the backward all-gather from the network" assumes ZeRO-3 gathers again in
            backward (3Ψ per step: forward gather, backward gather, reduce-scatter). With the
            zero3 profile's prefetching it does not (measured above: 2Ψ per micro-batch), so
            hpZ saves network bytes only at k > 1 or under 'global' accumulation, where it
            leaves one crossing gather per step instead of k or 3k.
    qwZ     zero_quantized_weights: every parameter all-gather (primary and secondary) sends int8
            weights and an fp32 scale per block of at most 8000 elements (CUDAQuantizer's
            target_group_size): QWZ_BYTES per element instead of p (+0.05%).
    qgZ     zero_quantized_gradients, N > 1 only (one node: the plain reduce-scatter;
            DeepSpeed takes the node size from device_count()): `all_to_all_quant_reduce` sends each
            2-D gradient as int4 in an all-to-all inside the node ((n-1)/n of it), reduces, and
            sends the node's 1/n share, re-quantised, in an all-to-all across the nodes' same-index
            ranks ((N-1)/N of S/n): two stages one after the other, both at QGZ_BYTES per element
            (int4 + an fp32 scale per max(rows, cols, G) group). 1-D gradients (biases, norms;
            taken as the Ψ_p small parameters) fall back to the c-byte reduce-scatter.
    MiCS    mics_shard_size s (= n): parameters, gradients and optimizer states sharded over the s
            ranks of a node and replicated across nodes; gathers and the per-micro-batch
            reduce-scatter run inside the shard group, then at the accumulation boundary the
            gradient partitions are all-reduced across the N replicas (cΨ_t/s: MiCS's 2-hop
            synchronisation, from the MiCS paper and DeepSpeed <= 0.16's mics.py).
            DeepSpeed 0.19.8 removed MiCS: `mics_shard_size` is a DeepSpeedConfigError there
            (issue 8489). It is modelled here for comparison only.

Intra/inter split (`link_bytes`, `comm_time`): bytes one GPU sends over the node's links and over
its share of the network, for a collective over S bytes (the whole tensor; f = 2 for all-reduce,
1 otherwise):
    world group  NCCL's hierarchical (two-level) convention: f (n-1)/n S inside, f (N-1)/N S/n
                 across (each GPU carries 1/n of the tensor on its own NIC); the two levels are
                 pipelined in chunks, so a collective takes the slower of the two. NCCL's flat
                 rail-aligned ring puts (G-1)/G S/n on each NIC, the same to within 1/N.
                 all-to-all: (n-1)/G S inside, (G-n)/G S across.
    node group   (hpZ secondary, MiCS shard, qgZ's first stage) f (r-1)/r S inside only.
    rail group   (one rank per node: MiCS replicas, qgZ's second stage) f (N-1)/N S across only.
    send         the SigLIP ring sends to both neighbours: on a node's edge GPU half of it
                 crosses the network (all of it at one GPU per node).
Stages that DeepSpeed runs one after the other (qgZ's two all-to-alls, MiCS's reduce-scatter and
replica all-reduce) are separate entries, so their times add.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from rsclip_ds.precision import compute_dtype, is_autocast, weight_dtype

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
# A network of `gbps` Gb/s line rate per GPU (one NIC each, or a node's NICs split evenly),
# ~90% achieved like the InfiniBand figures above: 100 Gb/s -> 11.25 GB/s.
def network_bw(gbps: float) -> float:
    return gbps / 8 * 0.9 * GB


# ZeRO++ wire formats in DeepSpeed 0.19.8 (the module docstring): qwZ int8 + an fp32 scale per
# block of <= 8000 elements; qgZ int4 + an fp32 scale per group of ~min(rows, cols) elements,
# 1024 for the large towers' width-1024 matrices (+0.8%).
QWZ_BYTES = 1 + 4 / 8000
QGZ_BYTES = 0.5 + 4 / 1024
GROUPS = ("world", "node", "rail")


@dataclass(frozen=True)
class Traffic:
    """One kind of traffic in one optimizer step of one rank."""
    op: str          # one of OPS
    what: str        # "gradients", "parameters after step", "parameters in forward", ... "loss features"
    size: int        # bytes of the whole tensors, summed over the step's calls (send: bytes this rank sends)
    calls: int       # calls per step (from the bucket sizes; an estimate, never used for bytes)
    group: str = "world"   # 'world', 'node' (ranks of one node) or 'rail' (one rank per node)
    ranks: int = 0         # ranks in the group (0: the world)

    def message(self, world: int) -> float:
        """Bytes as the comms logger records them (the module docstring's 'message')."""
        return self.size / (self.ranks or world) if self.op == "all_gather" else float(self.size)

    def ring(self, world: int) -> float:
        """Bytes this rank sends in a bandwidth-optimal ring (the module docstring's 'ring')."""
        r = self.ranks or world
        if r == 1 and self.op != "send":
            return 0.0
        factor = {"all_reduce": 2 * (r - 1) / r, "send": 1.0}.get(self.op, (r - 1) / r)
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
                 loss: LossTraffic | None = None, gpus_per_node: int | None = None, autocast: int = 0,
                 autocast_all: int | None = None, autocast_persistent: int = 0) -> list[Traffic]:
    """Traffic of one rank per optimizer step (formulas in the module docstring).

    params, trainable: Ψ and Ψ_t (None: all train); stage: ZeRO stage of the profile (0: the ddp
    profile, no ZeRO); zero: its zero_optimization block (bucket sizes for the call counts; hpZ, qwZ,
    qgZ and MiCS keys); comm_dtype: DeepSpeed's communication_data_type (None: the precision; under
    autocast it must be None: the wire dtype is per parameter); persistent: Ψ_p, elements ZeRO-3 keeps
    gathered (`persistent_elements`); accumulation_mode: the run's batch.accumulation; checkpointed:
    elements of the non-persistent parameters inside activation-checkpointed layers (the encoder layers
    of both towers when checkpointing is on; ZeRO-3 'global' only); gpus_per_node: n (None: one node of
    `world`); autocast: Ψ_a, the trainable elements whose gradients travel in 16 bits under amp_bf16 /
    amp (memory.ModelSpec.autocast_params); autocast_all, autocast_persistent: Ψ_A, every element of the
    Linear/Conv parameters (None: Ψ_a), and how many of them ZeRO-3 keeps gathered (ModelSpec.autocast_all,
    .autocast_small): ZeRO-3 gathers those in 16 bits."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage} is not modelled (0, 1, 2 or 3)")
    if accumulation_mode not in ("plain", "global"):
        raise ValueError(f"accumulation mode {accumulation_mode!r}: 'plain' or 'global'")
    zero, t, k = zero or {}, params if trainable is None else trainable, accumulation
    p = DTYPE_BYTES[weight_dtype(precision)]
    wire = gradient_wire(t, precision, comm_dtype, autocast)
    n = gpus_per_node or world
    hybrid = hybrid_settings(zero, n, world)
    if stage < 3 and any(hybrid.values()):
        raise ValueError(f"hpZ, qwZ, qgZ and MiCS ({[k_ for k_, v in hybrid.items() if v]}) are ZeRO-3 options")
    out = loss_traffic(loss, world, k, accumulation_mode) if loss is not None else []
    if world == 1:
        return out
    reduce_bucket = zero.get("reduce_bucket_size", 5e8)
    if stage == 0:   # rsclip_ds.gradients: once per step, no gather
        out += [Traffic("all_reduce", "gradients" + what, c * m, _calls(m, reduce_bucket)) for what, c, m in wire]
        return out
    if stage < 3:
        reductions = 1 if stage == 1 else k            # ZeRO-1 at the boundary only
        op = "all_reduce" if zero.get("use_multi_rank_bucket_allreduce", True) or \
            not zero.get("reduce_scatter", True) else "reduce"
        for what, c, m in wire:
            calls = _calls(m, reduce_bucket) * (world if op == "reduce" else 1)
            out.append(Traffic(op, "gradients" + what, c * m * reductions, calls * reductions))
        out.append(Traffic("all_gather", "parameters after step", p * t, 1))
        return out
    # bytes per gathered element: p, or under autocast the mean of the Linear/Conv ones' 16 bits and the rest's 32;
    # the checkpointed layers' re-gathered parameters are their Linear weights (16-bit under autocast)
    low = DTYPE_BYTES[compute_dtype(precision)]
    big = (autocast if autocast_all is None else autocast_all) - autocast_persistent
    w, w_p, w_ck = p, p, p
    if is_autocast(precision):
        w = (low * big + p * (params - persistent - big)) / max(1, params - persistent)
        w_p, w_ck = (low * autocast_persistent + p * (persistent - autocast_persistent)) / max(1, persistent), low
    out += _zero3_gathers(params - persistent, persistent, k, accumulation_mode, checkpointed, (w, w_p, w_ck), zero,
                          hybrid)
    out += _zero3_gradients(t, min(persistent, t), k, wire, reduce_bucket, hybrid, n, world)
    if persistent:
        shard = hybrid["mics"]
        out.append(Traffic("all_gather", "persistent parameters after step", w_p * persistent, 1,
                           "node" if shard else "world", shard))
    return out


def gradient_wire(trainable: int, precision: str, comm_dtype: str | None = None,
                  autocast: int = 0) -> list[tuple[str, int, int]]:
    """[(label, bytes per element, elements)] of the gradients on the wire (module docstring): one group in
    ``comm_dtype`` or the weights' dtype, or under autocast the Linear/Conv group in the autocast dtype and
    the rest in fp32 (an empty group left out)."""
    if not is_autocast(precision):
        return [("", DTYPE_BYTES[comm_dtype or precision], trainable)]
    if comm_dtype is not None:
        raise ValueError(f"communication_data_type {comm_dtype} with {precision}: under torch.autocast DeepSpeed "
                         f"reduces each parameter in its own dtype (pass None)")
    if not 0 <= autocast <= trainable:
        raise ValueError(f"{autocast} elements on the 16-bit wire of {trainable} trainable ones")
    low = compute_dtype(precision)
    groups = [(f", {low} (Linear/Conv)", DTYPE_BYTES[low], autocast), (", fp32 (the rest)", 4, trainable - autocast)]
    return [g for g in groups if g[2] > 0]


def hybrid_settings(zero: dict, gpus_per_node: int, world: int) -> dict:
    """hpZ group size, qwZ, qgZ and MiCS shard size from a zero_optimization block (0/False: off).
    Groups must sit inside a node (those spanning nodes are not modelled)."""
    hpz = int(zero.get("zero_hpz_partition_size", 1) or 1)
    mics = int(zero.get("mics_shard_size", -1) or -1)
    out = {"hpz": hpz if hpz > 1 else 0, "mics": mics if mics > 0 else 0,
           "qwz": bool(zero.get("zero_quantized_weights")), "qgz": bool(zero.get("zero_quantized_gradients"))}
    for key in ("hpz", "mics"):
        if out[key] and (out[key] > gpus_per_node or gpus_per_node % out[key] or world % out[key]):
            raise ValueError(f"{key} group of {out[key]} ranks: must divide the {gpus_per_node} GPUs of a node "
                             f"(groups across nodes are not modelled)")
    return out


def _zero3_gathers(gathered: int, persistent: int, k: int, mode: str, checkpointed: int, wire: tuple, zero: dict,
                   hybrid: dict) -> list[Traffic]:
    """ZeRO-3's parameter all-gathers per step (module docstring): (what, elements, of which the
    step's first gather, calls), then the group and wire bytes hpZ / qwZ / MiCS give them. ``wire``: bytes per
    element of the gathered, the persistent and the checkpointed layers' parameters."""
    p, p_persistent, p_layers = wire
    prefetch = zero.get("stage3_prefetch_bucket_size", 5e7)
    if not prefetch:   # nothing keeps a module's parameters past its forward: backward gathers them again
        passes = 3 if mode == "global" and k > 1 else 2
        gathers = [("parameters in forward and backward", gathered * passes * k, gathered,
                    _calls(gathered, 1) * passes * k)]
        if checkpointed:   # and the recomputation of every checkpointed layer once more
            gathers.append(("recomputed layers' parameters", checkpointed * k, 0, k, p_layers))
    elif mode == "global" and k > 1:   # the trace never holds: see the module docstring
        gathers = [("parameters in forward/backward", gathered * 3 * k, gathered, _calls(gathered, prefetch) * 3 * k)]
        if checkpointed:
            gathers.append(("recomputed layers' parameters", checkpointed * k // 2, 0, k, p_layers))
        if persistent:
            gathers.append(("persistent parameters, re-recorded trace", persistent * (k - 1), 0, k - 1, p_persistent))
    else:
        gathers = [("parameters in forward", gathered * k, gathered, _calls(gathered, prefetch) * k)]
    out = []
    for what, elements, first, calls, *own in gathers:
        w = QWZ_BYTES if hybrid["qwz"] else (own[0] if own else p)
        if hybrid["mics"]:
            out.append(Traffic("all_gather", what, w * elements, calls, "node", hybrid["mics"]))
        elif hybrid["hpz"]:   # the step's first gather from the primary partition, the rest from the secondary
            per = max(1, calls * first // max(1, elements))
            if first:
                out.append(Traffic("all_gather", what + ", primary", w * first, per))
            if elements > first:
                out.append(Traffic("all_gather", what + ", hpZ secondary", w * (elements - first), calls - per,
                                   "node", hybrid["hpz"]))
        else:
            out.append(Traffic("all_gather", what, w * elements, calls))
    return out


def _zero3_gradients(t: int, small: int, k: int, wire: list[tuple[str, int, int]], bucket: float, hybrid: dict,
                     n: int, world: int) -> list[Traffic]:
    """ZeRO-3's gradient reduction per step: a reduce-scatter per micro-batch (one per wire dtype); MiCS's
    inside the shard group + the replica all-reduce at the boundary; qgZ's two int4 all-to-alls (module
    docstring). MiCS and qgZ take the wire's mean bytes per element (DeepSpeed refuses autocast with ZeRO++'s
    quantised weights; 0.19.8 removed MiCS)."""
    if not (hybrid["mics"] or hybrid["qgz"]):
        return [Traffic("reduce_scatter", "gradients" + what, c * m * k, _calls(m, bucket) * k) for what, c, m in wire]
    c, calls = sum(c * m for _, c, m in wire) / max(1, t), _calls(t, bucket)
    if hybrid["mics"]:
        s, nodes = hybrid["mics"], world // n
        if nodes > 1 and s != n:
            raise ValueError(f"MiCS shard groups of {s} < {n} GPUs per node on {nodes} nodes are not modelled")
        return [Traffic("reduce_scatter", "gradients, shard group", c * t * k, calls * k, "node", s),
                Traffic("all_reduce", "gradient partitions across replicas", c * t / s, calls,
                        "rail" if nodes > 1 else "node", world // s)]
    nodes = world // n
    if hybrid["qgz"] and nodes > 1:
        q = t - small                                   # 2-D gradients; 1-D ones fall back
        return [Traffic("all_to_all", "gradients int4, inside the node (qgZ)", QGZ_BYTES * q * k, calls * k, "node", n),
                Traffic("all_to_all", "gradients int4, across nodes (qgZ)", QGZ_BYTES * q / n * k, calls * k, "rail",
                        nodes),
                Traffic("reduce_scatter", "1-D gradients (qgZ falls back)", c * small * k, k)]
    return [Traffic("reduce_scatter", "gradients", c * t * k, calls * k)]   # qgZ on one node: the plain one


def by_collective(traffic: list[Traffic], world: int, convention: str = "ring") -> dict[str, float]:
    """Bytes per step by collective: 'ring' (sent by a rank), 'message' (as logged) or 'size'
    (whole tensors, the input of `comm_seconds`)."""
    out: dict[str, float] = {}
    for tr in traffic:
        value = {"ring": tr.ring(world), "message": tr.message(world), "size": float(tr.size)}[convention]
        out[tr.op] = out.get(tr.op, 0.0) + value
    return out


@dataclass(frozen=True)
class CommTime:
    """One step's communication of one GPU, by link (the module docstring's split)."""
    intra_bytes: float   # sent over the node's links (NVLink / PCIe)
    inter_bytes: float   # sent over the GPU's share of the network
    intra_s: float       # those bytes at the intra-node bandwidth
    inter_s: float       # at the inter-node bandwidth
    total_s: float       # per collective the slower level (pipelined), summed over the step

    def to_dict(self) -> dict:
        return asdict(self)


def link_bytes(tr: Traffic, nodes: int, gpus_per_node: int) -> tuple[float, float]:
    """(inside the node, across nodes): bytes one GPU sends for `tr` (module docstring)."""
    n, N, S = gpus_per_node, nodes, float(tr.size)
    G = n * N
    f = 2.0 if tr.op == "all_reduce" else 1.0
    if tr.op not in OPS:
        raise ValueError(f"unknown collective {tr.op!r}; known: {', '.join(OPS)}")
    if tr.group not in GROUPS:
        raise ValueError(f"unknown group {tr.group!r}; known: {', '.join(GROUPS)}")
    if tr.op == "send":
        if N == 1:
            return S, 0.0
        return (0.0, S) if n == 1 else (S / 2, S / 2)
    if tr.group != "world":
        r = tr.ranks or (n if tr.group == "node" else N)
        moved = f * (r - 1) / r * S
        return (moved, 0.0) if tr.group == "node" else (0.0, moved)
    if tr.op == "all_to_all":
        return (n - 1) / G * S, (G - n) / G * S
    return f * (n - 1) / n * S, f * (N - 1) / N * S / n


def comm_time(traffic: list[Traffic], nodes: int, gpus_per_node: int, intra_bw: float = NVLINK4_BW,
              inter_bw: float = IB_NDR_PER_GPU) -> CommTime:
    """Seconds per step in collectives, not overlapped with compute, split by link. intra_bw: a
    GPU's achieved bus bandwidth inside a node; inter_bw: its share of the node's network (bytes/s,
    one direction; constants above). A collective that uses both levels takes the slower (NCCL
    pipelines them); separate entries (sequential stages, separate collectives) add. Latency per
    call is left out (bandwidth-bound sizes: buckets are 10^7-10^8 elements)."""
    intra = inter = ti = tx = total = 0.0
    for tr in traffic:
        a, b = link_bytes(tr, nodes, gpus_per_node)
        intra, inter, ti, tx = intra + a, inter + b, ti + a / intra_bw, tx + b / inter_bw
        total += max(a / intra_bw, b / inter_bw)
    return CommTime(intra, inter, ti, tx, total)


def comm_seconds(bytes_by_collective: dict[str, float], nodes: int, gpus_per_node: int,
                 intra_bw: float = NVLINK4_BW, inter_bw: float = IB_NDR_PER_GPU) -> float:
    """`comm_time(...).total_s` for whole-tensor bytes per op over the world group
    (`by_collective(..., convention="size")`)."""
    traffic = [Traffic(op, op, size, 1) for op, size in bytes_by_collective.items()]
    return comm_time(traffic, nodes, gpus_per_node, intra_bw, inter_bw).total_s

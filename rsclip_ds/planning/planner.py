"""The profile picker: for a model and a GPU budget, every profile's peak memory (memory.py),
largest micro-batch that fits, and modelled step time; the fastest that fits is recommended.

    rows = plan(preset_spec("git-rsclip-large"), Budget(gpus_per_node=4, nodes=1, gpu_bytes=24 * GiB), 4096)
    best = recommend(rows)

The speed score is compute (flops.py's matmul FLOPs at an assumed rate) + communication (comms.py's
bytes through the link bandwidths of `Hardware`, split into time on the node's links and on the
network, less the part `Hardware.overlap` hides behind compute) + offload traffic.

Besides ds_profiles/*.json the candidates include the hybrid ZeRO-3 strategies of `HYBRID` (hpZ,
ZeRO++, MiCS), modelled from the zero3 profile plus their keys whether or not their JSON is on
disk. They are recommended only across nodes: on one node hpZ's and MiCS's groups are the world
(zero3's traffic, more memory) and ZeRO++ would only trade weight/gradient precision for NVLink
bytes; and never where the installed DeepSpeed rejects them (MiCS in 0.19.8). A row fits when the predicted *reserved* peak (allocated + allocator headroom + the CUDA/NCCL
reserve, `memory.Peak.reserved`) is within the GPU's memory, and the offloaded states within the
node's CPU memory when that is given.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache

from rsclip_ds.planning import comms
from rsclip_ds.planning.memory import BYTES, GiB, ModelSpec, Peak, model_state_bytes, peak
from rsclip_ds.planning.teacher import forward_flops, with_teacher
from rsclip_ds.planning.teacher import traffic as teacher_traffic

# Hybrid ZeRO-3 strategies by profile name: zero_optimization keys added to zero3's block;
# "per_node" becomes the budget's GPUs per node (hpZ's secondary group, MiCS's shard group).
HYBRID = {
    "zero3_hpz": {"zero_hpz_partition_size": "per_node"},
    "zero3_zeropp": {"zero_hpz_partition_size": "per_node", "zero_quantized_weights": True,
                     "zero_quantized_gradients": True},
    "zero3_mics": {"mics_shard_size": "per_node"},
}
NOTES = {"zero3_zeropp": "lossy: int8 weights in all-gathers, int4 gradients (ZeRO++)"}


def hybrid_profile(name: str, gpus_per_node: int):
    """The profile `name` of HYBRID for nodes of `gpus_per_node`: its JSON if ds_profiles/ has one
    that loads, else zero3's, with the table's keys set. (A zero3_mics.json does not load on
    DeepSpeed 0.19.8: its schema rejects mics_shard_size.)"""
    from rsclip_ds.config import ConfigError
    from rsclip_ds.profiles import available_profiles, load_profile

    try:
        base = load_profile(name if name in available_profiles() else "zero3")
    except ConfigError:
        base = load_profile("zero3")
    strategy = copy.deepcopy(base.strategy)
    zero = strategy.setdefault("zero_optimization", {})
    zero.update({k: gpus_per_node if v == "per_node" else v for k, v in HYBRID[name].items()})
    return replace(base, name=name, strategy=strategy,
                   description=base.description if base.name == name else f"{name}: zero3 + {HYBRID[name]}")


@lru_cache(maxsize=None)
def deepspeed_rejects(key: str) -> str:
    """DeepSpeed's message when the installed version rejects a zero_optimization key, else ''."""
    try:
        from deepspeed.runtime.config import _reject_removed_config_keys
    except ImportError:   # a DeepSpeed without the removal list still has every option
        return ""
    try:
        _reject_removed_config_keys({"zero_optimization": {key: 1}})
    except Exception as err:   # DeepSpeedConfigError
        return str(err)
    return ""


def candidacy(name: str, budget: "Budget") -> tuple[bool, str]:
    """(may it be recommended, why not / what to know) for a profile on a budget."""
    if name not in HYBRID:
        return True, ""
    for key in HYBRID[name]:
        if deepspeed_rejects(key):
            return False, f"DeepSpeed rejects {key}: {deepspeed_rejects(key).split(';')[0]}"
    if budget.nodes == 1:
        return False, "one node: zero3's traffic (hpZ/MiCS groups are the world) with more memory"
    return True, NOTES.get(name, "")


@dataclass(frozen=True)
class Hardware:
    """Assumed throughput for the speed score. Bandwidths are a GPU's achieved bus bandwidth,
    one direction, bytes/s (comms.py states where the defaults come from: NVLink 4 inside an
    H100/H200 node, one InfiniBand NDR NIC per GPU across nodes)."""
    flops: float = 100e12               # achieved FLOP/s per GPU (bf16; fp32 at a quarter)
    intra_bw: float = comms.NVLINK4_BW  # inside a node
    inter_bw: float = comms.IB_NDR_PER_GPU   # a GPU's share of its node's network
    pcie_bw: float = 12e9               # bytes/s GPU <-> pinned CPU memory per rank
    cpu_adam: float = 1e9               # parameters/s one node's CPU Adam updates
    overlap: float = 0.0                # share of min(compute, communication) hidden (0: none, 1: all)


@dataclass(frozen=True)
class Budget:
    gpus_per_node: int
    nodes: int
    gpu_bytes: int
    cpu_bytes: int | None = None   # per node; None: not checked

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Row:
    profile: str
    checkpointing: bool
    fits: bool
    max_micro: int        # largest micro-batch that fits (0: not even 1)
    micro: int            # micro-batch used: global = micro x accumulation x gpus
    accumulation: int
    gpu_gib: float        # predicted reserved peak per GPU at `micro` (at 1 when nothing fits)
    allocated_gib: float  # of which allocated by PyTorch (torch.cuda.max_memory_allocated)
    phase: str            # which phase sets the peak: 'forward/backward' or 'step'
    cpu_gib_node: float
    step_s: float         # modelled seconds per optimizer step (Hardware)
    relative_speed: float = 0.0   # step time of the fastest fitting candidate / this one's; 0 if it does not fit
    compute_s: float = 0.0        # of the step: compute
    comm_intra_s: float = 0.0     # communication on the node's links (NVLink / PCIe)
    comm_inter_s: float = 0.0     # communication on the network
    comm_s: float = 0.0           # communication, the slower link of each collective, before overlap
    candidate: bool = True        # may be recommended (hybrid profiles: across nodes only)
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def accumulation_for(per_rank: int, max_micro: int) -> tuple[int, int]:
    """The smallest accumulation a with per_rank % a == 0 and per_rank / a <= max_micro:
    (micro, a). Whole micro-batches only, so the micro used can be below the largest that fits."""
    for a in range(math.ceil(per_rank / max_micro), per_rank + 1):
        if per_rank % a == 0:
            return per_rank // a, a
    raise AssertionError("unreachable: a = per_rank always divides")


@dataclass(frozen=True)
class StepTime:
    compute: float
    comm: comms.CommTime
    offload: float          # PCIe + CPU Adam
    total: float


def train_flops(spec: ModelSpec, samples: int, checkpointing: bool, cached_forward: bool) -> float:
    """Matmul FLOPs of `samples` training samples (flops.py's count per tower): forward x (1 + 2 x
    the tower's trained share: a locked tower runs forward only), x 8/6 with checkpointing (one
    more forward), x 8/6 more for 'global' accumulation's cached pass."""
    from transformers import SiglipConfig
    import json

    from rsclip_ds.planning.flops import text_flops, vision_flops

    config = SiglipConfig.from_dict(json.loads(spec.config_json))
    per_tower = [(vision_flops(config.vision_config).total, spec.tower_trains("vision")),
                 (text_flops(config.text_config).total, spec.tower_trains("text"))]
    flops = sum(fwd * (1 + 2 * trains) for fwd, trains in per_tower) * samples
    return flops * (1 + 2 / 6 * checkpointing + 2 / 6 * cached_forward)


def step_time(spec: ModelSpec, prof, precision: str, checkpointing: bool, micro: int, accum: int,
              budget: Budget, accumulation: str = "global", hw: Hardware = Hardware(), loss: str = "siglip",
              negatives: str = "global", comm: str = "auto", teacher=None) -> StepTime:
    """Seconds per optimizer step of `prof` (profiles.Profile), by part:
      compute  `train_flops` of micro x accum samples at hw.flops (fp32 at a quarter);
      network  comms.step_traffic (what DeepSpeed 0.19.8 sends per step, the loss's features
               included) through comms.comm_time (intra-node bytes at hw.intra_bw, inter-node at
               hw.inter_bw; a hierarchical collective takes the slower level); hw.overlap of
               min(compute, network) is hidden;
      PCIe     optimizer offload: g Ψ/G per micro-batch out, p Ψ/G per step in; parameter
               offload 2p Ψ/G more per micro-batch; CPU Adam on the node's n Ψ/G parameters.
    ``teacher`` (planning.teacher.TeacherPlan): its forward per sample joins the compute, its
    weights' all-gathers (zero3 placement) the network."""
    from rsclip_ds.profiles import wire_dtype   # the run's distributed.communication_data_type, resolved

    p, g, _ = BYTES[precision]
    psi, G, t, stage = spec.params, budget.gpus, spec.trainable, prof.stage
    flops = train_flops(spec, micro * accum, checkpointing, accumulation == "global" and accum > 1)
    compute = flops / (hw.flops / (4 if precision == "fp32" else 1))
    if teacher is not None:
        compute += forward_flops(teacher) * micro * accum / (hw.flops / (4 if teacher.dtype == "fp32" else 1))
    traffic = comms.step_traffic(
        psi, t, stage=stage, world=G, accumulation=accum, precision=precision,
        comm_dtype=wire_dtype(comm, prof), zero=prof.strategy.get("zero_optimization", {}),
        persistent=spec.small_params if stage == 3 else 0, accumulation_mode=accumulation,
        checkpointed=spec.layer_params if checkpointing and stage == 3 else 0,
        loss=comms.LossTraffic(loss, negatives, micro, spec.embed_dim), gpus_per_node=budget.gpus_per_node)
    net = comms.comm_time(traffic + teacher_traffic(teacher, accum), budget.nodes, budget.gpus_per_node, hw.intra_bw, hw.inter_bw)
    part, tpart = psi / G, t / G
    pcie = (g * tpart * accum + p * tpart) * prof.offload_optimizer + 2 * p * part * accum * prof.offload_param
    cpu = tpart * budget.gpus_per_node / hw.cpu_adam if prof.offload_optimizer else 0.0
    offload = pcie / hw.pcie_bw + cpu
    total = compute + net.total_s - hw.overlap * min(compute, net.total_s) + offload
    return StepTime(compute, net, offload, total)


def step_seconds(*args, **kwargs) -> float:
    """`step_time(...).total`."""
    return step_time(*args, **kwargs).total


def plan(spec: ModelSpec, budget: Budget, global_batch: int, precision: str = "bf16",
         profiles: list[str] | None = None, loss: str = "siglip", negatives: str = "global",
         accumulation: str = "global", hw: Hardware = Hardware(), grad_accum: str = "auto",
         master: str = "fp32", comm: str = "auto", teacher=None) -> list[Row]:
    """One row per (profile, activation checkpointing), fastest first. ``grad_accum``: the run's
    bf16.grad_accum_dtype (auto: the profile's measured choice); ``master``: its bf16.master_weights;
    ``comm``: its distributed.communication_data_type (the gradient bytes on the wire); ``teacher``: a
    distillation teacher's planning.teacher.TeacherPlan (its weights, inputs, forward and FLOPs)."""
    from rsclip_ds.profiles import available_profiles, load_profile

    if global_batch % budget.gpus:
        raise ValueError(f"global batch {global_batch} is not a multiple of {budget.gpus} GPUs")
    per_rank = global_batch // budget.gpus
    names = profiles or available_profiles() + [h for h in HYBRID if h not in available_profiles()]
    rows = []
    for name in names:
        prof = hybrid_profile(name, budget.gpus_per_node) if name in HYBRID else load_profile(name)
        candidate, note = candidacy(name, budget)
        if comm not in ("auto", "fp16") and prof.strategy.get("zero_optimization", {}).get("zero_quantized_gradients"):
            # profiles.wire_dtype refuses it: the quantizer kernel reads fp16 only; modelled in fp16
            candidate, note, row_comm = False, f"qgZ reduces in fp16 only, not {comm}", "fp16"
        else:
            row_comm = comm
        zero = prof.strategy.get("zero_optimization", {})
        cpu_node = model_state_bytes(spec.params, prof.stage, prof.offload_optimizer, prof.offload_param, precision,
                                     budget.gpus, budget.gpus_per_node, trainable=spec.trainable, master=master,
                                     hpz=int(zero.get("zero_hpz_partition_size", 1) or 1),
                                     shard=max(0, int(zero.get("mics_shard_size", -1) or -1))).cpu_node
        for ac in (False, True):
            def at(m: int) -> Peak:   # micro m, as many micro-batches as the per-rank batch needs
                accum_m = math.ceil(per_rank / m)
                return with_teacher(peak(spec, prof, precision, budget.gpus, budget.gpus_per_node, micro=m,
                                         accumulation_steps=accum_m, checkpointing=ac, loss=loss,
                                         negatives=negatives, accumulation=accumulation, grad_accum=grad_accum,
                                         master=master), teacher, budget.gpus, m, accum_m, accumulation)
            lo, hi = 0, per_rank                      # largest m whose peak fits (monotonic in m)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if at(mid).reserved <= budget.gpu_bytes else (lo, mid - 1)
            cpu_ok = budget.cpu_bytes is None or cpu_node <= budget.cpu_bytes
            micro, accum = accumulation_for(per_rank, lo) if lo else (0, 0)
            used = at(max(micro, 1))
            st = step_time(spec, prof, precision, ac, max(micro, 1), max(accum, 1), budget, accumulation, hw,
                           loss, negatives, row_comm, teacher)
            rows.append(Row(name, ac, bool(lo) and cpu_ok, lo, micro, accum, round(used.reserved / GiB, 2),
                            round(used.allocated / GiB, 2), used.phase, round(cpu_node / GiB, 2), st.total,
                            compute_s=st.compute, comm_intra_s=st.comm.intra_s, comm_inter_s=st.comm.inter_s,
                            comm_s=st.comm.total_s, candidate=candidate, note=note))
    best = min((r.step_s for r in rows if r.fits and r.candidate), default=0.0)
    rows = [replace(r, relative_speed=round(best / r.step_s, 3) if r.fits and r.step_s else 0.0) for r in rows]
    return sorted(rows, key=lambda r: (not r.fits, r.step_s))


def recommend(rows: list[Row]) -> Row | None:
    """The fastest candidate row that fits; ties go to the smaller GPU footprint. None if nothing fits."""
    fitting = [r for r in rows if r.fits and r.candidate]
    return min(fitting, key=lambda r: (r.step_s, r.gpu_gib)) if fitting else None

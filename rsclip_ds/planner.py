"""The profile picker: for a model and a GPU budget, every profile's peak memory (memory.py),
largest micro-batch that fits, and modelled step time; the fastest that fits is recommended.

    rows = plan(preset_spec("git-rsclip-large"), Budget(gpus_per_node=4, nodes=1, gpu_bytes=24 * GiB), 4096)
    best = recommend(rows)

The speed score is compute (FLOPs at an assumed rate) + communication (comms.py's bytes through
the link bandwidths of `Hardware`) + offload traffic. A row fits when the predicted *reserved* peak (allocated + allocator headroom + the CUDA/NCCL
reserve, `memory.Peak.reserved`) is within the GPU's memory, and the offloaded states within the
node's CPU memory when that is given.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from rsclip_ds import comms
from rsclip_ds.memory import BYTES, GiB, ModelSpec, Peak, model_state_bytes, peak


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
    relative_speed: float = 0.0   # step time of the fastest fitting row / this one's; 0 if it does not fit

    def to_dict(self) -> dict:
        return asdict(self)


def accumulation_for(per_rank: int, max_micro: int) -> tuple[int, int]:
    """The smallest accumulation a with per_rank % a == 0 and per_rank / a <= max_micro:
    (micro, a). Whole micro-batches only, so the micro used can be below the largest that fits."""
    for a in range(math.ceil(per_rank / max_micro), per_rank + 1):
        if per_rank % a == 0:
            return per_rank // a, a
    raise AssertionError("unreachable: a = per_rank always divides")


def step_seconds(spec: ModelSpec, prof, precision: str, checkpointing: bool, micro: int, accum: int,
                 budget: Budget, accumulation: str = "global", hw: Hardware = Hardware(), loss: str = "siglip",
                 negatives: str = "global") -> float:
    """Seconds per optimizer step of `prof` (profiles.Profile), compute + communication + offload,
    not overlapped:
      compute  6 x (Ψ_vision x patches + Ψ_text x tokens) FLOPs per sample (a locked tower runs
               forward only), x 8/6 with checkpointing (one more forward), x 8/6 more for
               'global' accumulation's cached pass;
      network  comms.step_traffic (what DeepSpeed 0.19.8 sends per step, the loss's features
               included) through comms.comm_seconds (NCCL's hierarchical model: the slower of
               the links inside and across nodes);
      PCIe     optimizer offload: g Ψ/G per micro-batch out, p Ψ/G per step in; parameter
               offload 2p Ψ/G more per micro-batch; CPU Adam on the node's n Ψ/G parameters."""
    p, g, _ = BYTES[precision]
    psi, G, t, stage = spec.params, budget.gpus, spec.trainable, prof.stage
    per_tower = [(spec.vision_params * spec.vision_tokens, spec.tower_trains("vision")),
                 (spec.text_params * spec.text_tokens, spec.tower_trains("text"))]
    flops = sum(work * (2 + 4 * trains) for work, trains in per_tower) * micro * accum
    flops *= (1 + 2 / 6 * checkpointing + 2 / 6 * (accumulation == "global" and accum > 1))
    compute = flops / (hw.flops / (4 if precision == "fp32" else 1))
    traffic = comms.step_traffic(
        psi, t, stage=stage, world=G, accumulation=accum, precision=precision,
        comm_dtype=prof.strategy.get("communication_data_type"), zero=prof.strategy.get("zero_optimization", {}),
        persistent=spec.small_params if stage == 3 else 0, accumulation_mode=accumulation,
        checkpointed=spec.layer_params if checkpointing and stage == 3 else 0,
        loss=comms.LossTraffic(loss, negatives, micro, spec.embed_dim))
    net = comms.comm_seconds(comms.by_collective(traffic, G, "size"), budget.nodes, budget.gpus_per_node,
                             hw.intra_bw, hw.inter_bw)
    part, tpart = psi / G, t / G
    pcie = (g * tpart * accum + p * tpart) * prof.offload_optimizer + 2 * p * part * accum * prof.offload_param
    cpu = tpart * budget.gpus_per_node / hw.cpu_adam if prof.offload_optimizer else 0.0
    return compute + net + pcie / hw.pcie_bw + cpu


def plan(spec: ModelSpec, budget: Budget, global_batch: int, precision: str = "bf16",
         profiles: list[str] | None = None, loss: str = "siglip", negatives: str = "global",
         accumulation: str = "global", hw: Hardware = Hardware(), grad_accum: str = "auto",
         master: str = "fp32") -> list[Row]:
    """One row per (profile, activation checkpointing), fastest first. ``grad_accum``: the run's
    bf16.grad_accum_dtype (auto: the profile's measured choice); ``master``: its bf16.master_weights."""
    from rsclip_ds.profiles import available_profiles, load_profile

    if global_batch % budget.gpus:
        raise ValueError(f"global batch {global_batch} is not a multiple of {budget.gpus} GPUs")
    per_rank = global_batch // budget.gpus
    rows = []
    for prof in map(load_profile, profiles or available_profiles()):
        cpu_node = model_state_bytes(spec.params, prof.stage, prof.offload_optimizer, prof.offload_param, precision,
                                     budget.gpus, budget.gpus_per_node, trainable=spec.trainable,
                                     master=master).cpu_node
        for ac in (False, True):
            def at(m: int) -> Peak:   # micro m, as many micro-batches as the per-rank batch needs
                return peak(spec, prof, precision, budget.gpus, budget.gpus_per_node, micro=m,
                            accumulation_steps=math.ceil(per_rank / m), checkpointing=ac, loss=loss,
                            negatives=negatives, accumulation=accumulation, grad_accum=grad_accum,
                            master=master)
            lo, hi = 0, per_rank                      # largest m whose peak fits (monotonic in m)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if at(mid).reserved <= budget.gpu_bytes else (lo, mid - 1)
            cpu_ok = budget.cpu_bytes is None or cpu_node <= budget.cpu_bytes
            micro, accum = accumulation_for(per_rank, lo) if lo else (0, 0)
            used = at(max(micro, 1))
            secs = step_seconds(spec, prof, precision, ac, max(micro, 1), max(accum, 1), budget, accumulation, hw,
                                loss, negatives)
            rows.append(Row(prof.name, ac, bool(lo) and cpu_ok, lo, micro, accum, round(used.reserved / GiB, 2),
                            round(used.allocated / GiB, 2), used.phase, round(cpu_node / GiB, 2), secs))
    best = min((r.step_s for r in rows if r.fits), default=0.0)
    rows = [Row(**{**r.to_dict(), "relative_speed": round(best / r.step_s, 3) if r.fits and r.step_s else 0.0}) for r in rows]
    return sorted(rows, key=lambda r: (not r.fits, r.step_s))


def recommend(rows: list[Row]) -> Row | None:
    """The fastest row that fits; ties go to the smaller GPU footprint. None if nothing fits."""
    fitting = [r for r in rows if r.fits]
    return min(fitting, key=lambda r: (r.step_s, r.gpu_gib)) if fitting else None

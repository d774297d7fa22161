"""The profile picker: for a model and a GPU budget, every profile's peak memory (memory.py),
largest micro-batch that fits, and modelled step time; the fastest that fits is recommended.

    rows = plan(preset_spec("git-rsclip-large"), Budget(gpus_per_node=4, nodes=1, gpu_bytes=24 * GiB), 4096)
    best = recommend(rows)

The speed score is compute (flops.py's matmul FLOPs at an assumed rate) + communication (comms.py's
bytes through the link bandwidths of `Hardware`, split into time on the node's links and on the
network, less the part `Hardware.overlap` hides behind compute) + offload traffic + what the ZeRO
stage itself costs a rank (`stage_seconds`: ZeRO-3's hooks, measured on one H200; MEASURED_H200).
Rows are ranked by that step time, ties to the lighter stage: stage 0 (the ddp profile: no ZeRO, every
GPU holds the whole model) first, then ZeRO-1/2, ZeRO-3, offload. ddp sends the least (one all-reduce
of the gradients, no all-gather of the updated weights) and costs a rank no ZeRO hooks or partition
copies, so it wins wherever it fits at the micro-batch the others fit; ZeRO-3 and offload win only where
memory needs them (ZeRO-1/2 do not fit, or only with checkpointing or accumulation that costs more).
Rows a run would refuse with the plan's settings (precision=amp under ZeRO, bf16 weights at stage 0,
autocast with ZeRO++'s quantised weights: resolve.py's rules, `resolve_row`) are shown, never recommended.
`reason` says why the pick won, in one line; `nearest_fit`, when nothing fits, which row came
closest and what would make it fit.

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
import json
import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache

from rsclip_ds.planning import comms
from rsclip_ds.planning.memory import BYTES, GiB, ModelSpec, Peak, model_state_bytes, peak
from rsclip_ds.planning.teacher import forward_flops, with_teacher
from rsclip_ds.planning.teacher import traffic as teacher_traffic
from rsclip_ds.precision import compute_dtype, is_autocast

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


# ----------------------------------------------------------------------------- what a stage costs a rank
# Steps measured on one H200 (bf16, DeepSpeed 0.19.8, 2026-12-04), world 1 (no communication), no
# activation checkpointing, accumulation 1, the batch already on the GPU: (preset, how, micro,
# seconds per step). "plain": a PyTorch loop on the same model and batch (fp32 weights, autocast
# bf16, fused AdamW, SDPA). The DeepSpeed rows are benchmarks.gpu's, each in a fresh process; the
# same base zero2 engine ran 0.238 s a step over 15 steps in one process, the GPU busy ~0.176 s of
# it (matmuls ~0.077 s) and waiting on the host for the rest.
MEASURED_H200 = (
    ("git-rsclip-base", "plain", 256, 0.141),
    ("git-rsclip-base", "zero2", 256, 0.282),
    ("git-rsclip-base", "zero3", 256, 0.484),
    ("git-rsclip-large", "zero2", 128, 0.513),
    ("git-rsclip-large", "zero3", 128, 0.639),
)
# ZeRO-1/2 over a plain loop, seconds per optimizer step. Measured: 0.238 - 0.141 = 0.097 s (base,
# micro 256, in one process), but DeepSpeed settings behind part of it are being changed (issue 36)
# and what remains is expected to be small: 0 until a GPU run measures it. Re-fit it as the zero2
# row minus the plain row of such a run, at the same micro-batch.
ZERO12_STEP_S = 0.0
# ZeRO-3 over ZeRO-2, seconds per micro-step (forward + backward): ZERO3_MODULE_S per module with
# parameters of its own (those whose hooks gather and release parameters) + ZERO3_TOKEN_S per token
# of the micro-batch (patches + text positions). The two zero3 - zero2 gaps of MEASURED_H200 fix
# the two (`fit_zero3_costs` solves it; tests/unit/test_planner_speed.py holds these literals to it):
#     base   0.484 - 0.282 = 0.202 s = 206 modules x M + 256 x (196 + 64) = 66,560 tokens x T
#     large  0.639 - 0.513 = 0.126 s = 398 modules x M + 128 x (256 + 64) = 40,960 tokens x T
#     M = 6.24e-6 s, T = 3.016e-6 s
# The gap follows the micro-batch's tokens, not the hook count: large has 1.9x base's modules and
# the smaller gap (a fixed + per-module fit needs a negative per-module cost). Two rows fix two
# constants and check nothing: a run at two micro-batches per preset would. Assumed, not measured:
# per rank (the same on any world; the gathers' traffic is comms.py's), and with checkpointing or
# 'global' accumulation's cached forward it grows as the compute does (8/6 per extra forward).
# Offload: no measured row; its stage's cost plus the PCIe and CPU Adam time of `step_time`.
ZERO3_MODULE_S = 6.24e-6
ZERO3_TOKEN_S = 3.016e-6
# Stage 0 (ddp) over the plain loop: nothing. Its step is the plain loop's (torch's fused AdamW on the module's own
# parameters, no ZeRO hooks, no flat partitions to copy gradients into and weights out of); its all-reduce is
# comms.py's. It is never above ZERO12_STEP_S: a tie at equal compute and traffic goes to the lighter stage, and on
# more than one GPU ddp sends less (no all-gather). Under bf16/fp16 DeepSpeed's FP16_UnfusedOptimizer casts each
# gradient to fp32 and each weight back (two copies per tensor): not measured, left out.
STAGE0_STEP_S = 0.0


@lru_cache(maxsize=None)
def hooked_modules(spec: ModelSpec) -> int:
    """Modules with parameters of their own: those ZeRO-3's hooks gather and release."""
    from transformers import SiglipConfig

    from rsclip_ds.planning.activations import meta_model

    model = meta_model(SiglipConfig.from_dict(json.loads(spec.config_json)), spec.finetune_json)
    return sum(1 for m in model.modules() if next(m.parameters(recurse=False), None) is not None)


def tokens_per_sample(spec: ModelSpec) -> float:
    """Patches kept (patch dropout) + text positions: what one sample feeds the two towers."""
    dropped = json.loads(spec.config_json)["vision_config"].get("patch_dropout") or 0.0
    return spec.vision_tokens * (1 - dropped) + spec.text_tokens


def stage_seconds(spec: ModelSpec, stage: int, micro: int, accum: int, passes: float = 1.0) -> float:
    """What the ZeRO stage costs a rank per optimizer step beyond compute, communication and offload
    traffic (the table above); ``passes``: the compute's multiplier for extra forwards."""
    if stage == 0:
        return STAGE0_STEP_S
    if stage < 3:
        return ZERO12_STEP_S
    per_micro = ZERO3_MODULE_S * hooked_modules(spec) + ZERO3_TOKEN_S * micro * tokens_per_sample(spec)
    return ZERO12_STEP_S + accum * per_micro * passes


def fit_zero3_costs(measured=MEASURED_H200) -> tuple[float, float]:
    """(ZERO3_MODULE_S, ZERO3_TOKEN_S) solved from the zero3 - zero2 gaps of two presets in
    ``measured`` at their micro-batches (Cramer's rule on the two equations above)."""
    from rsclip_ds.planning.memory import preset_spec

    steps = {(preset, how): (micro, s) for preset, how, micro, s in measured}
    eqs = []
    for preset in dict.fromkeys(p for p, _, _, _ in measured):
        (micro, z3), (micro2, z2) = steps[(preset, "zero3")], steps[(preset, "zero2")]
        if micro != micro2:
            raise ValueError(f"{preset}: zero2 measured at micro {micro2}, zero3 at {micro}: the gap needs one micro")
        spec = preset_spec(preset)
        eqs.append((hooked_modules(spec), micro * tokens_per_sample(spec), z3 - z2))
    (a1, b1, c1), (a2, b2, c2) = eqs
    det = a1 * b2 - a2 * b1
    return (c1 * b2 - c2 * b1) / det, (a1 * c2 - a2 * c1) / det


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
    offload_s: float = 0.0        # PCIe traffic and CPU Adam of the offload profiles
    host_s: float = 0.0           # the stage's own host and hook time (`stage_seconds`: ZeRO-3's hooks)
    over_gib: float = 0.0         # GiB over the budget at micro 1, per GPU + per node of CPU (0: it fits)
    stage: int = 0
    precision: str = ""           # the row's precision (`auto` made concrete for its stage)
    offload: bool = False         # optimizer (or parameter) states in CPU memory
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
    host: float             # the stage's own cost (`stage_seconds`)
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
      compute  `train_flops` of micro x accum samples at hw.flops (fp32 at a quarter; the autocast
               precisions at the full rate: their matmuls are 16-bit);
      network  comms.step_traffic (what DeepSpeed 0.19.8 sends per step, the loss's features
               included) through comms.comm_time (intra-node bytes at hw.intra_bw, inter-node at
               hw.inter_bw; a hierarchical collective takes the slower level); hw.overlap of
               min(compute, network) is hidden;
      PCIe     optimizer offload: g Ψ/G per micro-batch out, p Ψ/G per step in; parameter
               offload 2p Ψ/G more per micro-batch; CPU Adam on the node's n Ψ/G parameters;
      host     `stage_seconds`: ZeRO-3's hooks, measured on one H200 (none hidden by overlap); stage 0
               and ZeRO-1/2: 0 (STAGE0_STEP_S, ZERO12_STEP_S).
    ``teacher`` (planning.teacher.TeacherPlan): its forward per sample joins the compute, its
    weights' all-gathers (zero3 placement) the network."""
    from rsclip_ds.resolve import wire_dtype   # the run's distributed.communication_data_type, resolved

    p, g, _ = BYTES[precision]
    psi, G, t, stage = spec.params, budget.gpus, spec.trainable, prof.stage
    cached = accumulation == "global" and accum > 1
    flops = train_flops(spec, micro * accum, checkpointing, cached)
    compute = flops / (hw.flops / (4 if compute_dtype(precision) == "fp32" else 1))   # amp: 16-bit matmuls
    host = stage_seconds(spec, stage, micro, accum, 1 + 2 / 6 * checkpointing + 2 / 6 * cached)
    if teacher is not None:
        compute += forward_flops(teacher) * micro * accum / (hw.flops / (4 if teacher.dtype == "fp32" else 1))
    traffic = comms.step_traffic(
        psi, t, stage=stage, world=G, accumulation=accum, precision=precision, autocast=spec.autocast_params,
        autocast_all=spec.autocast_all, autocast_persistent=spec.autocast_small if stage == 3 else 0,
        comm_dtype=None if is_autocast(precision) else wire_dtype(comm, prof),   # autocast: per parameter
        zero=prof.strategy.get("zero_optimization", {}),
        persistent=spec.small_params if stage == 3 else 0, accumulation_mode=accumulation,
        checkpointed=spec.layer_params if checkpointing and stage == 3 else 0,
        loss=comms.LossTraffic(loss, negatives, micro, spec.embed_dim), gpus_per_node=budget.gpus_per_node)
    net = comms.comm_time(traffic + teacher_traffic(teacher, accum), budget.nodes, budget.gpus_per_node, hw.intra_bw, hw.inter_bw)
    part, tpart = psi / G, t / G
    pcie = (g * tpart * accum + p * tpart) * prof.offload_optimizer + 2 * p * part * accum * prof.offload_param
    cpu = tpart * budget.gpus_per_node / hw.cpu_adam if prof.offload_optimizer else 0.0
    offload = pcie / hw.pcie_bw + cpu
    total = compute + net.total_s - hw.overlap * min(compute, net.total_s) + offload + host
    return StepTime(compute, net, offload, host, total)


def step_seconds(*args, **kwargs) -> float:
    """`step_time(...).total`."""
    return step_time(*args, **kwargs).total


def row_config(precision: str = "auto", master: str = "fp32", grad_accum: str = "auto", comm: str = "auto",
               loss: str = "siglip", negatives: str = "global", accumulation: str = "global"):
    """The run config a plan's settings describe (the rows differ by profile): what `resolve` decides from."""
    from rsclip_ds.config import load_config

    sets = [f"precision={precision}", f"loss.name={loss}", f"loss.negatives={negatives}",
            f"batch.accumulation={accumulation}", f"distributed.communication_data_type={comm}"]
    if precision in ("bf16", "auto"):   # the schema refuses bf16.* with another precision
        sets += [f"bf16.master_weights={master}", f"bf16.grad_accum_dtype={grad_accum}"]
    return load_config(None, sets)


def resolve_row(run, prof, budget: "Budget"):
    """A row's run as resolve() decides it for this budget's GPUs -> (precision, refusal, record): the precision
    as a run makes it (`precision: auto` per profile: amp_bf16 at stage 0, bf16 under ZeRO; bf16 wherever a
    bf16.* setting asks for it), why a run would refuse the row ('' where it runs) and the record (None where
    refused) -- what the Trainer resolves from the same config on such a world."""
    from rsclip_ds.config import ConfigError
    from rsclip_ds.resolve import GPU, World, resolve, resolve_run_precision

    try:
        record = resolve(run, prof, World(budget.gpus, budget.gpus_per_node), GPU)
    except ConfigError as err:
        return resolve_run_precision(run, prof)[0].precision, err.note, None
    return record.precision.name, "", record


def plan(spec: ModelSpec, budget: Budget, global_batch: int, precision: str = "auto",
         profiles: list[str] | None = None, loss: str = "siglip", negatives: str = "global",
         accumulation: str = "global", hw: Hardware = Hardware(), grad_accum: str = "auto",
         master: str = "fp32", comm: str = "auto", teacher=None) -> list[Row]:
    """One row per (profile, activation checkpointing): those that fit, fastest first, then the
    others, nearest to fitting first. Each row takes the largest micro-batch that fits and divides
    the per-GPU batch, accumulation the rest; a row that fits nowhere is shown at micro 1.
    ``grad_accum``: the run's bf16.grad_accum_dtype (auto: the profile's measured choice); ``master``:
    its bf16.master_weights; ``comm``: its distributed.communication_data_type (the gradient bytes on
    the wire); ``teacher``: a distillation teacher's planning.teacher.TeacherPlan (its weights,
    inputs, forward and FLOPs). A row whose profile DeepSpeed would refuse with these settings
    (`resolve_row`) is not a candidate; it is modelled with the settings its stage allows (stage 0:
    fp32 masters, bf16 accumulation)."""
    from rsclip_ds.profiles import available_profiles, load_profile

    if global_batch % budget.gpus:
        raise ValueError(f"global batch {global_batch} is not a multiple of {budget.gpus} GPUs")
    per_rank = global_batch // budget.gpus
    names = profiles or available_profiles() + [h for h in HYBRID if h not in available_profiles()]
    run = row_config(precision, master, grad_accum, comm, loss, negatives, accumulation)
    rows = []
    for name in names:
        prof = hybrid_profile(name, budget.gpus_per_node) if name in HYBRID else load_profile(name)
        candidate, note = candidacy(name, budget)
        row_precision, refused, _ = resolve_row(run, prof, budget)
        if refused:
            candidate, note = False, "; ".join(n for n in (note, refused) if n)
        qgz = prof.strategy.get("zero_optimization", {}).get("zero_quantized_gradients")
        row_comm = "fp16" if qgz and comm not in ("auto", "fp16") else comm   # qgZ: modelled in fp16
        row_master, row_accum = ("fp32", "auto") if prof.stage == 0 else (master, grad_accum)
        zero = prof.strategy.get("zero_optimization", {})
        cpu_node = model_state_bytes(spec.params, prof.stage, prof.offload_optimizer, prof.offload_param, row_precision,
                                     budget.gpus, budget.gpus_per_node, trainable=spec.trainable, master=row_master,
                                     hpz=int(zero.get("zero_hpz_partition_size", 1) or 1),
                                     shard=max(0, int(zero.get("mics_shard_size", -1) or -1))).cpu_node
        cpu_over = max(0, cpu_node - budget.cpu_bytes) if budget.cpu_bytes is not None else 0
        for ac in (False, True):
            def at(m: int) -> Peak:   # micro m, as many micro-batches as the per-rank batch needs
                accum_m = math.ceil(per_rank / m)
                return with_teacher(peak(spec, prof, row_precision, budget.gpus, budget.gpus_per_node, micro=m,
                                         accumulation_steps=accum_m, checkpointing=ac, loss=loss,
                                         negatives=negatives, accumulation=accumulation, grad_accum=row_accum,
                                         master=row_master), teacher, budget.gpus, m, accum_m, accumulation)
            lo, hi = 0, per_rank                      # largest m whose peak fits (monotonic in m)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if at(mid).reserved <= budget.gpu_bytes else (lo, mid - 1)
            micro, accum = accumulation_for(per_rank, lo) if lo else (0, 0)
            used = at(max(micro, 1))
            st = step_time(spec, prof, row_precision, ac, max(micro, 1), accum or per_rank, budget, accumulation, hw,
                           loss, negatives, row_comm, teacher)
            over = max(0, used.reserved - budget.gpu_bytes) + cpu_over
            rows.append(Row(name, ac, bool(lo) and not cpu_over, lo, micro, accum, round(used.reserved / GiB, 2),
                            round(used.allocated / GiB, 2), used.phase, round(cpu_node / GiB, 2), st.total,
                            compute_s=st.compute, comm_intra_s=st.comm.intra_s, comm_inter_s=st.comm.inter_s,
                            comm_s=st.comm.total_s, offload_s=st.offload, host_s=st.host,
                            over_gib=round(over / GiB, 2), stage=prof.stage, precision=row_precision,
                            offload=prof.offload_optimizer or prof.offload_param, candidate=candidate, note=note))
    best = min((r.step_s for r in rows if r.fits and r.candidate), default=0.0)
    rows = [replace(r, relative_speed=round(best / r.step_s, 3) if r.fits and r.step_s else 0.0) for r in rows]
    return sorted(rows, key=lambda r: (not r.fits, r.step_s if r.fits else r.over_gib))


def lightness(row: Row) -> int:
    """0: stage 0 (ddp), 1: ZeRO-1/2, 2: ZeRO-3 (the hybrids too), 3: offload -- the order in which stages
    add work."""
    return 3 if row.offload else {0: 0, 1: 1, 2: 1, 3: 2}[row.stage]


def recommend(rows: list[Row]) -> Row | None:
    """The fastest candidate row that fits; a tie (to the microsecond) goes to the lighter stage,
    then the lower stage, the plain profile before a hybrid, the smaller GPU footprint. None if
    nothing fits."""
    fitting = [r for r in rows if r.fits and r.candidate]
    return min(fitting, key=lambda r: (round(r.step_s, 6), lightness(r), r.stage, r.profile in HYBRID,
                                       r.gpu_gib)) if fitting else None


def _mem(n: int) -> str:
    return f"{n / 1e9:g} GB" if n % 10**9 == 0 else f"{n / GiB:.3g} GiB"


def _setting(r: Row) -> str:
    """'at micro 64 (x 4 accumulation) with activation checkpointing'; micro 1 for a row that fits nowhere."""
    batch = f"micro {r.micro or 1}" + (f" (x {r.accumulation} accumulation)" if r.accumulation > 1 else "")
    return f"at {batch}{' with activation checkpointing' if r.checkpointing else ''}"


def _cause(slow: Row, fast: Row) -> str:
    """The term of `slow`'s modelled step that grew most over `fast`'s."""
    terms = {"compute": slow.compute_s - fast.compute_s, "communication": slow.comm_s - fast.comm_s,
             "offload: PCIe and CPU Adam": slow.offload_s - fast.offload_s,
             "ZeRO-3 hooks" if slow.stage == 3 else "host work": slow.host_s - fast.host_s}
    name = max(terms, key=terms.get)
    if name == "compute" and slow.checkpointing and not fast.checkpointing:
        return "the recomputed forward of activation checkpointing"
    if name == "compute" and slow.accumulation > 1 >= fast.accumulation:
        return "the cached forward of 'global' accumulation"
    return name


def reason(best: Row, rows: list[Row], budget: Budget) -> str:
    """One line: why `best` (recommend's pick) won -- the lightest stage that fits (and the nearest
    lighter one that does not), or the fastest with a lighter one named -- and what the next heavier
    stage would cost, named by the term of the step that grows most."""
    fitting = [r for r in rows if r.fits and r.candidate]
    fits = f"fits {budget.gpus} x {_mem(budget.gpu_bytes)} {_setting(best)}"
    lighter = [r for r in fitting if lightness(r) < lightness(best)]
    if lighter:
        r = min(lighter, key=lambda r: r.step_s)
        return (f"{best.profile}: the fastest that {fits}; {r.profile} fits too ({_setting(r)}) but would be "
                f"{r.step_s / best.step_s:.2f}x slower per step ({_cause(r, best)})")
    plain = " (stage 0: plain data parallel, every GPU holds the whole model)" if best.stage == 0 else ""
    parts = [f"{best.profile}: the lightest stage that {fits}{plain}"]
    unfit = [r for r in rows if r.candidate and not r.fits and lightness(r) < lightness(best)]
    if unfit:
        r = min(unfit, key=lambda r: r.over_gib)
        parts.append(f"{r.profile} does not fit ({r.over_gib:.1f} GiB over {_setting(r)})")
    heavier = [r for r in fitting if lightness(r) > lightness(best)]
    # the fastest of each heavier stage in turn (ZeRO-1/2 after ddp, ZeRO-3 after ZeRO-1/2), up to the first one
    # at least 1% slower: on one GPU ddp and ZeRO-1 model the same step (recommend's tie), on several ZeRO-1 sends
    # the updated weights once more (a fraction of a percent of a step inside an NVLink node)
    for level in sorted({lightness(r) for r in heavier}):
        r = min((r for r in heavier if lightness(r) == level), key=lambda r: r.step_s)
        ratio = r.step_s / best.step_s
        if round(r.step_s, 6) == round(best.step_s, 6):
            parts.append(f"{r.profile} fits too, no faster (a tie goes to the lighter stage)")
        elif ratio < 1.01:
            parts.append(f"{r.profile} would be {ratio:.3f}x slower per step ({_cause(r, best)})")
        else:
            parts.append(f"{r.profile} would be {ratio:.2f}x slower per step ({_cause(r, best)})")
            break
    return "; ".join(parts)


@dataclass(frozen=True)
class NearestFit:
    """When nothing fits: the row closest to fitting, and what would make something fit."""
    row: Row
    gpu_over_gib: float
    cpu_over_gib: float
    more_gpus: Budget | None   # the fewest GPUs of this size (doubling) on which a row fits
    more_gpus_row: Row | None  # the recommendation there
    text: str

    def to_dict(self) -> dict:
        return {"row": self.row.to_dict(), "gpu_over_gib": self.gpu_over_gib, "cpu_over_gib": self.cpu_over_gib,
                "gpus_to_fit": self.more_gpus.gpus if self.more_gpus else None,
                "row_with_more_gpus": self.more_gpus_row.to_dict() if self.more_gpus_row else None,
                "text": self.text}


def _shape(b: Budget) -> str:
    mem = _mem(b.gpu_bytes)
    return f"{b.gpus} GPUs of {mem} in one node" if b.nodes == 1 else f"{b.nodes} nodes of {b.gpus_per_node} x {mem}"


def nearest_fit(spec: ModelSpec, budget: Budget, global_batch: int, rows: list[Row], max_gpus: int = 1024,
                **plan_kw) -> NearestFit:
    """For a plan where no candidate fits: the candidate row fewest GiB over (GPU + CPU), what it
    needs, and the fewest GPUs of the same size (doubling, up to ``max_gpus`` and the global batch)
    on which `plan` with ``plan_kw`` finds a fit."""
    near = min([r for r in rows if r.candidate] or rows, key=lambda r: r.over_gib)
    cpu_over = max(0.0, near.cpu_gib_node - budget.cpu_bytes / GiB) if budget.cpu_bytes is not None else 0.0
    gpu_over = round(max(0.0, near.over_gib - cpu_over), 2)
    more = more_row = None
    k = 0
    while more is None:   # 2, 4, 8 ... times the GPUs: a bigger node (up to 8), or more nodes like this one
        k += 1
        gpus = budget.gpus * 2**k
        if gpus > min(max_gpus, global_batch) or global_batch % gpus:
            break
        for b in ([replace(budget, gpus_per_node=gpus)] if budget.nodes == 1 and gpus <= 8 else []) + [
                replace(budget, nodes=budget.nodes * 2**k)]:
            if pick := recommend(plan(spec, b, global_batch, **plan_kw)):
                more, more_row = b, pick
                break
    text = [f"Nothing fits {budget.gpus} x {_mem(budget.gpu_bytes)}"
            + (f" with {_mem(budget.cpu_bytes)} of CPU memory per node" if budget.cpu_bytes is not None else "")
            + f". Nearest: {near.profile} {_setting(near)}, {near.over_gib:.1f} GiB over ("
            + ", ".join([f"{near.gpu_gib:.1f} GiB per GPU" if gpu_over else "the GPU fits"]
                        + ([f"{near.cpu_gib_node:.1f} GiB of CPU per node"] if cpu_over else [])) + ")."]
    fixes = ([f"GPUs of {near.gpu_gib:.1f} GiB or more"] if gpu_over else []) + (
        [f"{near.cpu_gib_node:.1f} GiB of CPU memory per node"] if cpu_over else [])
    if more:
        fixes.append(f"{_shape(more)} ({more_row.profile} {_setting(more_row)})")
    if not any(r.offload for r in rows):
        fixes.append("an offload profile (zero2_offload, zero3_offload)")
    text.append("To fit: " + "; or ".join(fixes + ["train fewer weights (finetune.lock_image, LoRA) or a smaller "
                                                   "model."]))
    return NearestFit(near, gpu_over, round(cpu_over, 2), more, more_row, " ".join(text))

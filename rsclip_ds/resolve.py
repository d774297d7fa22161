"""Every decision a training run makes, made once, before any process group:

    run = load_config("run.yaml", ["profile=zero2"])          # the schema: what a config says on its own
    resolved = resolve(run, load_profile(run.profile), World.from_env(), Device.current())
    ds_config = deepspeed_config(resolved)                    # DeepSpeed's dict, derived from the record

`resolve(config, profile, world, device)` is pure: no file, no environment variable, no device, no process
group (it asks the installed libraries what they have: a torch.compile backend, a monitor's package). The
same inputs give the same `ResolvedRun`, a frozen record of everything the run will do: the batch, what the
ZeRO stage shards and how the gradients are reduced, the precision and every dtype it implies (weights,
matmuls, the accumulation sum, the wire, the masters), who clips and who skips a non-finite step, activation
checkpointing, compilation, leaf modules, threads and loader workers, how a checkpoint is resumed, where each
injected fault strikes. `deepspeed_config` only writes the record in DeepSpeed's words: nothing reads a
decision back from that dict.

Where each rule lives:
- the schema (config.py) holds what a config says on its own -- each field's bounds, and fields that must
  agree with nothing but each other (warmup below steps, bf16.* with bf16, eval.every with something to
  evaluate) -- so that every command refuses them on load;
- every rule that needs the profile, the world or the device lives here, and each refusal is a ConfigError
  naming the fix (`ConfigError.note`: its short form, what `rsclip-ds plan` shows beside a refused row);
- a run learns some facts after start-up: the checkpoint every rank verified and the data position it holds
  (`saved`), the encoder layers of the built model that cannot be ZeRO-3 leaf modules (`unsafe_leaves`).
  Those are inputs of another call, never edits of a record.

Who calls it: the Trainer (assembly.py: it writes {output_dir}/resolved.json and prints the start-up lines
from the record), `rsclip-ds plan` (each row, for GPUs), `rsclip-ds show-config --resolved`, the op census and
the GPU benchmarks (benchmarks/). docs/explanations/architecture.md draws the whole path.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from rsclip_ds.config import ConfigError, RunConfig
from rsclip_ds.distill.config import DistillConfig
from rsclip_ds.faults import FaultPlan
from rsclip_ds.precision import autocast_section, compute_dtype, is_autocast, resolve_precision, uses_fp16, weight_dtype
from rsclip_ds.profiles import PER_NODE, RUN_KEYS, Profile
from rsclip_ds.runtime.compilation import CompileConfig


# --------------------------------------------------------------------------- the inputs

@dataclass(frozen=True)
class World:
    """The ranks of a run: how many, and how many share a node (its cores, its /dev/shm); `local_size`
    None: no launcher said, which only a one-rank world can do without where a profile partitions per node."""
    size: int = 1
    local_size: int | None = None

    @property
    def per_node(self) -> int:
        return self.local_size or 1

    @classmethod
    def from_env(cls) -> "World":
        """What the launcher announced (WORLD_SIZE, LOCAL_SIZE / LOCAL_WORLD_SIZE): known before the process
        group exists."""
        from rsclip_ds.runtime.distributed import launcher_local_world_size, world_size_from_env

        return cls(world_size_from_env(), launcher_local_world_size())


@dataclass(frozen=True)
class Device:
    """What each rank runs on: DeepSpeed's accelerator ('cuda' or 'cpu'), whether it computes in bf16, the CPU
    cores this process may use, and an OMP_NUM_THREADS the environment set (it wins over threads_per_rank=auto)."""
    kind: Literal["cpu", "cuda"] = "cpu"
    bf16: bool = True
    cores: int = 1
    omp_threads: int | None = None

    @property
    def on_gpu(self) -> bool:
        return self.kind != "cpu"

    @classmethod
    def current(cls) -> "Device":
        from rsclip_ds.data.workers import available_cores
        from rsclip_ds.runtime.distributed import accelerator_has_bf16, accelerator_is_gpu

        omp = os.environ.get("OMP_NUM_THREADS", "")
        return cls("cuda" if accelerator_is_gpu() else "cpu", accelerator_has_bf16(), available_cores(),
                   int(omp) if omp.isdigit() and int(omp) > 0 else None)


GPU = Device("cuda", bf16=True, cores=1)   # what `rsclip-ds plan` plans for


@dataclass(frozen=True)
class SavedRun:
    """The checkpoint a run resumes, as its files say (checkpoint.saved_run): its tag, the ranks that wrote it,
    whether ZeRO partitioned its states (stage 0: every rank's file holds the whole model and optimizer), and
    the data streams per rank of its saved position (None until a rank has read it)."""
    tag: str
    world_size: int
    partitioned: bool = True
    streams: int | None = None


# --------------------------------------------------------------------------- the record

@dataclass(frozen=True)
class BatchSizes:
    micro: int          # samples per rank per forward/backward
    accumulation: int   # micro-batches per optimizer step
    world: int          # data-parallel ranks

    @property
    def global_batch(self) -> int:
        return self.micro * self.accumulation * self.world

    def __str__(self) -> str:
        return f"{self.micro} x {self.accumulation} x {self.world} = {self.global_batch}"


@dataclass(frozen=True)
class PrecisionPlan:
    """The precision and what it keeps in which dtype (precision.py's table, for this profile)."""
    name: str                # fp32, bf16, fp16, amp_bf16, amp
    why: str                 # 'as set', or what precision: auto chose and why
    weights: str             # the module's weights and gradients
    compute: str             # the matmuls and most activations
    grad_accum: str          # the sum over micro-batches (DeepSpeed's data_types.grad_accum_dtype)
    wire: str                # the gradients in the reduction (communication_data_type; per layer under autocast)
    masters: str             # the optimizer's master weights and AdamW's moments (bf16.master_weights)
    loss_scale: str | None   # 'deepspeed' (fp16's dynamic scale), 'torch' (amp's GradScaler) or None
    check_grad_overflow: bool   # DeepSpeed's per-tensor inf/NaN test (bf16.check_grad_overflow)
    masters_from_pretrained: bool   # a fresh start from a pretrained folder in 16 bits: masters set from its files


@dataclass(frozen=True)
class GuardPlan:
    """Who skips a step whose gradient norm is not finite (`skips`), who clips (`clips`) and who computes the
    norm (`norm`): 'deepspeed', its optimizer, or 'rsclip', the StepGuard (finite.py; DeepSpeed's
    gradient_clipping is then 0, its zero_optimization.compute_grad_norm false where rsclip_ds computes the norm)."""
    skips: Literal["deepspeed", "rsclip"]
    clips: Literal["deepspeed", "rsclip"]
    reason: str
    norm: Literal["deepspeed", "rsclip"] = "deepspeed"

    @property
    def ours(self) -> bool:
        """Whether a StepGuard is installed: it skips, clips, or both."""
        return "rsclip" in (self.skips, self.clips)


@dataclass(frozen=True)
class ZeroPlan:
    """What the ZeRO stage shards and how the gradients travel."""
    stage: int
    offload_optimizer: bool
    offload_param: bool
    reduction: Literal["none", "rsclip", "deepspeed"]   # who all-reduces the gradients ('none': one rank, stage 0)
    bucket_elements: int           # elements per reduction bucket
    overlap_comm: bool             # as DeepSpeed runs it
    leaf_modules: tuple[str, ...]  # ZeRO-3 leaf module classes (empty: every submodule hooked)
    dropped_leaves: tuple[str, ...]   # the built model's layers that made the profile's leaf modules unsafe
    per_node: dict[str, int]       # profile keys given as the GPUs per node, resolved
    block: dict[str, Any] | None   # zero_optimization as DeepSpeed gets it (None: the profile has none)

    @property
    def shards(self) -> str:
        return {0: "nothing: every rank holds the whole model and optimizer", 1: "the optimizer states",
                2: "the optimizer states and gradients",
                3: "the optimizer states, gradients and parameters"}[self.stage]


@dataclass(frozen=True)
class OptimizerPlan:
    impl: Literal["torch", "deepspeed"]   # torch's fused AdamW, or DeepSpeed's (FusedAdam / DeepSpeedCPUAdam)
    lr: float                  # the peak learning rate after optim.lr_scaling
    clipping: float            # optim.gradient_clipping (0: off)
    clipped_by: Literal["deepspeed", "rsclip"]


@dataclass(frozen=True)
class HostPlan:
    """The host side of a rank: its loader workers (streams of the data schedule) and torch / OpenMP threads."""
    workers: int
    workers_why: str
    threads: int
    threads_why: str


@dataclass(frozen=True)
class ResumePlan:
    """'fresh', 'same' (the ranks that wrote it), 'whole' (another number of ranks, stage 0: every rank's file
    holds everything) or 'universal' (another number of ranks through DeepSpeed's universal checkpoint)."""
    mode: Literal["fresh", "same", "whole", "universal"]
    tag: str | None = None
    saved_world: int | None = None


@dataclass(frozen=True)
class DistillPlan:
    teacher: str
    dtype: str            # distill.dtype resolved for the device
    placement: str
    weight: float


@dataclass(frozen=True)
class LoopPlan:
    """The numbers the training loop runs by (loop.py reads nothing else of a run): the batch, the steps, the
    log and stop-check cadence, the accumulation mode and the non-finite stop."""
    batch: BatchSizes
    steps: int
    log_every: int = 10
    accumulation: Literal["plain", "global"] = "global"
    stop_after: int | None = None
    stop_check_every: int = 10
    max_nonfinite_steps: int = 3
    count_nonfinite: bool = True     # not under fp16, whose loss scaler skips steps by design


@dataclass(frozen=True)
class ResolvedRun:
    """Everything a run decided (module docstring); `to_dict` is {output_dir}/resolved.json."""
    config: RunConfig          # the run config, its precision made concrete
    profile: Profile
    world: World
    device: Device
    batch: BatchSizes
    precision: PrecisionPlan
    zero: ZeroPlan
    optimizer: OptimizerPlan
    guard: GuardPlan
    activation_checkpointing: bool
    activation_checkpointing_why: str
    compiled: bool
    host: HostPlan
    resume: ResumePlan
    faults: FaultPlan
    distill: DistillPlan | None
    monitors: dict[str, Any] = field(default_factory=dict)   # DeepSpeed's monitor sections
    asked: RunConfig | None = field(default=None, compare=False, repr=False)   # the config as given

    @property
    def loop(self) -> LoopPlan:
        c, f = self.config, self.faults
        return LoopPlan(self.batch, c.steps, c.logging.log_every, c.batch.accumulation, c.checkpoint.stop_after,
                        f.stop_check_every, f.max_nonfinite_steps, f.count_nonfinite)

    def to_dict(self) -> dict:
        out = {"profile": {"name": self.profile.name, "path": str(self.profile.path)}}
        for f in ("world", "device", "batch", "precision", "zero", "optimizer", "guard", "activation_checkpointing",
                  "activation_checkpointing_why", "compiled", "host", "resume", "faults", "distill", "monitors"):
            value = getattr(self, f)
            out[f] = asdict(value) if hasattr(value, "__dataclass_fields__") else value
        out["batch"]["global"] = self.batch.global_batch
        out["batch"]["accumulation_mode"] = self.config.batch.accumulation
        out["zero"]["shards"] = self.zero.shards
        return json.loads(json.dumps(out, default=str))

    def step_decisions(self) -> list[str]:
        """What the run decided about the optimizer step on the user's behalf."""
        z, g, run = self.zero, self.guard, self.config
        step = [f"a step whose gradient norm is not finite is skipped by "
                f"{'rsclip_ds' if g.skips == 'rsclip' else 'DeepSpeed'} ({g.reason})"]
        if g.clips == "rsclip" and run.optim.gradient_clipping:
            step.append(f"clipping at {run.optim.gradient_clipping:g} by rsclip_ds's step guard (ds_config.json's "
                        f"gradient_clipping is 0)")
        if z.stage == 0:
            step.append("no gradient all-reduce (one rank)" if z.reduction == "none" else
                        "gradients averaged by rsclip_ds's overlapped all-reduce (buckets of "
                        f"{z.bucket_elements:,} elements; DeepSpeed's stage-0 reduction waits for the whole "
                        "backward and copies every gradient twice)")
        if one_rank_overlap(self.profile, self.world.size):
            step.append(f"overlap_comm off (one rank: ZeRO-{z.stage} has no reduction to overlap, and DeepSpeed "
                        f"would sync the device at every bucket)")
        return step

    def lines(self) -> list[str]:
        """The start-up lines: what the run decided on the user's behalf."""
        p, z = self.precision, self.zero
        out = [f"profile {self.profile.name} (ZeRO-{z.stage}: shards {z.shards}) | precision {p.name}"
               f"{'' if p.why == 'as set' else f' ({p.why})'} | batch micro x accumulation x world = global: "
               f"{self.batch}"]
        out.append("DeepSpeed step: " + "; ".join(self.step_decisions()))
        if z.dropped_leaves:
            out.append(f"ZeRO-3: no leaf modules (the profile's leaf_module): {len(z.dropped_leaves)} trained encoder "
                       f"layer(s) get an input that needs no gradient ({', '.join(z.dropped_leaves)}), which DeepSpeed "
                       f"cannot run as leaves; every submodule is hooked instead (more host time a step, the same "
                       f"math)")
        out.append(f"threads per rank: {self.host.threads} ({self.host.threads_why})")
        if self.host.workers_why:
            out.append(f"data.num_workers=auto: {self.host.workers} worker(s) per rank ({self.host.workers_why})")
        return out


# --------------------------------------------------------------------------- resolve

def resolve(config: RunConfig, profile: Profile, world: World = World(), device: Device = Device(), *,
            saved: SavedRun | None = None, unsafe_leaves: tuple[str, ...] | list[str] = ()) -> ResolvedRun:
    """The run's every decision (module docstring); a ConfigError naming the fix where the run cannot work.
    ``saved``: the checkpoint it resumes; ``unsafe_leaves``: the built model's encoder layers that cannot be
    ZeRO-3 leaf modules (runtime/layers.unsafe_zero3_leaves)."""
    if world.size < 1:
        raise ConfigError(f"world size must be >= 1, got {world.size}")
    run, why = resolve_run_precision(config, profile, device.bf16)
    if profile.cuda_only and not device.on_gpu:
        # DeepSpeed would fail inside engine build or the first backward with "This op had not been
        # implemented on CPU backend"
        raise ConfigError(f"profile {profile.path.name} needs DeepSpeed's CUDA quantizer kernels for "
                          f"{', '.join(profile.cuda_only)}; these ranks run on the CPU accelerator: use "
                          f"zero3_hpz or zero3 here, {profile.name} on GPUs")
    check_precision_for_stage(run.precision, profile)
    batch = derive_batch(run, world.size)
    precision = _precision(run, profile, why, saved)
    guard = guard_plan(run, profile)
    optimizer = OptimizerPlan("deepspeed" if _uses_deepspeed_adam(run, profile, device) else "torch",
                              scaled_lr(run, world.size), run.optim.gradient_clipping,
                              "rsclip" if guard.clips == "rsclip" else "deepspeed")
    bf16_master_flags(run, profile, optimizer.impl == "torch")
    zero = _zero(run, profile, world, guard, tuple(unsafe_leaves))
    ac, ac_why = activation_checkpointing(run, profile)
    refused = compile_refusal(run.compile, zero.stage, device.on_gpu)
    if refused:
        raise ConfigError(refused)
    resolved = ResolvedRun(
        config=run, profile=profile, world=world, device=device, batch=batch, precision=precision, zero=zero,
        optimizer=optimizer, guard=guard, activation_checkpointing=ac, activation_checkpointing_why=ac_why,
        compiled=run.compile.enabled, host=_host(run, world, device, saved),
        resume=_resume(saved, world), faults=fault_plan(run, world), distill=_distill(run, zero.stage, device),
        monitors=monitor_sections(run, profile), asked=config)
    _check_worker_faults(resolved)
    _check_profile_values(resolved)
    return resolved


def build_ds_config(run: RunConfig, profile: Profile, world_size: int, *, on_gpu: bool,
                    local_world_size: int | None = None) -> dict[str, Any]:
    """`deepspeed_config(resolve(...))` for a world of ``world_size`` ranks, ``local_world_size`` per node (None:
    what the launcher announced), on GPUs or CPU ranks: the form the tests and `rsclip-ds plan --write-config`
    use."""
    if local_world_size is None:
        from rsclip_ds.runtime.distributed import launcher_local_world_size

        local_world_size = launcher_local_world_size()
    device = Device("cuda" if on_gpu else "cpu")
    return deepspeed_config(resolve(run, profile, World(world_size, local_world_size), device))


# --------------------------------------------------------------------------- batch and learning rate

def derive_batch(run: RunConfig, world_size: int) -> BatchSizes:
    """The one place where the global batch is computed (micro x accumulation x world)."""
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    return BatchSizes(run.batch.micro_batch_size, run.batch.gradient_accumulation_steps, world_size)


def scaled_lr(run: RunConfig, world_size: int) -> float:
    factor = {"none": 1.0, "linear": float(world_size), "sqrt": math.sqrt(world_size)}
    return run.optim.lr * factor[run.optim.lr_scaling]


# --------------------------------------------------------------------------- precision

def resolve_run_precision(run: RunConfig, profile: Profile, bf16_supported: bool = True) -> tuple[RunConfig, str]:
    """The run with `precision: auto` made concrete for its profile (precision.resolve_precision), and why.
    A bf16.* setting made on purpose asks for bf16 weights: auto then means bf16. Idempotent."""
    if run.precision != "auto":
        return run, "as set"
    b = run.bf16
    if b.master_weights != "fp32" or b.grad_accum_dtype != "auto" or b.check_grad_overflow:
        picked, why = "bf16", "auto: bf16, which the bf16.* settings of this run are for"
    else:
        picked, why = resolve_precision("auto", profile.stage, bf16_supported)
    return run.model_copy(update={"precision": picked}), why


def check_precision_for_stage(precision: str, profile: Profile) -> None:
    """The precision x stage pairs a run refuses (ConfigError, `note` its short form for the planner)."""
    if precision == "amp" and profile.stage > 0:
        # measured (ZeRO-1/2/3, 0.19.8): its ZeRO optimizers step torch's GradScaler without ever scaling the
        # loss, and every step's gradient norm came out inf and was skipped
        raise ConfigError(f"precision=amp (fp16 autocast with a gradient scaler) needs stage 0 ({profile.path.name} "
                          f"has ZeRO-{profile.stage}): DeepSpeed 0.19.8's ZeRO optimizers do not scale the loss under "
                          f"fp16 autocast, and every step is skipped. Use --set profile=ddp, or precision=amp_bf16 "
                          f"(bf16 needs no scaler), or precision=fp16 (DeepSpeed's loss scaler) with ZeRO",
                          note="precision=amp runs at stage 0 only (under ZeRO DeepSpeed skips every fp16-autocast "
                               "step)")
    if profile.stage == 0 and precision in ("bf16", "fp16"):
        # measured (benchmarks/census.py, tiny and git-rsclip-base shapes): 93 host syncs a step, and a first
        # update 0.74x of AdamW's (its state initialisation takes a step on zero gradients)
        amp = "amp_bf16" if precision == "bf16" else "amp"
        raise ConfigError(f"precision={precision} at stage 0 ({profile.path.name}) runs DeepSpeed 0.19.8's "
                          f"FP16_UnfusedOptimizer, which reads every gradient tensor on the host each step and starts "
                          f"AdamW one step ahead (its first updates come out about 0.74x). Use --set "
                          f"precision={amp} (fp32 weights under autocast: the plain loop's recipe) or fp32, or a ZeRO "
                          f"profile (zero1, zero2) for {precision} weights",
                          note=f"precision={precision} at stage 0 runs DeepSpeed's FP16_UnfusedOptimizer (a host sync "
                               f"per gradient, AdamW a step ahead): refused, use {amp}")
    if is_autocast(precision) and profile.strategy.get("zero_optimization", {}).get("zero_quantized_weights"):
        raise ConfigError(f"precision={precision} with {profile.path.name}: DeepSpeed refuses torch autocast with qwZ "
                          f"(zero_quantized_weights); use precision=bf16, or a profile without qwZ (zero3_hpz)",
                          note=f"DeepSpeed refuses torch autocast ({precision}) with qwZ (zero_quantized_weights)")


def _precision(run: RunConfig, profile: Profile, why: str, saved: SavedRun | None) -> PrecisionPlan:
    p = run.precision
    return PrecisionPlan(
        name=p, why=why, weights=weight_dtype(p), compute=compute_dtype(p), grad_accum=grad_accum_dtype(run, profile),
        wire=communication_dtype(run, profile), masters=run.bf16.master_weights if p == "bf16" else "fp32",
        loss_scale="deepspeed" if p == "fp16" else ("torch" if p == "amp" else None),
        check_grad_overflow=p == "bf16" and run.bf16.check_grad_overflow,
        masters_from_pretrained=saved is None and weight_dtype(p) != "fp32" and run.model.pretrained is not None)


def auto_grad_accum_dtype(profile: Profile, accumulation: int) -> str:
    """What bf16.grad_accum_dtype='auto' means for a profile at ``accumulation`` micro-batches a step. The rule
    (docs/guides/precision.md, measured: docs/results/training.md#grad-accum): fp32 where, at k = 8
    micro-batches, it brings the gradient closer to the fp32 big-batch one (it does at every stage) AND
    costs at most 2 bytes per trainable parameter / G of GPU memory and no bytes on the wire. ZeRO-2 and
    ZeRO-3 pass: their gradient partition becomes fp32 (and the step's fp32 copy of it goes away); with
    ZeRO-3's optimizer offload that partition is in CPU memory. ZeRO-1 does not: DeepSpeed then swaps in
    its BF16_Optimizer, which keeps a whole fp32 gradient copy (4 bytes per parameter) on every GPU. ZeRO-2
    with optimizer offload does not either: a 4-byte partition appears on the GPU. At k = 1 there is nothing
    to sum: the fp32 partition holds the same numbers as the bf16 one (a bf16 value is exact in fp32), for a
    cast and an add per gradient tensor (census, git-rsclip-base shape: ZeRO-2 1.51x the twin's bytes and
    8.2x its Python calls in fp32, 1.40x and 4.7x in bf16), so bf16."""
    if accumulation > 1 and (profile.stage == 3 or (profile.stage == 2 and not profile.offload_optimizer)):
        return "fp32"
    return "bf16"


def bf16_accumulation(choice: str, master: str, profile: Profile, accumulation: int) -> str:
    """bf16.grad_accum_dtype ``choice`` for a bf16 run with ``master`` weights at ``accumulation`` micro-batches:
    'auto' is the profile's rule (auto_grad_accum_dtype), bf16 with bf16 masters -- the mode exists to save
    bytes, and the sum is rounded to bf16 for the step anyway (the master's gradient has
    master_weights_and_grads_dtype); an explicit fp32 sum works at ZeRO-2/3 with and without offload
    (measured), for 2 more bytes per parameter / G. The planner's memory model asks this too."""
    if choice != "auto":
        return choice
    return "bf16" if master == "bf16" else auto_grad_accum_dtype(profile, accumulation)


def grad_accum_dtype(run: RunConfig, profile: Profile) -> str:
    """DeepSpeed's data_types.grad_accum_dtype for this run: bf16.grad_accum_dtype resolved for bf16
    runs, the precision's weight dtype otherwise (what DeepSpeed does when it is unset). Raises ConfigError
    where DeepSpeed 0.19.8 would refuse the pair, or silently not do what was asked, naming the fix."""
    if run.precision != "bf16":
        return weight_dtype(run.precision)   # amp: the fp32 weights' gradients
    dtype = bf16_accumulation(run.bf16.grad_accum_dtype, run.bf16.master_weights, profile,
                              run.batch.gradient_accumulation_steps)
    zero = profile.strategy.get("zero_optimization", {})
    if dtype == "fp32" and profile.stage == 1 and not profile.offload_optimizer and run.bf16.master_weights == "bf16":
        # measured: DeepSpeed then builds its BF16_Optimizer, which ignores bf16_master_weights_and_grads
        # and keeps fp32 masters and fp32 AdamW states (16 bytes per parameter, what the mode removes)
        raise ConfigError(f"bf16.master_weights=bf16 with bf16.grad_accum_dtype=fp32 at ZeRO-1 ({profile.path.name}) "
                          f"silently keeps fp32 masters (DeepSpeed swaps in its BF16_Optimizer); use "
                          f"--set bf16.grad_accum_dtype=auto (bf16), or a ZeRO-2/3 profile (zero2, zero3) for an fp32 sum")
    if dtype == "fp32" and profile.stage == 1 and not profile.offload_optimizer and \
            zero.get("compute_grad_norm", True) is False:
        # ZeRO-1 + bf16 + fp32 accumulation is DeepSpeed's BF16_Optimizer, which needs the norm
        raise ConfigError(f"bf16.grad_accum_dtype=fp32 at ZeRO-1 runs DeepSpeed's BF16_Optimizer, which needs "
                          f"zero_optimization.compute_grad_norm: remove compute_grad_norm=false from "
                          f"{profile.path.name}, or --set bf16.grad_accum_dtype=bf16")
    from deepspeed.runtime.config import DtypeEnum

    DtypeEnum(dtype)   # DeepSpeed's own parser of the value
    return dtype


def communication_dtype(run: RunConfig, profile: Profile) -> str:
    """DeepSpeed's communication_data_type for this run, always written (the resolved ds_config.json
    shows the gradients' dtype on the wire): wire_dtype of distributed.communication_data_type,
    else the precision (what DeepSpeed does when the key is unset)."""
    if is_autocast(run.precision):
        choice = run.distributed.communication_data_type
        if choice != "auto":
            # DeepSpeed's ZeRO then reduces each parameter in its own comm_dtype and never reads this key
            raise ConfigError(f"distributed.communication_data_type={choice} with precision={run.precision}: under "
                              f"torch.autocast the wire dtype is per layer -- {compute_dtype(run.precision)} for the "
                              f"layers autocast runs in {compute_dtype(run.precision)} (Linear, Conv), fp32 for the "
                              f"rest -- so only auto is allowed; for one dtype on the wire use precision=bf16 or fp32",
                              note=f"communication_data_type={choice} is refused under autocast")
        return "fp32"   # the fp32 parameters outside AUTOCAST_MODULES; those inside go in compute_dtype
    return wire_dtype(run.distributed.communication_data_type, profile) or run.precision


def wire_dtype(choice: str, profile: Profile) -> str | None:
    """distributed.communication_data_type ``choice`` -> DeepSpeed's communication_data_type for this run (None:
    unset, DeepSpeed then reduces in the training precision). ZeRO++ qgZ (zero_quantized_gradients) needs fp16:
    with more than one node ZeRO-3 hands each gradient, cast to this dtype, to all_to_all_quant_reduce, whose
    swizzle_quant kernel reads its input as __half (DeepSpeed 0.19.8, ops/csrc/quantization/pt_binding.cpp).
    A bf16 gradient would be read as an fp16 bit pattern (1e-3 becomes ~0.81: exponent bits misread, no error),
    an fp32 one as two halves. So auto means fp16 under qgZ and any other choice is refused. fp16 holds bf16
    gradients to 3 more mantissa bits; beyond +-65504 they become inf (the non-finite guard stops the run) --
    the int4 quantization that follows loses far more."""
    qgz = profile.strategy.get("zero_optimization", {}).get("zero_quantized_gradients", False)
    if qgz and choice not in ("auto", "fp16"):
        raise ConfigError(f"distributed.communication_data_type={choice} with ZeRO++ qgZ ({profile.path.name}: "
                          f"zero_quantized_gradients): DeepSpeed's quantizer kernel reads gradients as fp16 only, "
                          f"so {choice} gradients would be misread without an error; use "
                          f"--set distributed.communication_data_type=auto (fp16), or a profile without qgZ "
                          f"(zero3_hpz) to reduce in {choice}", note=f"qgZ reduces in fp16 only, not {choice}")
    if qgz:
        return "fp16"
    return None if choice == "auto" else choice


def bf16_master_flags(run: RunConfig, profile: Profile, torch_adam: bool) -> dict[str, bool]:
    """bf16.master_weights -> the keys of DeepSpeed's bf16 block: 'bf16' turns on both
    bf16_master_weights_and_grads (the optimizer's master partition and its gradient in bf16) and
    bf16_optimizer_states (AdamW's m and v in bf16); 'fp32' adds nothing (DeepSpeed's defaults).
    Raises ConfigError where DeepSpeed 0.19.8 refuses the mode (``torch_adam``: the optimizer is
    torch's AdamW, not DeepSpeed's), naming the fix."""
    if run.precision != "bf16" or run.bf16.master_weights == "fp32":
        return {}
    if profile.offload_optimizer and torch_adam:
        # base_optimizer._configure_master_weights: offloaded bf16 masters need DeepSpeedCPUAdam (which
        # DeepSpeed then builds with fp32_optimizer_states=False); torch's AdamW fails an assert
        raise ConfigError(f"bf16.master_weights=bf16 with optimizer offload ({profile.path.name}) needs DeepSpeed's "
                          f"CPU Adam: --set optim.impl=deepspeed (optim.impl=auto picks it on GPUs only; "
                          f"JIT-built on first use), or a profile without offload (zero2, zero3)")
    return {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def _uses_deepspeed_adam(run: RunConfig, profile: Profile, device: Device) -> bool:
    """optim.impl: 'auto' picks DeepSpeed's CPU Adam for GPU runs with optimizer offload (torch's AdamW on the
    CPU would be the bottleneck there), torch's fused AdamW everywhere else."""
    impl = run.optim.impl
    return impl == "deepspeed" or (impl == "auto" and device.on_gpu and profile.offload_optimizer)


# --------------------------------------------------------------------------- the step guard

def guard_plan(run: RunConfig, profile: Profile) -> GuardPlan:
    """Who skips a step whose gradient norm is not finite in this run, DeepSpeed or rsclip_ds's step
    guard (plan_guard); a ConfigError where nothing would."""
    run, _ = resolve_run_precision(run, profile)
    zero = profile.strategy.get("zero_optimization", {})
    return plan_guard(run.precision, profile.stage, check_grad_overflow=run.bf16.check_grad_overflow,
                      grad_accum=grad_accum_dtype(run, profile), offload=profile.offload_optimizer,
                      compute_grad_norm=zero.get("compute_grad_norm", True) is not False, profile=profile.path.name)


def plan_guard(precision: str, stage: int, *, check_grad_overflow: bool, grad_accum: str, offload: bool,
               compute_grad_norm: bool, profile: str) -> GuardPlan:
    """The guard of a run (finite.py's table; amp_bf16 keeps fp32 weights, so DeepSpeed treats it as fp32). At
    ZeRO-1/2 without offload rsclip_ds computes the norm too (DeepSpeed's compute_grad_norm off), so a profile's
    compute_grad_norm=false is what it runs anyway; with offload, where DeepSpeed refuses it, it is a
    ConfigError naming the fix."""
    if precision == "fp16":
        return GuardPlan("deepspeed", "deepspeed", "fp16: DeepSpeed's loss scaler tests every gradient and skips the step")
    if precision == "amp":   # stage 0 only (check_precision_for_stage refuses it under ZeRO)
        return GuardPlan("rsclip", "rsclip", "amp at stage 0: DeepSpeed's torch GradScaler hands the fused AdamW its "
                                             "scale and skips on device without telling the engine; rsclip_ds reads "
                                             "the unscaled norm once per step, skips such a step (the scaler still "
                                             "halves its scale) and clips")
    if stage == 3:
        return GuardPlan("deepspeed", "deepspeed", "ZeRO-3 tests the step's gradient norm and skips the step")
    if stage == 0:   # fp32, amp_bf16 (bf16 and fp16 are refused there: check_precision_for_stage)
        return GuardPlan("rsclip", "rsclip", f"stage 0 {precision}: DeepSpeed steps torch's AdamW as it is; "
                                             f"rsclip_ds computes the norm (one foreach norm), clips and skips")
    if not offload and not check_grad_overflow and not (precision == "bf16" and stage == 1 and grad_accum == "fp32"):
        # DeepSpeed's ZeRO-1/2 norm casts every gradient tensor to fp64 and takes its norm one by one (two ops and
        # 10 bytes per element a step); its clipping reads the norm on the host once per parameter group
        return GuardPlan("rsclip", "rsclip", f"ZeRO-{stage} {precision}: rsclip_ds computes the gradient norm (one "
                                             f"foreach norm over the partition, in fp32), reads it once per step, "
                                             f"skips a step whose norm is not finite and clips, in DeepSpeed's "
                                             f"place", norm="rsclip")
    ours_clip = ("rsclip_ds clips in DeepSpeed's place with its formula (DeepSpeed's clipping reads the norm on the "
                 "host once per parameter group)")
    if not compute_grad_norm and offload:   # under offload the norm is DeepSpeed's (rsclip_ds computes none)
        raise ConfigError(f"profile {profile} sets zero_optimization.compute_grad_norm=false with optimizer offload, "
                          f"which DeepSpeed refuses and where nothing else would test the gradients: remove "
                          f"compute_grad_norm from the profile")
    if precision in ("fp32", "amp_bf16"):
        return GuardPlan("deepspeed", "rsclip", f"ZeRO-{stage} {precision} (fp32 weights): DeepSpeed tests the "
                                                f"step's gradient norm and skips the step; {ours_clip}")
    if check_grad_overflow:
        return GuardPlan("deepspeed", "deepspeed", "bf16.check_grad_overflow=true: DeepSpeed tests every gradient "
                                                   "tensor and the norm, and clips")
    if stage == 1 and grad_accum == "fp32" and not offload:
        return GuardPlan("deepspeed", "deepspeed", "ZeRO-1 bf16 with fp32 accumulation runs DeepSpeed's "
                                                   "BF16_Optimizer, which tests the norm")
    return GuardPlan("rsclip", "rsclip", f"ZeRO-{stage} bf16: DeepSpeed applies a step whose norm is not finite "
                                         f"unless its per-tensor check is on; rsclip_ds reads the norm once per step "
                                         f"and skips such a step; {ours_clip}")


# --------------------------------------------------------------------------- ZeRO

def _zero(run: RunConfig, profile: Profile, world: World, guard: GuardPlan, unsafe: tuple[str, ...]) -> ZeroPlan:
    strategy = profile.strategy.get("zero_optimization")
    block = None
    per_node: dict[str, int] = {}
    if strategy is not None:
        block = resolve_per_node(profile, world.size, world.local_size)
        per_node = {k: block[k] for k, v in strategy.items() if v == PER_NODE}
        if guard.norm == "rsclip":   # the step guard computes the norm (finite.partition_norm)
            block["compute_grad_norm"] = False
        if one_rank_overlap(profile, world.size):
            block["overlap_comm"] = False
        if unsafe and profile.stage == 3 and block.get("leaf_module"):
            del block["leaf_module"]   # every submodule hooked: slower on the host, the same math
    zero = block or {}
    stage = profile.stage
    leaves = zero.get("leaf_module") or {}
    return ZeroPlan(
        stage=stage, offload_optimizer=profile.offload_optimizer, offload_param=profile.offload_param,
        reduction="deepspeed" if stage else ("rsclip" if world.size > 1 else "none"),
        bucket_elements=int(zero.get("reduce_bucket_size", 10**7 if stage == 0 else 5 * 10**8)),
        overlap_comm=bool(zero.get("overlap_comm", stage == 3)),
        leaf_modules=tuple(leaves.get("classes", ())) if isinstance(leaves, dict) else tuple(leaves),
        dropped_leaves=unsafe if stage == 3 and (strategy or {}).get("leaf_module") else (),
        per_node=per_node, block=block)


def resolve_per_node(profile: Profile, world_size: int, local_world_size: int | None) -> dict[str, Any]:
    """The profile's zero_optimization with every PER_NODE value replaced by ``local_world_size``
    (ranks per node; None: unknown, which only a one-rank world can do without). Raises ConfigError
    when the world is not whole nodes of that size: DeepSpeed would fail an assert in
    _ensure_divisibility, or build partition groups that cross nodes."""
    zero = copy.deepcopy(dict(profile.strategy.get("zero_optimization", {})))
    keys = sorted(k for k, v in zero.items() if v == PER_NODE)
    if not keys:
        return zero
    if local_world_size is None and world_size == 1:
        local_world_size = 1
    if local_world_size is None:
        # guessing 1 would switch hpZ off without a word, in a config written for a cluster
        raise ConfigError(f"profile {profile.path.name} sets {keys} to the GPUs per node ({PER_NODE}), and no "
                          f"launcher said how many ranks run per node (LOCAL_SIZE / LOCAL_WORLD_SIZE): launch "
                          f"with deepspeed or torchrun, or pass local_world_size to build_ds_config")
    if local_world_size < 1 or world_size % local_world_size:
        raise ConfigError(f"profile {profile.path.name} sets {keys} to the GPUs per node ({PER_NODE}), but "
                          f"{world_size} ranks are not whole nodes of {local_world_size}: launch the same number "
                          f"of GPUs on every node (hostfile slots, --num_gpus), or use a profile without "
                          f"per-node partitions (zero3)")
    return {**zero, **{k: local_world_size for k in keys}}


def one_rank_overlap(profile: Profile, world_size: int) -> bool:
    """Whether the run turns the profile's overlap_comm off: ZeRO-1/2 on one rank, where there is no
    reduction to overlap with. DeepSpeed 0.19.8's ZeRO-1/2 with overlap_comm waits for the whole device
    (accelerator.synchronize()) before each gradient bucket's reduction and at the end of the backward,
    stalling the host's run-ahead of the GPU, and keeps a second bucket. ZeRO-3 keeps it (its prefetch of
    the next layer's weights uses the side stream)."""
    zero = profile.strategy.get("zero_optimization", {})
    return world_size == 1 and profile.stage in (1, 2) and bool(zero.get("overlap_comm"))


# --------------------------------------------------------------------------- the model's switches

def activation_checkpointing(run: RunConfig, profile: Profile) -> tuple[bool, str]:
    """The run config wins when set; otherwise the profile decides -> (on, why)."""
    ac = run.model.activation_checkpointing
    if ac is None:
        return profile.activation_checkpointing, f"profile {profile.name}'s rsclip.activation_checkpointing"
    return ac, "model.activation_checkpointing"


def activation_checkpointing_enabled(run: RunConfig, profile: Profile) -> bool:
    return activation_checkpointing(run, profile)[0]


def compile_refusal(cfg: CompileConfig, zero_stage: int, on_gpu: bool) -> str | None:
    """Why compile.* cannot work with this run (with the fix), or None when it can."""
    if not cfg.enabled:
        return None
    from rsclip_ds.runtime.compilation import available_backends

    backends = available_backends()
    if cfg.backend not in backends:
        return (f"compile.backend={cfg.backend!r} is not a torch.compile backend here; choose one of "
                f"{', '.join(sorted(b for b in backends if not b.endswith('TESTING_ONLY')))}")
    if zero_stage == 3 and cfg.scope == "model":
        # torch.compile of the whole module traces ZeRO-3's partitioned parameters (0-element
        # placeholders that DeepSpeed's hooks gather only around each submodule's forward): measured
        # here, "RuntimeError: b must be 2D" in the attention-pooling head's in_proj. The layers scope
        # compiles inside the hooks, on gathered parameters (runtime/compilation.py).
        return ("compile.scope=model does not work with ZeRO-3: torch.compile of the whole module traces the "
                "partitioned (empty) parameters that ZeRO-3 gathers only around each submodule's forward "
                "(measured: 'b must be 2D' in the attention-pooling head). Use compile.scope=layers (the "
                "default), or profile=zero1/zero2 for scope=model")
    if cfg.mode in ("reduce-overhead", "max-autotune") and not on_gpu:
        return (f"compile.mode={cfg.mode} captures CUDA graphs, which CPU ranks do not have: drop "
                f"compile.mode, or use 'max-autotune-no-cudagraphs'")
    if cfg.mode is not None and cfg.backend != "inductor":
        return f"compile.mode={cfg.mode} is an inductor option: set compile.backend=inductor or drop compile.mode"
    return None


# --------------------------------------------------------------------------- distillation

def teacher_dtype(choice: str, device: Device) -> str:
    """distill.dtype: 'auto' is bf16 on a GPU with bf16, fp16 on an older GPU, fp32 on CPU ranks."""
    if choice != "auto":
        return choice
    if not device.on_gpu:
        return "fp32"
    return "bf16" if device.bf16 else "fp16"


def teacher_placement(cfg: DistillConfig, zero_stage: int) -> None:
    """distill.* without a teacher, and zero3 placement without a ZeRO-3 student, are refused."""
    if cfg.teacher is None:
        if cfg.placement != "replicated" or cfg.dtype != "auto" or cfg.revision is not None:
            raise ConfigError("distill.* is set but distill.teacher is not: name the teacher "
                              "(--set distill.teacher=FOLDER_OR_HUB_ID) or drop the other distill keys")
        return
    if cfg.placement == "zero3" and zero_stage != 3:
        raise ConfigError(f"distill.placement=zero3 partitions the teacher like a ZeRO-3 student, but the profile "
                          f"is ZeRO stage {zero_stage}: use --set profile=zero3 (or zero3_offload), or "
                          "distill.placement=replicated")


def _distill(run: RunConfig, zero_stage: int, device: Device) -> DistillPlan | None:
    teacher_placement(run.distill, zero_stage)
    d = run.distill
    if d.teacher is None:
        return None
    return DistillPlan(d.teacher, teacher_dtype(d.dtype, device), d.placement, d.weight)


# --------------------------------------------------------------------------- host, resume, faults

def auto_num_workers(cores: int, local_ranks: int) -> int:
    """data.num_workers=auto: the node's cores shared by its ranks, one core of each share left to the rank's
    own process (it receives the batches and drives the device), at least 1."""
    return max(1, cores // max(1, local_ranks) - 1)


def loader_workers(num_workers: int | str, cores: int, local_ranks: int, saved_streams: int | None = None
                   ) -> tuple[int, str]:
    """Workers per rank for data.num_workers (a number or 'auto'), and why ('' for a number): 'auto' is
    auto_num_workers, but keeps a saved data position's count, which exact resume needs (``saved_streams``)."""
    if num_workers != "auto":
        return int(num_workers), ""
    mine = auto_num_workers(cores, local_ranks)
    if saved_streams is not None and saved_streams != mine:
        return saved_streams, (f"the saved data position's count, which exact resume needs; {cores} core(s) for "
                               f"{local_ranks} rank(s) here would give {mine}")
    return mine, f"{cores} core(s) for {local_ranks} rank(s) on this node, less one per rank for its own process"


def threads_per_rank(setting: int | str, device: Device, local_ranks: int, workers: int) -> tuple[int, str]:
    """distributed.threads_per_rank: a number wins; then an OMP_NUM_THREADS the environment set; 'auto' shares
    the node's cores among its ranks less each rank's loader workers (each a process of one torch thread,
    busy while the rank computes), at least 1. 8 ranks on 96 cores with 3 workers each: 12 - 3 = 9 threads;
    num_workers=auto (11 each): 1."""
    if setting != "auto":
        return int(setting), "distributed.threads_per_rank"
    if device.omp_threads:
        return device.omp_threads, "OMP_NUM_THREADS from the environment"
    threads = auto_threads_per_rank(device.cores, local_ranks, workers)
    return threads, f"{device.cores} core(s) / {local_ranks} rank(s) on this node, less {workers} loader worker(s)"


def auto_threads_per_rank(cores: int, local_ranks: int, workers: int) -> int:
    """threads_per_rank=auto: the node's cores shared by its ranks, less the rank's loader workers, at least 1."""
    return max(1, cores // max(1, local_ranks) - workers)


def _host(run: RunConfig, world: World, device: Device, saved: SavedRun | None) -> HostPlan:
    workers, workers_why = loader_workers(run.data.num_workers, device.cores, world.per_node,
                                          saved.streams if saved else None)
    threads, threads_why = threads_per_rank(run.distributed.threads_per_rank, device, world.per_node, workers)
    return HostPlan(workers, workers_why, threads, threads_why)


def _resume(saved: SavedRun | None, world: World) -> ResumePlan:
    if saved is None:
        return ResumePlan("fresh")
    if saved.world_size == world.size:
        return ResumePlan("same", saved.tag, saved.world_size)
    return ResumePlan("universal" if saved.partitioned else "whole", saved.tag, saved.world_size)


def fault_plan(run: RunConfig, world: World) -> FaultPlan:
    f, last = run.faults, world.size - 1
    for key in ("inject_data_delay_rank", "inject_rank", "inject_enospc_rank"):
        rank = getattr(f, key)
        if rank is not None and rank >= world.size:
            raise ConfigError(f"faults.{key}={rank}, but the run has {world.size} rank(s): name a rank "
                              f"below that")
    pick = lambda rank: last if rank is None else rank   # noqa: E731 -- the last rank unless one is named
    return FaultPlan(
        stop_check_every=f.stop_check_every, max_nonfinite_steps=f.max_nonfinite_steps,
        count_nonfinite=not uses_fp16(run.precision), last_rank=last, rank=pick(f.inject_rank),
        data_delay_rank=pick(f.inject_data_delay_rank), enospc_rank=pick(f.inject_enospc_rank),
        nan_at_step=f.inject_nan_at_step, nan_steps=f.inject_nan_steps, nan_value=f.inject_nan_value,
        kill_at_step=f.inject_kill_at_step, freeze_at_step=f.inject_freeze_at_step,
        data_delay_s=f.inject_data_delay_s, error_at_step=f.inject_error_at_step,
        worker_kill_at_step=f.inject_worker_kill_at_step, kill_in_save_at_step=f.inject_kill_in_save_at_step,
        enospc_in_save_at_step=f.inject_enospc_in_save_at_step)


def _check_worker_faults(r: ResolvedRun) -> None:
    if r.faults.worker_kill_at_step and r.host.workers == 0:
        raise ConfigError("faults.inject_worker_kill_at_step needs a DataLoader worker: set data.num_workers >= 1")


# --------------------------------------------------------------------------- monitors

# logging.<switch> -> (DeepSpeed's section, the folder under {output_dir}/monitor, the package it needs)
MONITORS = {"tensorboard": ("tensorboard", "tensorboard", "tensorboard"),
            "csv": ("csv_monitor", "csv", None),
            "wandb": ("wandb", "wandb", "wandb")}


def monitor_sections(run: RunConfig, profile: Profile) -> dict[str, Any]:
    """logging.tensorboard / csv -> DeepSpeed's monitor sections, writing under
    {output_dir}/monitor/<kind> (DeepSpeed joins output_path and job_name); logging.wandb adds none
    (reporting.wandb_log writes the W&B run), only its checks. A profile's own
    `tensorboard` / `csv_monitor` section keeps working when the switch is off; both at once is
    an error (two places deciding where one monitor writes). A missing package fails here, not
    inside deepspeed.initialize on rank 0."""
    sections: dict[str, Any] = {}
    root = Path(run.output_dir) / "monitor"
    for switch, (section, folder, package) in MONITORS.items():
        if not getattr(run.logging, switch):
            continue
        if section in profile.strategy:
            raise ConfigError(f"logging.{switch}=true and profile {profile.path.name} has its own {section!r} "
                              f"section: remove the section from the profile (the run then writes under "
                              f"{root}/{folder}), or --set logging.{switch}=false to keep the profile's")
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"logging.{switch}=true needs the {package!r} package: pip install {package} "
                              f"(or --set logging.{switch}=false)")
        # wandb: no DeepSpeed section. Its W&B monitor logs at the sample count as W&B's step, which
        # hides every event at our optimizer step; rank 0 writes the run itself (reporting.wandb_log)
        if switch != "wandb":
            sections[section] = {"enabled": True, "output_path": str(root), "job_name": folder}
    return sections


# --------------------------------------------------------------------------- DeepSpeed's words

def _run_keys(r: ResolvedRun) -> dict[str, Any]:
    """The per-run keys of DeepSpeed's dict (profiles.RUN_KEYS), as the run config gives them."""
    run, p, o = r.config, r.precision, r.config.optim
    torch_adam = r.optimizer.impl == "torch"
    values: dict[str, Any] = {
        "train_batch_size": r.batch.global_batch,
        "train_micro_batch_size_per_gpu": r.batch.micro,
        "gradient_accumulation_steps": r.batch.accumulation,
        "gradient_clipping": o.gradient_clipping,
        "optimizer": {"type": "AdamW", "params": {
            "lr": r.optimizer.lr, "betas": list(o.betas), "eps": o.eps,
            "weight_decay": o.weight_decay, "torch_adam": torch_adam}},
        "bf16": {"enabled": p.name == "bf16"},
        "fp16": {"enabled": p.name == "fp16"},
        **autocast_section(p.name),   # amp_bf16 / amp: fp32 weights, torch.autocast in the forward
    }
    if torch_adam:
        # torch's fused AdamW (CPU and CUDA kernels): one pass over each flat ZeRO partition in
        # place; foreach, DeepSpeed's default, makes partition-sized temporaries every step
        values["optimizer"]["params"]["fused"] = True
    if p.name == "bf16":
        # DeepSpeed 0.19.8 tests every gradient tensor for inf/NaN (amax, amin, isfinite) each step
        # unless told not to; the run's guard reads the step's gradient norm instead (finite.py)
        values["bf16"]["check_grad_overflow"] = p.check_grad_overflow
    if p.name == "fp16":
        f = run.fp16
        values["fp16"].update(loss_scale=0, initial_scale_power=f.initial_scale_power,
                              loss_scale_window=f.loss_scale_window, hysteresis=f.hysteresis,
                              min_loss_scale=f.min_loss_scale)
    values["data_types"] = {"grad_accum_dtype": p.grad_accum}
    values["communication_data_type"] = p.wire
    if p.masters == "bf16":
        values["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    return values


def _check_profile_values(r: ResolvedRun) -> None:
    """A profile may repeat a per-run value only if it agrees (profiles.py); the error names both sides."""
    values = _run_keys(r)
    for key, theirs in r.profile.run_values.items():
        if theirs != values.get(key):
            raise ConfigError(
                f"profile {r.profile.path.name} sets {key}={json.dumps(theirs)} but the run config gives "
                f"{json.dumps(values.get(key))} (from {RUN_KEYS[key]}); per-run values come from the run "
                f"config: remove {key!r} from the profile, or change {RUN_KEYS[key]}")


def deepspeed_config(r: ResolvedRun) -> dict[str, Any]:
    """The record in DeepSpeed's words: the profile's strategy keys, the run's values, the resolved
    zero_optimization block, the monitors; the universal-checkpoint switch where the run resumes through it."""
    values = _run_keys(r)
    if r.optimizer.clipped_by == "rsclip":
        # rsclip_ds's step guard clips at optim.gradient_clipping (finite.StepGuard): DeepSpeed's ZeRO-1/2
        # clipping reads the norm on the host once per parameter group, its stage-0 clipping takes a norm
        # and a multiplication per gradient tensor
        values["gradient_clipping"] = 0.0
    config = {"steps_per_print": 10**9, "wall_clock_breakdown": False, **copy.deepcopy(r.profile.strategy),
              **values, **copy.deepcopy(r.monitors)}
    if r.zero.block is not None:
        config["zero_optimization"] = copy.deepcopy(r.zero.block)
    if r.zero.offload_optimizer and r.optimizer.impl == "torch":
        # torch.optim.AdamW on offloaded states: allowed, slower than DeepSpeedCPUAdam on GPUs.
        config["zero_force_ds_cpu_optimizer"] = False
    if r.resume.mode == "universal":   # DeepSpeed reads it at deepspeed.initialize (reshard.py)
        config["checkpoint"] = {**config.get("checkpoint", {}), "load_universal": True}
    return config


def teacher_ds_config(r: ResolvedRun) -> dict[str, Any]:
    """The teacher's own DeepSpeed config for distill.placement=zero3: the student's ZeRO-3 block (its
    parameter offload too) without anything an optimizer needs, in the teacher's dtype."""
    zero = {k: v for k, v in (r.zero.block or {}).items() if k != "offload_optimizer"}
    dtype = r.distill.dtype if r.distill else "fp32"
    return {"train_micro_batch_size_per_gpu": r.batch.micro, "gradient_accumulation_steps": 1,
            "zero_optimization": zero, "bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": dtype == "fp16"},
            "steps_per_print": 2**31 - 1}


def with_facts(r: ResolvedRun, *, saved: SavedRun | None = None, unsafe_leaves=()) -> ResolvedRun:
    """`resolve` again, with what the run has learnt since (the module docstring's second call)."""
    return resolve(r.asked or r.config, r.profile, r.world, r.device, saved=saved, unsafe_leaves=unsafe_leaves)

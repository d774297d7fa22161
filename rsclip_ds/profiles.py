"""ds_profiles/*.json + run config -> the DeepSpeed config dict, and the batch arithmetic.

A profile holds the *strategy* (ZeRO stage, offload, buckets, activation checkpointing); the
run config holds the *per-run values* (batch sizes, precision, optimizer, schedule, clipping).
A profile may repeat a per-run value only if it agrees; otherwise it is an error naming both.
DeepSpeed ignores unknown top-level keys silently, so profiles are checked against our own
list here, and the `zero_optimization` block against DeepSpeed's own pydantic model.

A value a file cannot know, the GPUs per node of the launch (hpZ's secondary partition), is
written as the word "local_world_size" and resolved by build_ds_config.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rsclip_ds.config import ConfigError, RunConfig
from rsclip_ds.finite import GuardPlan, plan_guard
from rsclip_ds.precision import autocast_section, compute_dtype, is_autocast, resolve_precision, weight_dtype

# The checkout's ds_profiles/ (editable install), else the copy a wheel installs under
# <prefix>/share/rsclip_ds/ds_profiles (setup.cfg data_files).
_CANDIDATES = (Path(__file__).resolve().parent.parent / "ds_profiles",
               Path(sys.prefix) / "share" / "rsclip_ds" / "ds_profiles")
PROFILE_DIR = next((d for d in _CANDIDATES if d.is_dir()), _CANDIDATES[0])

# Strategy keys a profile may set (handed to DeepSpeed as they are). Not `sparse_gradients`:
# DeepSpeed 0.19.8 removed it and refuses a config that has it.
STRATEGY_KEYS = {
    "zero_optimization", "steps_per_print", "wall_clock_breakdown",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "prescale_gradients",
    "gradient_predivide_factor", "flops_profiler", "comms_logger",
    "tensorboard", "csv_monitor", "memory_breakdown", "dump_state",
}
# Per-run keys: derived from the run config; a profile may only repeat the same value.
RUN_KEYS = {
    "train_batch_size": "batch.* x world size",
    "train_micro_batch_size_per_gpu": "batch.micro_batch_size",
    "gradient_accumulation_steps": "batch.gradient_accumulation_steps",
    "fp16": "precision / fp16.*",
    "bf16": "precision / bf16.master_weights",
    "optimizer": "optim.*",
    "scheduler": "optim.warmup_steps / steps / optim.min_lr_ratio (engine.warmup_cosine)",
    "gradient_clipping": "optim.gradient_clipping",
    "data_types": "bf16.grad_accum_dtype",
    "communication_data_type": "distributed.communication_data_type",
    "torch_autocast": "precision (amp_bf16, amp)",
}
# Our own block, removed before DeepSpeed sees the dict.
RSCLIP_KEYS = {"description", "gpu_budget", "activation_checkpointing"}
# zero_optimization keys that may be given as PER_NODE: the ranks (GPUs) per node of the launch,
# which build_ds_config puts in. hpZ's secondary partition group is a block of that many
# consecutive ranks (deepspeed.utils.groups._create_zero_param_parallel_group): one node, since
# the launcher numbers a node's ranks consecutively.
PER_NODE = "local_world_size"
PER_NODE_KEYS = {"zero_hpz_partition_size"}
# ZeRO++ switches whose kernels DeepSpeed 0.19.8 has only for CUDA (QuantizerBuilder; the CPU
# accelerator's is a NotImplementedBuilder: "This op had not been implemented on CPU backend").
CUDA_ONLY_ZERO_KEYS = {
    "zero_quantized_weights": "qwZ (int8 all-gather of weights)",
    "zero_quantized_nontrainable_weights": "int8 storage of frozen weights",
    "zero_quantized_gradients": "qgZ (int4 all-to-all reduction of gradients)",
}
# zero_optimization keys that exist only at ZeRO-3 (DeepSpeed ignores them below it, silently).
STAGE3_ONLY_ZERO_KEYS = {"zero_hpz_partition_size", *CUDA_ONLY_ZERO_KEYS}


@dataclass(frozen=True)
class Profile:
    name: str
    path: Path
    strategy: dict[str, Any]       # the keys handed to DeepSpeed
    run_values: dict[str, Any]     # per-run keys the profile repeats (must agree)
    description: str
    activation_checkpointing: bool

    @property
    def stage(self) -> int:
        return int(self.strategy.get("zero_optimization", {}).get("stage", 0))

    @property
    def offload_optimizer(self) -> bool:
        return _offload_device(self.strategy, "offload_optimizer") not in (None, "none")

    @property
    def offload_param(self) -> bool:
        return _offload_device(self.strategy, "offload_param") not in (None, "none")

    @property
    def hpz(self) -> bool:
        """ZeRO++ hpZ: a secondary copy of the parameters sharded within each node (the per-node
        value, or a fixed partition size above 1)."""
        size = self.strategy.get("zero_optimization", {}).get("zero_hpz_partition_size", 1)
        return _switched_on(size)

    @property
    def cuda_only(self) -> list[str]:
        """The switches of this profile that need DeepSpeed's CUDA kernels (empty: runs on CPU ranks)."""
        zero = self.strategy.get("zero_optimization", {})
        return [f"{k}: {what}" for k, what in CUDA_ONLY_ZERO_KEYS.items() if zero.get(k)]


def _offload_device(strategy: dict, key: str) -> str | None:
    block = strategy.get("zero_optimization", {}).get(key) or {}
    return block.get("device")


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def runnable_profiles(on_gpu: bool) -> list[str]:
    """available_profiles() less those this accelerator cannot run (the CUDA-only ZeRO++ switches on
    CPU ranks): the default of benchmarks that sweep every profile."""
    return [name for name in available_profiles() if on_gpu or not load_profile(name).cuda_only]


# Profiles DeepSpeed 0.19.8 cannot run, by the names users look for (ds_profiles/README.md, "Not
# shipped"): asking for one says why and what to use instead.
NOT_SHIPPED = {
    "zero3_mics": "MiCS (mics_shard_size, mics_hierarchical_params_gather) was removed from DeepSpeed "
                  "(0.19.8 refuses the keys; https://github.com/deepspeedai/DeepSpeed/issues/8489). zero3_hpz "
                  "keeps a per-node copy of the parameters too (ZeRO++ hpZ), with optimizer states sharded "
                  "over all GPUs",
    "zero1_onebit_adam": "1-bit Adam, 0/1 Adam and 1-bit LAMB are not in DeepSpeed 0.19.8 (no OneBitAdam, "
                         "ZeroOneAdam or OneBitLamb optimizer, no compressed backend); zero3_zeropp compresses "
                         "the gradient reduction instead (qgZ, CUDA)",
}


def resolve_profile_path(name: str) -> Path:
    path = Path(name)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise ConfigError(f"profile file not found: {path}")
        return path
    path = PROFILE_DIR / f"{name}.json"
    if not path.is_file() and name in NOT_SHIPPED:
        raise ConfigError(f"profile {name!r} is not shipped: {NOT_SHIPPED[name]}")
    if not path.is_file():
        raise ConfigError(f"unknown profile {name!r}; available: {', '.join(available_profiles())} "
                          f"(or give a path to a profile JSON)")
    return path


def load_profile(name: str) -> Profile:
    """Read and validate a profile; errors name the file, the key and what is allowed."""
    path = resolve_profile_path(name)
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"profile {path}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"profile {path}: the top level must be an object")
    own = raw.pop("rsclip", {})
    removed = {k: m for k, m in _removed_keys()[0].items() if k in raw}
    if removed:
        raise ConfigError(f"profile {path}: key(s) DeepSpeed removed: " + " ".join(removed.values()))
    unknown = set(raw) - STRATEGY_KEYS - set(RUN_KEYS)
    if unknown:
        raise ConfigError(f"profile {path}: unknown key(s) {sorted(unknown)}; a profile may set "
                          f"{sorted(STRATEGY_KEYS)}, and per-run keys only from the run config")
    bad_own = set(own) - RSCLIP_KEYS
    if bad_own:
        raise ConfigError(f"profile {path}: unknown key(s) {sorted(bad_own)} in 'rsclip'; "
                          f"allowed: {sorted(RSCLIP_KEYS)}")
    _check_zero_block(path, raw.get("zero_optimization", {}))
    return Profile(
        name=path.stem, path=path,
        strategy={k: v for k, v in raw.items() if k in STRATEGY_KEYS},
        run_values={k: v for k, v in raw.items() if k in RUN_KEYS},
        description=str(own.get("description", "")),
        activation_checkpointing=bool(own.get("activation_checkpointing", False)),
    )


def _removed_keys() -> tuple[dict[str, str], dict[str, str]]:
    """DeepSpeed's own lists of config keys it removed, with its messages (top level, zero block);
    empty where this DeepSpeed has none."""
    from deepspeed.runtime import config as ds_config

    return (getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}),
            getattr(ds_config, "_REMOVED_ZERO_CONFIG_KEYS", {}))


def _switched_on(value: Any) -> bool:
    """A ZeRO++ key's value that turns its feature on: true, the per-node word, a partition size > 1."""
    return value is True or value == PER_NODE or (type(value) is int and value > 1)


def _check_zero_block(path: Path, block: dict) -> None:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    removed = {k: m for k, m in _removed_keys()[1].items() if k in block}
    if removed:   # e.g. MiCS: DeepSpeed's message says where it went, pydantic's only 'extra'
        raise ConfigError(f"profile {path}: zero_optimization has key(s) DeepSpeed removed: "
                          + " ".join(removed.values()))
    per_node = {k for k, v in block.items() if v == PER_NODE}
    if per_node - PER_NODE_KEYS:
        raise ConfigError(f"profile {path}: {sorted(per_node - PER_NODE_KEYS)} cannot be {PER_NODE!r}; "
                          f"only {sorted(PER_NODE_KEYS)} can")
    stage3_only = {k for k in STAGE3_ONLY_ZERO_KEYS if _switched_on(block.get(k))}
    if stage3_only and block.get("stage") != 3:
        raise ConfigError(f"profile {path}: {sorted(stage3_only)} work only at ZeRO-3 (DeepSpeed ignores "
                          f"them at stage {block.get('stage', 0)}): set \"stage\": 3 or remove them")
    try:
        # any partition size stands in for the per-node word (resolved at launch, checked there)
        DeepSpeedZeroConfig(**{k: 2 if k in per_node else v for k, v in block.items()})
    except ValidationError as err:
        msgs = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise ConfigError(f"profile {path}: zero_optimization is invalid: {msgs}") from None


# --------------------------------------------------------------------------- batch arithmetic

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


def derive_batch(run: RunConfig, world_size: int) -> BatchSizes:
    """The one place where the global batch is computed (micro x accumulation x world)."""
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    return BatchSizes(run.batch.micro_batch_size, run.batch.gradient_accumulation_steps, world_size)


def scaled_lr(run: RunConfig, world_size: int) -> float:
    factor = {"none": 1.0, "linear": float(world_size), "sqrt": math.sqrt(world_size)}
    return run.optim.lr * factor[run.optim.lr_scaling]


# --------------------------------------------------------------------------- the DeepSpeed dict

def _run_values(run: RunConfig, sizes: BatchSizes, on_gpu: bool, offload: bool) -> dict[str, Any]:
    o = run.optim
    use_ds_adam = o.impl == "deepspeed" or (o.impl == "auto" and on_gpu and offload)
    values: dict[str, Any] = {
        "train_batch_size": sizes.global_batch,
        "train_micro_batch_size_per_gpu": sizes.micro,
        "gradient_accumulation_steps": sizes.accumulation,
        "gradient_clipping": o.gradient_clipping,
        "optimizer": {"type": "AdamW", "params": {
            "lr": scaled_lr(run, sizes.world), "betas": list(o.betas), "eps": o.eps,
            "weight_decay": o.weight_decay, "torch_adam": not use_ds_adam}},
        "bf16": {"enabled": run.precision == "bf16"},
        "fp16": {"enabled": run.precision == "fp16"},
        **autocast_section(run.precision),   # amp_bf16 / amp: fp32 weights, torch.autocast in the forward
    }
    if not use_ds_adam:
        # torch's fused AdamW (CPU and CUDA kernels): one pass over each flat ZeRO partition in
        # place; foreach, DeepSpeed's default, makes partition-sized temporaries every step
        values["optimizer"]["params"]["fused"] = True
    if run.precision == "bf16":
        # DeepSpeed 0.19.8 tests every gradient tensor for inf/NaN (amax, amin, isfinite) each step
        # unless told not to; the run's guard reads the step's gradient norm instead (train.py)
        values["bf16"]["check_grad_overflow"] = run.bf16.check_grad_overflow
    if run.precision == "fp16":
        f = run.fp16
        values["fp16"].update(loss_scale=0, initial_scale_power=f.initial_scale_power,
                              loss_scale_window=f.loss_scale_window, hysteresis=f.hysteresis,
                              min_loss_scale=f.min_loss_scale)
    return values


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


def grad_accum_dtype(run: RunConfig, profile: Profile) -> str:
    """DeepSpeed's data_types.grad_accum_dtype for this run: bf16.grad_accum_dtype resolved for bf16
    runs ('auto': the profile's rule, bf16 with bf16 masters), the precision itself otherwise (what
    DeepSpeed does when it is unset). Raises ConfigError where DeepSpeed 0.19.8 would refuse the
    pair, or silently not do what was asked, naming the fix."""
    if run.precision != "bf16":
        return weight_dtype(run.precision)   # amp: the fp32 weights' gradients
    choice = run.bf16.grad_accum_dtype
    if choice == "auto":
        # bf16 masters: the mode exists to save bytes, and the sum is rounded to bf16 for the step
        # anyway (the master's gradient has master_weights_and_grads_dtype); an explicit fp32 sum
        # works at ZeRO-2/3 with and without offload (measured), for 2 more bytes per parameter / G
        dtype = "bf16" if run.bf16.master_weights == "bf16" else \
            auto_grad_accum_dtype(profile, run.batch.gradient_accumulation_steps)
    else:
        dtype = choice
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


def guard_plan(run: RunConfig, profile: Profile) -> GuardPlan:
    """Who skips a step whose gradient norm is not finite in this run, DeepSpeed or rsclip_ds's step
    guard (finite.plan_guard); a ConfigError where nothing would."""
    run, _ = resolve_run_precision(run, profile)
    zero = profile.strategy.get("zero_optimization", {})
    return plan_guard(run.precision, profile.stage, check_grad_overflow=run.bf16.check_grad_overflow,
                      grad_accum=grad_accum_dtype(run, profile), offload=profile.offload_optimizer,
                      compute_grad_norm=zero.get("compute_grad_norm", True) is not False, profile=profile.path.name)


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
                              f"rest -- so only auto is allowed; for one dtype on the wire use precision=bf16 or fp32")
        return "fp32"   # the fp32 parameters outside AUTOCAST_MODULES; those inside go in compute_dtype
    return wire_dtype(run.distributed.communication_data_type, profile) or run.precision


def wire_dtype(choice: str, profile: Profile) -> str | None:
    """distributed.communication_data_type ``choice`` -> DeepSpeed's communication_data_type for this run (None: unset, DeepSpeed then reduces in the
    training precision). ZeRO++ qgZ (zero_quantized_gradients) needs fp16: with more than one node
    ZeRO-3 hands each gradient, cast to this dtype, to all_to_all_quant_reduce, whose swizzle_quant
    kernel reads its input as __half (DeepSpeed 0.19.8, ops/csrc/quantization/pt_binding.cpp).
    A bf16 gradient would be read as an fp16 bit pattern (1e-3 becomes ~0.81: exponent bits
    misread, no error), an fp32 one as two halves. So auto means fp16 under qgZ and any other
    choice is refused. fp16 holds bf16 gradients to 3 more mantissa bits; beyond +-65504 they
    become inf (the non-finite guard stops the run) -- the int4 quantization that follows loses
    far more."""
    qgz = profile.strategy.get("zero_optimization", {}).get("zero_quantized_gradients", False)
    if qgz and choice not in ("auto", "fp16"):
        raise ConfigError(f"distributed.communication_data_type={choice} with ZeRO++ qgZ ({profile.path.name}: "
                          f"zero_quantized_gradients): DeepSpeed's quantizer kernel reads gradients as fp16 only, "
                          f"so {choice} gradients would be misread without an error; use "
                          f"--set distributed.communication_data_type=auto (fp16), or a profile without qgZ "
                          f"(zero3_hpz) to reduce in {choice}")
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


def resolve_per_node(profile: Profile, world_size: int, local_world_size: int | None) -> dict[str, Any]:
    """The profile's zero_optimization with every PER_NODE value replaced by ``local_world_size``
    (ranks per node; None: unknown, which only a one-rank world can do without). Raises ConfigError
    when the world is not whole nodes of that size: DeepSpeed would fail an assert in
    _ensure_divisibility, or build partition groups that cross nodes."""
    zero = dict(profile.strategy.get("zero_optimization", {}))
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


def build_ds_config(run: RunConfig, profile: Profile, world_size: int, *, on_gpu: bool,
                    local_world_size: int | None = None) -> dict[str, Any]:
    """Merge the profile's strategy with the run's values; conflicts name both sides.
    ``local_world_size``: ranks per node (the per-node partition of hpZ profiles); None: what the
    launcher announced (distributed.launcher_local_world_size), so that the trainer and every
    worker that builds from a profile resolve it the same way without passing it along."""
    if local_world_size is None:
        from rsclip_ds.runtime.distributed import launcher_local_world_size

        local_world_size = launcher_local_world_size()
    run, _ = resolve_run_precision(run, profile)   # the Trainer's is resolved already, with the device's bf16
    if profile.cuda_only and not on_gpu:
        # DeepSpeed would fail inside engine build or the first backward with "This op had not been
        # implemented on CPU backend"
        raise ConfigError(f"profile {profile.path.name} needs DeepSpeed's CUDA quantizer kernels for "
                          f"{', '.join(profile.cuda_only)}; these ranks run on the CPU accelerator: use "
                          f"zero3_hpz or zero3 here, {profile.name} on GPUs")
    if run.precision == "amp" and profile.stage > 0:
        # measured (ZeRO-1/2/3, 0.19.8): its ZeRO optimizers step torch's GradScaler without ever scaling the
        # loss, and every step's gradient norm came out inf and was skipped
        raise ConfigError(f"precision=amp (fp16 autocast with a gradient scaler) needs stage 0 ({profile.path.name} "
                          f"has ZeRO-{profile.stage}): DeepSpeed 0.19.8's ZeRO optimizers do not scale the loss under "
                          f"fp16 autocast, and every step is skipped. Use --set profile=ddp, or precision=amp_bf16 "
                          f"(bf16 needs no scaler), or precision=fp16 (DeepSpeed's loss scaler) with ZeRO")
    if profile.stage == 0 and run.precision in ("bf16", "fp16"):
        # measured (benchmarks/census.py, tiny and git-rsclip-base shapes): 93 host syncs a step, and a first
        # update 0.74x of AdamW's (its state initialisation takes a step on zero gradients)
        raise ConfigError(f"precision={run.precision} at stage 0 ({profile.path.name}) runs DeepSpeed 0.19.8's "
                          f"FP16_UnfusedOptimizer, which reads every gradient tensor on the host each step and starts "
                          f"AdamW one step ahead (its first updates come out about 0.74x). Use --set "
                          f"precision={'amp_bf16' if run.precision == 'bf16' else 'amp'} (fp32 weights under "
                          f"autocast: the plain loop's recipe) or fp32, or a ZeRO profile (zero1, zero2) for "
                          f"{run.precision} weights")
    sizes = derive_batch(run, world_size)
    values = _run_values(run, sizes, on_gpu, profile.offload_optimizer)
    values["data_types"] = {"grad_accum_dtype": grad_accum_dtype(run, profile)}
    values["communication_data_type"] = communication_dtype(run, profile)
    values["bf16"].update(bf16_master_flags(run, profile, values["optimizer"]["params"]["torch_adam"]))
    for key, theirs in profile.run_values.items():
        if theirs != values.get(key):
            raise ConfigError(
                f"profile {profile.path.name} sets {key}={json.dumps(theirs)} but the run config gives "
                f"{json.dumps(values.get(key))} (from {RUN_KEYS[key]}); per-run values come from the run "
                f"config: remove {key!r} from the profile, or change {RUN_KEYS[key]}")
    guard = guard_plan(run, profile)
    if guard.clips == "rsclip":
        # rsclip_ds's step guard clips at optim.gradient_clipping (finite.StepGuard): DeepSpeed's ZeRO-1/2
        # clipping reads the norm on the host once per parameter group, its stage-0 clipping takes a norm
        # and a multiplication per gradient tensor
        values["gradient_clipping"] = 0.0
    config = {"steps_per_print": 10**9, "wall_clock_breakdown": False, **profile.strategy, **values,
              **monitor_sections(run, profile)}
    if "zero_optimization" in config:
        config["zero_optimization"] = resolve_per_node(profile, world_size, local_world_size)
        if guard.norm == "rsclip":   # the step guard computes the norm (finite.partition_norm)
            config["zero_optimization"]["compute_grad_norm"] = False
        if one_rank_overlap(profile, world_size):
            config["zero_optimization"]["overlap_comm"] = False
    if profile.offload_optimizer and values["optimizer"]["params"]["torch_adam"]:
        # torch.optim.AdamW on offloaded states: allowed, slower than DeepSpeedCPUAdam on GPUs.
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def one_rank_overlap(profile: Profile, world_size: int) -> bool:
    """Whether build_ds_config turns the profile's overlap_comm off: ZeRO-1/2 on one rank, where
    there is no reduction to overlap with. DeepSpeed 0.19.8's ZeRO-1/2 with overlap_comm waits for
    the whole device (accelerator.synchronize()) before each gradient bucket's reduction and at the
    end of the backward, stalling the host's run-ahead of the GPU, and keeps a second bucket.
    ZeRO-3 keeps it (its prefetch of the next layer's weights uses the side stream)."""
    zero = profile.strategy.get("zero_optimization", {})
    return world_size == 1 and profile.stage in (1, 2) and bool(zero.get("overlap_comm"))


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


def activation_checkpointing_enabled(run: RunConfig, profile: Profile) -> bool:
    """The run config wins when set; otherwise the profile decides."""
    ac = run.model.activation_checkpointing
    return profile.activation_checkpointing if ac is None else ac

"""ds_profiles/*.json: the strategy profiles, read and checked.

A profile holds the *strategy* (ZeRO stage, offload, buckets, activation checkpointing); the
run config holds the *per-run values* (batch sizes, precision, optimizer, schedule, clipping).
A profile may repeat a per-run value only if it agrees (resolve.py checks it, naming both).
DeepSpeed ignores unknown top-level keys silently, so profiles are checked against our own
list here, and the `zero_optimization` block against DeepSpeed's own pydantic model.

A value a file cannot know, the GPUs per node of the launch (hpZ's secondary partition), is
written as the word "local_world_size" and resolved with the world (resolve.resolve_per_node).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rsclip_ds.config import ConfigError

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
# which resolve.resolve_per_node puts in. hpZ's secondary partition group is a block of that many
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

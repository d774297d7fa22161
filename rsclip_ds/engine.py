"""build_engine(): deepspeed.initialize with the run's parameter groups and learning-rate schedule;
engine facts; exact fp32 masters."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn


def warmup_cosine(step: int, *, warmup: int, total: int, min_ratio: float = 0.0) -> float:
    """The learning-rate factor of optimizer step ``step`` (0-based: the run's first step is 0),
    open_clip's `cosine_lr` with a floor: linear warmup (step + 1) / warmup, so the first step
    already moves (DeepSpeed's WarmupCosineLR gives the first two steps lr 0); the peak at step
    warmup - 1, then cosine from 1 at step ``warmup`` towards ``min_ratio`` at step ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_scheduler(warmup: int, total: int, min_ratio: float) -> Callable[[torch.optim.Optimizer], Any]:
    """What deepspeed.initialize takes as ``lr_scheduler``: optimizer -> torch LambdaLR scaling
    every parameter group's own peak by warmup_cosine (DeepSpeed steps it after each optimizer
    step and saves its state in checkpoints; the schedule itself always comes from the config)."""
    factor = partial(warmup_cosine, warmup=warmup, total=total, min_ratio=min_ratio)
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build_engine(model: nn.Module, ds_config: dict[str, Any], param_groups: list[dict[str, Any]] | None = None,
                 schedule: Callable[[torch.optim.Optimizer], Any] | None = None):
    """Returns the DeepSpeed engine (the optimizer comes from ds_config, the learning-rate
    schedule from ``schedule``, an lr_scheduler(...); None: constant lr). ``param_groups``
    (finetune.param_groups) default to the two groups of a plain run: weight decay on matrices
    only, at the config's learning rate."""
    import deepspeed

    from rsclip_ds.config import OptimConfig
    from rsclip_ds.finetune import param_groups as groups_for

    if param_groups is None:
        params = ds_config["optimizer"]["params"]
        param_groups = groups_for(model, OptimConfig(lr=params["lr"], weight_decay=params["weight_decay"]))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups, config=ds_config,
                                           lr_scheduler=schedule)
    return engine


def engine_dtype(engine) -> torch.dtype:
    if engine.bfloat16_enabled():
        return torch.bfloat16
    if engine.fp16_enabled():
        return torch.float16
    return torch.float32


def loss_scale(engine) -> float | None:
    """The fp16 dynamic loss scale (DeepSpeed's under fp16; torch's GradScaler, which DeepSpeed makes at stage 0,
    under amp), or None without one. Reading GradScaler's scale is a host sync: call at log steps only."""
    scaler = getattr(engine, "torch_autocast_z0_gradscaler", None)
    if scaler is not None:
        return float(scaler.get_scale())
    if not engine.fp16_enabled():
        return None
    opt = engine.optimizer
    scale = getattr(opt, "loss_scale", None)
    if scale is None and hasattr(opt, "loss_scaler"):
        scale = opt.loss_scaler.cur_scale
    return float(scale) if scale is not None else None


def set_fp32_masters(engine, folder: Path) -> int:
    """Make the optimizer's fp32 master weights equal the pretrained folder's weights, exactly.

    Under bf16/fp16 DeepSpeed builds its fp32 masters from the 16-bit copy of the module, so a
    run from a 16-bit or fp32 checkpoint would start from weights rounded to the training dtype
    (bf16 keeps 8 bits of mantissa). This reads each weight from the folder's safetensors
    (memory-mapped, one tensor at a time) and writes it into the master with DeepSpeed's
    `safe_set_full_fp32_param` (every ZeRO stage). The 16-bit module copy already is the
    rounded value; the first step refreshes it from the masters. Returns the tensors set."""
    from safetensors import safe_open

    params = {name: p for name, p in engine.module.named_parameters() if p.requires_grad}
    done = 0
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                param = params.get(key)   # frozen and LoRA-wrapped weights have no master
                shape = tuple(getattr(param, "ds_shape", None) or param.shape) if param is not None else None
                if shape == tuple(f.get_slice(key).get_shape()):   # not a table resized since the load
                    _set_master(param, f.get_tensor(key).float())
                    done += 1
    return done


def _set_master(param, value: torch.Tensor) -> None:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_local_fp32_param

    if not hasattr(param, "ds_id"):
        safe_set_full_fp32_param(param, value)   # ZeRO-1/2
        return
    # ZeRO-3: this rank's slice of the flat value, zero-padded like DeepSpeed's partitions.
    # (0.19.8's safe_set_full_fp32_param reads past the end for the last rank when the size
    # does not divide by the ranks, e.g. the 1-element logit scale.)
    import torch.distributed as dist

    size = param.ds_tensor.numel()
    rank = dist.get_rank(group=getattr(param, "ds_process_group", None))
    flat = torch.nn.functional.pad(value.flatten(), (0, size * dist.get_world_size(
        group=getattr(param, "ds_process_group", None)) - value.numel()))
    safe_set_local_fp32_param(param, flat[rank * size:(rank + 1) * size])

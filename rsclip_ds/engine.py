"""build_engine(): parameter groups + deepspeed.initialize."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only: biases, norms and the logit scale/bias (ndim < 2) are not decayed,
    as in open_clip. Frozen parameters are left out."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_engine(model: nn.Module, ds_config: dict[str, Any]):
    """Returns the DeepSpeed engine (optimizer and scheduler come from ds_config)."""
    import deepspeed

    weight_decay = ds_config["optimizer"]["params"]["weight_decay"]
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=param_groups(model, weight_decay), config=ds_config)
    return engine


def engine_dtype(engine) -> torch.dtype:
    if engine.bfloat16_enabled():
        return torch.bfloat16
    if engine.fp16_enabled():
        return torch.float16
    return torch.float32


def loss_scale(engine) -> float | None:
    """The fp16 dynamic loss scale, or None when not training in fp16."""
    if not engine.fp16_enabled():
        return None
    opt = engine.optimizer
    scale = getattr(opt, "loss_scale", None)
    if scale is None and hasattr(opt, "loss_scaler"):
        scale = opt.loss_scaler.cur_scale
    return float(scale) if scale is not None else None

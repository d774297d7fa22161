"""The train step and loop. Read top to bottom; nothing here reads the environment."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from rsclip_ds.engine import engine_dtype, loss_scale
from rsclip_ds.profiles import BatchPlan
from rsclip_ds.progress import ProgressReporter


def train_step(engine, batch: dict, loss_fn: Callable, dtype: torch.dtype) -> torch.Tensor:
    """One micro-batch: forward, loss, backward; engine.step() updates only at the
    accumulation boundary (and engine.backward divides the loss by the accumulation steps)."""
    pixel_values = batch["pixel_values"].to(engine.device, dtype, non_blocking=True)   # (B,3,H,W)
    input_ids = batch["input_ids"].to(engine.device, non_blocking=True)                # (B,L)
    image, text, logit_scale, logit_bias = engine(pixel_values, input_ids)             # (B,D) x2
    loss = loss_fn(image, text, logit_scale, logit_bias)
    engine.backward(loss)
    engine.step()
    return loss.detach()


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)   # per optimizer step, mean over ranks
    lrs: list[float] = field(default_factory=list)      # learning rate used by each step
    optimizer_steps: int = 0
    micro_steps: int = 0
    skipped_steps: int = 0                              # fp16 overflow steps
    loss_scale: float | None = None
    seconds: float = 0.0
    samples_per_s: float = 0.0                          # global samples/s after the first step

    def to_dict(self) -> dict:
        return asdict(self)


def _mean_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """One collective per log window, not one host sync per step."""
    values = values.float()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values /= dist.get_world_size()
    return values.cpu()


def train(engine, batches: Iterator[dict], loss_fn: Callable, plan: BatchPlan, steps: int,
          log_every: int, reporter: ProgressReporter) -> TrainResult:
    result, pending = TrainResult(), []
    dtype = engine_dtype(engine)
    t_start = t_first = time.perf_counter()
    for step in range(1, steps + 1):
        result.lrs.append(float(engine.get_lr()[0]))
        micro_losses = [train_step(engine, next(batches), loss_fn, dtype) for _ in range(plan.accumulation)]
        pending.append(torch.stack(micro_losses).mean())
        if step == 1:
            t_first = time.perf_counter()   # excludes lazy init / first-call overheads
        if step % log_every == 0 or step == steps:
            result.losses += _mean_over_ranks(torch.stack(pending)).tolist()
            pending = []
            elapsed = time.perf_counter() - t_first
            rate = plan.global_batch * (step - 1) / elapsed if step > 1 else float("nan")
            reporter.update(step, {"loss": result.losses[-1], "lr": result.lrs[-1],
                                   "samples/s": rate, "loss_scale": loss_scale(engine)})
    end = time.perf_counter()
    result.seconds = end - t_start
    result.samples_per_s = plan.global_batch * (steps - 1) / (end - t_first) if steps > 1 else 0.0
    result.optimizer_steps = engine.global_steps
    result.micro_steps = engine.micro_steps
    result.skipped_steps = int(getattr(engine, "skipped_steps", 0))
    result.loss_scale = loss_scale(engine)
    return result

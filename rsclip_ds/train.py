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


def _inputs(engine, batch: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    pixel_values = batch["pixel_values"].to(engine.device, dtype, non_blocking=True)   # (B,3,H,W)
    input_ids = batch["input_ids"].to(engine.device, non_blocking=True)                # (B,L)
    return pixel_values, input_ids


def train_step(engine, batch: dict, loss_fn: Callable, dtype: torch.dtype) -> torch.Tensor:
    """One micro-batch ('plain' accumulation): forward, loss, backward; engine.step() updates
    only at the accumulation boundary (engine.backward divides the loss by the accumulation
    steps). The loss sees micro x world samples."""
    image, text, logit_scale, logit_bias = engine(*_inputs(engine, batch, dtype))     # (B,D) x2
    loss = loss_fn(image, text, logit_scale, logit_bias)
    engine.backward(loss)
    engine.step()
    return loss.detach()


def _rng_state():
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def train_step_global(engine, batches: list[dict], loss_fn: Callable, dtype: torch.dtype) -> torch.Tensor:
    """k micro-batches as one batch of k x micro x world samples ('global' accumulation, the
    GradCache scheme of Gao et al. 2021):
      1. embed every micro-batch without a graph (saving the RNG state before each);
      2. loss over all cached embeddings, backward to get d loss / d embedding (and d scale/bias);
      3. re-run each micro-batch with a graph under the same RNG state and back-propagate
         embedding . gradient through engine.backward, stepping at the boundary.
    Peak activation memory stays that of one micro-batch; the cost is one extra forward."""
    inputs = [_inputs(engine, b, dtype) for b in batches]
    states, images, texts = [], [], []
    with torch.no_grad():
        for pixel_values, input_ids in inputs:
            states.append(_rng_state())
            image, text, logit_scale, logit_bias = engine(pixel_values, input_ids)
            images.append(image.float())
            texts.append(text.float())
    all_image = torch.cat(images).requires_grad_()                              # (k*B, D)
    all_text = torch.cat(texts).requires_grad_()
    # Trainability from the module: under ZeRO-3 the outputs of a no-grad forward are
    # detached copies that say requires_grad=False even for trainable parameters.
    module = engine.module
    scale = logit_scale.detach().float().requires_grad_(module.logit_scale.requires_grad)
    bias = logit_bias.detach().float().requires_grad_(module.logit_bias.requires_grad)
    loss = loss_fn(all_image, all_text, scale, bias)
    loss.backward()   # includes the cross-rank exchange: features of all ranks get their gradient
    sizes = [len(i) for i in images]
    grad_image, grad_text = all_image.grad.split(sizes), all_text.grad.split(sizes)
    for i, (pixel_values, input_ids) in enumerate(inputs):
        _set_rng_state(states[i])   # same dropout masks as in the cached pass
        image_i, text_i, logit_scale, logit_bias = engine(pixel_values, input_ids)
        surrogate = (image_i.float() * grad_image[i]).sum() + (text_i.float() * grad_text[i]).sum()
        if i == 0:   # the scale/bias gradient is the whole batch's: add it once
            for param, leaf in ((logit_scale, scale), (logit_bias, bias)):
                if leaf.grad is not None:
                    surrogate = surrogate + (param.float() * leaf.grad).sum()
        # the surrogate's gradient already is the full batch's: no division by the k steps
        engine.backward(surrogate, scale_wrt_gas=False)
        engine.step()
    return loss.detach()


@dataclass
class TrainResult:
    # per optimizer step, mean over ranks; with 'global' accumulation the loss of the whole
    # k x micro x world batch, with 'plain' the mean of the k micro-batch losses
    losses: list[float] = field(default_factory=list)
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


def optimizer_step(engine, batches: Iterator[dict], loss_fn: Callable, plan: BatchPlan,
                   accumulation: str, dtype: torch.dtype) -> torch.Tensor:
    """One optimizer step over `plan.accumulation` micro-batches -> the step's loss."""
    micro = [next(batches) for _ in range(plan.accumulation)]
    if accumulation == "global" and plan.accumulation > 1:
        return train_step_global(engine, micro, loss_fn, dtype)
    return torch.stack([train_step(engine, b, loss_fn, dtype) for b in micro]).mean()


def train(engine, batches: Iterator[dict], loss_fn: Callable, plan: BatchPlan, steps: int,
          log_every: int, reporter: ProgressReporter, accumulation: str = "plain") -> TrainResult:
    result, pending = TrainResult(), []
    dtype = engine_dtype(engine)
    t_start = t_first = time.perf_counter()
    for step in range(1, steps + 1):
        result.lrs.append(float(engine.get_lr()[0]))
        pending.append(optimizer_step(engine, batches, loss_fn, plan, accumulation, dtype))
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

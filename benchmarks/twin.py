"""The plain PyTorch twin of our training step: the loop a user writes in an afternoon on the
same model and batch, the floor our engine is measured against (benchmarks.gpu, benchmarks.census).

It does our step's math (tests/unit/test_twin_parity.py holds its losses to ours, step for step):
fp32 weights; the forward under torch.autocast in the dtype our precision computes in (bf16 and
amp_bf16: bf16, the matmuls and attention in bf16, norms in fp32 as autocast's lists decide; fp32:
no autocast); the loss built as ours builds it (losses.build_loss), outside autocast, on the
features cast to fp32; gradient clipping with torch's foreach norm; torch's fused AdamW over the
same parameter groups (finetune.param_groups: weight decay on matrices only) stepped by our
learning-rate schedule (engine.lr_scheduler: warmup, then cosine); `zero_grad(set_to_none=True)`.
One rank, no DeepSpeed. ``compiled=True`` compiles every encoder layer (regional compilation,
torch's own recipe: one graph reused by every layer), the loss and the optimizer stay eager.

Until issue 44 the twin ran the loss inside the autocast region -- autocast runs `image @ text.T`
in bf16 whatever the inputs' dtype, so the features' cast to fp32 bought nothing -- and had no
schedule: every step at the peak learning rate, 10x our first step's under the default 10-step
warm-up (lr x 1/10).
"""

from __future__ import annotations

from typing import Iterator

import torch

from rsclip_ds.config import OptimConfig
from rsclip_ds.engine import lr_scheduler
from rsclip_ds.finetune import param_groups
from rsclip_ds.losses import build_loss
from rsclip_ds.precision import compute_dtype
from rsclip_ds.runtime.compilation import encoder_layers

AUTOCAST = {"bf16": torch.bfloat16, "fp32": None}   # our precision's compute dtype -> the twin's autocast


class PlainLoop:
    """``step(batch) -> loss``: forward under autocast, loss in fp32, backward, clip, AdamW, the
    schedule's step, zero_grad. ``steps``: the run's optimizer steps, the schedule's length (the
    cosine reaches lr x min_lr_ratio there), like RunConfig.steps for ours; ``loss``: the loss's
    name (RunConfig.loss.name)."""

    def __init__(self, model: torch.nn.Module, *, precision: str = "bf16", optim: OptimConfig | None = None,
                 clip: float = 1.0, compiled: bool = False, steps: int = 100, loss: str = "siglip"):
        optim = optim or OptimConfig()
        compute = compute_dtype(precision)
        if compute not in AUTOCAST:   # fp16 and amp would need torch's GradScaler, which this loop has not
            raise ValueError(f"the twin runs precisions that compute in {' or '.join(AUTOCAST)} (fp32, bf16, "
                             f"amp_bf16), not {precision!r}")
        self.model = model.float().train()
        self.device = next(model.parameters()).device
        self.dtype = AUTOCAST[compute]
        self.optimizer = torch.optim.AdamW(param_groups(model, optim), lr=optim.lr, betas=tuple(optim.betas),
                                           eps=optim.eps, weight_decay=optim.weight_decay, fused=True)
        # clipped in the groups' order, as our step guard sums the norm: the same float sums
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        # what DeepSpeed steps after each of our optimizer steps (engine.build_engine's lr_scheduler)
        self.schedule = lr_scheduler(optim.warmup_steps, steps, optim.min_lr_ratio)(self.optimizer)
        self.loss_fn = build_loss(loss, negatives="local", rank=0, world_size=1)
        self.clip = clip
        if compiled:
            for layer in encoder_layers(model):
                layer.compile(dynamic=False)

    def step(self, batch: dict) -> torch.Tensor:
        pixels = batch["pixel_values"].to(self.device, non_blocking=True)                # (B,3,H,W) uint8
        ids = batch["input_ids"].to(self.device, non_blocking=True)                      # (B,L)
        with torch.autocast(self.device.type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None):
            image, text, logit_scale, logit_bias = self.model(pixels, ids)               # (B,D) x2
        loss = self.loss_fn(image, text, logit_scale, logit_bias)   # fp32: outside autocast, as ours
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def plain_train(loop: PlainLoop, batches: Iterator[dict], steps: int, log_every: int) -> list[float]:
    """The twin's train loop: `steps` steps; every `log_every` steps the mean loss of those steps is
    read on the host (`.item()`: one host sync, a user's log line) -> the logged means."""
    logged, pending = [], []
    for step in range(1, steps + 1):
        pending.append(loop.step(next(batches)))
        if step % log_every == 0 or step == steps:
            logged.append(torch.stack(pending).mean().item())
            pending = []
    return logged

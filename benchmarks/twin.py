"""The plain PyTorch twin of our training step: the loop a user writes in an afternoon on the
same model and batch, the floor our engine is measured against (benchmarks.gpu, benchmarks.census).

fp32 weights, autocast to the run's precision (bf16: the matmuls and attention in bf16, norms and
the loss in fp32, as torch's autocast lists decide), the model's own attention (SDPA), the same
SigLIP loss, gradient clipping with torch's foreach norm, torch's fused AdamW over the same two
parameter groups (weight decay on matrices only), `zero_grad(set_to_none=True)`. One rank, no
DeepSpeed. ``compiled=True`` compiles every encoder layer (regional compilation, torch's own
recipe: one graph reused by every layer), the loss and the optimizer stay eager.
"""

from __future__ import annotations

import torch

from rsclip_ds.config import OptimConfig
from rsclip_ds.finetune import param_groups
from rsclip_ds.losses import siglip_loss
from rsclip_ds.runtime.compilation import encoder_layers


class PlainLoop:
    """``step(batch) -> loss``: forward under autocast, loss, backward, clip, AdamW, zero_grad."""

    def __init__(self, model: torch.nn.Module, *, precision: str = "bf16", optim: OptimConfig | None = None,
                 clip: float = 1.0, compiled: bool = False):
        optim = optim or OptimConfig()
        self.model = model.float().train()
        self.device = next(model.parameters()).device
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(param_groups(model, optim), lr=optim.lr, betas=tuple(optim.betas),
                                           eps=optim.eps, fused=True)
        self.clip = clip
        if compiled:
            for layer in encoder_layers(model):
                layer.compile(dynamic=False)

    def step(self, batch: dict) -> torch.Tensor:
        pixels = batch["pixel_values"].to(self.device, non_blocking=True)
        ids = batch["input_ids"].to(self.device, non_blocking=True)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            image, text, logit_scale, logit_bias = self.model(pixels, ids)
            loss = siglip_loss(image, text, logit_scale, logit_bias)
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

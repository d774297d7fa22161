"""Contrastive losses on L2-normalised embeddings.

Per-rank forms: each rank's loss sees its own micro-batch only (B_local negatives). The
global-batch forms (gathered / ring-exchanged features) come with the losses issue and are
tested against these as their single-process reference twins.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

CLIP_MAX_LOGIT_SCALE = math.log(100.0)   # CLIP clamps the temperature at 100


def siglip_loss(image: torch.Tensor, text: torch.Tensor, logit_scale: torch.Tensor,
                logit_bias: torch.Tensor) -> torch.Tensor:
    """Pairwise sigmoid loss (Zhai et al. 2023): every (i, j) pair is a binary problem,
    positive on the diagonal. Normalised by the batch size, as in big_vision."""
    image, text = image.float(), text.float()                                  # (B, D)
    logits = image @ text.T * logit_scale.float().exp() + logit_bias.float()   # (B, B)
    labels = 2 * torch.eye(len(image), device=logits.device) - 1               # +1 diag, -1 off
    return -F.logsigmoid(labels * logits).sum() / len(image)


def clip_loss(image: torch.Tensor, text: torch.Tensor, logit_scale: torch.Tensor,
              logit_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Symmetric InfoNCE (Radford et al. 2021); the bias is unused (softmax is shift-invariant)."""
    image, text = image.float(), text.float()                                  # (B, D)
    scale = logit_scale.float().clamp(max=CLIP_MAX_LOGIT_SCALE).exp()
    logits = scale * image @ text.T                                            # (B, B)
    labels = torch.arange(len(image), device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


LOSSES = {"siglip": siglip_loss, "clip": clip_loss}

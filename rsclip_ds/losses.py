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


# --------------------------------------------------------------------------- global-batch forms
#
# Every rank returns the loss of *its own rows* of the global problem, normalised by its local
# batch; DeepSpeed then averages gradients over ranks, which gives exactly the gradient of the
# single-process loss on the concatenated batch (tests/integration/test_loss_parity.py).

def gather_with_grad(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """(B_local, D) -> (world*B_local, D) in rank order; backward reduce-scatters the gradient."""
    if world_size == 1:
        return x
    import torch.distributed.nn.functional as dist_fn

    return torch.cat(dist_fn.all_gather(x), dim=0)


def clip_loss_global(image: torch.Tensor, text: torch.Tensor, logit_scale: torch.Tensor,
                     logit_bias: torch.Tensor | None = None, *, rank: int = 0,
                     world_size: int = 1) -> torch.Tensor:
    """InfoNCE over the global batch in the local-loss form (open_clip's `local_loss`):
    logits are (B_local, B_global), so memory is O(B_local * B_global), not O(B_global^2)."""
    image, text = image.float(), text.float()                                  # (B, D)
    all_image = gather_with_grad(image, world_size)                           # (W*B, D)
    all_text = gather_with_grad(text, world_size)
    scale = logit_scale.float().clamp(max=CLIP_MAX_LOGIT_SCALE).exp()
    labels = torch.arange(len(image), device=image.device) + rank * len(image)
    loss_i2t = F.cross_entropy(scale * image @ all_text.T, labels)           # (B, W*B) logits
    loss_t2i = F.cross_entropy(scale * text @ all_image.T, labels)
    return (loss_i2t + loss_t2i) / 2


class _RingExchange(torch.autograd.Function):
    """Send `to_left` to rank-1 and `to_right` to rank+1; receive from rank+1 and rank-1.
    The backward is the same exchange run the other way, so gradients return to their owners."""

    @staticmethod
    def forward(ctx, left: int, right: int, to_left: torch.Tensor, to_right: torch.Tensor):
        ctx.left, ctx.right = left, right
        return _exchange(left, right, to_left, to_right)

    @staticmethod
    def backward(ctx, grad_from_right, grad_from_left):
        # the gradient of what came from the right goes back to the right, and likewise left;
        # what we receive is the gradient of what we sent.
        grad_to_right, grad_to_left = _exchange(ctx.left, ctx.right, grad_from_left.contiguous(),
                                                grad_from_right.contiguous())
        return None, None, grad_to_left, grad_to_right


def _exchange(left: int, right: int, to_left: torch.Tensor, to_right: torch.Tensor):
    import torch.distributed as dist

    from_right, from_left = torch.empty_like(to_left), torch.empty_like(to_right)
    ops = [dist.P2POp(dist.isend, to_left.contiguous(), left),
           dist.P2POp(dist.isend, to_right.contiguous(), right),
           dist.P2POp(dist.irecv, from_right, right),
           dist.P2POp(dist.irecv, from_left, left)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return from_right, from_left


def _sigmoid_block(image, text, scale, bias, positives: bool, chunk_size: int) -> torch.Tensor:
    """Sum of -log sigmoid(z * logits) over one (B_img, B_txt) block; diagonal positive if asked.
    With chunk_size > 0, image rows are processed in chunks whose logits are recomputed in
    backward, so at most (chunk_size, B_txt) logits are alive at a time."""
    def block(img, offset):
        logits = img @ text.T * scale + bias                                  # (b, B_txt)
        labels = -torch.ones_like(logits)
        if positives:
            labels.diagonal(offset).fill_(1.0)   # rows offset.. of the block are the positives
        return -F.logsigmoid(labels * logits).sum()

    if chunk_size <= 0 or chunk_size >= len(image):
        return block(image, 0)
    from torch.utils.checkpoint import checkpoint

    return sum(checkpoint(block, image[i:i + chunk_size], i, use_reentrant=False)
               for i in range(0, len(image), chunk_size))


def siglip_loss_global(image: torch.Tensor, text: torch.Tensor, logit_scale: torch.Tensor,
                       logit_bias: torch.Tensor, *, rank: int = 0, world_size: int = 1,
                       chunk_size: int = 0) -> torch.Tensor:
    """Sigmoid loss over the global batch without any rank holding global logits (big_vision's
    chunked sigmoid loss, with open_clip's bidirectional ring): text features travel around the
    ring both ways at once, so W-1 blocks of (B_local, B_local) arrive in ceil((W-1)/2) rounds."""
    image, text = image.float(), text.float()                                  # (B, D)
    scale, bias = logit_scale.float().exp(), logit_bias.float()
    loss = _sigmoid_block(image, text, scale, bias, True, chunk_size)
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    to_left = to_right = text
    rounds, odd = divmod(world_size - 1, 2)
    for _ in range(rounds):
        from_right, from_left = _RingExchange.apply(left, right, to_left, to_right)
        loss = loss + _sigmoid_block(image, from_right, scale, bias, False, chunk_size)
        loss = loss + _sigmoid_block(image, from_left, scale, bias, False, chunk_size)
        to_left, to_right = from_right, from_left   # keep them moving in the same direction
    if odd:   # one block left (even world size): the rank opposite us on the ring
        from_right, _ = _RingExchange.apply(left, right, to_left, to_right)
        loss = loss + _sigmoid_block(image, from_right, scale, bias, False, chunk_size)
    return loss / len(image)


def naive_global_loss(name: str, image, text, logit_scale, logit_bias, *, rank: int, world_size: int):
    """The textbook form: gather everything and build the (B_global, B_global) logits on every
    rank. Kept for the benchmark (its memory grows with B_global^2) and as a cross-check."""
    # Every rank computes the whole loss; all_gather's backward sums the W identical feature
    # gradients and DeepSpeed's average over ranks divides by W again: the gradient is exact.
    all_image = gather_with_grad(image.float(), world_size)
    all_text = gather_with_grad(text.float(), world_size)
    return LOSSES[name](all_image, all_text, logit_scale, logit_bias)


def build_loss(name: str, *, negatives: str, rank: int, world_size: int, chunk_size: int = 0):
    """The loss callable (image, text, logit_scale, logit_bias) -> scalar for this rank."""
    if negatives == "local" or world_size == 1:
        return LOSSES[name]
    if name == "clip":
        return lambda i, t, s, b: clip_loss_global(i, t, s, b, rank=rank, world_size=world_size)
    return lambda i, t, s, b: siglip_loss_global(i, t, s, b, rank=rank, world_size=world_size,
                                                 chunk_size=chunk_size)

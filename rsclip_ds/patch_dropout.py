"""Patch dropout (FLIP, Li et al. 2023): train the image tower on a random subset of its patches.

`apply_patch_dropout(model, p)` puts a forward hook on the model's own vision embeddings
(transformers' SiglipVisionEmbeddings has no option for it; the class is left alone): in
training forward passes the hook keeps ``kept_tokens(N, p)`` of the N patch tokens of every
image -- a random subset per image, the same count for all so the batch stays a dense
(B, K, D) tensor -- after the position embeddings were added (kept tokens keep their
positions) and before the encoder. SigLIP's attention-pooling head then pools over the K kept
tokens (its one probe query attends to any number of keys). In eval mode (evaluation,
`model.eval()`) nothing is dropped.

The subset is drawn from torch's generator of the embeddings' device (the CPU's, or the current
CUDA device's), the generators 'global' accumulation saves before its cached pass and restores
before the replay (train.train_step_global): both passes keep the same patches.

`PatchDropoutSwitch` is a train-loop hook that turns it off for the last N optimizer steps
(the unmasked phase FLIP ends with; open_clip's `--force-patch-dropout 0`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("rsclip_ds")


def kept_tokens(num_patches: int, p: float) -> int:
    """Patches kept per image at drop fraction ``p``: round((1 - p) N), at least 1."""
    return max(1, round((1.0 - p) * num_patches))


class PatchDropout:
    """The hook's state: the fraction ``p`` and whether it is on (the switch turns it off).
    Not a module: it holds no tensors, and the state dict stays a SiglipModel state dict."""

    def __init__(self, p: float):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"patch dropout {p}: a fraction of patches to drop, 0 <= p < 1")
        self.p, self.enabled = p, True
        self.handle = None

    def __call__(self, module: nn.Module, args, embeddings: torch.Tensor) -> torch.Tensor | None:
        """Forward hook of SiglipVisionEmbeddings: (B, N, D) -> (B, K, D) kept tokens."""
        if not (module.training and self.enabled and self.p > 0):
            return None   # the output unchanged
        batch, n, dim = embeddings.shape
        keep = self.draw(batch, n, embeddings.device)                                 # (B, K)
        return embeddings.gather(1, keep.unsqueeze(-1).expand(-1, -1, dim))           # (B, K, D)

    @torch.compiler.disable
    def draw(self, batch: int, n: int, device: torch.device) -> torch.Tensor:
        """(B, K) indices of the kept patches: the K largest of B x N uniform draws (a uniformly
        random K-subset per image, as open_clip's PatchDropout draws it). Eager under torch.compile
        (compilation.py): inductor would draw from its own generator, so the masks would differ
        from eager's and 'global' accumulation's replay would rest on two compiled graphs drawing
        alike; eager, they come from the generator the replay restores."""
        scores = torch.rand(batch, n, device=device)                                   # (B, N)
        return scores.topk(kept_tokens(n, self.p), dim=1).indices                      # (B, K)


def apply_patch_dropout(model: nn.Module, p: float) -> PatchDropout | None:
    """Drop fraction ``p`` of the image patches in ``model``'s training forward passes (a
    DualEncoder or anything with ``.vision_model.embeddings``). p = 0 changes nothing (no hook:
    the forward stays bit for bit the model's own). Returns the hook's state, also kept as
    ``model.patch_dropout`` for the switch; applying again replaces the previous hook."""
    previous = getattr(model, "patch_dropout", None)
    if previous is not None and previous.handle is not None:
        previous.handle.remove()
    if p == 0:
        model.patch_dropout = None
        return None
    dropout = PatchDropout(p)
    dropout.handle = model.vision_model.embeddings.register_forward_hook(dropout)
    model.patch_dropout = dropout
    return dropout


class PatchDropoutSwitch:
    """Train-loop hook (train.train's ``hooks``): after optimizer step ``step`` it turns patch
    dropout off once ``step >= steps - off_last_steps``, so steps ``steps - N + 1 .. steps`` run
    unmasked. Call it with the resumed step before training (the loop runs hooks at step 0 of a
    fresh run only). Returns nothing: the loop would log a dict as an evaluation."""

    def __init__(self, dropout: PatchDropout, steps: int, off_last_steps: int, rank: int = 0):
        self.dropout, self.off_at, self.rank = dropout, steps - off_last_steps, rank
        if rank == 0:
            log.info("patch dropout %.2f in training passes%s", dropout.p,
                     f", off after step {self.off_at}" if off_last_steps else "")

    def __call__(self, step: int, engine=None) -> None:
        if self.dropout.enabled and step >= self.off_at:
            self.dropout.enabled = False
            if self.rank == 0:
                log.info("patch dropout %.2f off after step %d: steps %d.. run on every patch",
                         self.dropout.p, step, step + 1)

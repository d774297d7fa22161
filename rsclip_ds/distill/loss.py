"""The distillation term: open_clip's DistillClipLoss over the global batch.

For the image->text direction, row i of the teacher's logits ``t * T_img_i . T_txt_j`` turned
into a softmax over j is the target distribution for row i of the student's logits
``s * S_img_i . S_txt_j``; the loss is the cross-entropy between them (soft labels), averaged
over rows, and likewise text->image; the term is the mean of both directions. Each model uses
its own logit scale: the student's as its contrastive loss does (CLIP's clamp at 100 for a 'clip'
student), the teacher's as it was trained (frozen, no gradient).

The global form follows the global contrastive losses (rsclip_ds.losses): each rank returns the
term of *its own rows* against every column of the gathered batch -- logits (B_local, B_global),
never (B_global, B_global) -- normalised by its local batch. DeepSpeed averages gradients over
ranks, which is the gradient of the single-process term on the concatenated batch
(``distill_loss``, the reference twin; tests/unit/test_distill.py holds the two equal).
"""

from __future__ import annotations

import torch

from rsclip_ds.losses import CLIP_MAX_LOGIT_SCALE, gather_with_grad


def soft_cross_entropy(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum_j softmax(teacher)_j log_softmax(student)_j (open_clip's dist_loss)."""
    return -(teacher_logits.softmax(dim=1) * student_logits.log_softmax(dim=1)).sum(dim=1).mean(dim=0)


def student_scale(logit_scale: torch.Tensor, loss: str) -> torch.Tensor:
    """exp of the student's log scale as its own contrastive loss uses it."""
    scale = logit_scale.float()
    return (scale.clamp(max=CLIP_MAX_LOGIT_SCALE) if loss == "clip" else scale).exp()


def distill_loss(image, text, logit_scale, t_image, t_text, t_logit_scale, *, loss: str = "siglip") -> torch.Tensor:
    """The reference twin: the whole (N, N) logits of both models in one process."""
    s, t = student_scale(logit_scale, loss), t_logit_scale.float().exp()
    student = s * image.float() @ text.float().T                                # (N, N)
    teacher = t * t_image.float() @ t_text.float().T                            # (N, N)
    return (soft_cross_entropy(teacher, student) + soft_cross_entropy(teacher.T, student.T)) / 2


def _gather(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """(B, D) -> (W*B, D) without a graph (the teacher's features carry no gradient)."""
    if world_size == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def distill_loss_global(image, text, logit_scale, t_image, t_text, t_logit_scale, *, rank: int = 0,
                        world_size: int = 1, loss: str = "siglip") -> torch.Tensor:
    """This rank's rows of ``distill_loss`` over the global batch (``rank`` only names the rows:
    the gathered columns are in rank order, as the teacher's)."""
    del rank   # soft targets need no labels: row i's target comes with row i
    image, text = image.float(), text.float()                                   # (B, D)
    t_image, t_text = t_image.float(), t_text.float()
    all_image, all_text = gather_with_grad(image, world_size), gather_with_grad(text, world_size)  # (W*B, D)
    t_all_image, t_all_text = _gather(t_image, world_size), _gather(t_text, world_size)
    s, t = student_scale(logit_scale, loss), t_logit_scale.float().exp()
    i2t = soft_cross_entropy(t * t_image @ t_all_text.T, s * image @ all_text.T)   # (B, W*B) logits
    t2i = soft_cross_entropy(t * t_text @ t_all_image.T, s * text @ all_image.T)
    return (i2t + t2i) / 2

"""Retrieval and zero-shot metrics: pure functions of embeddings.

Ties count against the model (a wrong candidate scoring *equal* to the right one ranks above
it): a collapsed model whose embeddings are all equal gets recall 0, not 1.
"""

from __future__ import annotations

import torch

def rank_of_correct(scores: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """scores (Q, K), correct (Q, K) bool, >= 1 True per row -> (Q,) rank of the best correct
    candidate: the number of wrong candidates scoring >= the best correct score (0 = top)."""
    best = scores.masked_fill(~correct, float("-inf")).max(dim=1, keepdim=True).values   # (Q, 1)
    return ((scores >= best) & ~correct).sum(dim=1)                                      # (Q,)


def retrieval_metrics(image_emb: torch.Tensor, text_emb: torch.Tensor,
                      text_image_index: torch.Tensor, ks: tuple[int, ...] = (1, 5, 10)) -> dict:
    """Recall@k both ways for N images and M captions (several per image).

    image_emb (N, D), text_emb (M, D) L2-normalised; text_image_index (M,) the image of each
    caption. image->text: a hit when any of the image's captions is among the top k captions;
    text->image: when its image is among the top k images. Fractions in [0, 1];
    ``mean_recall`` is the mean of the six numbers (RSICD papers' "mR", in percent there)."""
    image_emb, text_emb = image_emb.float(), text_emb.float()
    index = torch.as_tensor(text_image_index, dtype=torch.long)
    n, m = len(image_emb), len(text_emb)
    if m != len(index) or m == 0 or n == 0:
        raise ValueError(f"retrieval needs >= 1 image and one image index per caption "
                         f"(got {n} images, {m} captions, {len(index)} indices)")
    if bool((index < 0).any() or (index >= n).any()):
        raise ValueError(f"text_image_index must lie in [0, {n}); got {index.min()}..{index.max()}")
    sim = image_emb @ text_emb.T                                          # (N, M)
    owns = index[None, :] == torch.arange(n)[:, None]                     # (N, M) caption j of image i
    if not bool(owns.any(dim=1).all()):
        raise ValueError("every image needs at least one caption for image->text recall")
    i2t = rank_of_correct(sim, owns)                                     # (N,)
    t2i = rank_of_correct(sim.T, owns.T)                                 # (M,)
    out: dict = {}
    for k in ks:
        out[f"i2t_R@{k}"] = (i2t < k).float().mean().item()
    for k in ks:
        out[f"t2i_R@{k}"] = (t2i < k).float().mean().item()
    out["mean_recall"] = sum(out.values()) / len(out)
    out.update(num_images=n, num_texts=m)
    return out


def zero_shot_metrics(image_emb: torch.Tensor, class_emb: torch.Tensor, labels: torch.Tensor,
                      class_names: list[str] | None = None) -> dict:
    """Top-1 / top-5 and per-class accuracy of classifying each image as its nearest class.

    image_emb (N, D), class_emb (C, D) (one embedding per class, e.g. the normalised mean over
    prompt templates), labels (N,) in [0, C). ``mean_per_class`` is the unweighted mean of the
    per-class top-1 accuracies (classes without images are left out of it)."""
    image_emb, class_emb = image_emb.float(), class_emb.float()
    labels = torch.as_tensor(labels, dtype=torch.long)
    c = len(class_emb)
    names = list(class_names) if class_names is not None else [str(i) for i in range(c)]
    if len(names) != c or len(labels) != len(image_emb) or len(labels) == 0:
        raise ValueError(f"zero-shot needs one label per image and one name per class (got "
                         f"{len(image_emb)} images, {len(labels)} labels, {c} classes, {len(names)} names)")
    scores = image_emb @ class_emb.T                                      # (N, C)
    correct = torch.nn.functional.one_hot(labels, c).bool()               # (N, C)
    rank = rank_of_correct(scores, correct)                              # (N,)
    per_class = {}
    for i, name in enumerate(names):
        mine = labels == i
        if mine.any():
            per_class[name] = (rank[mine] == 0).float().mean().item()
    return {"top1": (rank < 1).float().mean().item(), "top5": (rank < 5).float().mean().item(),
            "mean_per_class": sum(per_class.values()) / len(per_class), "per_class": per_class,
            "num_images": len(labels), "num_classes": c}



def flat_metrics(results: dict) -> dict[str, float]:
    """{"zero_shot/top1": ..., "retrieval/t2i_R@1": ...}: the scalars, for logs and monitors."""
    return {f"{group}/{key}": float(value) for group, metrics in results.items()
            for key, value in metrics.items()
            if isinstance(value, float)}



def zero_shot_probabilities(image_emb: torch.Tensor, class_emb: torch.Tensor, logit_scale: torch.Tensor,
                            logit_bias: torch.Tensor, loss: str = "siglip") -> torch.Tensor:
    """(N, C) class probabilities as the model defines them: SigLIP scores each class on its own,
    sigmoid(exp(t) cos + b) (what transformers' zero-shot-image-classification pipeline reports
    for SigLIP); CLIP takes the softmax over the classes."""
    logits = image_emb.float() @ class_emb.float().T * logit_scale.float().exp() + logit_bias.float()  # (N, C)
    return torch.sigmoid(logits) if loss == "siglip" else torch.softmax(logits, dim=-1)

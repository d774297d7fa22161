"""Retrieval and zero-shot metrics against hand-computed cases and a brute-force reference."""

import pytest
import torch

from rsclip_ds.evaluation.metrics import retrieval_metrics, zero_shot_metrics


def test_retrieval_hand_computed():
    images = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    texts = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.8, 0.6], [0.0, -1.0]])
    index = torch.tensor([0, 0, 1, 2])
    # sim rows (images): [1, .6, .8, 0], [0, .8, .6, -1], [-1, -.6, -.8, 0]
    # i2t ranks: img0 -> 0 (t0), img1 -> 1 (t1 beats t2), img2 -> 0
    # t2i ranks: t0 -> 0, t1 -> 1 (img1 .8 > img0 .6), t2 -> 1, t3 -> 1 (tie 0 = 0 counts against)
    m = retrieval_metrics(images, texts, index)
    assert m["i2t_R@1"] == pytest.approx(2 / 3)
    assert m["t2i_R@1"] == pytest.approx(1 / 4)
    assert m["i2t_R@5"] == m["i2t_R@10"] == m["t2i_R@5"] == m["t2i_R@10"] == 1.0
    assert m["mean_recall"] == pytest.approx((2 / 3 + 1 / 4 + 4) / 6)
    assert (m["num_images"], m["num_texts"]) == (3, 4)


def test_retrieval_collapsed_model_scores_zero():
    same = torch.ones(4, 3)
    m = retrieval_metrics(same, torch.ones(8, 3), torch.arange(8) // 2)
    assert m["i2t_R@1"] == 0.0 and m["t2i_R@1"] == 0.0


def _brute_force(images, texts, index, k):
    sim = images @ texts.T
    i2t = [any(int(index[j]) == i for j in sim[i].argsort(descending=True)[:k]) for i in range(len(images))]
    t2i = [int(index[j]) in sim[:, j].argsort(descending=True)[:k].tolist() for j in range(len(texts))]
    return sum(i2t) / len(i2t), sum(t2i) / len(t2i)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_retrieval_matches_sorting_reference(seed):
    g = torch.Generator().manual_seed(seed)
    images = torch.nn.functional.normalize(torch.randn(20, 8, generator=g), dim=-1)
    index = torch.arange(20).repeat_interleave(5)[torch.randperm(100, generator=g)]
    texts = torch.nn.functional.normalize(images[index] + 1.5 * torch.randn(100, 8, generator=g), dim=-1)
    m = retrieval_metrics(images, texts, index)
    for k in (1, 5, 10):
        i2t, t2i = _brute_force(images, texts, index, k)
        assert m[f"i2t_R@{k}"] == pytest.approx(i2t)
        assert m[f"t2i_R@{k}"] == pytest.approx(t2i)
    assert 0 < m["t2i_R@1"] < 1   # the case is neither trivial nor hopeless


def test_retrieval_rejects_bad_index():
    with pytest.raises(ValueError, match="one image index per caption"):
        retrieval_metrics(torch.eye(2), torch.eye(3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="at least one caption"):
        retrieval_metrics(torch.eye(3), torch.eye(3)[:2], torch.tensor([0, 1]))


def test_zero_shot_hand_computed():
    classes = torch.eye(3)
    images = torch.tensor([[1.0, 0, 0], [0.2, 0.9, 0], [0, 0, 1.0], [0.5, 0.5, 0]])
    labels = torch.tensor([0, 0, 2, 1])
    # image 1 is nearer class 1 (wrong); image 3 ties classes 0 and 1 (counts as wrong)
    m = zero_shot_metrics(images, classes, labels, ["water", "forest", "desert"])
    assert m["top1"] == 0.5
    assert m["top5"] == 1.0
    assert m["per_class"] == {"water": 0.5, "forest": 0.0, "desert": 1.0}
    assert m["mean_per_class"] == pytest.approx(0.5)


def test_zero_shot_top5_and_missing_classes():
    g = torch.Generator().manual_seed(0)
    classes = torch.randn(10, 6, generator=g)
    images = torch.randn(50, 6, generator=g)
    labels = torch.randint(0, 7, (50,), generator=g)   # classes 7..9 have no images
    m = zero_shot_metrics(images, classes, labels)
    scores = images @ classes.T
    top5 = scores.topk(5, dim=1).indices
    assert m["top5"] == pytest.approx((top5 == labels[:, None]).any(1).float().mean().item())
    assert m["top1"] == pytest.approx((scores.argmax(1) == labels).float().mean().item())
    assert set(m["per_class"]) == {str(i) for i in labels.unique().tolist()}

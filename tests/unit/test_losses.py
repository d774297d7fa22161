import math

import pytest
import torch
import torch.nn.functional as F

from rsclip_ds.losses import clip_loss, siglip_loss


def _emb(b, d, seed):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(b, d, generator=g), dim=-1)


def test_siglip_loss_matches_elementwise_definition():
    img, txt = _emb(5, 8, 0), _emb(5, 8, 1)
    t, b = torch.tensor([math.log(10.0)]), torch.tensor([-10.0])
    expected = 0.0
    for i in range(5):
        for j in range(5):
            z = 1.0 if i == j else -1.0
            logit = 10.0 * float(img[i] @ txt[j]) - 10.0
            expected += -math.log(1 / (1 + math.exp(-z * logit)))
    assert siglip_loss(img, txt, t, b).item() == pytest.approx(expected / 5, rel=1e-5)


def test_siglip_loss_at_init_is_dominated_by_the_positive_pairs():
    # with b = -10 every pair is predicted negative: the B positives each cost ~10, negatives ~0
    img = txt = _emb(16, 32, 0)
    loss = siglip_loss(img, txt, torch.tensor([math.log(10.0)]), torch.tensor([-10.0]))
    assert loss.item() == pytest.approx(-F.logsigmoid(torch.tensor(0.0)).item(), abs=0.01)


def test_clip_loss_matches_cross_entropy_and_is_small_for_aligned_pairs():
    img, txt = _emb(6, 8, 0), _emb(6, 8, 1)
    scale = torch.tensor([math.log(1 / 0.07)])
    logits = img @ txt.T / 0.07
    labels = torch.arange(6)
    ref = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    assert clip_loss(img, txt, scale).item() == pytest.approx(ref.item(), rel=1e-5)
    assert clip_loss(img, img, torch.tensor([math.log(100.0)])).item() < 0.05


def test_clip_temperature_is_clamped_at_100():
    img, txt = _emb(4, 8, 0), _emb(4, 8, 1)
    assert clip_loss(img, txt, torch.tensor([10.0])).item() == pytest.approx(
        clip_loss(img, txt, torch.tensor([math.log(100.0)])).item())


def test_losses_give_gradients_to_scale_and_bias():
    img, txt = _emb(4, 8, 0).requires_grad_(), _emb(4, 8, 1)
    t, b = torch.tensor([1.0], requires_grad=True), torch.tensor([-1.0], requires_grad=True)
    siglip_loss(img, txt, t, b).backward()
    assert t.grad.abs().item() > 0 and b.grad.abs().item() > 0 and img.grad.abs().sum() > 0


@pytest.mark.parametrize("chunk", [0, 1, 2, 3, 5, 8])
@pytest.mark.parametrize("name", ["siglip", "clip"])
def test_global_forms_on_one_rank_equal_the_references(name, chunk):
    """With one rank the global forms reduce to the reference; chunking changes nothing."""
    from rsclip_ds.losses import build_loss, clip_loss_global, siglip_loss_global

    def run(fn):
        img, txt = _emb(5, 8, 0).requires_grad_(), _emb(5, 8, 1).requires_grad_()
        t, b = torch.tensor([1.5], requires_grad=True), torch.tensor([-2.0], requires_grad=True)
        loss = fn(img, txt, t, b)
        loss.backward()
        return loss.detach(), img.grad, txt.grad, t.grad

    if name == "siglip":
        got = run(lambda i, t, s, b: siglip_loss_global(i, t, s, b, chunk_size=chunk))
        ref = run(siglip_loss)
    else:
        got = run(lambda i, t, s, b: clip_loss_global(i, t, s, b))
        ref = run(clip_loss)
    for g, r in zip(got, ref):
        assert torch.allclose(g, r, atol=1e-6)
    assert build_loss(name, negatives="global", rank=0, world_size=1) in (siglip_loss, clip_loss)

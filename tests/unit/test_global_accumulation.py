"""Pieces of 'global' accumulation that need no process group."""

import pytest
import torch

from rsclip_ds.model import new_dual_encoder, preset_config
from rsclip_ds.loop import _rng_state, _set_rng_state


def test_rng_replay_gives_the_same_dropout_masks():
    """The cached (no-grad) pass and the replayed pass must see the same randomness."""
    config = preset_config("tiny")
    config.vision_config.attention_dropout = 0.3
    config.text_config.attention_dropout = 0.3
    model = new_dual_encoder(config).train()
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(2, 3, 64, 64, generator=g)
    ids = torch.randint(0, 1000, (2, 48), generator=g)
    state = _rng_state()
    with torch.no_grad():
        cached = model(pixels, ids)
    again = model(pixels, ids)            # RNG moved on: other masks
    _set_rng_state(state)
    replayed = model(pixels, ids)
    assert not torch.allclose(again[0], cached[0])
    assert torch.equal(replayed[0], cached[0]) and torch.equal(replayed[1], cached[1])


def test_one_micro_batch_on_the_device_at_a_time_and_the_big_batch_gradients(monkeypatch):
    """Both passes move each micro-batch when they use it (2k copies, each followed by its
    forward, the previous copy freed by then), and the step still is the big batch's: loss and
    gradients equal plain torch on the concatenated k x micro samples."""
    import weakref

    import rsclip_ds.loop as train_mod
    from rsclip_ds.losses import siglip_loss
    from tests.helpers import LocalEngine

    k, micro, config = 3, 4, preset_config("tiny")
    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (k * micro, 3, 64, 64), dtype=torch.uint8, generator=g)
    ids = torch.randint(0, 1000, (k * micro, 48), generator=g)
    batches = [{"pixel_values": p, "input_ids": i} for p, i in zip(pixels.split(micro), ids.split(micro))]

    events, on_device = [], []
    real_inputs = train_mod._inputs

    def copying_inputs(engine, batch, dtype):   # a "device" copy we can watch being freed
        moved = tuple(t.clone() for t in real_inputs(engine, batch, dtype))
        on_device.append(weakref.ref(moved[0]))
        events.append("move")
        return moved

    class Watched(LocalEngine):
        def __call__(self, *inputs):
            live = sum(ref() is not None for ref in on_device)
            events.append(f"forward({live} on device)")
            return super().__call__(*inputs)

    monkeypatch.setattr(train_mod, "_inputs", copying_inputs)
    engine = Watched(new_dual_encoder(config, seed=1))
    loss = train_mod.global_optimizer_step(engine, batches, siglip_loss, torch.float32)
    assert events == ["move", "forward(1 on device)"] * (2 * k)

    reference = new_dual_encoder(config, seed=1)
    ref_loss = siglip_loss(*reference(pixels, ids))
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)
    for (name, p), r in zip(engine.module.named_parameters(), reference.parameters()):
        assert (p.grad - r.grad).abs().max() < 2e-5, name


def test_the_logit_scale_and_bias_get_their_gradient_once_in_the_last_micro_batch():
    """global_optimizer_step adds the whole batch's gradient of the logit scale and bias in the last
    micro-batch's backward only: DeepSpeed 0.19.8's optimizer-offload paths drop a gradient a
    parameter got only in an earlier micro-batch of the step (measured by the removed
    benchmarks/precision/grad_accum.py: docs/results/training.md#grad-accum). The towers get theirs
    in every micro-batch; the sum still is the big batch's (the test above)."""
    import rsclip_ds.loop as train_mod
    from rsclip_ds.losses import siglip_loss
    from tests.helpers import LocalEngine

    k, micro, config = 3, 4, preset_config("tiny")
    g = torch.Generator().manual_seed(0)
    batches = [{"pixel_values": torch.randint(0, 256, (micro, 3, 64, 64), dtype=torch.uint8, generator=g),
                "input_ids": torch.randint(0, 1000, (micro, 48), generator=g)} for _ in range(k)]
    got = []

    class Recording(LocalEngine):
        def backward(self, loss, scale_wrt_gas: bool = True):
            before = [None if p.grad is None else p.grad.clone() for p in self._watched()]
            super().backward(loss, scale_wrt_gas)
            got.append([a is None and b.grad is not None or a is not None and not torch.equal(a, b.grad)
                        for a, b in zip(before, self._watched())])

        def _watched(self):
            m = self.module
            return [m.logit_scale, m.logit_bias, m.vision_model.embeddings.patch_embedding.weight]

    train_mod.global_optimizer_step(Recording(new_dual_encoder(config, seed=1)), batches, siglip_loss, torch.float32)
    # per backward: (scale changed, bias changed, a tower weight changed)
    assert got == [[False, False, True]] * (k - 1) + [[True, True, True]]

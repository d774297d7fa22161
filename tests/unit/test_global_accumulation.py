"""Pieces of 'global' accumulation that need no process group."""

import torch

from rsclip_ds.model import new_dual_encoder, preset_config
from rsclip_ds.train import _rng_state, _set_rng_state


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

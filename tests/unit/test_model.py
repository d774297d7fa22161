import math

import pytest
import torch

from rsclip_ds.config import ConfigError, ModelConfig
from rsclip_ds.model import (PRESETS, apply_activation_checkpointing, build_model, preset_config,
                             save_pretrained)


@pytest.fixture(scope="module")
def tok_dir(tiny_tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    tiny_tokenizer.save_pretrained(str(path))
    return path


def _batch(bundle, b=3):
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(b, 3, bundle.image_size, bundle.image_size, generator=g)
    ids = torch.randint(0, len(bundle.tokenizer), (b, bundle.max_text_length), generator=g)
    return pixels, ids


def test_tiny_builds_with_siglip_init_and_no_0dim_parameters(tok_dir):
    bundle = build_model(ModelConfig(preset="tiny", tokenizer=tok_dir), seed=0)
    m = bundle.model
    assert m.logit_scale.shape == (1,) and m.logit_bias.shape == (1,)   # 0-dim crashes DS 0.19.8
    assert all(p.dim() > 0 for p in m.parameters())
    assert m.logit_scale.item() == pytest.approx(math.log(10.0))
    assert m.logit_bias.item() == pytest.approx(-10.0)
    assert m.config.text_config.vocab_size == len(bundle.tokenizer)
    img, txt, _, _ = m(*_batch(bundle))
    assert img.shape == txt.shape == (3, 64)
    assert torch.allclose(img.norm(dim=-1), torch.ones(3), atol=1e-5)


def test_same_seed_same_weights_and_clip_freezes_bias(tok_dir):
    a = build_model(ModelConfig(tokenizer=tok_dir), seed=1).model
    b = build_model(ModelConfig(tokenizer=tok_dir), seed=1).model
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    other = build_model(ModelConfig(tokenizer=tok_dir), seed=2).model   # the seed reaches the weights
    assert not torch.equal(a.vision_model.encoder.layers[0].mlp.fc1.weight, other.vision_model.encoder.layers[0].mlp.fc1.weight)
    clip = build_model(ModelConfig(tokenizer=tok_dir), seed=1, loss="clip").model
    assert clip.logit_scale.item() == pytest.approx(math.log(1 / 0.07))
    assert not clip.logit_bias.requires_grad


def test_from_scratch_without_tokenizer_names_the_fix():
    with pytest.raises(ConfigError, match="rsclip-ds train-tokenizer"):
        build_model(ModelConfig(preset="tiny"), seed=0)


@pytest.mark.parametrize("preset, millions", [("git-rsclip-large", 652), ("git-rsclip-base", 203)])
def test_presets_have_the_published_size(preset, millions):
    from transformers import SiglipModel

    with torch.device("meta"):
        model = SiglipModel(preset_config(preset))
    n = sum(p.numel() for p in model.parameters()) / 1e6
    assert n == pytest.approx(millions, rel=0.02)
    vc = PRESETS[preset]["vision"]
    assert (vc["image_size"], vc["patch_size"]) == ((256, 16) if "large" in preset else (224, 16))


def test_pretrained_folder_round_trip(tok_dir, tmp_path):
    """save_pretrained writes a Hugging Face folder; pretrained= loads it with from_pretrained and
    gives the same embeddings; transformers' own AutoModel loads it too."""
    from transformers import AutoModel

    bundle = build_model(ModelConfig(tokenizer=tok_dir), seed=3)
    save_pretrained(bundle.model, bundle.tokenizer, tmp_path, mean=(0.4, 0.5, 0.6), std=(0.2, 0.3, 0.4))
    loaded = build_model(ModelConfig(pretrained=tmp_path), seed=99)
    assert loaded.image_mean == (0.4, 0.5, 0.6) and loaded.image_std == (0.2, 0.3, 0.4)
    pixels, ids = _batch(bundle)
    with torch.no_grad():
        ref = bundle.model.eval()(pixels, ids)
        got = loaded.model.eval()(pixels, ids)
        hf = AutoModel.from_pretrained(str(tmp_path)).eval()
        hf_img = hf.get_image_features(pixel_values=pixels).pooler_output
    for r, g in zip(ref, got):
        assert torch.allclose(r, g, atol=1e-6)
    assert torch.allclose(torch.nn.functional.normalize(hf_img, dim=-1), ref[0], atol=1e-5)
    assert loaded.tokenizer("a river")["input_ids"] == bundle.tokenizer("a river")["input_ids"]


def test_a_pretrained_folder_loads_in_training_mode_so_patch_dropout_and_checkpointing_act(tok_dir, tmp_path):
    """from_pretrained returns eval mode; a loaded model must train like a fresh one: patch
    dropout keeps half the image tokens and transformers' gradient checkpointing (which checks
    `.training`) is not skipped."""
    from rsclip_ds.model import apply_patch_dropout, kept_tokens

    bundle = build_model(ModelConfig(tokenizer=tok_dir), seed=3)
    save_pretrained(bundle.model, bundle.tokenizer, tmp_path)
    loaded = build_model(ModelConfig(pretrained=tmp_path), seed=99).model
    assert all(m.training for m in loaded.modules())
    apply_patch_dropout(loaded, 0.5)
    pixels, _ = _batch(bundle)
    v = loaded.vision_model.config
    n = (v.image_size // v.patch_size) ** 2
    tokens = loaded.vision_model.embeddings(pixels)                                    # (B, K, D)
    assert tokens.shape[1] == kept_tokens(n, 0.5) < n


def test_not_a_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="not a Hugging Face model folder"):
        build_model(ModelConfig(pretrained=tmp_path), seed=0)


def test_activation_checkpointing_saves_memory_and_gives_the_same_gradients(tok_dir):
    def grads(ac):
        bundle = build_model(ModelConfig(tokenizer=tok_dir), seed=0)
        if ac:
            apply_activation_checkpointing(bundle.model)
        bundle.model.train()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            img, txt, *_ = bundle.model(*_batch(bundle))
        (img.sum() + txt.pow(2).sum()).backward()
        return [p.grad.clone() for p in bundle.model.parameters() if p.grad is not None], sum(saved)

    (plain, plain_saved), (ckpt, ckpt_saved) = grads(False), grads(True)
    assert ckpt_saved < 0.6 * plain_saved   # the encoder layers' activations are not kept
    assert len(plain) == len(ckpt) > 0
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, ckpt))

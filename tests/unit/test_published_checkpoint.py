"""A folder shaped like the published Git-RSCLIP (tests/published_like.py), measured against
transformers itself: token ids, evaluation pixels, embeddings of the loaded model, zero-shot
probabilities against the `zero-shot-image-classification` pipeline; the 16-bit weights load
as fp32; a hub id resolves from a cache laid out as huggingface_hub lays it out, offline.

Measured differences (max abs) are printed with `pytest -s` and asserted below the stated
tolerances."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from rsclip_ds.config import ConfigError, ModelConfig
from rsclip_ds.data.tokenizer import tokenize
from rsclip_ds.evaluation.embed import Embedder, class_embeddings, eval_transform, uint8_batch
from rsclip_ds.evaluation.metrics import zero_shot_probabilities
from rsclip_ds.hub import is_hub_id, resolve_source
from rsclip_ds.model import build_model, load_tokenizer, normalize_pixels
from tests.published_like import IMAGE_SIZE, TEXT_LENGTH, captions, write_hf_cache, write_published_like

TEMPLATE = "a satellite photo of {}."
CLASSES = ["forest", "river", "dense residential area", "airport"]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return write_published_like(tmp_path_factory.mktemp("git_rsclip_like"))


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list:
    """JPEGs and PNGs of several sizes (smaller and larger than the model's input, not square)."""
    out = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(3)
    paths = []
    for i, (h, w, fmt) in enumerate([(20, 28, "JPEG"), (64, 48, "PNG"), (100, 130, "JPEG"), (33, 33, "PNG")]):
        yy, xx = np.mgrid[0:h, 0:w]
        arr = np.stack([(xx * 7 + i * 40) % 256, (yy * 5) % 256, rng.integers(0, 256, (h, w))], -1).astype(np.uint8)
        path = out / f"img{i}.{'jpg' if fmt == 'JPEG' else 'png'}"
        Image.fromarray(arr).save(path, fmt, quality=92)
        paths.append(path)
    return paths


def test_the_folder_has_the_published_files_only(published):
    assert sorted(p.name for p in published.iterdir()) == sorted([
        "config.json", "model.safetensors", "spiece.model", "tokenizer_config.json",
        "special_tokens_map.json", "preprocessor_config.json"])
    assert {t.dtype for t in load_file(published / "model.safetensors").values()} == {torch.float16}


def test_token_ids_equal_siglip_processor(published):
    from transformers import SiglipProcessor

    bundle = build_model(ModelConfig(pretrained=str(published)), seed=0)
    texts = [TEMPLATE.format(c) for c in CLASSES] + captions(6, seed=5) + [" ".join(captions(20, seed=9))]  # one > 64 tokens
    ours = tokenize(bundle.tokenizer, texts, bundle.max_text_length)
    theirs = SiglipProcessor.from_pretrained(str(published))(
        text=texts, padding="max_length", max_length=TEXT_LENGTH, truncation=True, return_tensors="pt")["input_ids"]
    assert bundle.max_text_length == TEXT_LENGTH
    assert type(bundle.tokenizer).__name__ == "SiglipTokenizer"
    assert ours.shape == (len(texts), TEXT_LENGTH)
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()


def test_evaluation_pixels_equal_siglip_image_processor(published, images):
    from transformers import AutoImageProcessor

    bundle = build_model(ModelConfig(pretrained=str(published)), seed=0)
    # what the model receives from evaluation (uint8) and normalises itself, with the folder's mean/std
    ours = normalize_pixels(uint8_batch(eval_transform(bundle), images), bundle.model.image_mean,
                            bundle.model.image_std)
    processor = AutoImageProcessor.from_pretrained(str(published))
    theirs = processor(images=[Image.open(p).convert("RGB") for p in images], return_tensors="pt")["pixel_values"]
    diff = (ours - theirs).abs().max().item()
    print(f"\nevaluation pixels vs {type(processor).__name__}: max abs {diff:.2e} (normalised units)")
    assert ours.shape == theirs.shape == (len(images), 3, IMAGE_SIZE, IMAGE_SIZE)
    assert diff < 1e-6


def test_16bit_weights_load_as_fp32_and_embed_as_transformers(published, images):
    """The loaded model's embeddings equal SiglipModel's get_image/text_features (normalised)."""
    from transformers import AutoImageProcessor, SiglipModel

    bundle = build_model(ModelConfig(pretrained=str(published)), seed=0)
    params = dict(bundle.model.named_parameters())
    stored = load_file(published / "model.safetensors")
    assert {p.dtype for p in params.values()} == {torch.float32}
    assert max((params[k] - v.float()).abs().max().item() for k, v in stored.items() if k in params) == 0.0
    reference = SiglipModel.from_pretrained(str(published), dtype=torch.float32).eval()
    pixels = AutoImageProcessor.from_pretrained(str(published))(
        images=[Image.open(p).convert("RGB") for p in images], return_tensors="pt")["pixel_values"]
    ids = tokenize(bundle.tokenizer, [TEMPLATE.format(c) for c in CLASSES], TEXT_LENGTH)
    with torch.no_grad():
        image, text, _, _ = bundle.model.eval()(pixels, ids)
        ref_image = torch.nn.functional.normalize(reference.get_image_features(pixel_values=pixels).pooler_output, dim=-1)
        ref_text = torch.nn.functional.normalize(reference.get_text_features(input_ids=ids).pooler_output, dim=-1)
    diffs = (image - ref_image).abs().max().item(), (text - ref_text).abs().max().item()
    print(f"\nembeddings vs SiglipModel: image {diffs[0]:.2e}, text {diffs[1]:.2e}")
    assert max(diffs) < 1e-6


def test_zero_shot_probabilities_equal_the_transformers_pipeline(published, images):
    from transformers import pipeline

    bundle = build_model(ModelConfig(pretrained=str(published)), seed=0)
    embedder = Embedder(bundle.model.eval(), bundle, batch_size=3, progress=False)
    image_emb, text_emb = embedder.embed(images, [TEMPLATE.format(c) for c in CLASSES], "zero-shot")
    ours = zero_shot_probabilities(image_emb, class_embeddings(text_emb, len(CLASSES), 1),
                                   embedder.logit_scale, embedder.logit_bias)            # (N, C)
    # fp32 like ours: left to itself transformers 5 runs the folder's stored dtype (fp16 here)
    classify = pipeline("zero-shot-image-classification", model=str(published), device="cpu", dtype=torch.float32)
    theirs = torch.zeros_like(ours)
    for i, path in enumerate(images):
        for row in classify(Image.open(path).convert("RGB"), candidate_labels=CLASSES, hypothesis_template=TEMPLATE):
            theirs[i, CLASSES.index(row["label"])] = row["score"]
    diff = (ours - theirs).abs().max().item()
    print(f"\nzero-shot probabilities vs pipeline: max abs {diff:.2e} (range {ours.min():.3f}..{ours.max():.3f})")
    assert 0.005 < ours.min() and ours.max() < 0.995   # the comparison means something
    assert diff < 1e-5


def test_a_missing_tokenizer_backend_names_the_package(published, monkeypatch):
    from transformers import AutoTokenizer

    def no_sentencepiece(*args, **kwargs):
        raise ImportError("SiglipTokenizer requires the SentencePiece library but it was not found in "
                          "your environment.")
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", no_sentencepiece)
    with pytest.raises(ConfigError, match="pip install sentencepiece"):
        load_tokenizer(published)


# --------------------------------------------------------------------------- hub ids

def test_a_hub_id_resolves_from_the_cache_offline(published, tmp_path, monkeypatch):
    commit = write_hf_cache(tmp_path / "hub", "lcybuaa/Git-RSCLIP", published)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants   # read at import: point them at the test cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert is_hub_id("lcybuaa/Git-RSCLIP") and not is_hub_id(str(published))
    for revision in (None, commit):
        bundle = build_model(ModelConfig(pretrained="lcybuaa/Git-RSCLIP", revision=revision), seed=0)
        assert bundle.source.kind == "hub" and bundle.source.commit == commit
        assert str(bundle.source).startswith("lcybuaa/Git-RSCLIP@0123456789ab")
        assert type(bundle.tokenizer).__name__ == "SiglipTokenizer"
    with pytest.raises(ConfigError, match="hf download lcybuaa/Other"):
        resolve_source(ModelConfig(pretrained="lcybuaa/Other"))


def test_the_export_model_card_names_the_hub_base_model():
    from rsclip_ds.checkpoint import _model_card
    from rsclip_ds.hub import ModelSource

    hub = ModelSource("hub", "lcybuaa/Git-RSCLIP", folder="/cache/x", revision=None, commit="0" * 40).to_dict()
    card = _model_card("git-rsclip-rsicd", hub, step=3000, dtype="bf16")
    header = card.split("---")[1]
    assert "base_model: lcybuaa/Git-RSCLIP" in header and "library_name: transformers" in header
    assert "3000 optimizer steps" in card and "bf16" in card
    folder = _model_card("m", ModelSource("folder", "models/x", folder="models/x").to_dict(), 5, "fp32")
    assert "base_model" not in folder and "models/x" in folder


def test_source_checks_fail_before_launch(tmp_path):
    from rsclip_ds.hub import check_source

    with pytest.raises(ConfigError, match="not a hub id"):
        check_source(ModelConfig(pretrained=str(tmp_path / "missing" / "deeper" / "x")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="hf download"):
        check_source(ModelConfig(pretrained=str(tmp_path / "empty")))
    with pytest.raises(ValueError, match="model.revision"):
        ModelConfig(revision="abc")
    check_source(ModelConfig(pretrained="lcybuaa/Git-RSCLIP"))   # a hub id: checked when fetched

"""A folder shaped like the published Git-RSCLIP (`lcybuaa/Git-RSCLIP`), small enough for tests.

The published folder holds `config.json`, `model.safetensors` (16-bit), `spiece.model`,
`tokenizer_config.json`, `special_tokens_map.json` and `preprocessor_config.json`; the
tokenizer and image-processor files are written here as the SigLIP releases write them (not as
rsclip_ds or this transformers version would), and nothing rsclip_ds-specific is in it. The
SentencePiece model is trained on the spot with sentencepiece's own trainer.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch

IMAGE_SIZE = 32
TEXT_LENGTH = 64          # the real model's max_position_embeddings
TOKENIZER_CONFIG = {       # as google/siglip-* and lcybuaa/Git-RSCLIP ship it
    "additional_special_tokens": [], "clean_up_tokenization_spaces": True, "do_lower_case": True,
    "eos_token": "</s>", "model_input_names": ["input_ids"], "model_max_length": TEXT_LENGTH,
    "pad_token": "</s>", "processor_class": "SiglipProcessor", "sp_model_kwargs": {},
    "tokenizer_class": "SiglipTokenizer", "unk_token": "<unk>"}
SPECIAL_TOKENS = {"eos_token": "</s>", "pad_token": "</s>", "unk_token": "<unk>"}
PREPROCESSOR = {"do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
                "image_processor_type": "SiglipImageProcessor", "image_std": [0.5, 0.5, 0.5],
                "processor_class": "SiglipProcessor", "resample": 3, "rescale_factor": 1 / 255,
                "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}}


def captions(n: int = 600, seed: int = 0) -> list[str]:
    from rsclip_ds.data.synthetic import render_sample

    rng = np.random.default_rng(seed)
    return [render_sample(rng, 8)[1] for _ in range(n)]


def train_sentencepiece(texts: list[str], out: Path, vocab_size: int = 90) -> Path:
    """A unigram SentencePiece model with SigLIP's special ids (pad 0, eos 1, unk 2, no bos)."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(out / "spiece"),
                                   vocab_size=vocab_size, model_type="unigram", character_coverage=1.0,
                                   pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2,
                                   num_threads=1, seed_sentencepiece_size=100000)
    (out / "spiece.vocab").unlink()   # the trainer's side file; the published folder has none
    return out / "spiece.model"


def write_published_like(out: Path, *, dtype: torch.dtype = torch.float16, seed: int = 0) -> Path:
    """-> ``out``: a SigLIP-shaped folder, weights saved in ``dtype`` as safetensors."""
    from transformers import SiglipConfig, SiglipModel

    out.mkdir(parents=True, exist_ok=True)
    spiece = train_sentencepiece(captions(), out)
    import sentencepiece as spm

    vocab = spm.SentencePieceProcessor(model_file=str(spiece)).get_piece_size()
    config = SiglipConfig(
        text_config=dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=TEXT_LENGTH),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=IMAGE_SIZE, patch_size=8))
    torch.manual_seed(seed)
    model = SiglipModel(config).eval()
    with torch.no_grad():   # a trained model's temperature and bias: probabilities away from 0 and 1
        model.logit_scale.fill_(math.log(20.0))
        model.logit_bias.fill_(-2.0)
    model.to(dtype).save_pretrained(str(out), safe_serialization=True)
    (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(SPECIAL_TOKENS, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    return out


COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hf_cache(root: Path, repo: str, folder: Path, commit: str = COMMIT) -> str:
    """``folder`` as revision ``commit`` of ``repo``, laid out as huggingface_hub caches it (blobs,
    a snapshot of links, refs/main); point HF_HUB_CACHE at ``root``. Returns the commit."""
    base = root / f"models--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    (base / "blobs").mkdir()
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    for i, item in enumerate(sorted(folder.iterdir())):
        blob = base / "blobs" / f"{i:040x}"
        shutil.copy2(item, blob)
        (snap / item.name).symlink_to(blob)
    return commit

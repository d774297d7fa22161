"""A small WordPiece tokenizer built from the captions of the shards, for from-scratch runs:
whole words by frequency plus single characters, so that no word is unknown.

SigLIP-style: lowercase, every caption ends with ``</s>`` and is padded to ``max_length`` with
``<pad>``, no attention mask (the SigLIP text tower pools the last position, which is then
always a pad). Special ids are fixed: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2. The eos id is
deliberately not 2: Hugging Face's CLIP text model treats ``eos_token_id == 2`` as the legacy
"pool at the highest token id" rule, which would pool at a random word with this vocabulary.

    tok = train_tokenizer(iter_captions(urls), "runs/tok", vocab_size=1000, max_length=64)
    AutoTokenizer.from_pretrained("runs/tok")   # works offline
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator

import torch
import webdataset as wds
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, EOS, UNK]  # ids 0, 1, 2 in this order


def _pick_caption(sample: dict, keys: list[str]) -> str:
    for key in keys:
        if key in sample:
            return sample[key].decode("utf-8").strip()
    members = sorted(k for k in sample if not k.startswith("__"))
    raise ValueError(f"sample {sample.get('__key__')!r} in {sample.get('__url__')} has no caption "
                     f"member {keys} (it has {members}); set data.caption_key to one of those")


def iter_captions(urls: list[str], caption_key: str = "txt") -> Iterator[str]:
    """Captions of every sample of ``urls`` in order; ``caption_key`` may list ';'-separated options."""
    keys = [k.strip() for k in caption_key.split(";") if k.strip()]
    # No nodesplitter / shuffle: a plain single-process pass over the shards in the given order.
    pipeline = wds.DataPipeline(wds.SimpleShardList(list(urls)), wds.tarfile_to_samples())
    for sample in pipeline:
        yield _pick_caption(sample, keys)


def _build_backend() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token=UNK, max_input_chars_per_word=100))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()  # split on whitespace and punctuation
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return tok


def _word_vocab(backend: Tokenizer, captions: Iterable[str], vocab_size: int) -> dict[str, int]:
    """Special tokens, every character seen (as a word start and as a '##' continuation, so no
    word is ever <unk>), then whole words by frequency, ties by spelling. Deterministic by
    construction: the tokenizers library's WordPiece trainer numbers its merges in the order of
    a randomly seeded hash map, so two processes trained on the same captions produced different
    vocabularies (checked), i.e. runs that did not reproduce."""
    counts: Counter[str] = Counter()
    for caption in captions:
        normalized = backend.normalizer.normalize_str(caption)
        counts.update(w for w, _ in backend.pre_tokenizer.pre_tokenize_str(normalized))
    chars = sorted({c for w in counts for c in w})
    pieces = SPECIAL_TOKENS + chars + [f"##{c}" for c in chars]
    if vocab_size < len(pieces):
        raise ValueError(f"vocab_size {vocab_size} cannot hold the {len(pieces)} special and character "
                         f"tokens of these captions; use at least {len(pieces) + 100}")
    words = sorted((w for w in counts if len(w) > 1), key=lambda w: (-counts[w], w))
    pieces += words[: vocab_size - len(pieces)]
    return {t: i for i, t in enumerate(pieces)}


def train_tokenizer(captions: Iterable[str], out_dir: str | Path, *, vocab_size: int = 1000,
                    max_length: int = 64) -> PreTrainedTokenizerFast:
    """Build the vocabulary from ``captions``, save a Hugging Face folder in ``out_dir``, return it."""
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 to hold a word and </s> (got {max_length})")
    backend = _build_backend()
    backend.model = models.WordPiece(_word_vocab(backend, captions, vocab_size), unk_token=UNK,
                                     max_input_chars_per_word=100)
    eos_id = backend.token_to_id(EOS)
    backend.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, eos_id)])

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, model_max_length=max_length, padding_side="right",
        truncation_side="right", pad_token=PAD, eos_token=EOS, unk_token=UNK,
        model_input_names=["input_ids"])  # no attention mask: SigLIP pads to max_length
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def tokenize(tokenizer, captions: list[str], max_length: int) -> torch.LongTensor:
    """Captions -> (B, max_length) int64 ids, padded and truncated (``</s>`` is kept on truncation)."""
    out = tokenizer(list(captions), padding="max_length", truncation=True, max_length=max_length,
                    return_attention_mask=False, return_token_type_ids=False, return_tensors="pt")
    return out["input_ids"]  # (B, L)

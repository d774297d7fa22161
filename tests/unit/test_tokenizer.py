"""Caption tokenizer: trained from shards, SigLIP-style padding, reloads offline."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoTokenizer

from rsclip_ds.data.tokenizer import iter_captions, tokenize, train_tokenizer


def _urls(index, split="train"):
    return [str(index["dir"] / s["url"]) for s in index[split]]


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def test_iter_captions_reads_every_sample_in_order(tiny_shards):
    captions = list(iter_captions(_urls(tiny_shards, "val")))
    assert len(captions) == sum(s["num_samples"] for s in tiny_shards["val"]) == 16
    assert all(c.endswith(".") for c in captions)


def test_iter_captions_names_the_missing_key(tiny_shards):
    with pytest.raises(ValueError, match="caption_key"):
        next(iter_captions(_urls(tiny_shards, "val"), caption_key="caption"))


def test_round_trip_recovers_caption_words(tiny_shards, tiny_tokenizer):
    captions = list(iter_captions(_urls(tiny_shards)))
    ids = tokenize(tiny_tokenizer, captions, max_length=40)  # (64, 40); captions need <= 33
    assert ids.shape == (64, 40) and ids.dtype == torch.int64
    for row, caption in zip(ids, captions):
        assert _words(tiny_tokenizer.decode(row, skip_special_tokens=True)) == _words(caption)
        assert tiny_tokenizer.unk_token_id not in row.tolist()


def test_padding_eos_and_truncation(tiny_tokenizer):
    tok = tiny_tokenizer
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    ids = tokenize(tok, ["forest", "water " * 40, "Ω"], max_length=8)  # (3, 8)
    short, long_, unknown = ids.tolist()
    n = short.index(tok.eos_token_id)
    assert n >= 1 and short[n + 1:] == [tok.pad_token_id] * (8 - n - 1)
    assert long_[-1] == tok.eos_token_id and tok.pad_token_id not in long_  # eos survives truncation
    assert unknown[:2] == [tok.unk_token_id, tok.eos_token_id]


def test_reload_from_folder_gives_same_ids(tiny_shards, tiny_tokenizer, tmp_path):
    captions = list(iter_captions(_urls(tiny_shards, "val")))
    tok = train_tokenizer(captions, tmp_path, vocab_size=200, max_length=20)
    again = AutoTokenizer.from_pretrained(tmp_path)  # local folder only: no hub access
    assert again.model_max_length == 20
    assert torch.equal(tokenize(again, captions, 20), tokenize(tok, captions, 20))
    assert "attention_mask" not in again(captions[:2], padding="max_length", max_length=20)


_TRAIN_IN_SUBPROCESS = """
import sys
from rsclip_ds.data.tokenizer import train_tokenizer
caps = [f"a {c} field with {n} {o} in the {p}" for c in ("green", "brown", "sparse") for n in ("two", "many")
        for o in ("houses", "trees", "ponds") for p in ("top left", "centre", "bottom right")]
train_tokenizer(caps, sys.argv[1], vocab_size=200, max_length=16)
"""


def test_same_captions_give_the_same_vocabulary_in_every_process(tmp_path):
    """The tokenizers library's trainer numbers merges in a randomly seeded hash map's order;
    ours must not depend on the process (it did: 3 processes gave 2 different vocabularies)."""
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", _TRAIN_IN_SUBPROCESS, str(tmp_path / f"t{i}")])
             for i in range(3)]   # at once: each is mostly the interpreter's imports
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0]
    files = [(tmp_path / f"t{i}" / "tokenizer.json").read_bytes() for i in range(3)]
    assert files[0] == files[1] == files[2]


def test_unseen_words_are_spelled_not_unknown(tmp_path):
    tok = train_tokenizer(["green field", "brown field"], tmp_path, vocab_size=100, max_length=8)
    ids = tokenize(tok, ["brine"], 8)[0].tolist()   # 'brine' was never seen, its letters were
    assert tok.unk_token_id not in ids
    assert tok.decode([i for i in ids if i not in (tok.pad_token_id, tok.eos_token_id)]) == "brine"
    assert tokenize(tok, ["field"], 8)[0, 0] == tok.convert_tokens_to_ids("field")   # a whole word

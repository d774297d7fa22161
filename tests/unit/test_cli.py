"""The CLI fails before any process group starts, with the key and the fix in the message."""

import json
import re

import pytest
from transformers import AutoTokenizer

from rsclip_ds.cli import strip_local_rank, main
from rsclip_ds.data.tokenizer import iter_captions, tokenize


def test_launcher_local_rank_is_accepted_anywhere():
    assert strip_local_rank(["--local_rank=1", "train", "--set", "a=1"]) == ["train", "--set", "a=1"]
    assert strip_local_rank(["train", "--local_rank", "0", "--config", "x"]) == ["train", "--config", "x"]


@pytest.mark.parametrize("sets, fragment", [
    (["bogus=1"], "bogus: unknown key"),
    (["profile=zero9"], "unknown profile 'zero9'; available: ddp, zero1, zero2"),
    (["data.train_shards=/nonexistent/shard-{0..3}.tar"], "matches no file"),
    ([], "data.train_shards is not set"),
    (["batch.micro_batch_size=0"], "batch.micro_batch_size: Input should be greater than or equal to 1"),
    (["data.train_shards={shards}", "data.train_weights=[1,2]"],
     "data.train_weights [1.0, 2.0] needs one non-negative weight per '::'-separated"),
])
def test_train_rejects_bad_input_before_starting(sets, fragment, capsys, monkeypatch, tiny_shards):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    shards = tiny_shards["train_pattern"]
    argv = ["train"] + [a for s in sets for a in ("--set", s.replace("{shards}", shards))]
    assert main(argv) == 2
    assert fragment in capsys.readouterr().err


def test_inconsistent_batch_in_a_profile_is_reported(tmp_path, capsys):
    profile = tmp_path / "mine.json"
    profile.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}))
    assert main(["train", "--set", f"profile={profile}", "--set", "batch.gradient_accumulation_steps=2"]) == 2
    err = capsys.readouterr().err
    assert "gradient_accumulation_steps=4" in err and "batch.gradient_accumulation_steps" in err


def test_make_synthetic_and_train_tokenizer_commands(tmp_path, capsys):
    assert main(["make-synthetic", "--out", str(tmp_path / "d"), "--num-train", "32", "--num-val", "8",
                 "--shard-size", "16", "--image-size", "32"]) == 0
    assert sorted(p.name for p in (tmp_path / "d").glob("*.tar")) == [
        "train-000000.tar", "train-000001.tar", "val-000000.tar"]
    captions = list(iter_captions([str(tmp_path / "d" / f"train-00000{i}.tar") for i in (0, 1)]))
    assert len(captions) == 32   # --num-train samples, each with a caption
    assert main(["train-tokenizer", "--shards", str(tmp_path / "d" / "train-{000000..000001}.tar"),
                 "--out", str(tmp_path / "tok"), "--vocab-size", "200", "--max-length", "48"]) == 0
    # the folder reloads offline with the asked size and length and covers the captions' words
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert len(tok) <= 200 and tok.model_max_length == 48
    assert f"tokenizer with {len(tok)} tokens written to" in capsys.readouterr().out
    ids = tokenize(tok, captions, max_length=48)   # (32, 48)
    assert (ids != tok.unk_token_id).all()
    for row, caption in zip(ids, captions):
        words = re.findall(r"[a-z]+", caption.lower())
        assert re.findall(r"[a-z]+", tok.decode(row, skip_special_tokens=True)) == words


def test_show_config_and_profiles_print_tables(capsys):
    assert main(["show-config", "--set", "steps=77"]) == 0
    out = capsys.readouterr().out
    assert "batch.micro_batch_size" in out and "77" in out
    assert main(["profiles"]) == 0
    assert "zero3_offload" in capsys.readouterr().out

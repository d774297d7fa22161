"""Evaluation inputs: class names from folders, prompt templates, class-folder and caption-JSON
sets, the synthetic eval layout, rank interleaving and batch-size independence of embedding."""

import json

import pytest
import torch
from PIL import Image

from rsclip_ds.config import ConfigError, EvalConfig, ModelConfig, load_config
from rsclip_ds.evaluation.datasets import (EvalSets, class_name_from_folder, load_caption_json,
                                           load_class_folders, load_templates)
from rsclip_ds.evaluation.embed import Embedder, class_embeddings, interleave_ranks
from rsclip_ds.data.synthetic import LAND_COVER_CLASSES, TEMPLATES, make_synthetic


@pytest.mark.parametrize("folder, name", [
    ("denseResidential", "dense residential"),          # UCMerced / AID style
    ("DenseResidential", "dense residential"),
    ("baseball_diamond", "baseball diamond"),           # NWPU-RESISC45
    ("AnnualCrop", "annual crop"),                      # EuroSAT
    ("HerbaceousVegetation", "herbaceous vegetation"),
    ("SeaLake", "sea lake"),
    ("storage-tanks", "storage tanks"),
    ("RSImage_Port", "rs image port"),                  # an acronym, then a word
    ("Airport", "airport"),
])
def test_class_name_from_folder(folder, name):
    assert class_name_from_folder(folder) == name


def test_shipped_templates():
    templates = load_templates()
    assert templates[0] == "a remote sensing image of {}."   # Git-RSCLIP's own prompt
    assert "a satellite photo of {}." in templates and len(templates) >= 4
    assert all(t.count("{}") == 1 for t in templates)


def test_custom_templates_and_errors(tmp_path):
    good = tmp_path / "t.txt"
    good.write_text("# comment\n\nphoto of {}\n  {} seen from space  \n")
    assert load_templates(good) == ["photo of {}", "{} seen from space"]
    bad = tmp_path / "bad.txt"
    bad.write_text("photo of {}\nno placeholder here\n")
    with pytest.raises(ConfigError, match=r"bad.txt:2: .*exactly one"):
        load_templates(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_templates(tmp_path / "missing.txt")


def test_class_embeddings_average_templates():
    # 2 classes x 2 templates, class-major
    text = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [-1.0, 0.0]])
    out = class_embeddings(text, 2, 2)
    assert torch.allclose(out, torch.tensor([[2 ** -0.5, 2 ** -0.5], [-1.0, 0.0]]))


def _image(path, color=(10, 20, 30)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (16, 16), color).save(path)


def test_class_folders(tmp_path, caplog):
    for cls, n in (("denseResidential", 2), ("Airport", 1), ("empty_class", 0)):
        (tmp_path / cls).mkdir()
        for i in range(n):
            _image(tmp_path / cls / f"{i}.tif")
    (tmp_path / "Airport" / "notes.txt").write_text("not an image")
    zs = load_class_folders(tmp_path)
    assert zs.folders == ["Airport", "denseResidential", "empty_class"]
    assert zs.class_names == ["airport", "dense residential", "empty class"]
    assert zs.labels == [0, 1, 1] and [p.name for p in zs.paths] == ["0.tif", "0.tif", "1.tif"]
    assert "empty_class has no images" in caplog.text
    with pytest.raises(ConfigError, match="class folder"):
        load_class_folders(tmp_path / "Airport")


def test_caption_json(tmp_path):
    for name in ("a.jpg", "b.tif", "c.jpg"):
        _image(tmp_path / "imgs" / name)
    doc = {"images": [
        {"filename": "a.jpg", "split": "test", "sentences": [{"raw": " one. "}, {"raw": "two."}]},
        {"filename": "b.tif", "split": "test", "sentences": [{"raw": "three."}]},
        {"filename": "c.jpg", "split": "train", "sentences": [{"raw": "four."}]}]}
    (tmp_path / "dataset.json").write_text(json.dumps(doc))
    cs = load_caption_json(tmp_path / "dataset.json")        # finds imgs/ beside the JSON
    assert [p.name for p in cs.image_paths] == ["a.jpg", "b.tif"]
    assert cs.captions == ["one.", "two.", "three."] and cs.text_image_index == [0, 0, 1]
    assert len(load_caption_json(tmp_path / "dataset.json", split="train").captions) == 1
    with pytest.raises(ConfigError, match="no images with split 'val'"):
        load_caption_json(tmp_path / "dataset.json", split="val")
    with pytest.raises(ConfigError, match="retrieval_images"):
        load_caption_json(tmp_path / "dataset.json", images_dir=tmp_path)


def test_eval_config_needs_a_data_set():
    with pytest.raises(ConfigError, match="nothing to evaluate"):
        load_config(None, ["eval.every=10"])
    with pytest.raises(ConfigError, match="nothing to evaluate"):
        EvalSets.from_config(EvalConfig())


def test_interleave_ranks_uneven():
    # 7 items over 3 ranks: rank r holds items r, r + 3, ... padded to 3 rows
    items = torch.arange(7.0)[:, None]
    parts = [torch.cat([items[r::3], torch.zeros(3 - len(items[r::3]), 1)]) for r in range(3)]
    assert torch.equal(interleave_ranks(parts, 7), items)


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    return out, make_synthetic(out, num_train=16, num_val=24, shard_size=8, seed=3, progress=False,
                               eval_layout=True)


def test_synthetic_eval_layout(synth, tmp_path):
    out, index = synth
    plain = tmp_path / "plain"
    make_synthetic(plain, num_train=16, num_val=24, shard_size=8, seed=3, progress=False)
    for tar in plain.glob("*.tar"):                              # shards unchanged by eval_layout
        assert (out / tar.name).read_bytes() == tar.read_bytes()
    index_plain = json.loads((plain / "index.json").read_text())
    assert {k: v for k, v in json.loads((out / "index.json").read_text()).items() if k != "eval"} == index_plain
    zs = load_class_folders(index["zero_shot_dir"])
    assert zs.class_names == sorted(LAND_COVER_CLASSES) and len(zs.paths) == 24
    cs = load_caption_json(index["retrieval_json"])
    assert len(cs.image_paths) == 24 and len(cs.captions) == 24 * len(TEMPLATES)
    # the class folder of each image is its land cover, which every one of its captions names
    name_of = {p.name: zs.class_names[label] for p, label in zip(zs.paths, zs.labels)}
    for caption, i in zip(cs.captions, cs.text_image_index):
        assert name_of[cs.image_paths[i].name] in caption.lower()


def test_embedding_does_not_depend_on_batch_size(synth, tmp_path):
    out, index = synth
    from rsclip_ds.model import build_model
    from rsclip_ds.data.tokenizer import iter_captions, train_tokenizer

    train_tokenizer(iter_captions([str(out / s["url"]) for s in index["train"]]), tmp_path / "tok",
                    vocab_size=200)
    bundle = build_model(ModelConfig(tokenizer=tmp_path / "tok"), 0)
    cs = load_caption_json(index["retrieval_json"])
    a = Embedder(bundle.model.eval(), bundle, 64, progress=False).embed(cs.image_paths, cs.captions, "x")
    b = Embedder(bundle.model.eval(), bundle, 5, progress=False).embed(cs.image_paths, cs.captions, "x")
    assert a[0].shape == (24, 64) and a[1].shape == (96, 64)
    assert torch.allclose(a[0], b[0], atol=1e-5) and torch.allclose(a[1], b[1], atol=1e-5)


def test_cli_make_synthetic_eval_and_eval_errors(tmp_path, capsys):
    from rsclip_ds.cli import main

    assert main(["make-synthetic", "--out", str(tmp_path / "s"), "--num-train", "8", "--num-val", "5",
                 "--shard-size", "8", "--eval"]) == 0
    assert len(load_caption_json(tmp_path / "s/eval/captions.json").image_paths) == 5
    assert len(load_class_folders(tmp_path / "s/eval/classes").paths) == 5
    # a wrong path fails with exit 2 and the fix, before any process group starts
    assert main(["eval", "--checkpoint", str(tmp_path / "nothing")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    assert main(["eval", "--model", str(tmp_path / "s")]) == 2
    assert "not a Hugging Face model folder" in capsys.readouterr().err

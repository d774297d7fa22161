"""The benchmark suite (`rsclip-ds eval --suite`): zero-shot numbers equal transformers' own
pipeline on the Git-RSCLIP-shaped folder; hand-computed metrics on hand-built sets with known
embeddings, on one rank and two; the report (markdown with the published columns, PNG, the
compared model); the template sets; the hook during training; the CLI on a suite root in the
released layouts (that one needs catalog.find_sets, issue 24's catalog part); the per-sample rows behind
every number (issue 46: samples.py) and the files and report.html they go to.""" 

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from rsclip_ds.config import EvalConfig, ModelConfig
from rsclip_ds.data.tokenizer import tokenize
from rsclip_ds.evaluation.catalog import FoundSet, PublishedResult, SetSpec
from rsclip_ds.evaluation.datasets import CaptionSet, ClassFolderSet
from rsclip_ds.evaluation.embed import Embedder
from rsclip_ds.evaluation.hook import make_eval_hook
from rsclip_ds.evaluation.prompts import TEMPLATE_SETS, load_template_set
from rsclip_ds.evaluation.report import markdown_report, write_report
from rsclip_ds.evaluation.suite import evaluate_suite, suite_metrics
from rsclip_ds.model import ModelBundle, build_model
from tests.published_like import write_published_like
from tests.unit.forked_ranks import run_ranks

GIT_RSCLIP_PROMPT = "a remote sensing image of {}"   # its model card's zero-shot example


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return write_published_like(tmp_path_factory.mktemp("git_rsclip_like"))


def _save(path, rgb, size=(24, 20), fmt="PNG", noise=None):
    arr = np.empty((size[1], size[0], 3), np.uint8)
    arr[:] = rgb
    if noise is not None:
        arr = np.clip(arr.astype(int) + noise.integers(-60, 60, arr.shape), 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path, fmt)
    return path


# --------------------------------------------------------------------------- (a) transformers' pipeline

def test_zero_shot_equals_the_transformers_pipeline(published, tmp_path):
    """evaluate_suite with the git-rsclip set (one template) on a class-folder set: the
    probabilities sigmoid(logits) and the top-1 of every image equal the
    zero-shot-image-classification pipeline's with the same labels and hypothesis_template."""
    from transformers import pipeline

    rng = np.random.default_rng(0)
    folders = {"denseresidential": "dense residential", "river": "river", "forest": "forest",
               "airport": "airport"}
    paths, labels = [], []
    for label, folder in enumerate(folders):
        for i in range(3):
            fmt, ext = [("PNG", "png"), ("JPEG", "jpg"), ("TIFF", "tif")][i]
            paths.append(_save(tmp_path / folder / f"{folder}{i}.{ext}", (40 * label, 200 - 30 * i, 90),
                               size=(20 + 7 * i, 30), fmt=fmt, noise=rng))
            labels.append(label)
    cs = ClassFolderSet(paths, labels, list(folders.values()), list(folders))
    found = [FoundSet("UCMerced", tmp_path, "all images", classification=cs)]
    bundle = build_model(ModelConfig(pretrained=str(published)), seed=0)
    embedder = Embedder(bundle.model.eval(), bundle, batch_size=5, progress=False)
    templates = load_template_set("git-rsclip")
    assert templates.templates == (GIT_RSCLIP_PROMPT,)
    record = evaluate_suite(found, embedder, templates, keep_logits=True)["sets"][0]
    ours = torch.sigmoid(torch.tensor(record["logits"]))                                   # (N, C)

    classify = pipeline("zero-shot-image-classification", model=str(published), device="cpu", dtype=torch.float32)
    phrases = list(folders.values())
    theirs = torch.zeros_like(ours)
    for i, path in enumerate(paths):
        for row in classify(Image.open(path).convert("RGB"), candidate_labels=phrases,
                            hypothesis_template=GIT_RSCLIP_PROMPT):
            theirs[i, phrases.index(row["label"])] = row["score"]
    diff = (ours - theirs).abs().max().item()
    logit_diff = (torch.tensor(record["logits"]) - torch.logit(theirs.double()).float()).abs().max().item()
    print(f"\nsuite vs pipeline: probabilities max abs {diff:.2e} (range {ours.min():.4f}..{ours.max():.3f}), "
          f"logits max abs {logit_diff:.2e}")
    assert 1e-4 < ours.min() and 0.3 < ours.max() < 0.999    # unsaturated: the comparison means something
    assert diff < 1e-5 and logit_diff < 1e-3
    assert torch.equal(ours.argmax(1), theirs.argmax(1))
    pipeline_top1 = (theirs.argmax(1) == torch.tensor(labels)).float().mean().item()
    assert record["top1"] == pytest.approx(pipeline_top1, abs=1e-9)
    assert record["class_phrases"] == folders and record["templates"] == [GIT_RSCLIP_PROMPT]
    assert (record["protocol"], record["split"], record["images"], record["classes"]) == \
        ("zero-shot classification", "all images", 12, 4)


# --------------------------------------------------------------------------- (b) known embeddings

E = torch.eye(3)
COLOURS = [(250, 0, 0), (0, 250, 0), (0, 0, 250), (250, 250, 0), (0, 250, 250), (250, 0, 250), (120, 120, 120)]


class KnownModel:
    """model(pixels, ids) with chosen embeddings: an image's by its colour, a text's by its ids."""

    def __init__(self, bundle: ModelBundle, images: dict, texts: dict):
        self.images = {c: torch.nn.functional.normalize(v, dim=0) for c, v in images.items()}
        self.texts = {tuple(tokenize(bundle.tokenizer, [t], bundle.max_text_length)[0].tolist()):
                      torch.nn.functional.normalize(v, dim=0) for t, v in texts.items()}

    def __call__(self, pixels, ids):
        zero = torch.zeros(3)
        image = torch.stack([self.images.get(tuple(p[:, 0, 0].tolist()), zero) for p in pixels])
        text = torch.stack([self.texts.get(tuple(i.tolist()), zero) for i in ids])
        return image, text, torch.tensor([math.log(10.0)]), torch.tensor([-1.0])


def _known_suite(root, bundle, templates):
    """A class-folder set (3 classes, 7 images: one of C looks like A) and a caption set (3
    images, 4 captions; two captions closer to another image), with their embeddings."""
    phrases, folders = ["farm land", "bare land", "sea ice"], ["farmland", "bareLand", "sea_ice"]
    img_vec = [E[0], E[0], E[0], 0.6 * E[0] + 0.8 * E[1], E[1], E[2], 0.8 * E[0] + 0.6 * E[2]]
    img_lab = [0, 0, 0, 1, 1, 2, 2]
    paths = [_save(root / "cls" / folders[lab] / f"{i}.png", COLOURS[i]) for i, lab in enumerate(img_lab)]
    texts = {t.format(p): E[k] for k, p in enumerate(phrases) for t in templates}
    cs = ClassFolderSet(paths, img_lab, phrases, folders)
    # retrieval: images e0, e1, e2; captions e0 (image 0), 0.8e0+0.6e1 (image 1), e2 and e1 (image 2)
    rpaths = [_save(root / "ret" / f"r{i}.png", COLOURS[i]) for i in range(3)]
    captions = ["a field", "a bare field", "white ice", "green grass"]
    cap_vec = [E[0], 0.8 * E[0] + 0.6 * E[1], E[2], E[1]]
    rs = CaptionSet(rpaths, captions, [0, 1, 2, 2])
    # the retrieval images reuse colours 0-2, embedded e0, e1, e2 there: a model of their own
    model = KnownModel(bundle, dict(zip(COLOURS, img_vec)), texts)
    retrieval_model = KnownModel(bundle, {c: E[i] for i, c in enumerate(COLOURS[:3])}, dict(zip(captions, cap_vec)))
    found = [FoundSet("WHU-RS19", root / "cls", "all images", spec=SetSpec("WHU-RS19", "classification",
                      dict(zip(folders, phrases)), "https://example.org/whu-rs19"), classification=cs),
             FoundSet("RSICD", root / "ret", "test (dataset_rsicd.json split 'test')", retrieval=rs)]
    return found, model, retrieval_model


EXPECTED_CLS = {"top1": 6 / 7, "top5": 1.0, "mean_per_class": (1 + 1 + 0.5) / 3,
                "per_class": {"farm land": 1.0, "bare land": 1.0, "sea ice": 0.5}}
# i2t: image 0 top, image 1 below image 2's e1 caption, image 2 top; t2i: captions 0 and 2 top,
# caption 1 second (image 0 first), caption 3 third (image 1, then image 0 ties image 2 at 0: ties count against)
EXPECTED_RET = {"i2t_R@1": 2 / 3, "i2t_R@5": 1.0, "i2t_R@10": 1.0, "t2i_R@1": 0.5, "t2i_R@5": 1.0, "t2i_R@10": 1.0,
                "mean_recall": (2 / 3 + 1 + 1 + 0.5 + 1 + 1) / 6}


@pytest.fixture(scope="module")
def known(published, tmp_path_factory):
    bundle = build_model(ModelConfig(pretrained=str(published)), seed=0)
    bundle = ModelBundle(None, bundle.tokenizer, bundle.image_size, bundle.image_mean, bundle.image_std,
                         bundle.max_text_length)
    templates = load_template_set("ours")
    found, model, retrieval_model = _known_suite(tmp_path_factory.mktemp("known"), bundle, templates.templates)
    return found, bundle, model, retrieval_model, templates


def _run_known(known, rank=0, world=1) -> dict:
    found, bundle, model, retrieval_model, templates = known
    classification = [s for s in found if s.classification is not None]
    out = evaluate_suite(classification, Embedder(model, bundle, 2, rank, world, progress=False), templates)
    retrieval = [s for s in found if s.retrieval is not None]
    out["sets"] += evaluate_suite(retrieval, Embedder(retrieval_model, bundle, 3, rank, world, progress=False),
                                  templates)["sets"]
    return out


def test_known_embeddings_give_the_hand_computed_metrics(known):
    results = _run_known(known)
    cls, ret = results["sets"]
    assert results["template_set"] == "ours"
    for key, value in EXPECTED_CLS.items():
        assert cls[key] == pytest.approx(value), key
    assert cls["class_phrases"] == {"farmland": "farm land", "bareLand": "bare land", "sea_ice": "sea ice"}
    assert (cls["images"], cls["classes"], cls["skipped_images"], cls["known"]) == (7, 3, 0, True)
    for key, value in EXPECTED_RET.items():
        assert ret[key] == pytest.approx(value), key
    assert (ret["protocol"], ret["images"], ret["captions"], ret["known"]) == ("retrieval", 3, 4, False)
    assert suite_metrics(results) == pytest.approx({"suite/WHU-RS19/top1": 6 / 7,
                                                    "suite/RSICD/mean_recall": EXPECTED_RET["mean_recall"]})


def _two_ranks(rank, world, known_args):
    return _run_known(known_args, rank, world)


def test_two_ranks_equal_one_and_a_broken_set_does_not_stop_the_suite(known, tmp_path):
    """Items split over 2 gloo ranks and gathered: the same numbers on both; a set whose images
    are missing is recorded as failed on every rank and the next set is still scored."""
    found, bundle, model, retrieval_model, templates = known
    broken = ClassFolderSet([tmp_path / "gone.png"] * 3, [0, 1, 1], ["a", "b"], ["a", "b"])
    with_broken = ([FoundSet("EuroSAT", tmp_path, "all images", classification=broken)] + found, bundle,
                   model, retrieval_model, templates)
    ranks = run_ranks(_two_ranks, 2, tmp_path / "ranks", with_broken)
    assert all("value" in r for r in ranks), ranks
    a, b = (r["value"]["sets"] for r in ranks)
    assert a[1:] == b[1:]
    # the count is the gathered one; the examples named are each rank's own
    assert a[0]["error"].split(" (e.g.")[0] == b[0]["error"].split(" (e.g.")[0] == \
        "eval EuroSAT zero-shot: 3 of 3 images are unreadable or missing, more than eval.max_bad_fraction=0.01 of the set"
    assert a[1]["top1"] == pytest.approx(6 / 7) and a[2]["mean_recall"] == pytest.approx(EXPECTED_RET["mean_recall"])


# --------------------------------------------------------------------------- (c), (d) the report

PUBLISHED = [PublishedResult("Git-RSCLIP", "WHU-RS19", "top1", 0.9432, "https://huggingface.co/lcybuaa/Git-RSCLIP"),
             PublishedResult("SkyCLIP50", "WHU-RS19", "top1", 0.7781, "https://example.org/skyclip"),
             PublishedResult("RemoteCLIP ViT-L-14", "RSICD", "mean_recall", 36.35, "https://example.org/remoteclip"),
             PublishedResult("GeoRSCLIP", "RSICD", "mean_recall", 38.87, "https://example.org/rs5m"),
             PublishedResult("GeoRSCLIP", "AID", "top1", 0.7, "https://example.org/rs5m")]


def test_report_table_published_columns_compare_and_png(known, tmp_path):
    pytest.importorskip("matplotlib")
    results = {"model": "models/ours", **_run_known(known), "unrecognised": [str(tmp_path / "notes")]}
    other = _run_known(known)
    other["sets"][0]["top1"], other["sets"][1]["mean_recall"] = 0.5, 0.25       # a second model's numbers
    results["compare"] = {"model": "runs/base/", "sets": other["sets"]}
    md = markdown_report(results, PUBLISHED)
    print("\n" + md)
    lines = md.splitlines()
    assert ("| set | split | images | classes | top-1 | top-5 | mean per class | base top-1 | Git-RSCLIP | "
            "RemoteCLIP | GeoRSCLIP | SkyCLIP |") in lines
    assert "| WHU-RS19 | all images | 7 | 3 | 85.71 | 100.00 | 83.33 | 50.00 | 94.32 | — | — | 77.81 |" in lines
    assert ("| RSICD | test (dataset_rsicd.json split 'test') | 3 | 4 | 66.67 | 100.00 | 100.00 | 50.00 | 100.00 | "
            "100.00 | 86.11 | 25.00 | — | 36.35 | 38.87 | — |") in lines
    assert "- RemoteCLIP ViT-L-14: https://example.org/remoteclip" in lines
    assert "- WHU-RS19: `farmland` -> \"farm land\", `bareLand` -> \"bare land\", `sea_ice` -> \"sea ice\"" in lines
    assert f"Not recognised (not evaluated): `{tmp_path / 'notes'}`" in lines
    written = write_report(results, tmp_path / "out", PUBLISHED)
    assert [p.name for p in written] == ["suite.json", "suite.md", "suite.png", "report.html"]   # no rows: no samples
    record = json.loads((tmp_path / "out/suite.json").read_text())
    assert record["sets"][0]["top1"] == pytest.approx(6 / 7) and record["compare"]["sets"][0]["top1"] == 0.5
    assert {p["set"] for p in record["published"]} == {"WHU-RS19", "RSICD"}    # AID was not evaluated
    with Image.open(tmp_path / "out/suite.png") as png:
        assert png.format == "PNG" and png.size[0] >= 600 and png.size[1] >= 300


def test_per_sample_rows_are_what_the_metrics_were_computed_from(known, tmp_path):
    """The rows of the known sets: each image's rank of its class and top classes, each caption's rank of its
    image and each image's rank of its captions (ties against the model, as in the metrics); recall and top-1
    counted from the rows equal the metrics; write_report puts them in samples/, one JSON line per row."""
    pd = pytest.importorskip("pandas")
    found, bundle, model, retrieval_model, templates = known
    cls = evaluate_suite(found[:1], Embedder(model, bundle, 2, progress=False), templates, samples=True)["sets"][0]
    ret = evaluate_suite(found[1:], Embedder(retrieval_model, bundle, 3, progress=False), templates,
                         samples=True)["sets"][0]
    rows = cls["rows"]
    assert [r["rank"] for r in rows] == [1, 1, 1, 1, 1, 1, 2]          # image 6 (sea ice) looks like farm land
    assert rows[6]["top5"] == [0, 2, 1] and rows[6]["top5_names"] == ["farm land", "sea ice", "bare land"]
    assert rows[6]["top5_scores"] == pytest.approx([0.8, 0.6, 0.0], abs=1e-4) and rows[6]["label_name"] == "sea ice"
    assert all(r["readable"] and r["error"] is None for r in rows)
    assert rows[3]["image"] == str(found[0].classification.paths[3])
    assert sum(r["rank"] == 1 for r in rows) / len(rows) == pytest.approx(cls["top1"])
    captions = [r for r in ret["rows"] if r["query"] == "caption"]
    images = [r for r in ret["rows"] if r["query"] == "image"]
    assert [r["rank"] for r in captions] == [1, 2, 1, 3] and [r["rank"] for r in images] == [1, 2, 1]
    assert captions[1]["top5"] == [0, 1, 2] and captions[1]["top5_images"][0] == str(found[1].retrieval.image_paths[0])
    assert images[1]["top5_captions"][:2] == ["green grass", "a bare field"] and images[2]["captions"] == [2, 3]
    for k in (1, 5, 10):
        assert sum(r["rank"] <= k for r in captions) / len(captions) == pytest.approx(ret[f"t2i_R@{k}"])
        assert sum(r["rank"] <= k for r in images) / len(images) == pytest.approx(ret[f"i2t_R@{k}"])
    written = write_report({"model": "m", "template_set": "ours", "sets": [cls, ret]}, tmp_path / "out", PUBLISHED)
    assert [p.relative_to(tmp_path / "out").as_posix() for p in written[:2]] == [
        "samples/WHU-RS19.zero-shot.jsonl", "samples/RSICD.retrieval.jsonl"]
    record = json.loads((tmp_path / "out/suite.json").read_text())
    assert [r["samples"] for r in record["sets"]] == ["samples/WHU-RS19.zero-shot.jsonl",
                                                       "samples/RSICD.retrieval.jsonl"]
    assert "rows" not in record["sets"][0]
    frame = pd.read_json(tmp_path / "out" / record["sets"][0]["samples"], lines=True)     # what a user does
    assert list(frame["rank"]) == [1] * 6 + [2] and list(frame["label_name"])[6] == "sea ice"
    assert len(pd.read_json(tmp_path / "out" / record["sets"][1]["samples"], lines=True)) == 4 + 3


def test_sample_files_keep_non_ascii_and_safe_names(tmp_path):
    from rsclip_ds.evaluation.samples import read_rows, sample_file, write_rows

    assert sample_file("UCM-captions", "retrieval") == "UCM-captions.retrieval.jsonl"
    assert sample_file("RS sets/北京 v1.0", "zero-shot") == "RS_sets____v1.0.zero-shot.jsonl"   # " ", "/", 北, 京, " "
    with pytest.raises(ValueError, match="one of"):
        sample_file("AID", "classification")
    rows = [{"caption": "一些绿色的树木在建筑物旁边", "rank": 3}, {"caption": "ciudad con río", "rank": 1}]
    path = write_rows(tmp_path / "samples" / "x.retrieval.jsonl", rows)
    assert "一些绿色的树木" in path.read_text(encoding="utf-8") and read_rows(path) == rows
    assert not list(path.parent.glob("*.partial"))


# --------------------------------------------------------------------------- template sets

def test_template_sets_and_their_sources(tmp_path):
    sets = {name: load_template_set(name) for name in TEMPLATE_SETS}
    assert sets["git-rsclip"].templates == ("a remote sensing image of {}",)
    assert "huggingface.co/lcybuaa/Git-RSCLIP" in sets["git-rsclip"].source
    remote = sets["remoteclip"]
    assert remote.for_set("AID")[0] == "a centered satellite photo of a {}." and len(remote.for_set("AID")) == 5
    assert remote.for_set("EuroSAT") == ["a centered satellite photo of {}.", "a centered satellite photo of a {}.",
                                         "a centered satellite photo of the {}."]
    assert len(remote.for_set("NWPU-RESISC45")) == 18 and "ChenDelong1999/ITRA" in remote.source
    geo = sets["georsclip"]
    assert len(geo.templates) == 105 and geo.templates[0] == "a remote sensing image of many {}."
    assert geo.templates[-1] == "a satellite image of a cool {}." and "om-ai-lab/RS5M" in geo.source
    assert sets["ours"].templates[0] == "a remote sensing image of {}."
    own = tmp_path / "mine.txt"
    own.write_text("# source: me\nphoto of {}\n[AID]\naerial {} photo\n")
    mine = load_template_set(own)
    assert (mine.for_set("AID"), mine.for_set("RSSCN7"), mine.source) == (["aerial {} photo"], ["photo of {}"], "me")
    own.write_text("photo of {}\n[AID]\n")
    with pytest.raises(ValueError, match="no templates for: AID"):
        load_template_set(own)
    with pytest.raises(ValueError, match="neither a template set"):
        load_template_set("gitrsclip")
    with pytest.raises(ValueError, match="not both"):
        EvalConfig(templates=own, templates_set="georsclip")
    with pytest.raises(ValueError, match="neither eval.every nor eval.suite_every"):
        EvalConfig(suite=tmp_path)
    with pytest.raises(ValueError, match="eval.suite is not"):
        EvalConfig(suite_every=100)
    assert EvalConfig(suite=tmp_path, every=100).suite == tmp_path     # a suite alone is something to evaluate


# --------------------------------------------------------------------------- (f) during training

class PlainEngine:
    """The part of a DeepSpeed engine the hook touches: forward, eval/train, .module, .device."""

    def __init__(self, model):
        self.module, self.device = model, torch.device("cpu")

    def __call__(self, pixels, ids):
        return self.module(pixels, ids)

    def eval(self):
        self.module.eval()

    def train(self, mode=True):
        self.module.train(mode)


def _hook_on_ranks(rank, world, published, found, out):
    bundle = build_model(ModelConfig(pretrained=str(published)), seed=0)
    cfg = EvalConfig(every=4, suite=out, suite_every=6, templates_set="git-rsclip", batch_size=4)
    hook = make_eval_hook(cfg, bundle, rank, world, out, last_step=10, suite=found,
                          templates=load_template_set(cfg.templates_set))
    engine = PlainEngine(bundle.model.train())
    calls = {step: hook(step, engine) for step in range(11)}
    assert engine.module.training                      # handed back in training mode
    return {str(k): v for k, v in calls.items()}


def test_the_training_hook_evaluates_the_suite_on_its_steps_on_every_rank(published, known, tmp_path):
    """eval.suite_every=6 with eval.every=4 (no other sets): the suite at steps 0, 6 and the last
    (10), nothing elsewhere; the same numbers on both ranks and as evaluate_suite alone; rank 0
    writes them under "suite" in the step JSON."""
    found = known[0][:1]
    ranks = run_ranks(_hook_on_ranks, 2, tmp_path / "ranks", published, found, tmp_path / "eval")
    assert all("value" in r for r in ranks), ranks
    a, b = (r["value"] for r in ranks)
    assert a == b
    assert [s for s, v in a.items() if v] == ["0", "6", "10"]
    bundle = build_model(ModelConfig(pretrained=str(published)), seed=0)
    alone = evaluate_suite(found, Embedder(bundle.model.eval(), bundle, 4, progress=False),
                           load_template_set("git-rsclip"))
    assert a["6"] == pytest.approx(suite_metrics(alone), abs=1e-6) and list(a["6"]) == ["suite/WHU-RS19/top1"]
    written = json.loads((tmp_path / "eval/step00000006.json").read_text())
    assert written["suite"]["template_set"] == "git-rsclip"
    assert written["suite"]["sets"][0]["top1"] == pytest.approx(alone["sets"][0]["top1"], abs=1e-6)
    assert not (tmp_path / "eval/step00000004.json").exists()
    # the step's report folder (rank 0 alone writes it): the suite's files, its samples, report.html
    step = tmp_path / "eval/step00000006"
    assert written["suite"]["sets"][0]["samples"] == "step00000006/samples/WHU-RS19.zero-shot.jsonl"
    assert {"report.html", "suite.json", "suite.md"} <= {p.name for p in step.iterdir()}
    assert json.loads((step / "suite.json").read_text())["sets"][0]["samples"] == "samples/WHU-RS19.zero-shot.jsonl"
    lines = (tmp_path / "eval" / written["suite"]["sets"][0]["samples"]).read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 7 and sum(r["rank"] == 1 for r in rows) / 7 == pytest.approx(alone["sets"][0]["top1"], abs=1e-6)


# --------------------------------------------------------------------------- (e) the command

WHU_RS19 = ["Airport", "Beach", "Bridge", "Commercial", "Desert", "Farmland", "footballField", "Forest",
            "Industrial", "Meadow", "Mountain", "Park", "Parking", "Pond", "Port", "railwayStation",
            "Residential", "River", "Viaduct"]


def _suite_root(root):
    """WHU-RS19 as released (19 class folders of .jpg), RSICD as released (dataset_rsicd.json and
    RSICD_images/), and a folder of images that is no set."""
    rng = np.random.default_rng(1)
    for k, folder in enumerate(WHU_RS19):
        for i in range(2):
            _save(root / "WHU-RS19" / folder / f"{folder.lower()}_{i + 1:02d}.jpg", (13 * k, 90, 40 * i),
                  fmt="JPEG", noise=rng)
    images = []
    for i in range(6):
        name = f"{['airport', 'beach', 'river'][i % 3]}_{i + 1}.jpg"
        _save(root / "RSICD" / "RSICD_images" / name, (40 * i, 200, 30), fmt="JPEG", noise=rng)
        images.append({"filename": name, "split": "test" if i < 4 else "train", "imgid": i,
                       "sentences": [{"raw": f"there is a {name.split('_')[0]} here ."},
                                     {"raw": f"many buildings are near the {name.split('_')[0]} ."}]})
    (root / "RSICD" / "dataset_rsicd.json").write_text(json.dumps({"images": images, "dataset": "rsicd"}))
    (root / "notes").mkdir()   # a folder of figures: images, but no set (no class folders, no caption JSON)
    (root / "notes" / "readme.txt").write_text("not a data set")
    _save(root / "notes" / "figure_1.png", (0, 0, 0), fmt="PNG", noise=rng)


def test_the_command_on_a_suite_root(published, tmp_path, capsys):
    from rsclip_ds.cli import main
    from rsclip_ds.evaluation.catalog import published_results

    _suite_root(tmp_path / "rs")
    out = tmp_path / "report"
    code = main(["eval", "--model", str(published), "--suite", str(tmp_path / "rs"), "--templates-set", "git-rsclip",
                 "--compare", str(published), "--batch-size", "16", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    record = json.loads((out / "suite.json").read_text())
    by_name = {r["name"]: r for r in record["sets"]}
    whu, rsicd = by_name["WHU-RS19"], by_name["RSICD"]
    assert (whu["protocol"], whu["images"], whu["classes"]) == ("zero-shot classification", 38, 19)
    assert whu["class_phrases"]["footballField"] == "football field" and whu["templates"] == [GIT_RSCLIP_PROMPT]
    assert (rsicd["protocol"], rsicd["images"], rsicd["captions"]) == ("retrieval", 4, 8)   # the test split
    assert "test" in rsicd["split"] and whu["split"].startswith("all images")
    assert record["unrecognised"] == [str(tmp_path / "rs" / "notes")]
    assert record["template_set"] == "git-rsclip"
    assert record["compare"]["sets"] == [{k: v for k, v in r.items() if k != "samples"} for r in record["sets"]]
    # the same model twice: the same numbers; the rows are ours only, next to suite.json, and the report
    assert [r["samples"] for r in record["sets"]] == ["samples/RSICD.retrieval.jsonl",
                                                       "samples/WHU-RS19.zero-shot.jsonl"]
    assert len((out / "samples/WHU-RS19.zero-shot.jsonl").read_text().splitlines()) == 38
    assert (out / "report.html").is_file()
    assert "WHU-RS19" in printed and "all images" in printed and "notes" in printed
    md = (out / "suite.md").read_text()
    git = next(p for p in published_results() if p.model == "Git-RSCLIP" and p.set == "WHU-RS19")
    row = next(line for line in md.splitlines() if line.startswith("| WHU-RS19 |"))
    assert f"| {100 * git.value:.2f} |" in row and "Git-RSCLIP | RemoteCLIP | GeoRSCLIP | SkyCLIP |" in md
    assert (out / "suite.png").is_file()

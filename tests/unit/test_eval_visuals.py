"""The suite's visuals during training (reporting/eval_visuals.py): a step folder written by hand per
the contract (suite.json + samples/*.jsonl + small PNGs made with PIL) -> the confusion counts and the
gallery sample; TensorBoard images through DeepSpeed's own monitor writer, read back with
EventAccumulator; the run without matplotlib; the summary's report path. W&B's confusion chart and
gallery table: tests/unit/test_wandb_monitor.py."""

from __future__ import annotations

import json
import logging
import random
import sys

import numpy as np
import pytest

from rsclip_ds.config import load_config
from rsclip_ds.evaluation.suite import CLASSIFICATION, RETRIEVAL, RETRIEVAL_KEYS
from rsclip_ds.loop import TrainResult
from rsclip_ds.profiles import load_profile
from rsclip_ds.reporting.eval_visuals import (DPI, GALLERY_QUERIES, GALLERY_SEED, confusion_inches, gallery_inches,
                                              read_step, render_confusion, render_gallery, step_folder)
from rsclip_ds.reporting.metrics import MetricsLog, read_metrics
from rsclip_ds.reporting.progress import ProgressReporter
from rsclip_ds.reporting.summary import build_summary, latest_report, print_summary
from rsclip_ds.resolve import build_ds_config, derive_batch
from tests.unit.fake_engine import FakeEngine, fake_batches, run_loop

CLASSES = ["dense residential", "medium residential", "meadow"]
# (true class, top-1 class) of the readable images: the known confusions
PAIRS = [(0, 0), (0, 0), (0, 1), (1, 1), (1, 0), (1, 1), (1, 1), (2, 2), (2, 2)]
COUNTS = [[2, 1, 0],
          [1, 3, 0],
          [0, 0, 2]]
RETRIEVAL_IMAGES = 6        # image 5 unreadable: its captions are left out of the queries
CAPTIONS_PER_IMAGE = 2      # 10 readable caption queries, more than the gallery's 8
SUITE_METRICS = {"suite/UCM/top1": 7 / 9, "suite/RSICD/mean_recall": 0.5}


def _png(path, color, size=(40, 30)):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return str(path)


def write_step_folder(folder, images, step: int) -> dict:
    """{output_dir}/eval/step{N:08d}/ as the hook writes it (the shared contract): suite.json, one
    zero-shot set (UCM: the PAIRS above and one unreadable image), one retrieval set (RSICD), one set
    that could not be scored. -> {"zero_shot": rows, "retrieval": rows}."""
    zs_rows = []
    for i, (label, pred) in enumerate(PAIRS):
        top5 = [pred] + [c for c in range(len(CLASSES)) if c != pred]
        zs_rows.append({"image": _png(images / f"ucm{i}.png", (40 * label, 80, 120)), "label": label,
                        "label_name": CLASSES[label], "readable": True, "rank": top5.index(label) + 1,
                        "top5": top5, "top5_names": [CLASSES[c] for c in top5], "top5_scores": [0.3, 0.2, 0.1],
                        "error": None})
    zs_rows.append({"image": str(images / "missing.png"), "label": 2, "label_name": CLASSES[2], "readable": False,
                    "rank": None, "top5": [], "top5_names": [], "top5_scores": [], "error": "cannot identify image"})
    paths = [_png(images / f"rsicd{i}.png", (30 * i, 200 - 30 * i, 90)) for i in range(RETRIEVAL_IMAGES - 1)]
    paths.append(str(images / "rsicd_missing.png"))
    rt_rows = []
    for j in range(RETRIEVAL_IMAGES * CAPTIONS_PER_IMAGE):
        i = j // CAPTIONS_PER_IMAGE
        readable = i < RETRIEVAL_IMAGES - 1
        top5 = [(i + k) % (RETRIEVAL_IMAGES - 1) for k in range(5)][::(1 if j % 2 else -1)] if readable else []
        rt_rows.append({"query": "caption", "caption_index": j, "caption": f"caption {j}: 多 buildings near image {i}",
                        "image_index": i, "image": paths[i], "readable": readable,
                        "rank": top5.index(i) + 1 if readable else None, "top5": top5,
                        "top5_images": [paths[t] for t in top5], "top5_scores": [0.5 - 0.1 * k for k in range(len(top5))]})
    for i, path in enumerate(paths):   # the image queries: not shown in the gallery
        rt_rows.append({"query": "image", "image_index": i, "image": path, "readable": i < RETRIEVAL_IMAGES - 1,
                        "rank": 1, "top5": [0], "top5_captions": ["caption 0"], "top5_scores": [0.4],
                        "captions": [2 * i, 2 * i + 1], "error": None})
    samples = folder / "samples"
    samples.mkdir(parents=True, exist_ok=True)
    for name, rows in (("UCM.zero-shot.jsonl", zs_rows), ("RSICD.retrieval.jsonl", rt_rows)):
        (samples / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    suite = {"model": f"step {step}", "source": "training", "step": step, "unrecognised": [], "published": [],
             "template_set": "git-rsclip", "sets": [
                 {"name": "UCM", "root": str(images), "split": "all images", "known": True, "warnings": [],
                  "protocol": CLASSIFICATION, "images": len(PAIRS), "classes": len(CLASSES),
                  "class_phrases": {f"folder{i}": c for i, c in enumerate(CLASSES)}, "templates": 1,
                  "top1": 7 / 9, "top5": 1.0, "mean_per_class": 0.72, "per_class": {}, "skipped_images": 1,
                  "samples": "samples/UCM.zero-shot.jsonl"},
                 {"name": "RSICD", "root": str(images), "split": "test", "known": True, "warnings": [],
                  "protocol": RETRIEVAL, "images": RETRIEVAL_IMAGES - 1, "captions": 10,
                  **{k: 0.5 for k in RETRIEVAL_KEYS}, "skipped_images": 1, "skipped_captions": 2,
                  "samples": "samples/RSICD.retrieval.jsonl"},
                 {"name": "AID", "root": str(images), "split": "all images", "known": True, "warnings": [],
                  "protocol": CLASSIFICATION, "error": "more than eval.max_bad_fraction of its images unreadable"}]}
    (folder / "suite.json").write_text(json.dumps(suite, ensure_ascii=False), encoding="utf-8")
    (folder / "report.html").write_text("<html></html>")
    return {"zero_shot": zs_rows, "retrieval": rt_rows}


def expected_gallery(rt_rows, n=GALLERY_QUERIES, seed=GALLERY_SEED):
    """The capped, seeded sample as documented: readable caption queries, n of them, in caption order."""
    pool = [r for r in rt_rows if r["query"] == "caption" and r["readable"]]
    return [pool[i] for i in sorted(random.Random(seed).sample(range(len(pool)), min(n, len(pool))))]


def test_confusion_counts_and_the_gallery_sample_come_from_the_samples_files(tmp_path):
    folder = step_folder(tmp_path / "eval", 6)
    rows = write_step_folder(folder, tmp_path / "img", 6)
    visuals = read_step(folder)
    assert visuals.step == 6 and [c.set for c in visuals.confusions] == ["UCM"]   # AID (an error) left out
    (c,) = visuals.confusions
    assert c.classes == CLASSES
    assert c.counts().tolist() == COUNTS                     # the unreadable image counts nowhere
    assert c.counts().dtype == np.int64
    (g,) = visuals.galleries
    assert g.set == "RSICD" and g.total == 10 and len(g.rows) == GALLERY_QUERIES
    assert g.rows == expected_gallery(rows["retrieval"])
    assert all(r["image_index"] != RETRIEVAL_IMAGES - 1 for r in g.rows)
    assert read_step(folder).galleries[0].rows == g.rows     # seeded: the same queries at every read
    assert len(read_step(folder, queries=3).galleries[0].rows) == 3
    assert read_step(tmp_path / "eval" / "step00000007") is None


def test_a_missing_samples_file_leaves_its_set_out_with_a_warning(tmp_path, caplog):
    folder = step_folder(tmp_path / "eval", 6)
    write_step_folder(folder, tmp_path / "img", 6)
    (folder / "samples" / "UCM.zero-shot.jsonl").unlink()
    with caplog.at_level(logging.WARNING, logger="rsclip_ds"):
        visuals = read_step(folder)
    assert visuals.confusions == [] and [g.set for g in visuals.galleries] == ["RSICD"]
    assert "UCM left out" in caplog.text


def test_thumbnails_are_capped_and_an_unreadable_image_is_a_grey_square(tmp_path):
    from rsclip_ds.reporting.eval_visuals import THUMB_PX, thumbnail

    big = _png(tmp_path / "big.png", (10, 20, 30), size=(300, 200))
    assert thumbnail(big).size == (THUMB_PX, 85) and thumbnail(big).mode == "RGB"
    grey = thumbnail(tmp_path / "moved.png")
    assert grey.size == (THUMB_PX, THUMB_PX) and grey.getpixel((0, 0)) == (200, 200, 200)


def test_duplicate_class_phrases_get_distinct_names(tmp_path):
    from rsclip_ds.reporting.eval_visuals import unique_names

    assert unique_names(["meadow", "farmland", "meadow"]) == ["meadow", "farmland", "meadow (2)"]


def _tensorboard_run(out, steps, suite_steps):
    """MetricsLog with DeepSpeed's TensorBoard monitor (logging.tensorboard=true, as the Trainer builds
    it) through the train loop; at ``suite_steps`` the hook writes the step folder, then returns the
    suite's metrics, as the training hook does."""
    from rsclip_ds.evaluation.hook import build_monitor

    run = load_config(None, [f"output_dir={out}", "logging.tensorboard=true"])
    monitor = build_monitor(build_ds_config(run, load_profile("zero2"), 1, on_gpu=False))

    def hook(step, engine):
        if step % 3:
            return None
        metrics = {"zero_shot/top1": step / 10}
        if step in suite_steps:
            write_step_folder(step_folder(out / "eval", step), out / "img", step)
            metrics.update(SUITE_METRICS)
        return metrics

    log = MetricsLog(out / "metrics.jsonl", monitor)
    try:
        run_loop(FakeEngine(), fake_batches(), steps, 2, reporter=ProgressReporter(steps, "plain"), metrics=log,
                 hooks=[hook])
    finally:
        log.close()
    return monitor, log


def _events(out):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return EventAccumulator(str(out / "monitor" / "tensorboard"), size_guidance={"images": 0}).Reload()


def test_tensorboard_gets_each_sets_image_at_the_suite_step_in_deepspeeds_event_file(tmp_path, one_rank_group):
    pytest.importorskip("matplotlib", reason="the images need matplotlib (the test extra installs it)")
    from PIL import Image
    import io

    out = tmp_path / "run"
    monitor, log = _tensorboard_run(out, 6, suite_steps={6})
    writer = monitor.tb_monitor.summary_writer
    assert writer.all_writers is None                        # closed with the MetricsLog, at the run's end
    assert len(list((out / "monitor" / "tensorboard").glob("events.out.tfevents.*"))) == 1   # one writer, one file
    acc = _events(out)
    assert set(acc.Tags()["images"]) == {"Suite/UCM/confusion", "Suite/RSICD/gallery"}
    side = round(confusion_inches(len(CLASSES)) * DPI)
    width, height = (round(x * DPI) for x in gallery_inches(GALLERY_QUERIES))
    for tag, size in (("Suite/UCM/confusion", (side, side)), ("Suite/RSICD/gallery", (width, height))):
        (event,) = acc.Images(tag)                           # only the suite step has them (step 3 did not run it)
        assert event.step == 6 and (event.width, event.height) == size
        assert Image.open(io.BytesIO(event.encoded_image_string)).size == size
    # the scalars beside them, on the same axis
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("Eval/suite/UCM/top1")] == [(6, round(7 / 9, 4))]
    assert [e.step for e in acc.Scalars("Eval/zero_shot/top1")] == [0, 3, 6]


def test_renders_have_their_documented_size_and_show_the_confusions(tmp_path):
    pytest.importorskip("matplotlib", reason="the test extra installs it")
    folder = step_folder(tmp_path / "eval", 6)
    write_step_folder(folder, tmp_path / "img", 6)
    visuals = read_step(folder)
    image = render_confusion(visuals.confusions[0])
    side = round(confusion_inches(3) * DPI)
    assert image.shape == (side, side, 3) and image.dtype == np.uint8
    gallery = render_gallery(visuals.galleries[0])
    width, height = gallery_inches(GALLERY_QUERIES)
    assert gallery.shape == (round(height * DPI), round(width * DPI), 3)
    assert confusion_inches(45) > confusion_inches(3) and confusion_inches(1000) == 16.0   # bounded


def test_only_rank_0_writes_images_and_only_with_tensorboard_on(tmp_path, one_rank_group):
    from rsclip_ds.evaluation.hook import build_monitor

    run = load_config(None, [f"output_dir={tmp_path}", "logging.tensorboard=true"])
    monitor = build_monitor(build_ds_config(run, load_profile("zero2"), 1, on_gpu=False))
    assert MetricsLog(tmp_path / "a.jsonl", monitor, enabled=False).images is None
    csv_only = build_monitor(build_ds_config(load_config(None, [f"output_dir={tmp_path}", "logging.csv=true"]),
                                             load_profile("zero2"), 1, on_gpu=False))
    only_csv = MetricsLog(tmp_path / "b.jsonl", csv_only)
    assert only_csv.images is None
    only_csv.close()
    log = MetricsLog(tmp_path / "c.jsonl", monitor)
    assert log.images is not None and log.images.eval_dir == tmp_path / "eval"
    log.close()


def test_without_matplotlib_the_scalars_are_logged_and_the_reason_said_once(tmp_path, one_rank_group, monkeypatch,
                                                                             caplog):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)        # `import matplotlib...` raises ImportError
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="rsclip_ds"):
        _tensorboard_run(out, 6, suite_steps={3, 6})
    said = [r.getMessage() for r in caplog.records if "no suite images" in r.getMessage()]
    assert len(said) == 1 and "matplotlib is not installed" in said[0]
    acc = _events(out)
    assert acc.Tags()["images"] == []
    assert [e.step for e in acc.Scalars("Eval/suite/UCM/top1")] == [3, 6]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")["eval"]] == [0, 3, 6]


def test_the_summary_names_the_latest_report(tmp_path, capsys, monkeypatch):
    assert latest_report(tmp_path) is None
    for step in (6, 12, 100):
        write_step_folder(step_folder(tmp_path / "eval", step), tmp_path / "img", step)
    (step_folder(tmp_path / "eval", 100) / "report.html").unlink()   # step 100's report not (yet) there
    step_folder(tmp_path / "eval", 200).mkdir()
    (tmp_path / "eval" / "step00000300.json").write_text("{}")       # an evaluation without the suite
    want = str(tmp_path / "eval" / "step00000012" / "report.html")
    assert latest_report(tmp_path) == want
    run = load_config(None, [])
    result = TrainResult(losses=[3.0, 2.0], lrs=[0.0, 0.0], optimizer_steps=2, micro_steps=2, seconds=1.0,
                         samples_per_s=8.0)
    common = dict(profile=load_profile("zero2"), batch=derive_batch(run, 1), precision="fp32", source="tiny",
                  num_parameters=1000, activation_checkpointing=False, loss="clip", negatives="global",
                  accumulation="plain")
    s = build_summary(result, output_dir=tmp_path, **common)
    assert s["report"] == want
    assert build_summary(result, **common)["report"] is None
    monkeypatch.setenv("COLUMNS", "400")
    print_summary(s)
    assert f"eval report │ {want} (open it in a browser)" in capsys.readouterr().out

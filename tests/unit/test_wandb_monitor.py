"""logging.wandb with the real `wandb` package, offline, in one process: the train loop (train())
writing through MetricsLog into reporting.wandb_log's run, with DeepSpeed's own samples-keyed event
after every optimizer step as DeepSpeed's engine writes it (global batch 64), read back from the
offline run's .wandb files (read_offline_run, wandb's own protobuf classes). Also the mode rules of
configure_wandb_offline and the suite's tables. The 2-rank launch: tests/integration/test_launch.py
(monitors run) and test_checkpoint_resume.py (SIGKILL + --resume auto)."""

from __future__ import annotations

import copy
import json

import pytest

from rsclip_ds.config import load_config
from rsclip_ds.evaluation.suite import CLASSIFICATION, RETRIEVAL, RETRIEVAL_KEYS
from rsclip_ds.profiles import load_profile
from rsclip_ds.resolve import build_ds_config
from rsclip_ds.reporting.metrics import MetricsLog, read_metrics
from rsclip_ds.reporting.progress import ProgressReporter
from rsclip_ds.reporting.wandb_log import build_wandb_log, markdown_tables, read_offline_run, state_path
from rsclip_ds.runtime.distributed import configure_wandb_offline
from rsclip_ds.loop import client_state
from tests.unit.fake_engine import FakeEngine, fake_batches, run_loop

GLOBAL_BATCH = 64


def _suite_record(step: int) -> dict:
    """eval/step{N}.json's "suite" as the hook writes it: one classification and one retrieval set."""
    return {"template_set": "git-rsclip", "template_source": None, "sets": [
        {"name": "WHU-RS19", "protocol": CLASSIFICATION, "split": "all images", "images": 40, "classes": 19,
         "top1": 0.25 + step / 100, "top5": 0.5, "mean_per_class": 0.2},
        {"name": "RSICD", "protocol": RETRIEVAL, "split": "test", "images": 20, "captions": 100,
         **{k: 0.1 for k in RETRIEVAL_KEYS}}]}


def eval_hook(out_dir):
    """Every 3 steps and at step 8 (the last): zero-shot on the train lines' axis, and at 6 the
    suite too, its record written first as the real hook does."""
    def hook(step, engine):
        if step % 3 and step != 8:
            return None
        metrics = {"zero_shot/top1": step / 10}
        if step == 6:
            (out_dir / "eval").mkdir(parents=True, exist_ok=True)
            (out_dir / "eval" / f"step{step:08d}.json").write_text(json.dumps({"step": 6, "suite": _suite_record(6)}))
            metrics.update({"suite/WHU-RS19/top1": 0.31, "suite/RSICD/mean_recall": 0.1})
        return metrics
    return hook


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B's variables unset (configure_wandb_offline then picks offline and {out}/monitor/wandb); wandb
    torn down after the test (it keeps its settings per process)."""
    wandb = pytest.importorskip("wandb", reason="the test extra installs wandb (setup.cfg)")
    for var in ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_API_KEY", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield tmp_path / "run"
    wandb.teardown()


def _segment(out, *, steps=8, resume=None, stop_after=None, exit_code=0):
    """One process's part of a run: configure, W&B writer, train(), finish -> (engine, result, run id)."""
    run = load_config(None, [f"output_dir={out}", "logging.wandb=true", "logging.wandb_project=rs-test"])
    configure_wandb_offline(out / "monitor")
    resume = copy.deepcopy(resume)   # train() extends the history lists it resumes from
    step = resume["step"] if resume else None
    wb = build_wandb_log(run.logging, out, rank=0, resumed_at=step, config=run.model_dump(mode="json"))
    engine = FakeEngine(resume["w"], step, GLOBAL_BATCH) if resume else FakeEngine(samples_per_step=GLOBAL_BATCH)
    log = MetricsLog(out / "metrics.jsonl", engine.monitor, resumed_at=step, wandb=wb)
    engine.monitor = wb.deepspeed_monitor(engine)   # after MetricsLog took the original (None here)
    try:
        result = run_loop(engine, fake_batches(), steps, 2, reporter=ProgressReporter(steps, "plain"), metrics=log,
                          hooks=[eval_hook(out)], resume=resume["state"] if resume else None, stop_after=stop_after)
    finally:
        log.close()
    run_id = wb.run.id
    wb.summary({"loss_end": result.losses[-1], "load": {"slowest_rank": 0, "step_s": [0.1]}, "losses": [1.0]})
    wb.finish(exit_code)
    return engine, result, run_id


def _read(out, run_id) -> dict:
    import wandb

    wandb.teardown()   # the core writes the last records as it shuts down
    return read_offline_run(out / "monitor" / "wandb", run_id)


def _series(rows, key):
    return [(r["_step"], r[key]) for r in rows if key in r]


def test_every_train_line_evaluation_and_deepspeed_event_lands_at_its_optimizer_step(offline):
    out = offline
    _, result, run_id = _segment(out)
    run = _read(out, run_id)
    rows, lines = run["history"], read_metrics(out / "metrics.jsonl")
    assert run["segments"] == 1
    # one row per step, W&B's step our optimizer step: it never went backwards, nothing was dropped
    assert [r["_step"] for r in rows] == list(range(0, 9))
    assert _series(rows, "Train/loss") == [(r["step"], r["loss"]) for r in lines["train"]]
    assert [s for s, _ in _series(rows, "Train/loss")] == [2, 4, 6, 8]
    assert _series(rows, "Train/lr") == [(s, result.lrs[s - 1]) for s in (2, 4, 6, 8)]
    assert all(r["Train/grad_norm"] > 0 and r["Load/step_s/rank0"] > 0 for r in rows if "Train/loss" in r)
    # every evaluation, also those between log steps (3) and before training (0)
    assert _series(rows, "Eval/zero_shot/top1") == [(0, 0.0), (3, 0.3), (6, 0.6), (8, 0.8)]
    assert _series(rows, "Eval/suite/WHU-RS19/top1") == [(6, 0.31)]
    # DeepSpeed's own event after every step, at its step and with its sample count as its axis
    assert _series(rows, "samples") == [(k, GLOBAL_BATCH * k) for k in range(1, 9)]
    assert _series(rows, "Train/Samples/lr") == [(k, 0.5 / (1 + k)) for k in range(1, 9)]
    assert run["config"]["steps"] == 100 and run["config"]["logging"]["wandb_project"] == "rs-test"
    assert run["summary"]["summary/loss_end"] == result.losses[-1] and run["summary"]["summary/load/slowest_rank"] == 0
    assert "summary/losses" not in run["summary"]
    # the suite's tables (suite.md's rows) and its plot, as W&B media files of the run
    six = next(r for r in rows if r["_step"] == 6)
    assert six["Suite/classification"]["_type"] == "table-file" and six["Suite/plot"]["_type"] == "image-file"
    files = next((out / "monitor" / "wandb" / "wandb").glob(f"offline-run-*-{run_id}/files"))
    table = json.loads((files / six["Suite/classification"]["path"]).read_text())
    assert table["columns"][:7] == ["set", "split", "images", "classes", "top-1", "top-5", "mean per class"]
    assert table["data"][0][:7] == ["WHU-RS19", "all images", 40, 19, 31.0, 50.0, 20.0]
    assert (files / six["Suite/plot"]["path"]).stat().st_size > 1000
    assert (out / "eval" / "suite_step00000006.png").is_file()
    # nothing logged at a step W&B had passed (its own warning, in the run's log)
    log = next((out / "monitor" / "wandb" / "wandb").glob("offline-run-*/logs/debug-internal.log")).read_text()
    assert "ignoring partial history record" not in log


@pytest.mark.parametrize("lost", [False, True])
def test_a_resumed_run_continues_the_same_wandb_run_without_a_step_twice(offline, lost):
    """Checkpoint at 4; the next segment logs 5 and 6 and dies; the resume from 4 recomputes 5-6 and
    logs 7-8. One W&B run over three offline folders, every step once. ``lost``: a SIGKILL took what
    wandb-core had buffered of the first two segments (their files cut to the header, as a killed
    launch left them): the resume sends the lines up to its checkpoint again from metrics.jsonl,
    and 5-6 live. A fresh run after all that is a new W&B run."""
    out = offline
    engine, first, run_id = _segment(out, stop_after=4)
    resume = {"step": 4, "w": engine.w.item(), "state": client_state(4, first, None)}
    assert json.loads(state_path(out).read_text()) == {"id": run_id}
    *_, died_id = _segment(out, resume=resume, stop_after=6, exit_code=1)
    if lost:
        for path in (out / "monitor" / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"):
            path.write_bytes(path.read_bytes()[:7])
    *_, resumed_id = _segment(out, resume=resume)
    assert died_id == resumed_id == run_id
    run = _read(out, run_id)
    rows = run["history"]
    assert run["segments"] == 3
    steps = [r["_step"] for r in rows]
    # increasing across the folders, none twice; lost: DeepSpeed's events of 1 and 3 are gone with them
    assert steps == sorted(set(steps)) == ([0, 2, 3, 4, 5, 6, 7, 8] if lost else list(range(0, 9)))
    lines = read_metrics(out / "metrics.jsonl")                        # the last line written for each step
    assert _series(rows, "Train/loss") == [(r["step"], r["loss"]) for r in lines["train"]]
    assert _series(rows, "Eval/zero_shot/top1") == [(r["step"], r["eval"]["zero_shot/top1"]) for r in lines["eval"]]
    assert [s for s, _ in _series(rows, "Train/Samples/lr")] == ([5, 6, 7, 8] if lost else list(range(1, 9)))
    *_, fresh_id = _segment(out)   # no resume: a new W&B run
    assert fresh_id != run_id and json.loads(state_path(out).read_text()) == {"id": fresh_id}


def test_deepspeed_gets_no_wandb_section(tmp_path):
    """DeepSpeed's W&B monitor would log at the sample count as W&B's step: the run is ours alone."""
    pytest.importorskip("wandb", reason="logging.wandb=true checks that the package is there")
    run = load_config(None, [f"output_dir={tmp_path}", "logging.wandb=true", "logging.csv=true"])
    ds = build_ds_config(run, load_profile("zero2"), 2, on_gpu=False)
    assert "wandb" not in ds and ds["csv_monitor"]["enabled"]


@pytest.mark.parametrize("env, mode, said", [
    ({}, "offline", "W&B offline: neither WANDB_MODE nor WANDB_API_KEY is set"),
    ({"WANDB_MODE": "online"}, "online", "W&B mode online (WANDB_MODE)"),      # the user's mode is kept
    ({"WANDB_API_KEY": "k" * 40}, None, "W&B online (WANDB_API_KEY is set"),   # a key: wandb's default
    ({"WANDB_MODE": "disabled", "WANDB_DIR": "elsewhere"}, "disabled", "W&B mode disabled"),
])
def test_offline_only_when_nothing_says_otherwise(tmp_path, env, mode, said):
    env = {k: str(tmp_path / v) if k == "WANDB_DIR" else v for k, v in env.items()}
    given = env.get("WANDB_DIR")
    line = configure_wandb_offline(tmp_path / "monitor", env)
    assert env.get("WANDB_MODE") == mode and line.startswith(said)
    assert env["WANDB_DIR"] == (given or str(tmp_path / "monitor" / "wandb")) and env["WANDB_DIR"] in line
    assert env["WANDB_PROJECT"] == "rsclip_ds"
    mine = {**env, "WANDB_PROJECT": "mine"}   # the user's project is kept too
    configure_wandb_offline(tmp_path / "monitor", mine)
    assert mine["WANDB_PROJECT"] == "mine"


def test_markdown_tables_read_back_cells_as_suite_md_writes_them():
    text = "# t\n\n## Retrieval\n\n| set | a\\|b | x |\n|---|---:|---:|\n| RSICD | 1.50 | — |\n\nafter\n"
    assert markdown_tables(text) == [("Retrieval", ["set", "a|b", "x"], [["RSICD", 1.5, None]])]


def _offline_records(out, run_id, kind: str):
    from rsclip_ds.reporting.wandb_log import wandb_records

    for path in sorted((out / "monitor" / "wandb" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == kind:
                yield getattr(record, kind)


def _visualize_specs(out, run_id) -> dict:
    """The run's custom charts: config's _wandb.visualize (read_offline_run leaves _wandb out)."""
    specs = {}
    for config in _offline_records(out, run_id, "config"):
        for item in config.update:
            keys = list(item.nested_key) or [item.key]
            if keys[:2] == ["_wandb", "visualize"]:
                specs[keys[2]] = json.loads(item.value_json)
    return specs


def _table_artifact(out, run_id, key: str) -> tuple[dict, dict]:
    """A logged table as `wandb sync` uploads it: W&B puts a table of media into a run_table artifact
    (the run's files/ copy holds "Image" placeholders) -> (the table's JSON, {its path: the staged file})."""
    from pathlib import Path

    for artifact in _offline_records(out, run_id, "artifact"):
        files = {c.path: Path(c.local_path) for c in artifact.manifest.contents}
        if f"{key}.table.json" in files:
            return json.loads(files[f"{key}.table.json"].read_text()), files
    raise AssertionError(f"no run_table artifact holds {key}")


def test_the_suite_confusion_matrix_and_gallery_land_at_the_suite_step(offline):
    """The hook wrote eval/step00000006/ (the shared contract: suite.json + samples/, by hand here):
    W&B's own confusion-matrix chart of the fixture's known confusions and a table of the capped, seeded
    caption sample with its images, at step 6 beside the scalars."""
    from PIL import Image

    from tests.unit.test_eval_visuals import CLASSES, COUNTS, SUITE_METRICS, expected_gallery, write_step_folder

    out = offline
    run = load_config(None, [f"output_dir={out}", "logging.wandb=true", "logging.wandb_project=rs-test"])
    configure_wandb_offline(out / "monitor")
    wb = build_wandb_log(run.logging, out, rank=0, resumed_at=None, config={})
    rows = write_step_folder(out / "eval" / "step00000006", out / "img", 6)
    log = MetricsLog(out / "metrics.jsonl", wandb=wb)
    log.eval(3, {"zero_shot/top1": 0.3})                    # no suite: no visuals
    log.eval(6, {"zero_shot/top1": 0.4, **SUITE_METRICS})
    log.train(6, {"loss": 1.0})
    log.close()
    run_id = wb.run.id
    wb.finish()
    history = _read(out, run_id)["history"]
    three, six = (next(r for r in history if r["_step"] == s) for s in (3, 6))
    assert not any(k.startswith("Suite/") for k in three)
    assert six["Eval/suite/UCM/top1"] == SUITE_METRICS["suite/UCM/top1"] and six["Train/loss"] == 1.0
    assert not any(k.startswith("Suite/AID/") for k in six)   # a set that could not be scored
    # the confusion matrix: W&B's chart (its vega spec) over its K x K table of counts
    assert six["Suite/UCM/confusion_table"]["_type"] == "table-file"
    spec = _visualize_specs(out, run_id)["Suite/UCM/confusion"]
    assert spec["panel_config"]["panelDefId"] == "wandb/confusion_matrix/v1"
    table, _ = _table_artifact(out, run_id, "Suite/UCM/confusion_table")
    assert table["columns"] == ["Actual", "Predicted", "nPredictions"] and len(table["data"]) == len(CLASSES) ** 2
    got = {(a, p): n for a, p, n in table["data"]}
    assert [[got[(a, p)] for p in CLASSES] for a in CLASSES] == COUNTS
    # the gallery: one row per sampled caption query, its images as W&B images
    assert six["Suite/RSICD/gallery"]["_type"] == "table-file" and six["Suite/RSICD/gallery"]["nrows"] == 8
    gallery, files = _table_artifact(out, run_id, "Suite/RSICD/gallery")
    assert gallery["columns"] == ["caption", "caption_index", "rank", "correct image", "top1", "top2", "top3", "top4",
                                  "top5"]
    want = expected_gallery(rows["retrieval"])
    assert [r[:3] for r in gallery["data"]] == [[w["caption"], w["caption_index"], w["rank"]] for w in want]
    for row, w in zip(gallery["data"], want):
        cells = row[3:]
        assert all(c["_type"] == "image-file" for c in cells)
        assert [c["caption"].endswith("correct") for c in cells[1:]] == [t == w["image_index"] for t in w["top5"]]
        assert [c["caption"][:4] for c in cells[1:]] == [f"{v:.2f}" for v in w["top5_scores"]]
        for c in cells:   # the fixture's 40 x 30 PNGs, under the 128 px thumbnail cap: as they are
            assert (c["width"], c["height"]) == (40, 30) and Image.open(files[c["path"]]).size == (40, 30)


def test_a_confusion_matrix_over_wandbs_table_limit_goes_as_its_image(offline, monkeypatch, caplog):
    """wandb.plot.confusion_matrix makes a K x K table of counts, cut at Table.MAX_ROWS rows: a set with
    more cells (here: the limit lowered to 4 < 3 x 3) gets the rendered matrix instead, said once."""
    pytest.importorskip("matplotlib", reason="the rendering needs matplotlib (the test extra installs it)")
    import logging

    import wandb

    from tests.unit.test_eval_visuals import SUITE_METRICS, write_step_folder

    monkeypatch.setattr(wandb.Table, "MAX_ROWS", 4)
    out = offline
    run = load_config(None, [f"output_dir={out}", "logging.wandb=true"])
    configure_wandb_offline(out / "monitor")
    wb = build_wandb_log(run.logging, out, rank=0, resumed_at=None, config={})
    with caplog.at_level(logging.INFO, logger="rsclip_ds"):
        for step in (3, 6):
            write_step_folder(out / "eval" / f"step{step:08d}", out / "img", step)
            wb.eval(step, SUITE_METRICS)
    run_id = wb.run.id
    wb.finish()
    rows = [r for r in _read(out, run_id)["history"] if "Suite/UCM/confusion" in r]
    assert [r["_step"] for r in rows] == [3, 6] and all(r["Suite/UCM/confusion"]["_type"] == "image-file" for r in rows)
    assert sum("over W&B's table limit" in r.getMessage() for r in caplog.records) == 1

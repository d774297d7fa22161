"""Metrics while the run runs (reporting.metrics, reporting.load), in one process: the train loop's
metrics.jsonl against its own history, a resume appending, the data-wait rule and its warning,
the monitor switches in the DeepSpeed config, and DeepSpeed's TensorBoard / CSV monitors read
back (EventAccumulator, csv)."""

from __future__ import annotations

import csv
import json
import logging
import math

import pytest

from rsclip_ds.config import ConfigError, load_config
from rsclip_ds.profiles import load_profile
from rsclip_ds.resolve import build_ds_config
from rsclip_ds.reporting.load import (HOST_PEAK, DataWaitWatch, add_to_totals, data_wait_outliers, load_summary,
                                      peak_memory, rank_record)
from rsclip_ds.reporting.metrics import MetricsLog, monitor_events, read_metrics, train_values
from rsclip_ds.reporting.progress import ProgressReporter
from rsclip_ds.reporting.summary import _load_rows
from rsclip_ds.faults import Faults
from rsclip_ds.loop import client_state
from tests.unit.fake_engine import FakeEngine, fake_batches, fault_plan, run_loop


def _train(path, steps=8, *, resume=None, stop_after=None, faults=None, monitor=None, hooks=(), log_every=2):
    engine = FakeEngine()
    if resume is not None:
        engine.w.data.fill_(resume["w"])
        engine.global_steps = resume["step"]
    log = MetricsLog(path, monitor, resumed_at=resume["step"] if resume else None)
    try:
        result = run_loop(engine, fake_batches(), steps, log_every, faults=faults, metrics=log, hooks=hooks,
                          reporter=ProgressReporter(steps, "plain"), resume=resume["state"] if resume else None,
                          stop_after=stop_after)
    finally:
        log.close()
    return engine, result


def test_a_line_per_log_step_with_the_loss_history_and_a_resume_appends(tmp_path):
    path = tmp_path / "metrics.jsonl"
    engine, first = _train(path, stop_after=4)
    state = client_state(4, first, None)
    _, result = _train(path, resume={"step": 4, "w": engine.w.item(), "state": state})
    m = read_metrics(path)
    assert [e["event"] for e in m["events"]] == ["start", "resume"] and m["events"][1]["step"] == 4
    lines = m["train"]
    assert [r["step"] for r in lines] == [2, 4, 6, 8]
    assert len(result.losses) == 8
    for r in lines:   # the last step's loss and the mean since the previous line, from the same history
        s = r["step"]
        assert r["loss"] == result.losses[s - 1]
        assert r["loss_mean"] == pytest.approx(sum(result.losses[s - 2:s]) / 2)
        assert r["lr"] == result.lrs[s - 1]
        assert r["grad_norm"] > 0 and r["loss_scale"] is None and r["bad_data"] == {}
        assert r["ranks"]["peak_mem_kind"] == HOST_PEAK and len(r["ranks"]["step_s"]) == 1
        assert r["ranks"]["peak_mem_bytes"][0] > 2**20 and 0 <= r["ranks"]["data_wait"][0] < 1
    assert lines[0]["samples_per_s"] > 0
    # the raw file: one JSON object per line, the first segment's lines kept before the resume
    raw = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r.get("event") or r["step"] for r in raw] == ["start", 2, 4, "resume", 6, 8]
    # the run totals cover both segments, less each segment's first step (start-up, as for samples/s)
    assert result.rank_load["steps"] == 6 and len(result.rank_load["seconds"]) == 1


def test_the_data_delay_shows_as_data_wait_of_that_rank(tmp_path):
    delay = 0.05
    faults = fault_plan(f"inject_data_delay_s={delay}")   # the last rank: 0
    _, result = _train(tmp_path / "m.jsonl", steps=4, faults=faults)
    lines = read_metrics(tmp_path / "m.jsonl")["train"]
    for r in lines:   # one batch per step, each handed over >= `delay` late (time.sleep's guarantee)
        wait_per_step = r["ranks"]["data_wait"][0] * r["ranks"]["step_s"][0]
        assert delay * (1 - 1e-9) <= wait_per_step < r["ranks"]["step_s"][0], r["ranks"]
    assert load_summary(result.rank_load)["max_data_wait_rank"] == 0
    other = iter([1])   # another rank's batches pass through untouched
    elsewhere = fault_plan(f"inject_data_delay_s={delay}", "inject_data_delay_rank=1", world=2)
    assert Faults(elsewhere, 0).batches(other) is other


def test_hook_results_are_eval_lines_on_the_same_step_axis(tmp_path):
    def hook(step, engine):
        return {"retrieval/mean_recall": step / 10, "classes": "8"} if step % 3 == 0 else None

    _, result = _train(tmp_path / "m.jsonl", steps=6, hooks=[hook])
    m = read_metrics(tmp_path / "m.jsonl")
    assert [(r["step"], r["eval"]) for r in m["eval"]] == [(e["step"], {k: v for k, v in e.items() if k != "step"})
                                                           for e in result.evals]
    assert [r["step"] for r in m["eval"]] == [0, 3, 6] and m["eval"][1]["eval"]["retrieval/mean_recall"] == 0.3


def test_sigkill_keeps_the_lines_written_so_far(tmp_path):
    """Each line is flushed when written: a reader sees it while the writer is still open."""
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.train(2, {"loss": 1.5})
    assert [json.loads(x).get("step") for x in path.read_text().splitlines()] == [None, 2]
    log.close()


@pytest.mark.parametrize("fractions, want", [
    ([0.05, 0.6], [1]),                      # two ranks: the median of the others is rank 0's
    ([0.05, 0.15], []),                      # 3x the other but below 0.2 absolute
    ([0.3, 0.35], []),                       # above 0.2 but like the other
    ([0.02, 0.03, 0.5, 0.02], [2]),
    ([0.0, 0.25], [1]),
    ([0.7], []),                             # one rank alone is never an outlier
])
def test_data_wait_outlier_rule(fractions, want):
    assert data_wait_outliers(fractions, 0.2, 3.0) == want


def test_the_warning_comes_once_per_occurrence(caplog):
    watch = DataWaitWatch(0.2, 3.0)
    with caplog.at_level(logging.INFO, logger="rsclip_ds"):
        assert watch.update(10, [0.05, 0.6]) == [1]
        assert watch.update(20, [0.05, 0.7]) == []           # still slow: no second warning
        assert watch.update(30, [0.05, 0.06]) == []          # recovered
        assert watch.update(40, [0.05, 0.5]) == [1]          # a new occurrence
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("rank 1 waits for data" in w for w in warnings)
    assert "step 10: rank 1 waits for data 60% of its step time, the other ranks 5%" in warnings[0]
    assert any("rank 1's data wait is back to 6%" in r.getMessage() for r in caplog.records)


def test_load_totals_name_the_slowest_fastest_and_max_wait_ranks():
    totals = add_to_totals({}, [[2.0, 0.1, 100.0], [2.2, 1.2, 300.0]], 4, HOST_PEAK)
    totals = add_to_totals(totals, [[1.0, 0.0, 200.0], [1.0, 0.5, 250.0]], 2, HOST_PEAK)
    s = load_summary(totals)
    assert s["step_s"] == pytest.approx([0.5, 3.2 / 6]) and s["data_wait"] == pytest.approx([0.1 / 3, 1.7 / 3.2])
    assert (s["slowest_rank"], s["fastest_rank"], s["max_data_wait_rank"], s["max_peak_mem_rank"]) == (1, 0, 1, 1)
    assert s["peak_mem_bytes"] == [200, 300]
    rows = dict(_load_rows(s))
    assert rows["step time per rank"].startswith("slowest rank 1 (0.533 s), fastest rank 0 (0.500 s)")
    assert rows["data wait per rank"].startswith("max rank 1 (53% of its step time)")
    assert "host RSS high-water" in rows["peak memory per rank"]
    # a resume on another world size starts the totals again
    assert add_to_totals(totals, [[1.0, 0.0, 1.0]], 1, HOST_PEAK)["steps"] == 1
    assert load_summary({}) is None
    assert rank_record([[2.0, 0.5, 7.0]], 4, HOST_PEAK) == {
        "step_s": [0.5], "data_wait": [0.25], "peak_mem_bytes": [7], "peak_mem_kind": HOST_PEAK}
    assert peak_memory("cpu")[0] > 0


def test_monitor_events_have_the_documented_names():
    rec = {"loss": 2.0, "loss_mean": 2.5, "lr": 1e-3, "grad_norm": None, "samples_per_s": float("nan"),
           "loss_scale": 1024.0, "bad_data": {"decode": 2},
           "ranks": {"step_s": [0.1, 0.3], "data_wait": [0.0, 0.5], "peak_mem_bytes": [7, 9]}}
    assert monitor_events(7, rec) == [("Train/loss", 2.0, 7), ("Train/loss_mean", 2.5, 7), ("Train/lr", 1e-3, 7),
                                      ("Train/loss_scale", 1024.0, 7), ("Data/bad_decode", 2.0, 7),
                                      ("Load/step_s_max", 0.3, 7), ("Load/data_wait_max", 0.5, 7),
                                      ("Load/peak_mem_bytes_max", 9.0, 7)]
    # W&B takes every rank's load too (a CSV monitor would make a file of each)
    per_rank = train_values({**rec, "mfu": 0.4}, per_rank=True)
    assert per_rank["Train/mfu"] == 0.4 and per_rank["Load/data_wait/rank1"] == 0.5
    assert [k for k in per_rank if k.startswith("Load/peak")] == [
        "Load/peak_mem_bytes_max", "Load/peak_mem_bytes/rank0", "Load/peak_mem_bytes/rank1"]


# --------------------------------------------------------------------------- monitor switches

def test_switches_map_to_deepspeed_sections_under_the_output_dir(tmp_path):
    run = load_config(None, [f"output_dir={tmp_path}", "logging.tensorboard=true", "logging.csv=true"])
    ds = build_ds_config(run, load_profile("zero2"), 2, on_gpu=False)
    assert ds["tensorboard"] == {"enabled": True, "output_path": str(tmp_path / "monitor"), "job_name": "tensorboard"}
    assert ds["csv_monitor"] == {"enabled": True, "output_path": str(tmp_path / "monitor"), "job_name": "csv"}
    assert "wandb" not in ds
    from deepspeed.monitor.config import get_monitor_config   # DeepSpeed's own parser accepts them
    parsed = get_monitor_config(ds)
    assert parsed.enabled and parsed.tensorboard.enabled and parsed.csv_monitor.enabled
    plain = build_ds_config(load_config(None, []), load_profile("zero2"), 2, on_gpu=False)
    assert not {"tensorboard", "csv_monitor", "wandb"} & set(plain)


def test_a_profile_monitor_section_keeps_working_and_both_at_once_is_refused(tmp_path):
    raw = json.loads(load_profile("zero2").path.read_text())
    raw["csv_monitor"] = {"enabled": True, "output_path": "csv_here", "job_name": "mine"}
    profile = tmp_path / "mine.json"
    profile.write_text(json.dumps(raw))
    ds = build_ds_config(load_config(None, [f"profile={profile}"]), load_profile(str(profile)), 2, on_gpu=False)
    assert ds["csv_monitor"]["job_name"] == "mine"
    with pytest.raises(ConfigError, match=r"logging.csv=true and profile mine.json has its own 'csv_monitor'"):
        build_ds_config(load_config(None, [f"profile={profile}", "logging.csv=true"]), load_profile(str(profile)),
                        2, on_gpu=False)


def test_wandb_without_the_package_names_the_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install wandb"):
        build_ds_config(load_config(None, ["logging.wandb=true"]), load_profile("zero2"), 2, on_gpu=False)


def test_data_delay_rank_needs_a_delay():
    with pytest.raises(ConfigError, match="inject_data_delay_rank is set without"):
        load_config(None, ["faults.inject_data_delay_rank=1"])


def test_tensorboard_and_csv_hold_our_events_at_the_optimizer_step(tmp_path, one_rank_group):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rsclip_ds.evaluation.hook import build_monitor

    run = load_config(None, [f"output_dir={tmp_path}", "logging.tensorboard=true", "logging.csv=true"])
    monitor = build_monitor(build_ds_config(run, load_profile("zero2"), 1, on_gpu=False))
    _, result = _train(tmp_path / "metrics.jsonl", steps=6, monitor=monitor)
    monitor.tb_monitor.summary_writer.close()
    lines = read_metrics(tmp_path / "metrics.jsonl")["train"]
    want = [(r["step"], r["loss"]) for r in lines]
    assert want == [(s, result.losses[s - 1]) for s in (2, 4, 6)]
    acc = EventAccumulator(str(tmp_path / "monitor" / "tensorboard")).Reload()
    assert {"Train/loss", "Train/lr", "Train/grad_norm", "Load/data_wait_max"} <= set(acc.Tags()["scalars"])
    got = [(e.step, e.value) for e in acc.Scalars("Train/loss")]
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)   # TB stores float32
    with open(tmp_path / "monitor" / "csv" / "Train_loss.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "loss"]
    assert [(int(s), float(v)) for s, v in rows[1:]] == want                       # CSV: repr, exact
    assert all(math.isfinite(float(v)) for _, v in rows[1:])


def test_skipped_steps_are_logged_and_enough_in_a_row_stop_the_run_at_the_failing_step(tmp_path):
    """A NaN gradient from step 4 on: each step is skipped (an event line apiece, the count on the train
    lines); the third in a row stops the run at step 6 -- neither a log step (every 4) nor a stop-check
    sync (every 5) -- after a line for it."""
    from rsclip_ds.loop import NonFiniteLoss

    faults = fault_plan("inject_nan_at_step=4", "max_nonfinite_steps=3", "stop_check_every=5")
    with pytest.raises(NonFiniteLoss, match=r"not finite for 3 consecutive steps \(4..6\).*after step 3"):
        _train(tmp_path / "m.jsonl", log_every=4, faults=faults)
    m = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in m["train"]] == [4, 6]
    assert [r["skipped_steps"] for r in m["train"]] == [1, 3] and m["train"][-1]["grad_norm"] is None
    assert all(math.isfinite(r["loss"]) for r in m["train"])        # the losses stay finite: the gradient was not
    skipped = [e for e in m["events"] if e["event"] == "skipped"]
    assert [(e["step"], e["grad_norm"]) for e in skipped] == [(4, None), (5, None), (6, None)]   # NaN: null


def test_train_lines_carry_mfu_where_the_devices_peak_is_known(tmp_path):
    """mfu_of: the model's training FLOPs per sample x samples/s over world x the device's datasheet
    peak (16-bit tensor cores for bf16, CUDA cores for fp32); none on CPU ranks or unknown devices.
    MetricsLog adds it to the train line (and so to every monitor) when samples/s is measured."""
    from rsclip_ds.model import preset_config
    from rsclip_ds.planning.flops import flops_per_sample
    from rsclip_ds.reporting.metrics import mfu_of

    config = preset_config("git-rsclip-base")
    per_device = mfu_of(config, "bf16", 8, "NVIDIA H200")
    assert per_device(1000.0) == pytest.approx(flops_per_sample(config).train() * 1000.0 / (8 * 989.4e12))
    assert mfu_of(config, "fp32", 1, "NVIDIA H200")(1.0) == pytest.approx(flops_per_sample(config).train() / 66.9e12)
    assert mfu_of(config, "bf16", 2, "cpu") is None and mfu_of(config, "bf16", 1, "Some GPU") is None
    log = MetricsLog(tmp_path / "m.jsonl", mfu=lambda rate: rate / 1e4)
    log.train(1, {"loss": 1.0, "samples_per_s": float("nan")})    # the first step: no rate, no mfu
    log.train(2, {"loss": 1.0, "samples_per_s": 250.0})
    log.close()
    lines = read_metrics(tmp_path / "m.jsonl")["train"]
    assert "mfu" not in lines[0] and lines[1]["mfu"] == 0.025

import io
import json
import logging

from rich.console import Console

from rsclip_ds.config import load_config
from rsclip_ds.profiles import load_profile
from rsclip_ds.resolve import derive_batch
from rsclip_ds.reporting.progress import ProgressReporter
from rsclip_ds.reporting.summary import build_summary, print_summary, write_summary
from rsclip_ds.loop import TrainResult


def test_plain_progress_logs_loss_lr_rate_and_loss_scale(caplog):
    caplog.set_level(logging.INFO, logger="rsclip_ds")
    rep = ProgressReporter(20, mode="plain")
    rep.update(10, {"loss": 1.25, "lr": 1e-3, "samples/s": 100.0, "loss_scale": 65536.0})
    rep.update(20, {"loss": 1.0, "lr": 5e-4, "samples/s": 110.0, "loss_scale": None})
    rep.close()
    lines = [r.getMessage() for r in caplog.records]
    assert "step 10/20" in lines[0] and "loss 1.25" in lines[0] and "loss_scale 6.554e+04" in lines[0]
    assert "loss_scale" not in lines[1]


def test_rich_progress_renders_step_and_metrics_and_logs_nothing(caplog):
    caplog.set_level(logging.INFO, logger="rsclip_ds")
    rep = ProgressReporter(3, mode="rich")
    bar = rep._bar   # the rich Progress; close() drops the reference
    assert bar is not None and bar.live.is_started
    rep.update(2, {"loss": 1.5, "lr": 1e-3, "loss_scale": None})
    rep.close()
    assert not bar.live.is_started and rep._bar is None
    (task,) = bar.tasks
    assert (task.completed, task.total, task.fields["metrics"]) == (2, 3, "loss 1.5  lr 0.001")
    # the row the bar draws: label, completed/total and the metrics text
    console = Console(file=io.StringIO(), width=120, record=True, color_system=None)
    console.print(bar.make_tasks_table(bar.tasks))
    row = console.export_text()
    assert "train" in row and "2/3" in row and "loss 1.5  lr 0.001" in row, row
    assert not caplog.records   # a live bar replaces the log lines


def test_disabled_reporter_logs_nothing(caplog):
    caplog.set_level(logging.INFO, logger="rsclip_ds")
    silent = ProgressReporter(3, mode="plain", enabled=False)
    silent.update(3, {"loss": 1.0})
    silent.close()
    assert not caplog.records and silent._bar is None
    ProgressReporter(3, mode="plain").update(3, {"loss": 1.0})   # control: enabled, it logs here
    assert [r.getMessage().split("  (")[0] for r in caplog.records] == ["step 3/3  loss 1"]


def test_summary_has_the_batch_arithmetic_and_loss_window(tmp_path, capsys):
    run = load_config(None, ["batch.micro_batch_size=4", "batch.gradient_accumulation_steps=2"])
    result = TrainResult(losses=[9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0], lrs=[0.0] * 7, optimizer_steps=7,
                         micro_steps=14, seconds=2.0, samples_per_s=48.0)
    s = build_summary(result, profile=load_profile("zero2"), batch=derive_batch(run, 3),
                      precision="bf16", source="tiny", num_parameters=210_000,
                      activation_checkpointing=False, loss="siglip", negatives="global",
                      accumulation="global")
    assert s["batch_arithmetic"] == "4 x 2 x 3 = 24" and s["global_batch"] == 24
    assert (s["loss_start"], s["loss_end"]) == (7.0, 5.0)   # means of the first / last 5 steps
    assert json.loads(write_summary(s, tmp_path).read_text())["micro_steps"] == 14
    print_summary(s)
    out = capsys.readouterr().out
    assert "4 x 2 x 3 = 24" in out and "7.0000 -> 5.0000" in out

"""logging.wandb with the real `wandb` package, offline: the DeepSpeed config section, DeepSpeed's W&B
monitor writing through our MetricsLog into the offline run folder configure_wandb_offline names,
and the run read back from its .wandb file. Also the caveat docs/guides/monitoring.md states: W&B
keeps one step counter per run, and DeepSpeed's own samples-keyed event runs it ahead of our
optimizer-step events, which W&B then drops."""

from __future__ import annotations

import json
import struct

import pytest

from rsclip_ds.config import load_config
from rsclip_ds.profiles import build_ds_config, load_profile
from rsclip_ds.reporting.metrics import MetricsLog, read_metrics
from rsclip_ds.runtime.distributed import configure_wandb_offline

wandb = pytest.importorskip("wandb", reason="the test extra installs wandb (setup.cfg)")

BLOCK, HEADER = 32768, 7   # wandb's .wandb file: LevelDB's log format after a 7-byte ':W&B' header


def read_history(path) -> list[dict]:
    """The history rows of a .wandb file (records: 7-byte header crc32/length/type, chunks in 32 KiB
    blocks; types 1 full, 2 first, 3 middle, 4 last), parsed with wandb's own protobuf classes."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunks, rows = path.read_bytes(), HEADER, b"", []
    assert data[:4] == b":W&B", data[:7]
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:   # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:
            break
        chunks += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


@pytest.fixture
def one_rank_group(tmp_path):
    """DeepSpeed's monitors ask deepspeed.comm for the rank: a 1-process gloo group."""
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, init_method=f"file://{tmp_path}/store",
                               rank=0, world_size=1, verbose=False)
    yield
    dist.destroy_process_group()


def _offline_run(tmp_path, monkeypatch, write) -> list[dict]:
    """A W&B monitor from logging.wandb=true; ``write(metrics_log, monitor)``; -> the history read back."""
    from rsclip_ds.evaluation.hook import build_monitor

    for var in ("WANDB_MODE", "WANDB_DIR"):   # configure_wandb_offline sets them only when unset
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = load_config(None, [f"output_dir={tmp_path}", "logging.wandb=true", "logging.wandb_project=rs-test"])
    ds = build_ds_config(run, load_profile("zero2"), 1, on_gpu=False)
    assert ds["wandb"] == {"enabled": True, "project": "rs-test"}
    configure_wandb_offline(tmp_path / "monitor")
    monitor = build_monitor(ds)
    log = MetricsLog(tmp_path / "metrics.jsonl", monitor)
    try:
        write(log, monitor)
    finally:
        log.close()
        wandb.finish()
        wandb.teardown()   # wandb keeps its settings (WANDB_DIR) per process: the next test starts afresh
    runs = list((tmp_path / "monitor" / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    return read_history(runs[0])


def _record(step: int) -> dict:
    return {"loss": 5.0 - 0.25 * step, "loss_mean": 5.1 - 0.25 * step, "lr": 1e-3 * step, "grad_norm": 1.5,
            "samples_per_s": 100.0 + step, "loss_scale": None, "bad_data": {"decode": 0}, "ranks": None}


def test_our_events_land_offline_on_the_optimizer_step_axis(tmp_path, monkeypatch, one_rank_group):
    def write(log, monitor):
        for step in (2, 4, 6):
            log.train(step, _record(step))
        log.eval(6, {"zero_shot/top1": 0.25})

    rows = _offline_run(tmp_path, monkeypatch, write)
    loss = [(r["_step"], r["Train/loss"]) for r in rows if "Train/loss" in r]
    assert loss == [(2, 4.5), (4, 4.0), (6, 3.5)]                     # the floats as written
    assert [r["Train/lr"] for r in rows if "Train/lr" in r] == [2e-3, 4e-3, 6e-3]
    assert [(r["_step"], r["Eval/zero_shot/top1"]) for r in rows if "Eval/zero_shot/top1" in r] == [(6, 0.25)]
    assert [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")["train"]] == [4.5, 4.0, 3.5]


def test_deepspeeds_samples_keyed_event_makes_wandb_drop_ours(tmp_path, monkeypatch, one_rank_group):
    """As in a run: after each optimizer step k the engine writes Train/Samples/lr at k x global
    batch (32) samples; our Train/loss at the lower step k is then dropped by W&B."""
    def write(log, monitor):
        for step in range(1, 7):
            monitor.write_events([("Train/Samples/lr", 1e-3 * step, 32 * step)])   # what DeepSpeed's engine writes
            if step % 2 == 0:
                log.train(step, _record(step))

    rows = _offline_run(tmp_path, monkeypatch, write)
    assert [r["_step"] for r in rows if "Train/Samples/lr" in r] == [32 * k for k in range(1, 7)]
    assert not [r for r in rows if "Train/loss" in r]                  # every one of ours dropped

"""Metrics while the run runs: {output_dir}/metrics.jsonl, DeepSpeed's monitor and W&B, on rank 0.

    metrics = MetricsLog(out / "metrics.jsonl", engine.monitor, resumed_at=None, wandb=None)
    metrics.train(step, {"loss": ..., "lr": ..., ...})    # one line per log step
    metrics.eval(step, {"zero_shot/top1": ...})           # one line per evaluation
    metrics.close()

Every line is flushed when written, so a run killed by SIGKILL keeps its lines up to its last
log step (a machine crash may lose what the OS had not written yet). Each process start appends
a marker line ({"event": "start"} or {"event": "resume", "step": N}); readers keep, for each
step, the line written last (a resumed run repeats the steps since its checkpoint). The schema
is in docs/guides/monitoring.md. metrics.jsonl is the source of truth; the monitors (TensorBoard,
CSV through DeepSpeed's MonitorMaster; W&B through reporting.wandb_log.WandbLog) get the same
numbers on the same optimizer-step axis.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

from rsclip_ds.reporting.eval_visuals import SuiteImages, tensorboard_writer


def read_metrics(path: str | Path, *, last_run: bool = False) -> dict[str, list[dict]]:
    """-> {"train": [...], "eval": [...], "events": [...]}: the train and eval lines of the whole
    run in step order, the last line written for each step winning (a resume repeats steps).
    ``last_run``: only the lines after the last start marker (a fresh run into a folder that had a
    metrics.jsonl appends after the old run's lines)."""
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    events = []
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        if last_run and rec.get("event") == "start":
            train, evals, events = {}, {}, []
        if "event" in rec:
            events.append(rec)
        elif rec.get("kind") == "eval":
            evals[rec["step"]] = rec
        else:
            train[rec["step"]] = rec
    return {"train": [train[k] for k in sorted(train)], "eval": [evals[k] for k in sorted(evals)],
            "events": events}


TRAIN_NAMES = {"loss": "Train/loss", "loss_mean": "Train/loss_mean", "lr": "Train/lr",
               "grad_norm": "Train/grad_norm", "samples_per_s": "Train/samples_per_s",
               "loss_scale": "Train/loss_scale", "mfu": "Train/mfu", "skipped_steps": "Train/skipped_steps"}


def train_values(record: dict[str, Any], *, per_rank: bool = False) -> dict[str, float]:
    """A train line -> {monitor name: value}: the TRAIN_NAMES fields, the bad-data counts
    (Data/bad_<kind>) and the slowest rank's load (Load/step_s_max, Load/data_wait_max,
    Load/peak_mem_bytes_max); ``per_rank`` adds every rank's (Load/step_s/rank<r>, ...: W&B's
    panels take them, a CSV monitor would make a file of each). Values not measured (None, the
    NaN samples/s of a first step) are left out; a NaN loss is kept."""
    values = {name: float(record[key]) for key, name in TRAIN_NAMES.items() if record.get(key) is not None}
    if math.isnan(values.get("Train/samples_per_s", 0.0)):
        del values["Train/samples_per_s"]
    values.update({f"Data/bad_{kind}": float(n) for kind, n in (record.get("bad_data") or {}).items()})
    ranks = record.get("ranks") or {}
    for key in ("step_s", "data_wait", "peak_mem_bytes"):
        if ranks.get(key):
            values[f"Load/{key}_max"] = float(max(ranks[key]))
            if per_rank:
                values.update({f"Load/{key}/rank{r}": float(v) for r, v in enumerate(ranks[key])})
    return values


def monitor_events(step: int, record: dict[str, Any]) -> list[tuple[str, float, int]]:
    """A train line -> DeepSpeed monitor events (name, value, optimizer step)."""
    return [(name, value, step) for name, value in train_values(record).items()]


def suite_ran(metrics: dict[str, Any]) -> bool:
    """An evaluation's flat metrics hold the benchmark suite's (suite/<set>/<metric>): its step
    folder eval/step{N:08d}/ was written."""
    return any(k.startswith("suite/") for k in metrics)


def eval_values(metrics: dict[str, Any]) -> dict[str, float]:
    """An evaluation's flat metrics -> {"Eval/<group>/<metric>": value}, numbers only."""
    return {f"Eval/{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


def mfu_of(config, precision: str, world_size: int, device_name: str) -> Callable[[float], float] | None:
    """The run's MFU per device from its samples/s: the model's training FLOPs per sample
    (planning/flops.py: 3 x the forward's matmuls, patch dropout and recompute not counted) over
    world_size devices at their datasheet peak; None where the peak is unknown (CPU, other GPUs)."""
    from rsclip_ds.planning.flops import flops_per_sample, mfu_per_device, peak_flops

    peak = peak_flops(device_name, precision)
    if peak is None:
        return None
    flops = flops_per_sample(config).train()
    return lambda samples_per_s: mfu_per_device(flops, samples_per_s, world_size, peak)


class MetricsLog:
    """Rank 0's writer (`enabled=False` on the other ranks: every call is then a no-op).
    `monitor`: the engine's DeepSpeed MonitorMaster (TensorBoard / CSV), or None. `wandb`: a
    reporting.wandb_log.WandbLog, or None; its owner finishes it (the summary comes after close).
    `mfu`: samples/s (all ranks) -> each device's model FLOPs utilisation (mfu_of), or None where the
    device's peak is unknown (CPU ranks): train lines then carry `mfu` (monitors: Train/mfu).
    With DeepSpeed's TensorBoard monitor on, a suite evaluation also puts the suite's confusion
    matrices and retrieval galleries into its event file as images (eval_visuals.SuiteImages), read
    from `eval_dir`/step{N:08d}/ (default: the eval/ folder beside metrics.jsonl, where the hook writes)."""

    def __init__(self, path: str | Path, monitor=None, *, resumed_at: int | None = None, enabled: bool = True,
                 wandb=None, mfu: Callable[[float], float] | None = None, eval_dir: str | Path | None = None):
        self.enabled, self.mfu = enabled, mfu
        self.monitor = monitor if monitor is not None and getattr(monitor, "enabled", False) else None
        self.wandb = wandb if enabled else None
        self._f = None
        self.images = None
        if not enabled:
            return
        writer = tensorboard_writer(self.monitor)
        if writer is not None:
            self.images = SuiteImages(writer, Path(eval_dir) if eval_dir is not None else Path(path).parent / "eval")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = path.open("a")   # a resumed run continues the file; a fresh run adds a start marker
        marker = {"event": "start"} if resumed_at is None else {"event": "resume", "step": resumed_at}
        self._write({**marker, "time": time.time()})

    def _write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def train(self, step: int, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        rate = record.get("samples_per_s")
        if self.mfu is not None and rate is not None and math.isfinite(rate):
            record = {**record, "mfu": self.mfu(rate)}
        self._write({"kind": "train", "step": step, **record, "time": time.time()})
        if self.monitor is not None:
            self.monitor.write_events(monitor_events(step, record))
        if self.wandb is not None:
            self.wandb.train(step, record)

    def eval(self, step: int, metrics: dict[str, Any]) -> None:
        """A hook's dict, on the train lines' step axis (monitors: Eval/<metric>)."""
        if not self.enabled:
            return
        self._write({"kind": "eval", "step": step, "eval": metrics, "time": time.time()})
        if self.monitor is not None:
            self.monitor.write_events([(name, value, step) for name, value in eval_values(metrics).items()])
        if self.images is not None and suite_ran(metrics):
            self.images.write(step)
        if self.wandb is not None:
            self.wandb.eval(step, metrics)

    def epoch_end(self, step: int, record: dict[str, Any]) -> None:
        """The loader finished an epoch at optimizer step `step` (reporting/epochs.py): a marker line
        {"event": "epoch_end", "step", "epoch", "samples" delivered (all ranks), "batches_per_rank",
        "coverage"} -- read_metrics lists it with the events."""
        if self.enabled:
            self._write({"event": "epoch_end", "step": step, **record, "time": time.time()})

    def skipped(self, step: int, grad_norm: float | None) -> None:
        """Optimizer step `step` was skipped, its gradient norm not finite (rsclip_ds.finite): a marker
        line {"event": "skipped", "step", "grad_norm" (null for NaN, else inf as a string)}."""
        if self.enabled:
            norm = None if grad_norm is None or math.isnan(grad_norm) else str(grad_norm)
            self._write({"event": "skipped", "step": step, "grad_norm": norm, "time": time.time()})

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        if self.images is not None:   # the run's end: DeepSpeed's TensorBoard writer closes with it
            self.images.close()
            self.images = None

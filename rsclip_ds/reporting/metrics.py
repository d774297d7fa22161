"""Metrics while the run runs: {output_dir}/metrics.jsonl and DeepSpeed's monitor, on rank 0.

    metrics = MetricsLog(out / "metrics.jsonl", engine.monitor, resumed_at=None)
    metrics.train(step, {"loss": ..., "lr": ..., ...})    # one line per log step
    metrics.eval(step, {"zero_shot/top1": ...})           # one line per evaluation
    metrics.close()

Every line is flushed when written, so a run killed by SIGKILL keeps its lines up to its last
log step (a machine crash may lose what the OS had not written yet). Each process start appends
a marker line ({"event": "start"} or {"event": "resume", "step": N}); readers keep, for each
step, the line written last (a resumed run repeats the steps since its checkpoint). The schema
is in docs/guides/monitoring.md.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


def read_metrics(path: str | Path) -> dict[str, list[dict]]:
    """-> {"train": [...], "eval": [...], "events": [...]}: the train and eval lines of the whole
    run in step order, the last line written for each step winning (a resume repeats steps)."""
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    events = []
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        if "event" in rec:
            events.append(rec)
        elif rec.get("kind") == "eval":
            evals[rec["step"]] = rec
        else:
            train[rec["step"]] = rec
    return {"train": [train[k] for k in sorted(train)], "eval": [evals[k] for k in sorted(evals)],
            "events": events}


def monitor_events(step: int, record: dict[str, Any]) -> list[tuple[str, float, int]]:
    """A train line -> DeepSpeed monitor events (name, value, optimizer step). Values that were
    not measured (None, NaN samples/s of the first step) are left out."""
    names = {"loss": "Train/loss", "loss_mean": "Train/loss_mean", "lr": "Train/lr",
             "grad_norm": "Train/grad_norm", "samples_per_s": "Train/samples_per_s",
             "loss_scale": "Train/loss_scale"}
    events = [(name, float(record[key]), step) for key, name in names.items() if record.get(key) is not None]
    events += [(f"Data/bad_{kind}", float(n), step) for kind, n in (record.get("bad_data") or {}).items()]
    ranks = record.get("ranks")
    if ranks:
        events += [("Load/step_s_max", max(ranks["step_s"]), step),
                   ("Load/data_wait_max", max(ranks["data_wait"]), step)]
    return [e for e in events if not (e[0] == "Train/samples_per_s" and math.isnan(e[1]))]


class MetricsLog:
    """Rank 0's writer (`enabled=False` on the other ranks: every call is then a no-op).
    `monitor`: the engine's DeepSpeed MonitorMaster (TensorBoard / CSV / W&B), or None."""

    def __init__(self, path: str | Path, monitor=None, *, resumed_at: int | None = None, enabled: bool = True):
        self.enabled = enabled
        self.monitor = monitor if monitor is not None and getattr(monitor, "enabled", False) else None
        self._f = None
        if not enabled:
            return
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
        self._write({"kind": "train", "step": step, **record, "time": time.time()})
        if self.monitor is not None:
            self.monitor.write_events(monitor_events(step, record))

    def eval(self, step: int, metrics: dict[str, Any]) -> None:
        """A hook's dict, on the train lines' step axis (monitor: Eval/<metric>)."""
        if not self.enabled:
            return
        self._write({"kind": "eval", "step": step, "eval": metrics, "time": time.time()})
        if self.monitor is not None:
            self.monitor.write_events([(f"Eval/{k}", float(v), step) for k, v in metrics.items()
                                       if isinstance(v, (int, float))])

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

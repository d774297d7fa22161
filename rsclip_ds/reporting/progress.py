"""Rank-0 progress: a rich live bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("rsclip_ds")


def _fmt(metrics: dict[str, float | None]) -> str:
    parts = []
    for key, value in metrics.items():
        if value is None:
            continue
        parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    return "  ".join(parts)


class ProgressReporter:
    """update(step, metrics) after each log window; close() when done (also on error)."""

    def __init__(self, total_steps: int, mode: str = "auto", enabled: bool = True):
        self.total = total_steps
        self.enabled = enabled
        self.t0 = time.perf_counter()
        use_rich = mode == "rich" or (mode == "auto" and sys.stdout.isatty())
        self._bar = None
        if enabled and use_rich:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)
            self._bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(),
                                 TextColumn("{task.fields[metrics]}"))
            self._task = self._bar.add_task("train", total=total_steps, metrics="")
            self._bar.start()

    def update(self, step: int, metrics: dict[str, float | None]) -> None:
        if not self.enabled:
            return
        text = _fmt(metrics)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, metrics=text)
        else:
            log.info("step %d/%d  %s  (%.1fs)", step, self.total, text, time.perf_counter() - self.t0)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

"""What each epoch of the run delivers, said where users look: the start-up line, an `epoch_end`
line in metrics.jsonl when a rank's loader finishes an epoch, and `epochs` in summary.json.

The numbers come from the loader's schedule (data/schedule.py: `coverage`, `describe`), computed
from the shards' counts; which epoch the run is in comes from the batches the loader has handed
out (`loader.batches`, counted from the run's start and kept in the checkpoint). Under
data.policy=exact an epoch is every sample of its data once, less fewer than one global batch;
a batch of an epoch is taken by every rank at the same optimizer step, so rank 0's count is the
run's. A loader without a schedule (a benchmark's own batches) has no epochs to say.
"""

from __future__ import annotations

from typing import Any


def schedule_of(loader) -> Any:
    """The loader's EpochSchedule, or None."""
    return getattr(loader, "schedule", None)


def startup_lines(loader) -> list[str]:
    """The epoch the run starts in and, when that is a remap's transition epoch, the next one:
    'epoch 0: 34 batches per rank = 8,704 of 8,734 samples (99.7 %)'."""
    from rsclip_ds.data.bad import DataError

    schedule = schedule_of(loader)
    if schedule is None:
        return []
    try:
        epoch = schedule.epoch_of(loader.batches)
    except DataError:   # no global batch in the data: said here, raised by the loader's first batch
        return [schedule.describe(schedule.first)]
    lines = [schedule.describe(epoch)]
    if schedule.coverage(epoch)["transition"]:
        lines.append(schedule.describe(epoch + 1) + " (and every epoch after)")
    elif loader.batches > schedule.start(epoch):
        lines[0] += f" (resumed at its batch {loader.batches - schedule.start(epoch):,} per rank)"
    return lines


class EpochWatch:
    """After each optimizer step, `ended()` -> the epochs the loader finished since the last call,
    each as {"epoch", "samples", "batches_per_rank", "coverage"} (metrics.jsonl's epoch_end)."""

    def __init__(self, loader):
        self.loader, self.schedule = loader, schedule_of(loader)
        self.epoch = self.schedule.epoch_of(loader.batches) if self.schedule is not None else None

    def ended(self) -> list[dict[str, Any]]:
        out = []
        while self.schedule is not None and self.loader.batches >= self.schedule.start(self.epoch + 1):
            c = self.schedule.coverage(self.epoch)
            out.append({"epoch": self.epoch, "samples": c["samples"], "batches_per_rank": c["batches_per_rank"],
                        "coverage": c["coverage"]})
            self.epoch += 1
        return out


def epochs_record(loader) -> list[dict[str, Any]] | None:
    """summary.json's `epochs`: every epoch the run has reached (from the schedule's first: a run
    remapped to another world size starts in its transition epoch), with its coverage and the
    samples delivered in it so far (`delivered`; `complete` once the loader passed its end)."""
    schedule = schedule_of(loader)
    if schedule is None:
        return None
    end = loader.batches
    out = []
    epoch = schedule.first
    while True:
        start, stop = schedule.start(epoch), schedule.start(epoch + 1)
        if start >= end and epoch > schedule.first:
            break
        c = {k: v for k, v in schedule.coverage(epoch).items() if k != "refused"}
        taken = max(0, min(end, stop) - start)
        out.append({**c, "delivered": taken * c["global_batch"], "complete": end >= stop})
        if end < stop:
            break
        epoch += 1
    return out

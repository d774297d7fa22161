"""Bad data: the kinds we skip and count, the per-stream counter, and the stop threshold.

Missing or unreadable shard files, truncated tars, empty shards, corrupt images and samples
without an image or caption are skipped and counted by kind; the first examples of each kind
are logged with their path, then one line per power of ten. More than
``data.max_bad_fraction`` bad samples or shards stops the run with ``DataError``.
"""

from __future__ import annotations

SHARD_KINDS = ("missing_shard", "unreadable_shard", "truncated_tar", "empty_shard")
SAMPLE_KINDS = ("corrupt_image", "missing_image", "missing_caption")
# not bad data, counted beside it (carried in the resumable state, summed in the summary):
# samples data.where dropped; no part of max_bad_fraction
FILTER_KINDS = ("filtered_out",)
BAD_KINDS = SHARD_KINDS + SAMPLE_KINDS + FILTER_KINDS


class DataError(RuntimeError):
    """The training data is too broken to go on (see data.max_bad_fraction)."""
    exit_code = 5   # docs/reference/exit-codes.md



def check_bad_fraction(bad: dict[str, int], samples: int, shards: int, limit: float, min_samples: int,
                       who: str, examples: dict[str, str]) -> None:
    """Raise DataError when more than ``limit`` of the samples or shards read were bad."""
    if samples < min_samples or limit >= 1:
        return
    bad_samples, bad_shards = sum(bad[k] for k in SAMPLE_KINDS), sum(bad[k] for k in SHARD_KINDS)
    for what, n, total in (("samples", bad_samples, samples), ("shards", bad_shards, shards)):
        if total and n / total > limit:
            counts = ", ".join(f"{k} {v}" for k, v in bad.items() if v)
            example = next((f"{k} at {p}" for k, p in examples.items()), "none logged")
            raise DataError(
                f"{who}: {n} of {total} {what} read were bad ({n / total:.1%} > data.max_bad_fraction="
                f"{limit}); counts: {counts}; e.g. {example}. Repair or drop those inputs, or raise "
                "data.max_bad_fraction (--set data.max_bad_fraction=0.2)")



class StreamCounter:
    """Bad-data counts and positions of one stream; `events` are examples for the main process."""

    EXAMPLES = 3   # examples per kind a worker sends (the counts are always complete)

    def __init__(self, state: dict):
        self.bad = {k: int(state.get("bad", {}).get(k, 0)) for k in BAD_KINDS}
        self.samples = int(state.get("samples", 0))   # samples taken from the buffer, good or bad
        self.shards = int(state.get("shards", 0))     # shards opened (for the bad-shard fraction)
        self.filtered_run = 0                         # data.where: samples dropped in a row
        self.opened = 0                               # shards opened in this epoch
        self.closed = 0                               # ... and read to the end (errors reported)
        self.quiet_opened = self.quiet_closed = 0     # replay: shards already counted before resume
        self.events: list[tuple[str, str, str]] = []
        self.examples: dict[str, str] = {}
        self._sent = dict.fromkeys(BAD_KINDS, 0)

    def shard_opened(self) -> bool:
        """Count a newly opened shard; False while replaying a shard whose errors were counted
        before a resume (a shard's errors are known when it has been read to its end)."""
        self.opened += 1
        self.shards += self.opened > self.quiet_opened
        return self.opened > self.quiet_closed

    def report(self, kind: str, where: str, detail: str) -> None:
        self.bad[kind] += 1
        self.examples.setdefault(kind, f"{where} ({detail[:200]})")
        if self._sent[kind] < self.EXAMPLES:
            self._sent[kind] += 1
            self.events.append((kind, where, detail[:200]))


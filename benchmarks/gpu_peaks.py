"""Peak dense FLOP/s per device and MFU per device, what benchmarks.gpu divides by: the package's
own table (rsclip_ds.planning.flops.PEAKS), which the run's metrics use too (metrics.jsonl's mfu)."""

from __future__ import annotations

from rsclip_ds.planning.flops import PEAKS, mfu_per_device, peak_flops  # noqa: F401 -- re-exported

__all__ = ["PEAKS", "mfu_per_device", "peak_flops"]

"""Peak dense FLOP/s per device and MFU per device, what benchmarks.gpu.run divides by: the package's
own table (rsclip_ds.planning.flops.PEAKS), which the run's metrics use too (metrics.jsonl's mfu);
and the device's short tag that names the GPU script's JSON (gpu_h100_base.json, gpu_h200_base.json)."""

from __future__ import annotations

import re

from rsclip_ds.planning.flops import PEAKS, mfu_per_device, peak_flops  # noqa: F401 -- re-exported

__all__ = ["PEAKS", "device_tag", "mfu_per_device", "peak_flops"]


def device_tag(name: str | None = None) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200', 'NVIDIA A100-SXM4-80GB' -> 'a100',
    'NVIDIA L40S' -> 'l40s':
    the first model number of the device's name (torch.cuda.get_device_name(); `name` None: this
    machine's first GPU), lower case; 'cpu' without a GPU, 'gpu' for a name without a model number."""
    if name is None:
        import torch

        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return "cpu"
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name.upper())
    return m[1].lower() if m else "gpu"

"""Peak dense FLOP/s per device, by precision, and MFU per device: what benchmarks.gpu divides by.

Vendor datasheet figures, dense (no 2:4 sparsity), per GPU. The variants differ: an H100 PCIe
(756 TFLOP/s bf16, 350 W) or NVL (835) is not an SXM (989), so the most specific name is
matched first. fp32 rows run on the CUDA cores (torch leaves TF32 matmuls off by default:
torch.backends.cuda.matmul.allow_tf32 is False), so they are divided by the fp32 peak, not bf16's.
"""

from __future__ import annotations

# (substring of torch.cuda.get_device_name(), bf16 tensor-core TFLOP/s, fp32 TFLOP/s), most specific first
PEAKS = (
    ("H100 PCIe", 756.5, 51.2),
    ("H100 NVL", 835.5, 60.0),
    ("H200", 989.4, 66.9),
    ("H100", 989.4, 66.9),      # SXM5 (e.g. 'NVIDIA H100 80GB HBM3')
    ("A100", 312.0, 19.5),
    ("L40S", 362.0, 91.6),
    ("A10", 125.0, 31.2),
)


def peak_flops(device_name: str, precision: str, override_tflops: float | None = None) -> float | None:
    """FLOP/s of one device at ``precision`` (bf16 or fp32); ``override_tflops`` (--peak-tflops) wins;
    None for a device not in PEAKS (MFU then stays empty rather than wrong)."""
    if override_tflops:
        return override_tflops * 1e12
    for key, bf16, fp32 in PEAKS:
        if key in device_name:
            return (bf16 if precision == "bf16" else fp32) * 1e12
    return None


def mfu_per_device(flops_per_sample: float, samples_per_s: float, world_size: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation of each device: the run's samples/s (all ranks together) over
    world_size devices of ``peak`` FLOP/s each."""
    return flops_per_sample * samples_per_s / (peak * world_size) if peak else None

"""Matmul FLOPs of the dual encoder, counted from its config, for MFU.

Convention (as torch.utils.flop_counter and the MFU literature): a (m, k) @ (k, n) product is
2mkn FLOPs; element-wise work, norms, softmax and embedding lookups are not counted (they are
a few % of a transformer and do not run on the matrix units). A training step costs
3 x forward (backward computes the input and the weight gradients, 2 x forward); with
activation checkpointing the hardware also re-runs the forward: 4 x. MFU uses the 3 x "model
FLOPs" either way (Chowdhery et al. 2022, appendix B); HFU the FLOPs actually executed.

SigLIP towers (transformers' SiglipVisionModel / SiglipTextModel), per sample, with n tokens
of width d, MLP width f, per encoder layer:
    q, k, v, o projections        4 x 2 n d^2
    scores QK^T and weights @ V    2 x 2 n^2 d
    MLP (fc1, fc2)                2 x 2 n d f
vision: n = (image_size / patch)^2, plus the patch embedding (a conv = a matmul of n patches
of 3 p^2 values with d filters: 2 n (3 p^2) d) and the attention-pooling head (one probe
query: q 2 d^2, k and v 2 x 2 n d^2, scores and weights @ V 2 x 2 n d, out 2 d^2, MLP 4 d f).
With patch dropout (a planning config's `patch_dropout`, planning/dropout.py) the layers and the
head see the kept n' = round((1 - p) n) tokens; the patch embedding all n.
text: n = max_position_embeddings (SigLIP pads every caption to it), plus the head
Linear(d, projection_size) on the pooled token: 2 d P.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rsclip_ds.model import kept_tokens
from rsclip_ds.planning.dropout import patch_dropout_of


@dataclass(frozen=True)
class TowerFlops:
    embed: int      # patch embedding (vision) / 0 (text: a lookup)
    layers: int     # all encoder layers
    head: int       # pooling head / projection

    @property
    def total(self) -> int:
        return self.embed + self.layers + self.head


def encoder_layer_flops(n: int, d: int, f: int) -> int:
    """Forward FLOPs of one pre-norm transformer layer on n tokens (per sample)."""
    return 4 * 2 * n * d * d + 2 * 2 * n * n * d + 2 * 2 * n * d * f


def vision_flops(cfg) -> TowerFlops:
    """Per-sample forward FLOPs of a SiglipVisionConfig."""
    d, f, p = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size
    n = (cfg.image_size // p) ** 2
    embed = 2 * n * (cfg.num_channels * p * p) * d   # every patch, before patch dropout
    n = kept_tokens(n, patch_dropout_of(cfg))       # what the encoder and the head see
    layers = cfg.num_hidden_layers * encoder_layer_flops(n, d, f)
    head = 0
    if getattr(cfg, "vision_use_head", True):
        head = 2 * d * d + 2 * 2 * n * d * d + 2 * 2 * n * d + 2 * d * d + 2 * 2 * d * f
    return TowerFlops(embed, layers, head)


def text_flops(cfg) -> TowerFlops:
    """Per-sample forward FLOPs of a SiglipTextConfig (captions padded to max_position_embeddings)."""
    d, f, n = cfg.hidden_size, cfg.intermediate_size, cfg.max_position_embeddings
    projection = getattr(cfg, "projection_size", None) or d
    return TowerFlops(0, cfg.num_hidden_layers * encoder_layer_flops(n, d, f), 2 * d * projection)


@dataclass(frozen=True)
class SampleFlops:
    vision_forward: int
    text_forward: int

    @property
    def forward(self) -> int:
        return self.vision_forward + self.text_forward

    def train(self, activation_checkpointing: bool = False, hardware: bool = False) -> int:
        """FLOPs of one training sample: 3 x forward (model FLOPs); with hardware=True and
        activation checkpointing, 4 x (the recomputed forward included)."""
        return (4 if hardware and activation_checkpointing else 3) * self.forward

    def to_dict(self) -> dict:
        return {**asdict(self), "forward": self.forward, "train_model_flops": self.train()}


def flops_per_sample(config) -> SampleFlops:
    """A SiglipConfig (or DualEncoder.config) -> per-sample forward FLOPs of both towers. The
    contrastive loss (a (B, B) logit matrix: 2 B D per sample) is left out: under 0.01 %."""
    return SampleFlops(vision_flops(config.vision_config).total, text_flops(config.text_config).total)


def mfu(flops_per_sample_train: int, samples_per_s: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over the hardware peak (all devices)."""
    return flops_per_sample_train * samples_per_s / peak_flops_per_s


# Peak dense FLOP/s per device, by precision: what MFU divides by (the run's metrics, benchmarks.gpu).
# Vendor datasheet figures, dense (no 2:4 sparsity), per GPU. The variants differ: an H100 PCIe
# (756 TFLOP/s bf16, 350 W) or NVL (835) is not an SXM (989), so the most specific name is matched
# first. fp32 runs on the CUDA cores (torch leaves TF32 matmuls off by default), so it is divided by
# the fp32 peak, not bf16's; fp16 by the 16-bit tensor-core peak (bf16's on these devices).
# (substring of torch.cuda.get_device_name(), 16-bit tensor-core TFLOP/s, fp32 TFLOP/s), most specific first
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
    """FLOP/s of one device at ``precision`` (bf16/fp16 or fp32); ``override_tflops`` wins; None for
    a device not in PEAKS (MFU then stays empty rather than wrong: CPU ranks, unknown GPUs)."""
    if override_tflops:
        return override_tflops * 1e12
    for key, half, fp32 in PEAKS:
        if key in device_name:
            return (fp32 if precision == "fp32" else half) * 1e12
    return None


def mfu_per_device(flops_per_sample: float, samples_per_s: float, world_size: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation of each device: the run's samples/s (all ranks together) over
    world_size devices of ``peak`` FLOP/s each."""
    return flops_per_sample * samples_per_s / (peak * world_size) if peak else None

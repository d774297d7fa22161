"""The training precisions and what each one keeps in which dtype: one table for the DeepSpeed config,
the planner, the guard and the start-up lines; and the run config's `fp16` and `bf16` sections.

- `fp32`: fp32 weights, gradients and matmuls; no DeepSpeed section.
- `bf16` / `fp16`: 16-bit weights, gradients and matmuls, fp32 masters in the optimizer (DeepSpeed's
  `bf16` / `fp16` sections; fp16 with DeepSpeed's dynamic loss scale).
- `amp_bf16` / `amp` (open_clip's names): fp32 weights and gradients, the forward under torch.autocast
  in bf16 / fp16 (DeepSpeed's `torch_autocast` section); amp adds torch's GradScaler -- the seed's
  DDP + autocast + GradScaler recipe, stage 0 only.
- `auto`, what a run config says by default: made concrete per profile by `resolve_precision`.

Under the two amp precisions the layers autocast runs in 16 bits (`AUTOCAST_MODULES`: Linear, the
patch Conv2d) also send their gradients over the wire in 16 bits (DeepSpeed's `comm_dtype` per
parameter under ZeRO; rsclip_ds.gradients at stage 0); LayerNorm, the embeddings, the logit scale
and bias stay fp32 everywhere, and the loss is computed outside the engine's forward, in fp32
(losses.py casts the features).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rsclip_ds.runtime.settings import Strict

Precision = Literal["fp32", "bf16", "fp16", "amp_bf16", "amp"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "amp_bf16", "amp")
PrecisionChoice = Literal["auto", "fp32", "bf16", "fp16", "amp_bf16", "amp"]   # what a run config may say
AUTOCAST = {"amp_bf16": "bf16", "amp": "fp16"}           # precision -> torch.autocast's dtype
DEEPSPEED_DTYPE = {"bf16": "bfloat16", "fp16": "float16"}
# DeepSpeed's own default list of lower_precision_safe_modules, written out so that ds_config.json says it
AUTOCAST_MODULES = ["torch.nn.modules.linear.Linear", "torch.nn.modules.conv.Conv1d",
                    "torch.nn.modules.conv.Conv2d", "torch.nn.modules.conv.Conv3d"]


def is_autocast(precision: str) -> bool:
    return precision in AUTOCAST


def compute_dtype(precision: str) -> str:
    """The dtype the matmuls and most activations run in: bf16 for bf16 and amp_bf16, and so on."""
    return AUTOCAST.get(precision, precision)


def weight_dtype(precision: str) -> str:
    """The dtype of the module's weights and gradients: fp32 under autocast."""
    return "fp32" if is_autocast(precision) else precision


def uses_fp16(precision: str) -> bool:
    """fp16 arithmetic somewhere: a loss scale keeps the gradients in range (DeepSpeed's scaler, or
    torch's GradScaler under amp)."""
    return compute_dtype(precision) == "fp16"


def autocast_section(precision: str) -> dict:
    """DeepSpeed's `torch_autocast` section for an amp precision ({} otherwise)."""
    if not is_autocast(precision):
        return {}
    return {"torch_autocast": {"enabled": True, "dtype": DEEPSPEED_DTYPE[AUTOCAST[precision]],
                               "lower_precision_safe_modules": list(AUTOCAST_MODULES)}}


def resolve_precision(choice: str, stage: int, bf16_supported: bool = True) -> tuple[str, str]:
    """`precision: auto` -> (the precision, why), from the op census (docs/results/throughput.md#census): the
    lighter step of the two for the stage. Stage 0 (ddp): amp_bf16, the plain PyTorch loop's recipe (fp32
    weights under autocast), within 1 % of the plain loop's ops and bytes, where bf16 weights there would
    run DeepSpeed's FP16_UnfusedOptimizer (refused). ZeRO: bf16, whose 16-bit gradient buckets and
    partitions move fewer bytes than amp_bf16's fp32 ones. A GPU without bf16 (before NVIDIA's Ampere):
    amp and fp16, the same with a loss scale. Another choice is returned as it is."""
    if choice != "auto":
        return choice, "as set"
    if stage == 0:
        picked = "amp_bf16" if bf16_supported else "amp"
        return picked, (f"auto: {picked} at stage 0 -- fp32 weights under torch.autocast, the plain PyTorch loop's "
                        f"recipe and its step, op for op")
    picked = "bf16" if bf16_supported else "fp16"
    return picked, (f"auto: {picked} under ZeRO-{stage} -- 16-bit weights and gradients, fewer bytes a step than "
                    f"amp_bf16's fp32 gradients there")


# --------------------------------------------------------------------------- the run config's sections

class Fp16Config(Strict):
    initial_scale_power: int = Field(16, ge=0, le=32, description="fp16 only: initial loss scale is 2**this.")
    loss_scale_window: int = Field(1000, ge=1, description="fp16 only: overflow-free steps before the scale grows.")
    hysteresis: int = Field(2, ge=1, description="fp16 only: overflows tolerated before the scale shrinks.")
    min_loss_scale: float = Field(1.0, gt=0, description="fp16 only: the scale never goes below this.")


class Bf16Config(Strict):
    master_weights: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16 only: the dtype of the optimizer's master weights and of AdamW's m and v. "
        "'fp32': DeepSpeed's mixed precision (an fp32 master copy and fp32 states, 16 bytes per trainable "
        "parameter with the bf16 weight and gradient). 'bf16': open_clip's pure_bf16, DeepSpeed's "
        "bf16_master_weights_and_grads + bf16_optimizer_states: no fp32 copy, 10 bytes per trainable "
        "parameter (DeepSpeed keeps a bf16 master beside the bf16 weight), but an update below half a bf16 "
        "step of its weight is lost (docs/guides/precision.md: profiles, bytes, measured quality). ZeRO-1/2/3; the "
        "offload profiles need optim.impl=deepspeed on CPU ranks.")
    grad_accum_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="bf16 only: the dtype DeepSpeed accumulates gradients in across micro-batches "
        "(its `data_types.grad_accum_dtype`). 'fp32' keeps the sum in fp32 (ZeRO-1 then runs DeepSpeed's "
        "BF16_Optimizer, with a whole fp32 gradient copy per GPU; ZeRO-2/3 an fp32 gradient partition); "
        "'bf16' sums in bf16. 'auto': fp32 for ZeRO-2 and ZeRO-3, bf16 for ZeRO-1 and ZeRO-2 with optimizer "
        "offload, where fp32 costs GPU memory the others do not pay (docs/guides/precision.md: the measurement, "
        "the rule and the bytes); bf16 with master_weights=bf16.")
    check_grad_overflow: bool = Field(
        False, description="bf16 only: DeepSpeed's per-gradient overflow check (amax, amin and isfinite on every "
        "gradient tensor and a host sync, each step: docs/results/throughput.md#census). A step whose gradient norm "
        "is not finite is skipped either way (docs/guides/precision.md#non-finite-steps): off, at ZeRO-1/2 by "
        "rsclip_ds's step guard, from the norm DeepSpeed computed; on, by DeepSpeed.")

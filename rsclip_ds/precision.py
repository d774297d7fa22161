"""The training precisions and what each one keeps in which dtype. One table for the DeepSpeed config,
the planner, the guard and the start-up lines.

| precision  | weights, gradients | forward / backward matmuls | DeepSpeed section           | named after              |
|------------|--------------------|----------------------------|-----------------------------|--------------------------|
| `fp32`     | fp32               | fp32                       | none                        |                          |
| `bf16`     | bf16 (fp32 masters)| bf16                       | `bf16`                      | DeepSpeed's mixed precision |
| `fp16`     | fp16 (fp32 masters)| fp16, dynamic loss scale   | `fp16`                      |                          |
| `amp_bf16` | fp32               | bf16 under torch.autocast  | `torch_autocast` (bfloat16) | open_clip's `amp_bf16`   |
| `amp`      | fp32               | fp16 under torch.autocast, | `torch_autocast` (float16)  | open_clip's `amp`, torch's |
|            |                    | a gradient scaler          |                             | `autocast` + `GradScaler`|

Under the two `amp` precisions DeepSpeed keeps fp32 weights and wraps the engine's forward in
torch.autocast; the layers autocast runs in 16 bits (`AUTOCAST_MODULES`: Linear, the patch Conv2d)
also send their gradients over the wire in 16 bits under ZeRO (DeepSpeed's `comm_dtype` per
parameter); LayerNorm, the embeddings, the logit scale and bias stay fp32 everywhere, and the loss
is computed outside the engine's forward, in fp32 (losses.py casts the features).
"""

from __future__ import annotations

from typing import Literal

Precision = Literal["fp32", "bf16", "fp16", "amp_bf16", "amp"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "amp_bf16", "amp")
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

"""The run config's ``distill`` section (docs/guides/pretraining.md, "Distillation"), beside what it
configures. Torch-free: rsclip_ds.config imports it."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from rsclip_ds.runtime.settings import Strict


class DistillConfig(Strict):
    teacher: Optional[str] = Field(
        None, description="Teacher dual encoder to distil from: a Hugging Face SigLIP or CLIP model folder "
        "(config.json + safetensors + tokenizer + preprocessor_config.json) or a hub id such as "
        "lcybuaa/Git-RSCLIP. Frozen, no optimizer state; it reads its own tokenizer's ids and its own image "
        "size (the loader emits both inputs from the same crop). None: no distillation.")
    revision: Optional[str] = Field(
        None, description="Hub revision (branch, tag or commit) of a hub-id teacher; None: main.")
    weight: float = Field(
        1.0, ge=0.0, description="Total loss = contrastive + weight x distillation, the distillation term "
        "being open_clip's DistillClipLoss: soft cross-entropy from the teacher's to the student's "
        "image-text softmax, both directions, over the global batch.")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="The teacher's weights and activations. 'auto': bf16 on a GPU that has it "
        "(fp16 on an older GPU), fp32 on CPU ranks (bf16 matrix products are slower than fp32 on CPUs "
        "without AMX, and the teacher's bytes matter less there).")
    placement: Literal["replicated", "zero3"] = Field(
        "replicated", description="'replicated': every rank holds the whole teacher in its dtype. 'zero3': "
        "partitioned over the ranks as the student's ZeRO-3 parameters are (1/world of its bytes per rank, "
        "gathered layer by layer in its forward by a DeepSpeed inference engine of its own): only with a "
        "ZeRO-3 profile, and not for a CLIP teacher (DeepSpeed 0.19.8 cannot partition its 0-dim logit_scale).")

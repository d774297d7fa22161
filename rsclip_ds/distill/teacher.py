"""The frozen teacher and the Distiller the train steps call.

The teacher is a transformers SiglipModel or CLIPModel read from a folder or a hub id with the
same resolver as ``model.pretrained`` (one fetch per node); it brings its own tokenizer, image
size and image mean/std (``TeacherInputs``: what the loader needs to emit its inputs). It is
frozen -- ``requires_grad=False``, eval mode, no optimizer state, no activations kept: every
forward runs under ``torch.no_grad()`` -- and lives on the rank's device in ``distill.dtype``,
replicated on every rank ('replicated' placement).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rsclip_ds.config import ConfigError, ModelConfig
from rsclip_ds.distill.config import DistillConfig
from rsclip_ds.distill.loss import distill_loss_global
from rsclip_ds.model import IMAGE_MEAN, IMAGE_STD, load_tokenizer, normalize_pixels

DUAL_ENCODERS = ("siglip", "clip")   # config.json model_type of the teachers we can read
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class TeacherInputs:
    """What the loader needs to emit the teacher's inputs next to the student's."""
    tokenizer: Any
    image_size: int
    max_text_length: int


class Teacher(nn.Module):
    """A SiglipModel / CLIPModel -> L2-normalised embeddings and its (log) logit scale, without a
    graph. uint8 pixels are normalised with the teacher's own mean/std in its dtype."""

    def __init__(self, model: nn.Module, mean=IMAGE_MEAN, std=IMAGE_STD):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.image_mean, self.image_std = tuple(mean), tuple(std)

    def train(self, mode: bool = True) -> "Teacher":
        return super().train(False)   # frozen: eval mode whatever the caller's mode

    def dtype(self) -> torch.dtype:
        return self.model.logit_scale.dtype

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor):
        if pixel_values.dtype == torch.uint8:                      # (B, 3, T, T) 0..255
            pixel_values = normalize_pixels(pixel_values, self.image_mean, self.image_std, self.dtype())
        image = self.model.get_image_features(pixel_values=pixel_values.to(self.dtype())).pooler_output  # (B, D_t)
        text = self.model.get_text_features(input_ids=input_ids).pooler_output                            # (B, D_t)
        return F.normalize(image.float(), dim=-1), F.normalize(text.float(), dim=-1), self.model.logit_scale


def teacher_dtype(name: str, on_gpu: bool) -> torch.dtype:
    """distill.dtype -> a torch dtype; 'auto': bf16 on a GPU with bf16, fp16 on an older GPU, fp32 on CPU."""
    if name != "auto":
        return DTYPES[name]
    if not on_gpu:
        return torch.float32
    from deepspeed.accelerator import get_accelerator

    return torch.bfloat16 if get_accelerator().is_bf16_supported() else torch.float16


def _model_type(folder: Path, what: str) -> str:
    config = folder / "config.json"
    if not config.is_file():
        raise ConfigError(f"{what} is not a Hugging Face model folder (no config.json in {folder}): download one "
                          "with `hf download lcybuaa/Git-RSCLIP --local-dir DIR`, or export a trained run with "
                          "`rsclip-ds export`")
    kind = json.loads(config.read_text()).get("model_type")
    if kind not in DUAL_ENCODERS:
        raise ConfigError(f"{what}: config.json says model_type={kind!r}, not a dual encoder; the teacher must be "
                          f"a SigLIP or CLIP model folder (model_type one of {', '.join(DUAL_ENCODERS)})")
    return kind


def check_distill(cfg: DistillConfig, zero_stage: int) -> None:
    """Config-time checks (no process group): the teacher exists and is a dual encoder, and the
    placement fits the profile. Raises ConfigError naming the fix."""
    if cfg.teacher is None:
        if cfg.placement != "replicated" or cfg.dtype != "auto" or cfg.revision is not None:
            raise ConfigError("distill.* is set but distill.teacher is not: name the teacher "
                              "(--set distill.teacher=FOLDER_OR_HUB_ID) or drop the other distill keys")
        return
    from rsclip_ds.hub import is_hub_id

    what = f"distill.teacher={cfg.teacher}"
    if Path(cfg.teacher).exists():
        _model_type(Path(cfg.teacher), what)
    elif not is_hub_id(cfg.teacher):
        raise ConfigError(f"{what}: no such folder, and not a hub id of the form 'org/name' "
                          "(e.g. lcybuaa/Git-RSCLIP)")
    if cfg.placement == "zero3" and zero_stage != 3:
        raise ConfigError(f"distill.placement=zero3 partitions the teacher like a ZeRO-3 student, but the profile "
                          f"is ZeRO stage {zero_stage}: use --set profile=zero3 (or zero3_offload), or "
                          "distill.placement=replicated")
    if cfg.placement == "zero3":
        raise ConfigError("distill.placement=zero3 is not available yet: a frozen teacher partitioned over the "
                          "ranks needs its own DeepSpeed inference engine for the per-layer gathers, which is not "
                          "built; use distill.placement=replicated (the teacher in distill.dtype on every rank)")


def load_teacher(cfg: DistillConfig, *, device, on_gpu: bool, local_rank: int = 0) -> tuple[Teacher, TeacherInputs]:
    """The teacher on ``device`` in its dtype, and its inputs' spec (tokenizer, image size, text length)."""
    from transformers import CLIPModel, SiglipModel

    from rsclip_ds.hub import resolve_source_per_node

    source = resolve_source_per_node(ModelConfig(pretrained=cfg.teacher, revision=cfg.revision), local_rank)
    folder = Path(source.folder)
    kind = _model_type(folder, f"distill.teacher={cfg.teacher}")
    cls = SiglipModel if kind == "siglip" else CLIPModel
    model = cls.from_pretrained(str(folder), dtype=teacher_dtype(cfg.dtype, on_gpu)).to(device)
    mean, std = IMAGE_MEAN, IMAGE_STD
    processor = folder / "preprocessor_config.json"
    if processor.is_file():
        spec = json.loads(processor.read_text())
        mean, std = tuple(spec.get("image_mean", mean)), tuple(spec.get("image_std", std))
    config = model.config
    inputs = TeacherInputs(load_tokenizer(folder), config.vision_config.image_size,
                           config.text_config.max_position_embeddings)
    return Teacher(model, mean, std), inputs


class Distiller:
    """The teacher's targets for a batch and the weighted distillation term of a step. ``world_size``
    is the loss's (1 with loss.negatives=local: each rank distils over its own micro-batch)."""

    def __init__(self, teacher: Teacher, weight: float, loss: str, rank: int = 0, world_size: int = 1):
        self.teacher, self.weight, self.loss_name = teacher, weight, loss
        self.rank, self.world_size = rank, world_size
        self.logit_scale = teacher.model.logit_scale.detach().float().reshape(())   # frozen: read once

    def targets(self, batch: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's (B, D_t) image and text embeddings of a batch (float32, no graph)."""
        pixels = batch["teacher_pixel_values"].to(device, non_blocking=True)          # (B, 3, T, T)
        ids = batch["teacher_input_ids"].to(device, non_blocking=True)                # (B, L_t)
        image, text, _ = self.teacher(pixels, ids)
        return image, text

    def loss(self, image, text, logit_scale, targets) -> torch.Tensor:
        """weight x the distillation term of the student's (B, D) embeddings against ``targets``."""
        term = distill_loss_global(image, text, logit_scale, *targets, self.logit_scale, rank=self.rank,
                                   world_size=self.world_size, loss=self.loss_name)
        return self.weight * term

"""The frozen teacher and the Distiller the train steps call.

The teacher is a transformers SiglipModel or CLIPModel read from a folder or a hub id with the
same resolver as ``model.pretrained`` (one fetch per node); it brings its own tokenizer, image
size and image mean/std (``TeacherInputs``: what the loader needs to emit its inputs). It is
frozen -- ``requires_grad=False``, eval mode, no optimizer state, no activations kept: every
forward runs under ``torch.no_grad()`` -- and lives on the rank's device in ``distill.dtype``:
replicated on every rank ('replicated' placement), or partitioned over the ranks as a ZeRO-3
student is ('zero3'): built inside ``deepspeed.zero.Init`` (rank by rank 1/W of its weights) and
wrapped in a DeepSpeed engine of its own without an optimizer (ZeRO-Inference: the engine's
parameter hooks gather each module's weights for its forward and release them after).
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
    """Config-time checks (no process group): the placement fits the profile (resolve.teacher_placement), and
    the teacher exists and is a dual encoder. Raises ConfigError naming the fix."""
    from rsclip_ds.resolve import teacher_placement

    teacher_placement(cfg, zero_stage)
    if cfg.teacher is None:
        return
    from rsclip_ds.hub import is_hub_id

    what = f"distill.teacher={cfg.teacher}"
    if Path(cfg.teacher).exists():
        _model_type(Path(cfg.teacher), what)
    elif not is_hub_id(cfg.teacher):
        raise ConfigError(f"{what}: no such folder, and not a hub id of the form 'org/name' "
                          "(e.g. lcybuaa/Git-RSCLIP)")
    if cfg.placement == "zero3" and Path(cfg.teacher).exists():
        _check_partitionable(_model_type(Path(cfg.teacher), what), what)


def _check_partitionable(kind: str, what: str) -> None:
    if kind == "clip":   # DeepSpeed 0.19.8 crashes on 0-dim parameters across ranks (shared/notes/deepspeed.md)
        raise ConfigError(f"{what} is a CLIP model, whose 0-dim logit_scale DeepSpeed 0.19.8 cannot partition "
                          "('self.dim() cannot be 0 to view Float as Byte'): use distill.placement=replicated")


def load_teacher(cfg: DistillConfig, *, device, on_gpu: bool, local_rank: int = 0, dtype: str | None = None,
                 ds_config: dict | None = None) -> tuple[Any, TeacherInputs]:
    """The teacher on ``device`` in ``dtype`` (the run's resolved distill dtype; None: resolve.teacher_dtype for
    this accelerator) -- a Teacher, or under 'zero3' placement its DeepSpeed engine (``ds_config``: the
    teacher's own, resolve.teacher_ds_config) -- and its inputs' spec (tokenizer, image size, text length)."""
    from transformers import CLIPModel, SiglipModel

    from rsclip_ds.hub import resolve_source_per_node
    from rsclip_ds.model import maybe_zero3_init

    source = resolve_source_per_node(ModelConfig(pretrained=cfg.teacher, revision=cfg.revision), local_rank)
    folder, what = Path(source.folder), f"distill.teacher={cfg.teacher}"
    kind = _model_type(folder, what)
    cls = SiglipModel if kind == "siglip" else CLIPModel
    if dtype is None:
        from rsclip_ds.resolve import Device, teacher_dtype

        dtype = teacher_dtype(cfg.dtype, Device.current() if on_gpu else Device("cpu"))
    dtype = DTYPES[dtype]
    zero3 = ds_config if cfg.placement == "zero3" else None
    if zero3 is not None:
        _check_partitionable(kind, what)
    with maybe_zero3_init(zero3) as partitioned:   # zero3: each rank builds and keeps 1/W of the weights
        model = cls.from_pretrained(str(folder), dtype=dtype)
    if not partitioned:
        model = model.to(device)
    mean, std = IMAGE_MEAN, IMAGE_STD
    processor = folder / "preprocessor_config.json"
    if processor.is_file():
        spec = json.loads(processor.read_text())
        mean, std = tuple(spec.get("image_mean", mean)), tuple(spec.get("image_std", std))
    config = model.config
    inputs = TeacherInputs(load_tokenizer(folder), config.vision_config.image_size,
                           config.text_config.max_position_embeddings)
    teacher = Teacher(model, mean, std)
    if zero3 is not None:
        import deepspeed

        teacher = deepspeed.initialize(model=teacher, config=zero3)[0]   # no optimizer: ZeRO-Inference
    return teacher, inputs


class Distiller:
    """The teacher's targets for a batch and the weighted distillation term of a step. ``teacher``: a
    Teacher or its ZeRO-3 engine; ``world_size`` is the loss's (1 with loss.negatives=local: each rank
    distils over its own micro-batch)."""

    def __init__(self, teacher, weight: float, loss: str, rank: int = 0, world_size: int = 1):
        from rsclip_ds.model import maybe_gathered

        self.teacher, self.weight, self.loss_name = teacher, weight, loss
        self.rank, self.world_size = rank, world_size
        scale = getattr(teacher, "module", teacher).model.logit_scale
        with maybe_gathered([scale]):   # frozen: read once (gathered under zero3 placement)
            self.logit_scale = scale.detach().float().clone().reshape(())

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

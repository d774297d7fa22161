"""What a distillation teacher (distill.teacher) adds to a rank's peak and to a step's FLOPs.

The teacher is frozen and runs without a graph (rsclip_ds.distill.teacher), so it has no
gradients, no optimizer state and keeps no activations for backward. Per rank:

    states       its weights in its dtype: d Ψ_T (replicated), d Ψ_T / G (distill.placement=zero3)
    inputs       its uint8 pixels and int64 token ids beside the student's: 3 T^2 + 8 L_T per sample,
                 and its float32 embeddings (2 x 4 D_T per sample of the step: 'global' accumulation
                 keeps every micro-batch's until the loss)
    activations  its forward's transient tensors for one micro-batch, alive while it runs: the
                 teacher runs before the student's forward (plain) or in the no-grad pass ('global'),
                 when no student activation is held, so the peak takes the larger of the two, not
                 the sum. Per sample, the larger tower's widest moment: the residual stream, q, k, v
                 and the MLP's hidden layer (n (4 D + F) values), plus the attention scores (H n^2;
                 the math kernel on CPU; flash attention on a GPU keeps none of them)
    FLOPs        one forward per sample (flops.py's count): plain and 'global' accumulation alike
                 (the latter's recompute pass needs no teacher)
    traffic      zero3 placement: its engine all-gathers the whole teacher, d Ψ_T, in every
                 micro-batch's forward (comms.Traffic, timed with the student's traffic)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import lru_cache

from rsclip_ds.planning.comms import Traffic
from rsclip_ds.planning.memory import ModelSpec, Peak

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class TeacherPlan:
    spec: ModelSpec               # the teacher's shape (memory.preset_spec / model_spec)
    dtype: str = "bf16"           # distill.dtype, resolved ('auto' is bf16 on GPUs)
    partitioned: bool = False     # distill.placement=zero3

    @property
    def bytes_per_value(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def _config(self):
        return _siglip_config(self.spec.config_json)


@lru_cache(maxsize=8)
def _siglip_config(config_json: str):
    from transformers import SiglipConfig

    return SiglipConfig.from_dict(json.loads(config_json))


def teacher_plan(teacher: str, dtype: str = "bf16", placement: str = "replicated") -> TeacherPlan:
    """A preset name (git-rsclip-large, ...) or a SigLIP model folder -> its TeacherPlan."""
    from pathlib import Path

    from rsclip_ds.config import ConfigError
    from rsclip_ds.model import PRESETS
    from rsclip_ds.planning.memory import model_spec, preset_spec

    if teacher in PRESETS:
        spec = preset_spec(teacher)
    elif (Path(teacher) / "config.json").is_file():
        from transformers import SiglipConfig

        spec = model_spec(SiglipConfig.from_pretrained(teacher), teacher)
    else:
        raise ConfigError(f"distill.teacher={teacher}: the planner counts a preset ({', '.join(PRESETS)}) or a "
                          "SigLIP model folder (with config.json)")
    from rsclip_ds.resolve import GPU, teacher_dtype

    return TeacherPlan(spec, teacher_dtype(dtype, GPU), placement == "zero3")   # the planner plans for GPUs


def weight_bytes(teacher: TeacherPlan, gpus: int) -> int:
    """Its weights on one rank."""
    return math.ceil(teacher.spec.params * teacher.bytes_per_value / (gpus if teacher.partitioned else 1))


def input_bytes_per_sample(teacher: TeacherPlan) -> int:
    vc, tc = teacher._config().vision_config, teacher._config().text_config
    return 3 * vc.image_size ** 2 + 8 * tc.max_position_embeddings


def forward_bytes(teacher: TeacherPlan, micro: int) -> int:
    """The transient peak of its no-grad forward over ``micro`` samples (module docstring), plus
    under zero3 placement the one layer gathered at a time."""
    config = teacher._config()
    widest = max(n * (4 * c.hidden_size + c.intermediate_size) + c.num_attention_heads * n * n
                 for n, c in ((teacher.spec.vision_tokens, config.vision_config),
                              (teacher.spec.text_tokens, config.text_config)))
    gathered = teacher.spec.largest_layer if teacher.partitioned else 0
    return (widest * micro + gathered) * teacher.bytes_per_value


def with_teacher(peak: Peak, teacher: TeacherPlan | None, gpus: int, micro: int, accumulation_steps: int = 1,
                 accumulation: str = "global") -> Peak:
    """``peak`` (memory.peak of the student) with the teacher's terms added (module docstring)."""
    if teacher is None:
        return peak
    held = micro * (accumulation_steps if accumulation == "global" else 1)   # samples whose embeddings wait
    embeddings = 2 * 4 * teacher.spec.embed_dim * held
    return replace(peak, states=peak.states + weight_bytes(teacher, gpus),
                   inputs=peak.inputs + input_bytes_per_sample(teacher) * micro + embeddings,
                   activations=max(peak.activations, forward_bytes(teacher, micro)))


def forward_flops(teacher: TeacherPlan | None) -> int:
    """Its matmul FLOPs per training sample (one forward); 0 without a teacher."""
    if teacher is None:
        return 0
    from rsclip_ds.planning.flops import flops_per_sample

    return flops_per_sample(teacher._config()).forward


def traffic(teacher: TeacherPlan | None, accumulation_steps: int) -> list[Traffic]:
    """Its collectives per optimizer step: the weights' all-gathers under zero3 placement, one
    forward per micro-batch; none when replicated (the embeddings' all-gather is B D_T floats)."""
    if teacher is None or not teacher.partitioned:
        return []
    size = teacher.spec.params * teacher.bytes_per_value
    return [Traffic("all_gather", "teacher parameters in forward", size * accumulation_steps, accumulation_steps)]

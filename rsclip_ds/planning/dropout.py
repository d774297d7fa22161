"""Patch dropout in the planner: a ModelSpec whose image tower sees the kept patches only.

The fraction travels inside the spec's SiglipConfig JSON, as ``vision_config.patch_dropout``
(an attribute transformers keeps and ignores), so every count made from the spec follows it:
flops.vision_flops runs the encoder layers and the pooling head on the kept tokens (the patch
embedding still sees the whole image), and memory's meta-device probe applies the hook
(rsclip_ds.model, apply_patch_dropout) and measures the smaller activations.
"""

from __future__ import annotations

import json
from dataclasses import replace


def with_patch_dropout(spec, p: float):
    """``spec`` (memory.ModelSpec) for a run with ``model.patch_dropout = p``; p = 0: ``spec``."""
    if not p:
        return spec
    if not 0.0 < p < 1.0:
        raise ValueError(f"patch dropout {p}: a fraction of patches to drop, 0 <= p < 1")
    config = json.loads(spec.config_json)
    config["vision_config"]["patch_dropout"] = p
    return replace(spec, name=f"{spec.name} (patch dropout {p:g})", config_json=json.dumps(config))


def patch_dropout_of(vision_config) -> float:
    """The fraction a (planning) SiglipVisionConfig carries; 0 for a model's own config."""
    return float(getattr(vision_config, "patch_dropout", 0.0) or 0.0)


def planned_patch_dropout(model, config):
    """``model`` (memory's meta-device probe) with the patch dropout ``config`` (a SiglipConfig) carries."""
    from rsclip_ds.model import apply_patch_dropout

    apply_patch_dropout(model, patch_dropout_of(config.vision_config))
    return model

"""Activations, measured rather than modelled: the bytes autograd saves for backward in each
tower's forward, counted with `saved_tensors_hooks` on the meta device (real shapes, no memory,
any model size), with the fine-tuning controls, activation checkpointing, the planned patch
dropout and ZeRO-3's linear applied as a run applies them. memory.py's peak multiplies them by
the micro-batch.
"""

from __future__ import annotations

import json
from functools import lru_cache

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def meta_model(config, finetune_json: str = "{}"):
    """The dual encoder on the meta device, with the fine-tuning controls applied (a new image
    size changes the config before; LoRA adds its adapters; locks set requires_grad)."""
    from rsclip_ds.config import FinetuneConfig
    from rsclip_ds.finetune import apply_lora, apply_trainability
    from rsclip_ds.model import new_dual_encoder

    finetune = FinetuneConfig.model_validate(json.loads(finetune_json))
    with torch.device("meta"):
        model = new_dual_encoder(config)
        apply_lora(model, finetune.lora)
    apply_trainability(model, finetune)
    return model



class _FlashLikeSDPA(torch.autograd.Function):
    """Stands in for F.scaled_dot_product_attention in the probe: saves what flash attention
    saves on a GPU (q, k, v, out, fp32 logsumexp), not the (N, N) probabilities that the meta
    device's math fallback would save. Forward only (shapes), never differentiated."""

    @staticmethod
    def forward(ctx, q, k, v):
        b, h, n, _ = q.shape   # laid out (B, N, H, Dv) as the kernels do, so the caller's
        out = torch.empty(b, n, h, v.shape[-1], dtype=q.dtype, device=q.device).transpose(1, 2)  # transpose+contiguous is free
        ctx.save_for_backward(q, k, v, out, torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device))
        return out

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("the activation probe is forward-only")


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _FlashLikeSDPA.apply(query, key, value)


def saved_bytes(fn, exclude=()) -> int:
    """Bytes of distinct storages autograd saves for backward while `fn()` runs (parameters,
    and views of them, excluded). Works on the meta device, where storages have no data."""
    skip = {t.untyped_storage()._cdata for t in exclude}
    seen: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in skip:
            seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@lru_cache(maxsize=None)
def _probe(config_json: str, precision: str, checkpointing: bool, samples: int,
           finetune_json: str = "{}", zero3: bool = False) -> tuple[int, int]:
    from unittest import mock

    from transformers import SiglipConfig

    from rsclip_ds.finetune import keep_checkpointed_inputs_differentiable
    from rsclip_ds.model import apply_activation_checkpointing
    from rsclip_ds.planning.dropout import planned_patch_dropout

    config = SiglipConfig.from_dict(json.loads(config_json))   # + the image tower's planned patch dropout:
    model = planned_patch_dropout(meta_model(config, finetune_json), config).to(DTYPES[precision]).train()
    if checkpointing:
        if finetune_json != "{}":
            keep_checkpointed_inputs_differentiable(model)
        apply_activation_checkpointing(model)
    vc, tc = config.vision_config, config.text_config
    with torch.device("meta"):
        pixels = torch.empty(samples, 3, vc.image_size, vc.image_size, dtype=DTYPES[precision])
        ids = torch.zeros(samples, tc.max_position_embeddings, dtype=torch.long)
    params = list(model.parameters())
    linear = torch.nn.functional.linear
    if zero3:   # what a ZeRO-3 engine puts in place of F.linear (memory_efficient_linear, on by default)
        from deepspeed.runtime.zero.linear import zero3_linear_wrap as linear
    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", _sdpa), \
            mock.patch.object(torch.nn.functional, "linear", linear):
        vision = saved_bytes(lambda: model.vision_model(pixel_values=pixels), params)
        text = saved_bytes(lambda: model.text_model(input_ids=ids), params)
    return vision, text


def activation_bytes_per_sample(config, precision: str = "bf16", checkpointing: bool = False,
                                finetune_json: str = "{}", zero3: bool = False) -> dict:
    """Measured bytes per sample saved for backward by each tower (SiglipConfig or preset name).

    A forward of 2 samples on the meta device (real shapes, no memory) under
    `saved_tensors_hooks`, halved. With checkpointing, the saved layer inputs plus one layer's
    activations, alive while backward recomputes it: (full - checkpointed) / layers. With the
    fine-tuning controls applied (``finetune_json``): a locked tower saves (almost) nothing.
    ``zero3``: with ZeRO-3's linear, which saves its input also for frozen weights (it matters
    for LoRA towers and partly locked ones; with everything trainable the bytes are the same)."""
    if isinstance(config, str):
        from rsclip_ds.model import preset_config

        config = preset_config(config)
    cj = config.to_json_string()
    full = _probe(cj, precision, False, 2, finetune_json, zero3)
    if not checkpointing:
        return {"vision": full[0] // 2, "text": full[1] // 2}
    ckpt = _probe(cj, precision, True, 2, finetune_json, zero3)
    layers = (config.vision_config.num_hidden_layers, config.text_config.num_hidden_layers)
    # backward recomputes one layer at a time, of one tower: only the larger layer counts
    layer = [max(0, f - c) // n for f, c, n in zip(full, ckpt, layers)]
    top = 0 if layer[0] >= layer[1] else 1
    return {tower: (ckpt[i] + (layer[i] if i == top else 0)) // 2
            for i, tower in enumerate(("vision", "text"))}

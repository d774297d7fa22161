"""Activations, measured rather than modelled: the bytes autograd saves for backward in each
tower's forward, counted with `saved_tensors_hooks` on the meta device (real shapes, no memory,
any model size), with the fine-tuning controls, activation checkpointing, the planned patch
dropout and ZeRO-3's linear applied as a run applies them. memory.py's peak multiplies them by
the micro-batch.

Under the autocast precisions (amp_bf16, amp) the model stays fp32 and torch.autocast casts the
inputs of the matmuls to 16 bits; the meta device has no autocast, so the probe makes the same
casts itself (`_Autocast`: F.linear and F.conv2d, the ops of this model on autocast's 16-bit list on
CPU and CUDA alike). What changes against bf16, per encoder layer: the residual stream and the
LayerNorm inputs stay fp32 (4 bytes, not 2), and q, k and v each save their own 16-bit copy of the
LayerNorm's fp32 output. autocast also keeps a 16-bit copy of every trainable weight it casts, for
the whole forward (its cache, cleared when the engine's forward returns) and then in autograd's
saved tensors until backward: ~2 bytes per Linear/Conv parameter whatever the micro-batch, counted
apart (`autocast_weight_bytes`). Checked against a real CPU forward under torch.autocast by
tests/unit/test_memory_precisions.py.
"""

from __future__ import annotations

import json
from functools import lru_cache

import torch

from rsclip_ds.precision import compute_dtype, is_autocast, weight_dtype

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


class _Autocast:
    """torch.autocast's casts on the meta device, where autocast does nothing: the floating inputs of
    the wrapped ops go to ``dtype``; a weight that trains is cast once per forward and kept (autocast's
    cache: a leaf that requires grad); a frozen weight is cast at every use. The copies of weights
    are remembered, to be counted apart from the activations (`weight_storages`)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.cache: dict[int, torch.Tensor] = {}
        self.uncached: list[torch.Tensor] = []   # frozen weights' casts (kept referenced: unique storages)

    def cast(self, t):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == self.dtype:
            return t
        if isinstance(t, torch.nn.Parameter) and t.requires_grad:
            if id(t) not in self.cache:
                self.cache[id(t)] = t.to(self.dtype)
            return self.cache[id(t)]
        out = t.to(self.dtype)
        if isinstance(t, torch.nn.Parameter):
            self.uncached.append(out)
        return out

    def wrap(self, fn):
        def run(*args, **kwargs):
            return fn(*map(self.cast, args), **{k: self.cast(v) for k, v in kwargs.items()})
        return run

    def wrap_zero3(self, fn):
        """DeepSpeed's ZeRO-3 linear (LinearFunctionForZeroStage3, autocast_custom_fwd) saves its fp32
        input and weight and runs its matmul in ``dtype`` inside: the output is 16-bit, the weight's
        cast is cached for the forward but not saved."""
        def run(input, weight, bias=None):
            self.cast(weight)
            return fn(input, weight, bias).to(self.dtype)
        return run

    def weight_storages(self) -> dict[int, int]:
        """{storage: bytes} of every weight copy made: the cache's and the frozen weights' casts."""
        return {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                for t in [*self.cache.values(), *self.uncached]}


def saved_bytes(fn, exclude=()) -> int:
    """Bytes of distinct storages autograd saves for backward while `fn()` runs (parameters,
    and views of them, excluded). Works on the meta device, where storages have no data."""
    return sum(saved_storages(fn, exclude).values())


def saved_storages(fn, exclude=()) -> dict[int, int]:
    """{storage: bytes} that `saved_bytes` sums. Every packed tensor is held until `fn` returns: a branch of the
    graph that dies during the forward (an output nobody uses, such as the pooling head's attention weights)
    would otherwise free its storages, whose addresses -- the keys -- a later one could take (it made the
    autocast probe's count vary by a few KB from run to run)."""
    skip = {t.untyped_storage()._cdata for t in exclude}
    seen: dict[int, int] = {}
    held = []

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in skip:
            seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
            held.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return seen


def _probe(config_json: str, precision: str, checkpointing: bool, samples: int,
           finetune_json: str = "{}", zero3: bool = False) -> tuple[int, int]:
    """(vision, text) bytes saved for backward by a forward of `samples` (the weights' autocast copies apart)."""
    return _probe_parts(config_json, precision, checkpointing, samples, finetune_json, zero3)[:2]


@lru_cache(maxsize=None)
def _probe_parts(config_json: str, precision: str, checkpointing: bool, samples: int,
                 finetune_json: str = "{}", zero3: bool = False) -> tuple[int, int, int]:
    """(vision, text, weight copies): the towers' saved activations and, under autocast, the bytes of the
    16-bit weight copies alive from forward to backward (the cache's, and the frozen weights' casts that
    autograd saved)."""
    from unittest import mock

    from transformers import SiglipConfig

    from rsclip_ds.finetune import keep_checkpointed_inputs_differentiable
    from rsclip_ds.model import apply_activation_checkpointing
    from rsclip_ds.planning.dropout import planned_patch_dropout

    config = SiglipConfig.from_dict(json.loads(config_json))   # + the image tower's planned patch dropout:
    weights = DTYPES[weight_dtype(precision)]                   # fp32 under autocast
    model = planned_patch_dropout(meta_model(config, finetune_json), config).to(weights).train()
    if checkpointing:
        if finetune_json != "{}":
            keep_checkpointed_inputs_differentiable(model)
        apply_activation_checkpointing(model)
    vc, tc = config.vision_config, config.text_config
    with torch.device("meta"):
        pixels = torch.empty(samples, 3, vc.image_size, vc.image_size, dtype=weights)
        ids = torch.zeros(samples, tc.max_position_embeddings, dtype=torch.long)
    params = list(model.parameters())
    linear, conv = torch.nn.functional.linear, torch.nn.functional.conv2d
    if zero3:   # what a ZeRO-3 engine puts in place of F.linear (memory_efficient_linear, on by default)
        from deepspeed.runtime.zero.linear import zero3_linear_wrap as linear
    cast = _Autocast(DTYPES[compute_dtype(precision)]) if is_autocast(precision) else None
    if cast is not None:
        linear, conv = (cast.wrap_zero3(linear) if zero3 else cast.wrap(linear)), cast.wrap(conv)
    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", _sdpa), \
            mock.patch.object(torch.nn.functional, "linear", linear), \
            mock.patch.object(torch.nn.functional, "conv2d", conv):
        vision = saved_storages(lambda: model.vision_model(pixel_values=pixels), params)
        text = saved_storages(lambda: model.text_model(input_ids=ids), params)
    copies = cast.weight_storages() if cast is not None else {}
    saved_copies = {k: v for k, v in copies.items() if k in vision or k in text}
    cached = {t.untyped_storage()._cdata for t in cast.cache.values()} if cast is not None else set()
    weight_copies = sum(v for k, v in copies.items() if k in cached or k in saved_copies)
    return (sum(v for k, v in vision.items() if k not in copies), sum(v for k, v in text.items() if k not in copies),
            weight_copies)


def autocast_weight_bytes(config, precision: str, finetune_json: str = "{}", zero3: bool = False) -> int:
    """Bytes of the 16-bit weight copies autocast keeps from forward to backward under an autocast
    precision (module docstring; 0 otherwise): ~2 per trainable Linear/Conv parameter, whatever the
    micro-batch. With activation checkpointing the forward casts the same weights (the cache), the
    recomputation one layer's again: the same bytes."""
    if not is_autocast(precision):
        return 0
    if isinstance(config, str):
        from rsclip_ds.model import preset_config

        config = preset_config(config)
    return _probe_parts(config.to_json_string(), precision, False, 2, finetune_json, zero3)[2]


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

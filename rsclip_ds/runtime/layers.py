"""Which encoder layers of a DualEncoder train, and which get an input that needs a gradient: what
ZeRO-3 leaf modules (resolve.py drops them where a layer is unsafe) and regional compilation (compilation.py)
decide per layer. Imports nothing of the package: both sides use it without an import cycle."""

from __future__ import annotations

from torch import nn


def encoder_layer_grads(model) -> list[tuple[str, nn.Module, bool, bool]]:
    """(name, layer, trains, upstream) for every encoder layer of both towers, vision first:
    ``trains``, a parameter of the layer trains; ``upstream``, one before it in its tower does (the
    embeddings or an earlier layer), so its input requires grad. A plain run: every layer both; a
    LoRA or lock_* fine-tune's first trained layer: trains, not upstream."""
    out = []
    for prefix in ("vision_model", "text_model"):
        tower = getattr(model, prefix)
        upstream = any(p.requires_grad for p in tower.embeddings.parameters())
        for i, layer in enumerate(tower.encoder.layers):
            trains = any(p.requires_grad for p in layer.parameters())
            out.append((f"{prefix}.encoder.layers.{i}", layer, trains, upstream))
            upstream = upstream or trains
    return out


def unsafe_zero3_leaves(model) -> list[str]:
    """Encoder layers DeepSpeed 0.19.8 cannot run as ZeRO-3 leaf modules: they train but their
    input needs no gradient (a LoRA or lock_*_unlocked_layers fine-tune without activation
    checkpointing; with it, finetune.keep_checkpointed_inputs_differentiable gives the input a
    gradient). DeepSpeed reduces a leaf's gradients in its full backward hook, which torch then
    fires before the leaf's own backward: its parameters are released under it ("size of tensor a
    (0) must match ...", measured on 2 CPU ranks, eager and compiled)."""
    return [name for name, layer, trains, upstream in encoder_layer_grads(model)
            if trains and not upstream and not getattr(layer, "gradient_checkpointing", False)]

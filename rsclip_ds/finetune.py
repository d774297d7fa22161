"""Fine-tuning controls, applied to a built model in this order (Trainer.build states it once):

    apply_image_size    interpolate the image tower's position embeddings to a new input size
    apply_lora          peft LoRA adapters on the attention (and MLP) projections of chosen towers
    apply_trainability  which parameters train: LoRA adapters only in a LoRA tower; locked towers
                        (all but their last N blocks) frozen; everything else trains
    param_groups        the optimizer's groups: per-tower learning rates, layer-wise decay, weight
                        decay on matrices only

Layers are numbered as BEiT / EVA-CLIP number them for layer decay: the embeddings are 0, encoder
block i is i + 1, the final norm and head are L + 1 = the tower's depth D; a parameter of layer l
trains at lr x decay^(D - l). Frozen parameters are left out of the groups: DeepSpeed keeps no
gradient or optimizer state for them.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rsclip_ds.config import ConfigError, FinetuneConfig, LoraConfig, OptimConfig

TOWERS = {"image": "vision_model", "text": "text_model"}
_BLOCK = re.compile(r"\.encoder\.layers\.(\d+)\.")


def tower_of(name: str) -> str:
    """'image', 'text' or 'logit' (the logit scale and bias) for a parameter name."""
    for tower, prefix in TOWERS.items():
        if name.startswith(prefix + "."):
            return tower
    return "logit"


def depth_of(model, tower: str) -> int:
    """Encoder blocks of a tower."""
    config = model.config.vision_config if tower == "image" else model.config.text_config
    return config.num_hidden_layers


def layer_of(name: str, blocks: int) -> int:
    """0 for the embeddings, i + 1 for encoder block i, blocks + 1 for the final norm / head."""
    found = _BLOCK.search(name)
    if found:
        return int(found.group(1)) + 1
    return 0 if ".embeddings." in name else blocks + 1


def check_lock_depth(cfg: FinetuneConfig, blocks: dict[str, int]) -> None:
    """A lock that keeps more blocks trainable than the tower has is a ConfigError."""
    for tower in ("image", "text"):
        unlocked = getattr(cfg, f"lock_{tower}_unlocked_layers")
        if unlocked > blocks[tower]:
            raise ConfigError(f"finetune.lock_{tower}_unlocked_layers={unlocked}: the {tower} tower has "
                              f"{blocks[tower]} blocks; use at most {blocks[tower]} (or drop the lock)")


# --------------------------------------------------------------------------- resolution

def apply_image_size(model, size: int) -> bool:
    """Interpolate the image tower's position embeddings to ``size`` px (bicubic with antialias,
    as open_clip's resize_pos_embed) and update the config; False when the size is unchanged.
    Under ZeRO-3 the old table is gathered first; the new one is a plain parameter that the
    engine partitions."""
    from rsclip_ds.model import maybe_gathered

    vc = model.config.vision_config
    if size == vc.image_size:
        return False
    if size % vc.patch_size:
        raise ConfigError(f"finetune.image_size={size} is not a multiple of the patch size {vc.patch_size}")
    emb = model.vision_model.embeddings
    old = emb.position_embedding.weight
    with maybe_gathered([old]):
        table = old.detach().float().clone()                                   # (G*G, D)
    grid, new_grid, dim = int(math.isqrt(table.shape[0])), size // vc.patch_size, table.shape[1]
    image = table.reshape(1, grid, grid, dim).permute(0, 3, 1, 2)             # (1, D, G, G)
    resized = F.interpolate(image, size=(new_grid, new_grid), mode="bicubic", antialias=True,
                            align_corners=False)                              # (1, D, G', G')
    emb.position_embedding = nn.Embedding(new_grid * new_grid, dim).to(old.dtype)
    with torch.no_grad():
        emb.position_embedding.weight.copy_(resized.permute(0, 2, 3, 1).reshape(-1, dim))
    emb.image_size, emb.num_patches = size, new_grid * new_grid
    emb.num_positions = emb.num_patches
    emb.register_buffer("position_ids", torch.arange(emb.num_positions).expand((1, -1)), persistent=False)
    vc.image_size = size
    return True


# --------------------------------------------------------------------------- LoRA

def lora_targets(cfg: LoraConfig) -> str:
    """peft's target_modules as one regex over the model's module names."""
    towers = "|".join(TOWERS[t] for t in cfg.towers)
    layers = "self_attn\\.(q_proj|k_proj|v_proj|out_proj)" + ("|mlp\\.(fc1|fc2)" if cfg.mlp else "")
    return rf"({towers})\.encoder\.layers\.\d+\.({layers})"


def peft_lora_config(cfg: LoraConfig):
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                          target_modules=lora_targets(cfg), bias="none")


def apply_lora(model, cfg: LoraConfig) -> int:
    """Inject LoRA layers (peft) into the chosen towers in place; returns the adapted modules.
    The adapters start at zero (B = 0): the model's outputs are unchanged until it trains."""
    if not cfg.towers:
        return 0
    from peft import inject_adapter_in_model

    inject_adapter_in_model(peft_lora_config(cfg), model)
    return sum(1 for name, _ in model.named_modules() if name.endswith(".lora_A"))


# --------------------------------------------------------------------------- what trains

def trainable(name: str, cfg: FinetuneConfig, blocks: dict[str, int]) -> bool:
    tower = tower_of(name)
    if tower == "logit":
        return True
    if tower in cfg.lora.towers:
        return ".lora_" in name
    if not getattr(cfg, f"lock_{tower}"):
        return True
    unlocked, depth = getattr(cfg, f"lock_{tower}_unlocked_layers"), blocks[tower]
    layer = layer_of(name, depth)
    if layer == depth + 1:      # final norm / head: with the last block
        return unlocked >= 1
    if layer == 0:              # embeddings: with the first block
        return unlocked >= depth
    return layer > depth - unlocked


def apply_trainability(model, cfg: FinetuneConfig, *, keep_frozen: set[str] = frozenset()) -> dict[str, int]:
    """Set requires_grad from the locks and LoRA (``keep_frozen``: names already frozen for
    other reasons, e.g. the CLIP loss's bias). Returns {tower: trainable elements}."""
    blocks = {t: depth_of(model, t) for t in TOWERS}
    check_lock_depth(cfg, blocks)
    counts = {"image": 0, "text": 0, "logit": 0}
    for name, param in model.named_parameters():
        on = trainable(name, cfg, blocks) and name not in keep_frozen
        param.requires_grad_(on)
        if on:
            counts[tower_of(name)] += getattr(param, "ds_numel", param.numel())
    return counts


def keep_checkpointed_inputs_differentiable(model) -> None:
    """Reentrant activation checkpointing returns no gradient for a block whose input does not
    require grad: with frozen embeddings, unlocked blocks and adapters would silently not train.
    Make the embedding output require grad (transformers' enable_input_require_grads) in each
    tower that has something to train; a fully locked tower stays forward-only."""
    def hook(module, args, output):
        return output.requires_grad_(True) if torch.is_grad_enabled() else output

    for prefix in TOWERS.values():
        tower = getattr(model, prefix)
        if any(p.requires_grad for p in tower.parameters()):
            tower.embeddings.register_forward_hook(hook)


# --------------------------------------------------------------------------- optimizer groups

def param_groups(model, optim: OptimConfig, lr_factor: float = 1.0) -> list[dict[str, Any]]:
    """Trainable parameters -> AdamW groups. Each group carries its own peak "lr" (the run's
    schedule, engine.lr_scheduler, scales every group's by the same factor); decay on matrices only (biases,
    norms, the logit scale/bias and 1-D tables are not decayed, as in open_clip). Without
    per-tower learning rates or layer decay: the two groups of a plain run."""
    base = {"image": optim.image_lr or optim.lr, "text": optim.text_lr or optim.lr, "logit": optim.logit_lr or optim.lr}
    decay = {"image": optim.image_layer_decay, "text": optim.text_layer_decay, "logit": 1.0}
    blocks = {t: depth_of(model, t) for t in TOWERS}
    groups: dict[tuple, dict[str, Any]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        tower = tower_of(name)
        depth = blocks.get(tower, 0) + 1
        layer = layer_of(name, depth - 1) if tower != "logit" else depth
        lr = base[tower] * lr_factor * decay[tower] ** (depth - layer)
        ndim = len(getattr(param, "ds_shape", param.shape))   # ZeRO-3 partitions are flat: the real shape
        wd = optim.weight_decay if ndim >= 2 else 0.0
        key = (round(lr, 15), wd)
        if key not in groups:
            groups[key] = {"params": [], "lr": lr, "weight_decay": wd}
        groups[key]["params"].append(param)
    # decayed groups first: a plain run's [decay, no decay] order, as DeepSpeed flattens them
    return sorted(groups.values(), key=lambda g: g["weight_decay"] == 0)


def apply_finetune(bundle, cfg: FinetuneConfig, loss: str, *, checkpointing: bool):
    """The fine-tuning controls on a built bundle, in this order: new image size, LoRA, what
    trains, inputs kept differentiable for checkpointed blocks. Returns the bundle (its image
    size updated) and the trainable elements per tower."""
    from dataclasses import replace

    if cfg.image_size and apply_image_size(bundle.model, cfg.image_size):
        bundle = replace(bundle, image_size=cfg.image_size)
    apply_lora(bundle.model, cfg.lora)
    counts = apply_trainability(bundle.model, cfg, keep_frozen={"logit_bias"} if loss == "clip" else set())
    if checkpointing and (cfg.lock_image or cfg.lock_text or cfg.lora.towers):
        keep_checkpointed_inputs_differentiable(bundle.model)
    return bundle, counts


# --------------------------------------------------------------------------- export

def merge_lora_state(state: dict[str, torch.Tensor], cfg: LoraConfig) -> dict[str, torch.Tensor]:
    """A state dict with peft LoRA layers -> plain SiglipModel keys, each adapted weight merged:
    W + (alpha / r) B A (what peft's merge_and_unload computes; dropout is off at inference)."""
    scale = cfg.alpha / cfg.rank
    merged = {}
    for key, value in state.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        if ".base_layer." not in key:
            merged[key] = value
            continue
        prefix, _, leaf = key.rpartition(".base_layer.")
        if leaf == "weight":
            a, b = state[f"{prefix}.lora_A.default.weight"], state[f"{prefix}.lora_B.default.weight"]
            value = value + scale * (b.float() @ a.float()).to(value.dtype)                 # (out, in)
        merged[f"{prefix}.{leaf}"] = value
    return merged


def save_adapter(state: dict[str, torch.Tensor], cfg: LoraConfig, out_dir) -> None:
    """The LoRA weights alone in peft's format (adapter_config.json + adapter_model.safetensors):
    `peft.PeftModel.from_pretrained(SiglipModel.from_pretrained(BASE), out_dir)` applies them.
    Only the adapters: a run that also trained other weights needs the merged export."""
    from safetensors.torch import save_file

    adapter = {f"base_model.model.{k.replace('.default.', '.')}": v.contiguous() for k, v in state.items()
               if ".lora_A." in k or ".lora_B." in k}
    peft_lora_config(cfg).save_pretrained(str(out_dir))
    save_file(adapter, str(out_dir / "adapter_model.safetensors"))

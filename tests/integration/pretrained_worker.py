"""Run under the deepspeed launcher: a fine-tune from a folder of the published Git-RSCLIP shape,
assembled by the Trainer as `rsclip-ds train` assembles it.

    deepspeed --num_gpus 2 tests/integration/pretrained_worker.py --folder F --shards S --out DIR [--set k=v ...]

Rank 0 writes DIR/result.json: what every rank held right after the build (parameter elements
stored locally vs the model's size), the largest difference between the engine's fp32 master
weights and the folder's 16-bit weights, the summary of the short training run; and
DIR/embeddings.pt: embeddings of a probe batch through the engine before training.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rsclip_ds.data.tokenizer import tokenize
from rsclip_ds.engine import engine_dtype
from rsclip_ds.assembly import Trainer
from tests.integration.helpers import pretrained_worker_config

CAPTIONS = ["a satellite photo of forest.", "a satellite photo of a river.", "an airport seen from above."]


def _probe_pixels(folder: Path) -> torch.Tensor:
    """Two images through transformers' own SigLIP image processor."""
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor

    yy, xx = np.mgrid[0:48, 0:40]
    images = [Image.fromarray(np.stack([(xx * k) % 256, (yy * 3) % 256, (xx + yy) % 256], -1).astype(np.uint8))
              for k in (3, 7)]
    return AutoImageProcessor.from_pretrained(str(folder))(images=images, return_tensors="pt")["pixel_values"]


def _master_vs_folder(engine, folder: Path) -> float:
    """max |fp32 master - stored 16-bit weight| over all parameters (collective on every rank)."""
    from deepspeed.utils import safe_get_full_fp32_param
    from safetensors.torch import load_file

    stored = load_file(folder / "model.safetensors")
    worst = 0.0
    for name, param in engine.module.named_parameters():
        master = safe_get_full_fp32_param(param)
        worst = max(worst, (master.cpu() - stored[name].float()).abs().max().item())
    return worst


def main() -> None:
    args, run = pretrained_worker_config("checkpoint.at_end=false")
    with Trainer(run) as trainer:
        parts = trainer.build()
        engine, bundle = parts.engine, parts.bundle
        params = list(engine.module.parameters())
        held = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)
        held_per_rank = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(held_per_rank, torch.tensor([float(held)], dtype=torch.float64))
        master_diff = _master_vs_folder(engine, args.folder)
        opt = engine.optimizer   # ZeRO-1/2 keep the groups' parameters in bit16_groups, ZeRO-3 in fp16_groups
        members = getattr(opt, "bit16_groups", None) or getattr(opt, "fp16_groups")
        decay = [{"weight_decay": g["weight_decay"],
                  "matrices": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params
                                  if len(getattr(p, "ds_shape", p.shape)) >= 2),
                  "elements": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params)}
                 for g, params in zip(opt.param_groups, members)]
        pixels = _probe_pixels(args.folder)
        ids = tokenize(bundle.tokenizer, CAPTIONS, bundle.max_text_length)
        engine.eval()
        with torch.no_grad():   # through forward(): ZeRO-3 gathers the parameters there
            image, text, _, _ = engine(pixels.to(engine.device, engine_dtype(engine)), ids.to(engine.device))
        engine.train()
        summary = trainer.train()
        if trainer.info.rank == 0:
            torch.save({"pixels": pixels, "ids": ids, "image": image.float().cpu(), "text": text.float().cpu()},
                       args.out / "embeddings.pt")
            (args.out / "result.json").write_text(json.dumps({
                "held_per_rank": [int(h.item()) for h in held_per_rank], "parameters": bundle.num_parameters(),
                "master_vs_folder": master_diff, "groups": decay, "summary": summary}, indent=2))


if __name__ == "__main__":
    sys.exit(main())

"""Run under the deepspeed launcher: a fine-tune with locks / LoRA / a new image size from a folder
of the published Git-RSCLIP shape, assembled by the Trainer as `rsclip-ds train` does.

    deepspeed --num_gpus 2 tests/integration/finetune_worker.py --folder F --shards S --out DIR [--set k=v ...]

Rank 0 writes DIR/result.json: which parameters changed in training (full values gathered before
and after, compared bit for bit), the optimizer's groups (learning rate, elements), the optimizer
state elements summed over ranks, the trainable elements; DIR/embeddings.pt: a probe batch's
embeddings through the engine after training. The run ends with a checkpoint to export.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from rsclip_ds.data.tokenizer import tokenize
from rsclip_ds.engine import engine_dtype
from rsclip_ds.model import maybe_gathered
from rsclip_ds.assembly import Trainer
from tests.integration.helpers import pretrained_worker_config

CAPTIONS = ["a satellite photo of forest.", "a satellite photo of a river.", "an airport seen from above."]


def _full_params(module) -> dict[str, torch.Tensor]:
    """Trainable: the optimizer's fp32 master (a bf16 copy can miss small steps); frozen: the
    module's weight (it has no master). Collective: every rank calls it."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, param in module.named_parameters():
        if param.requires_grad:
            out[name] = safe_get_full_fp32_param(param).float().cpu().clone()
            continue
        with maybe_gathered([param]):
            out[name] = param.detach().float().cpu().clone()
    return out


def _optimizer_state_elements(engine) -> int:
    """Elements of Adam's exp_avg this rank holds (the fp32 partitions the wrapped optimizer steps)."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return sum(s["exp_avg"].numel() for s in inner.state.values() if "exp_avg" in s)


def main() -> None:
    args, run = pretrained_worker_config("optim.lr=5e-3", "optim.min_lr_ratio=0.5", "precision=fp32")
    with Trainer(run) as trainer:
        parts = trainer.build()
        engine, bundle = parts.engine, parts.bundle
        before = _full_params(engine.module)
        opt = engine.optimizer   # ZeRO-1/2 keep the groups' parameters in bit16_groups, ZeRO-3 in fp16_groups
        members = getattr(opt, "bit16_groups", None) or getattr(opt, "fp16_groups")
        groups = [{"peak_lr": lr, "weight_decay": g["weight_decay"],
                   "elements": sum(getattr(p, "ds_numel", p.numel()) for p in params),
                   "matrices": sum(getattr(p, "ds_numel", p.numel()) for p in params
                                   if len(getattr(p, "ds_shape", p.shape)) >= 2)}
                  for lr, g, params in zip(engine.lr_scheduler.base_lrs, opt.param_groups, members)]
        trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad}
        summary = trainer.train()
        for group, lr in zip(groups, engine.get_lr()):   # every group on the same schedule
            group["last_lr"] = lr
        after = _full_params(engine.module)
        state = torch.tensor([float(_optimizer_state_elements(engine))], dtype=torch.float64)
        dist.all_reduce(state)
        from PIL import Image
        import numpy as np
        from transformers import AutoImageProcessor

        yy, xx = np.mgrid[0:48, 0:40]
        image = Image.fromarray(np.stack([(xx * 5) % 256, (yy * 3) % 256, (xx + yy) % 256], -1).astype(np.uint8))
        processor = AutoImageProcessor.from_pretrained(str(args.folder),
                                                       size={"height": bundle.image_size, "width": bundle.image_size})
        pixels = processor(images=[image, image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)],
                           return_tensors="pt")["pixel_values"]
        ids = tokenize(bundle.tokenizer, CAPTIONS, bundle.max_text_length)
        engine.eval()
        with torch.no_grad():
            image_emb, text_emb, _, _ = engine(pixels.to(engine.device, engine_dtype(engine)), ids.to(engine.device))
        if trainer.info.rank == 0:
            torch.save({"pixels": pixels, "ids": ids, "image": image_emb.float().cpu(), "text": text_emb.float().cpu()},
                       args.out / "embeddings.pt")
            changed = sorted(n for n in before if not torch.equal(before[n], after[n]))
            (args.out / "result.json").write_text(json.dumps({
                "changed": changed, "unchanged": sorted(set(before) - set(changed)),
                "trainable": sorted(trainable), "groups": groups, "state_elements": int(state.item()),
                "trainable_elements": sum(before[n].numel() for n in trainable),
                "image_size": bundle.image_size, "summary": summary}, indent=2))


if __name__ == "__main__":
    sys.exit(main())

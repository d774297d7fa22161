"""Run under the deepspeed launcher: distributed losses and 'global' accumulation against a
single-process reference on the concatenated batch.

    deepspeed --num_gpus W tests/integration/parity_worker.py --stages 0 1 2 3 --amp --out result.json

The engine gets a client SGD optimizer with lr=1 and no clipping, so the parameter update *is*
minus the (rank-averaged) gradient: comparing updates compares the gradient of every parameter,
on any ZeRO stage, without reaching into DeepSpeed's partitions. Rank 0 computes the reference
with plain torch on the whole batch and writes the worst differences to --out, per stage (one
launch runs every stage asked for: the launch, not the cases, is what costs seconds).
"""

from __future__ import annotations

import argparse
import json
import sys

import deepspeed
import torch
import torch.distributed as dist

from rsclip_ds.gradients import build_gradient_buckets
from rsclip_ds.precision import autocast_section
from rsclip_ds.runtime.distributed import init_distributed
from rsclip_ds.losses import LOSSES, build_loss
from rsclip_ds.model import new_dual_encoder, preset_config
from rsclip_ds.profiles import load_profile
from rsclip_ds.loop import micro_batch_step, global_optimizer_step

MICRO = 4          # samples per rank per micro-batch
SEED = 0


def global_batch(n: int, config) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    size, length = config.vision_config.image_size, config.text_config.max_position_embeddings
    pixels = torch.randn(n, 3, size, size, generator=g)                        # (N,3,H,W)
    ids = torch.randint(0, config.text_config.vocab_size, (n, length), generator=g)
    return pixels, ids


# stage 0 (the ddp profile) reduces with rsclip_ds's buckets: small ones here, so that a step fills several
STAGE0_BUCKET = 20_000


def engine_for(config, loss: str, stage: int, world: int, accumulation: int, precision: str = "fp32"):
    model = new_dual_encoder(config, loss, SEED)
    ds_config = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accumulation,
        "train_batch_size": MICRO * accumulation * world, "gradient_clipping": 0.0,
        # the shipped profile's ZeRO block (buckets, overlap_comm, ...), as users run it
        "zero_optimization": load_profile("ddp" if stage == 0 else f"zero{stage}").strategy["zero_optimization"],
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": False}, "fp16": {"enabled": False}, "steps_per_print": 10**9,
        **autocast_section(precision),
    }
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(params, lr=1.0),
                                      config=ds_config)
    build_gradient_buckets(engine, stage, world, STAGE0_BUCKET)
    return engine


def full_params(engine) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
        return [p.detach().clone().float() for p in params]


def reference_grads(config, loss: str, pixels, ids, precision: str = "fp32") -> tuple[float, list[torch.Tensor]]:
    model = new_dual_encoder(config, loss, SEED)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "amp_bf16"):   # as DeepSpeed's forward
        out = model(pixels, ids)
    value = LOSSES[loss](*out)   # outside autocast, as the train step's loss
    value.backward()
    return value.item(), [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]


def distributed_update(config, loss: str, stage: int, rank: int, world: int, k: int,
                       mode: str, negatives: str, chunk: int = 0,
                       precision: str = "fp32") -> tuple[float, list[torch.Tensor]]:
    """One optimizer step of k micro-batches per rank -> (mean loss over ranks, -update)."""
    pixels, ids = global_batch(MICRO * k * world, config)
    mine = slice(rank * MICRO * k, (rank + 1) * MICRO * k)   # this rank's k micro-batches
    batches = [{"pixel_values": p, "input_ids": i}
               for p, i in zip(pixels[mine].split(MICRO), ids[mine].split(MICRO))]
    engine = engine_for(config, loss, stage, world, k, precision)
    before = full_params(engine)
    loss_fn = build_loss(loss, negatives=negatives, rank=rank, world_size=world, chunk_size=chunk)
    if mode == "global" and k > 1:
        value = global_optimizer_step(engine, batches, loss_fn, torch.float32)
    else:
        value = torch.stack([micro_batch_step(engine, b, loss_fn, torch.float32) for b in batches]).mean()
    after = full_params(engine)
    dist.all_reduce(value)
    return value.item() / world, [b - a for b, a in zip(before, after)]


def worst(got: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, float, float, float]:
    """(max abs error, max abs reference gradient, projection ratio <got, ref> / <ref, ref>, relative L2
    error ||got - ref|| / ||ref|| over every parameter)."""
    err = max((g - r).abs().max().item() for g, r in zip(got, ref))
    scale = max(r.abs().max().item() for r in ref)
    ratio = sum((g * r).sum() for g, r in zip(got, ref)) / sum((r * r).sum() for r in ref)
    rel = (sum(((g - r) ** 2).sum() for g, r in zip(got, ref)) / sum((r * r).sum() for r in ref)) ** 0.5
    return err, scale, float(ratio), float(rel)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, nargs="+", required=True)
    parser.add_argument("--amp", action="store_true", help="also the amp_bf16 cases")
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    init_distributed()   # ours: also unlinks DeepSpeed's CPU shm buffers (they leaked 64 MiB per rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = preset_config("tiny")
    cases = [  # (name, loss, k, accumulation mode, negatives, chunk, expected to match the big batch)
        (f"{loss}/{neg}/{mode}/k{k}", loss, k, mode, neg, 0, neg == "global" and (mode == "global" or k == 1))
        for loss in ("siglip", "clip")
        for (k, mode, neg) in ((1, "plain", "global"), (2, "global", "global"), (3, "global", "global"),
                               (1, "plain", "local"), (2, "plain", "global"))
    ] + [("siglip/global/global/k2/chunk3", "siglip", 2, "global", "global", 3, True)]
    # amp_bf16 (fp32 weights, the forward under autocast, Linear gradients on a bf16 wire) against the big batch
    # under the same autocast; runs last: DeepSpeed keeps torch_autocast's state in process globals
    amp = [("siglip/global/plain/k1/amp_bf16", "siglip", 1, "plain", "global", 0, True),
           ("siglip/global/global/k2/amp_bf16", "siglip", 2, "global", "global", 0, True),
           ("clip/local/plain/k1/amp_bf16", "clip", 1, "plain", "local", 0, False)]
    results = {stage: {} for stage in args.stages}
    for precision, group in (("fp32", cases), ("amp_bf16", amp if args.amp else [])):
        for stage in args.stages:
            for name, loss, k, mode, neg, chunk, should_match in group:
                value, update = distributed_update(config, loss, stage, rank, world, k, mode, neg, chunk, precision)
                if rank == 0:
                    ref_value, ref = reference_grads(config, loss, *global_batch(MICRO * k * world, config),
                                                     precision)
                    err, scale, ratio, rel = worst(update, ref)
                    results[stage][name] = {"loss": value, "ref_loss": ref_value, "max_abs_err": err,
                                            "max_abs_grad": scale, "ratio": ratio, "rel_l2": rel,
                                            "should_match": should_match}
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world": world, "stages": results}, f, indent=2)
    dist.barrier()


if __name__ == "__main__":
    sys.exit(main())

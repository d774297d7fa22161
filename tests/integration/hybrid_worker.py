"""Run under the deepspeed launcher, 2 "nodes" x 2 ranks: the hybrid-sharding profiles against
plain zero3 on the same seed and data.

    deepspeed --hostfile HF --no_ssh --node_rank R --master_addr 127.0.0.1 --master_port P \
        tests/integration/hybrid_worker.py --profiles zero3 zero3_hpz --steps 3 --out result.json

For each profile in turn: the DeepSpeed config from rsclip_ds.resolve.build_ds_config (the
run's AdamW, fp32, per-node values resolved from the launcher's LOCAL_SIZE), the tiny model built
under that config (zero.Init, as the trainer builds it), then `--steps` optimizer steps on
the same global batches (each rank its slice). Rank 0 writes, per profile: the rank-averaged
loss of every step, every parameter's full gradient after step 1's backward
(safe_get_full_grad, before the step), the full weights after the last step, and what DeepSpeed
actually built (hpZ: the secondary partition group's size, how many parameters hold a secondary
shard): without those a parity check of a switched-off feature would pass trivially.

zero3 must come first: DeepSpeed keeps hpZ's partition group in a module global, and a ZeRO-3
engine built after it would pick it up (stage3.py passes the existing group on, whatever the
engine's own zero_hpz_partition_size).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

from rsclip_ds.config import load_config
from rsclip_ds.runtime.distributed import init_distributed
from rsclip_ds.engine import build_engine
from rsclip_ds.losses import build_loss
from rsclip_ds.model import new_dual_encoder, preset_config
from rsclip_ds.profiles import load_profile
from rsclip_ds.resolve import build_ds_config

MICRO = 4
SEED = 0


def batches(config, steps: int, world: int, rank: int) -> list[dict]:
    """`steps` global batches of MICRO x world samples; this rank's slice of each."""
    g = torch.Generator().manual_seed(1234)
    size, length = config.vision_config.image_size, config.text_config.max_position_embeddings
    out = []
    for _ in range(steps):
        pixels = torch.randn(MICRO * world, 3, size, size, generator=g)                  # (N,3,H,W)
        ids = torch.randint(0, config.text_config.vocab_size, (MICRO * world, length), generator=g)
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        out.append({"pixel_values": pixels[mine], "input_ids": ids[mine]})
    return out


def full(params, get) -> list[list[float]]:
    """`get(param)` -> full tensor (a collective on every rank), as nested lists for JSON."""
    return [get(p).detach().float().flatten().tolist() for p in params]


def run_profile(name: str, steps: int, rank: int, world: int) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    run = load_config(None, ["precision=fp32", f"profile={name}", f"batch.micro_batch_size={MICRO}",
                             f"steps={steps}", "optim.lr=1e-3", "optim.warmup_steps=0", f"seed={SEED}"])
    profile = load_profile(name)
    ds_config = build_ds_config(run, profile, world, on_gpu=False)   # local world size: the launcher's
    config = preset_config("tiny")
    model = new_dual_encoder(config, "siglip", SEED, ds_config=ds_config)
    engine = build_engine(model, ds_config)
    loss_fn = build_loss("siglip", negatives="global", rank=rank, world_size=world)
    params = [p for p in engine.module.parameters() if p.requires_grad]
    losses, grads, secondary = [], None, []
    for i, batch in enumerate(batches(config, steps, world, rank)):
        image, text, scale, bias = engine(batch["pixel_values"], batch["input_ids"])     # (B,D) x2
        loss = loss_fn(image, text, scale, bias)
        engine.backward(loss)
        if i == 0:   # hpZ's secondary shards live from forward to the step (invalidate_secondary_tensor)
            grads = full(params, safe_get_full_grad)
            secondary = [p for p in engine.module.parameters() if getattr(p, "ds_secondary_tensor", None) is not None]
        engine.step()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)
    weights = full(params, safe_get_full_fp32_param)
    zero = ds_config["zero_optimization"]
    built = {"hpz_partition_size": zero.get("zero_hpz_partition_size", 1),
             "secondary_group_size": max((p.ds_secondary_tensor_group_size for p in secondary), default=0),
             "params_with_secondary": len(secondary), "params": len(list(engine.module.parameters()))}
    engine.destroy()
    return {"losses": losses, "grads": grads, "weights": weights, "built": built}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profiles", nargs="+", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    info = init_distributed()
    results = {name: run_profile(name, args.steps, info.rank, info.world_size) for name in args.profiles}
    if info.rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world": info.world_size, "local_world": info.local_world_size, "profiles": results}, f)
    dist.barrier()


if __name__ == "__main__":
    sys.exit(main())

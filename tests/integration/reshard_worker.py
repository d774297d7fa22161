"""Run under the deepspeed launcher: a tiny fp32 run on in-memory batches that are the same global
batch at every step whatever the number of ranks, and a dump of the engine's state at one step.

    deepspeed --num_gpus N tests/integration/reshard_worker.py --out DIR --tokenizer DIR \
        --global-batch 12 [--dump-at K | --resume TAG] [--set k=v ...]

Without --resume (a first run): trains, and after optimizer step K every rank takes part in
gathering the state that rank 0 writes to DIR/state_at_K.pt. With --resume TAG: resumes TAG from
DIR/checkpoints (saved by any number of ranks), writes the state right after loading to
DIR/state_resumed.pt, then trains to the end. The state: the module's weights (gathered), the
fp32 masters and Adam's exp_avg / exp_avg_sq of every parameter (full tensors), Adam's step, each
optimizer group's options, the learning rates, DeepSpeed's global_steps and the client state's
data part. Rank 0 of every run also writes DIR/summary.json (the Trainer does).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import deepspeed
import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

from rsclip_ds.config import load_config
from rsclip_ds.assembly import Trainer

ROOT = Path(__file__).resolve().parents[2]


class GlobalBatches:
    """Endless micro-batches: global batch g holds samples g*G .. g*G+G-1 (G = micro x world), rank r
    the slice r*micro .. (r+1)*micro of it; sample i is drawn from a generator seeded with i. So
    every world size sees the same global batches in the same order. The position is one number
    (global batches handed out), which `state_dict` gives and `load_state_dict` takes, also as
    {"remap_from": [every old rank's state]} -- the contract of a resume on another world size."""

    def __init__(self, rank: int, world: int, micro: int):
        self.rank, self.world, self.micro = rank, world, micro
        self.image_size = self.text_length = self.vocab = None   # the model's: set once it is built
        self.batches = 0

    def state_dict(self) -> dict:
        return {"global_batches": self.batches, "world": self.world}

    def load_state_dict(self, state: dict) -> None:
        if "remap_from" in state:
            positions = {s["global_batches"] for s in state["remap_from"]}
            assert len(positions) == 1, f"old ranks disagree on the position: {positions}"
            self.batches = positions.pop()
        else:
            assert state["world"] == self.world
            self.batches = state["global_batches"]

    def _sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        pixels = torch.randint(0, 256, (3, self.image_size, self.image_size), generator=g, dtype=torch.uint8)
        ids = torch.randint(0, self.vocab, (self.text_length,), generator=g)
        return pixels, ids

    def __iter__(self):
        while True:
            first = self.batches * self.micro * self.world + self.rank * self.micro
            samples = [self._sample(first + j) for j in range(self.micro)]
            self.batches += 1
            yield {"pixel_values": torch.stack([p for p, _ in samples]),
                   "input_ids": torch.stack([t for _, t in samples])}


def full_optimizer_state(engine, param, key: str) -> torch.Tensor:
    """The whole ``key`` state (exp_avg, exp_avg_sq) of ``param``, on every rank (collective)."""
    if hasattr(param, "ds_id"):   # ZeRO-3
        return safe_get_full_optimizer_state(param, key).clone()
    # ZeRO-1/2: 0.19.8 links a parameter to its optimizer-state fragments only when a checkpoint
    # loads (stage_1_and_2.py _link_all_hp_params; torch's AdamW makes its state at the first
    # step, after the link), so safe_get_full_optimizer_state fails in a run that never loaded
    # one. The same gathering as tensor_fragment.get_full_hp_param, from the state itself:
    full = torch.zeros(param.numel(), dtype=torch.float32)
    mapping = param._hp_mapping
    if mapping is not None:
        zero = engine.optimizer
        flat = zero.optimizer.state[zero.single_partition_of_fp32_groups[mapping.param_group_index]][key]
        lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
        full.narrow(0, lp.start, lp.numel).copy_(flat.narrow(0, hp.start, hp.numel))
    torch.distributed.all_reduce(full, group=param._dp_group)
    return full.view(param.shape)


def engine_state(engine) -> dict:
    """Full tensors on every rank (collective at ZeRO-3: every rank must call it). Stage 0 (the ddp profile,
    fp32 weights): the parameters are the masters and torch's AdamW holds their state as it is."""
    params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    stage0 = not hasattr(engine.optimizer, "optimizer")
    if stage0:
        state = {"fp32": {n: p.detach().clone() for n, p in params},
                 **{key: {n: engine.optimizer.state[p][key].clone() for n, p in params}
                    for key in ("exp_avg", "exp_avg_sq")}}
    else:
        state = {
            "fp32": {n: safe_get_full_fp32_param(p).clone() for n, p in params},
            "exp_avg": {n: full_optimizer_state(engine, p, "exp_avg") for n, p in params},
            "exp_avg_sq": {n: full_optimizer_state(engine, p, "exp_avg_sq") for n, p in params},
        }
    everything = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(everything, enabled=hasattr(everything[0], "ds_id")):
        state["module"] = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    base = engine.optimizer if stage0 else engine.optimizer.optimizer
    state["adam_step"] = sorted({float(s["step"]) for s in base.state.values()})   # one value expected
    state["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups]
    state["lr"] = engine.get_lr()
    state["scheduler_last_epoch"] = engine.lr_scheduler.last_epoch
    state["global_steps"] = engine.global_steps
    return state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--dump-at", type=int)
    parser.add_argument("--resume")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    resume = [f"checkpoint.resume={args.resume}"] if args.resume else []
    run = load_config(ROOT / "configs" / "tiny_demo.yaml", [
        "precision=fp32", "logging.progress=plain", "logging.log_every=1", f"output_dir={args.out}",
        f"model.tokenizer={args.tokenizer}", f"batch.micro_batch_size={args.global_batch // world}",
        *args.set, *resume])

    def dump(step: int, engine):
        if step == args.dump_at:
            state = engine_state(engine)
            if rank == 0:
                torch.save(state, args.out / f"state_at_{step}.pt")

    loader = GlobalBatches(rank, world, run.batch.micro_batch_size)
    with Trainer(run, hooks=[dump], loader=loader) as trainer:
        parts = trainer.build()
        b = parts.bundle
        loader.image_size, loader.text_length, loader.vocab = b.image_size, b.max_text_length, len(b.tokenizer)
        if parts.resume is not None:
            if parts.resume["data"] is not None:
                loader.load_state_dict(parts.resume["data"])
            state = engine_state(parts.engine)
            if rank == 0:
                state["data"] = parts.resume["data"]
                torch.save(state, args.out / "state_resumed.pt")
        trainer.train()


if __name__ == "__main__":
    main()

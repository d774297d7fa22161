"""Run under the deepspeed launcher: demo-length training at ZeRO-3 with the evaluation hook,
evaluation of the untrained and the trained model through the engine, and an export of the
trained weights for the single-process comparison.

    deepspeed --num_gpus 2 tests/integration/eval_worker.py --data DIR --out DIR [--set k=v ...]

DIR (--data) holds make_synthetic(..., eval_layout=True) output and tokenizer/. Rank 0 writes
--out/result.json (metrics before / after training, the hook's records), --out/embeddings.pt
(retrieval embeddings of the trained model under ZeRO-3) and --out/export/ (a Hugging Face folder).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import deepspeed
import torch

from rsclip_ds.config import load_config
from rsclip_ds.data import build_train_loader
from rsclip_ds.distributed import destroy_distributed, init_distributed
from rsclip_ds.engine import build_engine, engine_dtype
from rsclip_ds.evaluate import Embedder, EvalSets, build_eval_hook
from rsclip_ds.losses import build_loss
from rsclip_ds.model import build_model, new_dual_encoder, save_pretrained
from rsclip_ds.profiles import build_ds_config, derive_batch, load_profile
from rsclip_ds.progress import ProgressReporter
from rsclip_ds.train import train

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    index = json.loads((args.data / "index.json").read_text())
    run = load_config(ROOT / "configs" / "tiny_demo.yaml", [
        "profile=zero3", "precision=fp32", "logging.progress=plain", f"output_dir={args.out}",
        f"data.train_shards={args.data}/train-{{000000..{len(index['train']) - 1:06d}}}.tar",
        f"model.tokenizer={args.data / 'tokenizer'}", f"eval.zero_shot_dir={args.data / 'eval/classes'}",
        f"eval.retrieval_json={args.data / 'eval/captions.json'}", "eval.every=1000000"] + args.set)
    info = init_distributed()
    try:
        rank, world = info.rank, info.world_size
        plan = derive_batch(run, world)
        bundle = build_model(run.model, run.seed, loss=run.loss.name)
        engine = build_engine(bundle.model, build_ds_config(run, load_profile(run.profile), world, on_gpu=False))
        hook = build_eval_hook(run, bundle, rank, world)   # train() calls it at step 0 too
        loader = build_train_loader(run.data, tokenizer=bundle.tokenizer, image_size=bundle.image_size,
                                    image_mean=bundle.image_mean, image_std=bundle.image_std,
                                    max_text_length=bundle.max_text_length, micro_batch_size=plan.micro,
                                    rank=rank, world_size=world, seed=run.seed)
        loss_fn = build_loss(run.loss.name, negatives=run.loss.negatives, rank=rank, world_size=world)
        result = train(engine, iter(loader), loss_fn, plan, run.steps, run.logging.log_every,
                       ProgressReporter(run.steps, "plain", enabled=rank == 0),
                       accumulation=run.batch.accumulation, hooks=[hook])
        # the trained model's retrieval embeddings, through the ZeRO-3 engine
        sets = EvalSets.from_config(run.eval)
        engine.eval()
        embedder = Embedder(engine, bundle, run.eval.batch_size, rank, world, engine_dtype(engine),
                            engine.device, progress=False)
        image_emb, text_emb = embedder.embed(sets.retrieval.image_paths, sets.retrieval.captions, "retrieval")
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
            state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        if rank == 0:
            full = new_dual_encoder(bundle.model.config, run.loss.name)
            full.load_state_dict(state)
            save_pretrained(full, bundle.tokenizer, args.out / "export", bundle.image_mean, bundle.image_std)
            torch.save({"image": image_emb, "text": text_emb}, args.out / "embeddings.pt")
            (args.out / "result.json").write_text(json.dumps({
                "world": world, "stage": load_profile(run.profile).stage, "before": result.evals[0],
                "evals": result.evals, "losses": result.losses, "lrs": result.lrs}, indent=2))
    finally:
        destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())

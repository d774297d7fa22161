"""Run under the deepspeed launcher: demo-length training at ZeRO-3 with the evaluation hook,
evaluation of the untrained and the trained model through the engine, and an export of the
trained weights for the single-process comparison.

    deepspeed --num_gpus 2 tests/integration/eval_worker.py --data DIR --out DIR [--set k=v ...]

DIR (--data) holds make_synthetic(..., eval_layout=True) output and tokenizer/. Rank 0 writes
--out/result.json (metrics before / after training, the hooks' records: the eval hook's and the
benchmark suite's on the same sets), --out/embeddings.pt
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
from rsclip_ds.evaluation import Embedder, EvalSets
from rsclip_ds.evaluation.catalog import FoundSet
from rsclip_ds.evaluation.datasets import load_caption_json, load_class_folders
from rsclip_ds.evaluation.hook import make_eval_hook
from rsclip_ds.model import new_dual_encoder, save_pretrained
from rsclip_ds.assembly import Trainer

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
        "checkpoint.at_end=false",
        f"data.train_shards={args.data}/train-{{000000..{len(index['train']) - 1:06d}}}.tar",
        f"model.tokenizer={args.data / 'tokenizer'}", f"eval.zero_shot_dir={args.data / 'eval/classes'}",
        f"eval.retrieval_json={args.data / 'eval/captions.json'}", "eval.every=1000000"] + args.set)
    with Trainer(run) as trainer:   # the run as `rsclip-ds train` assembles it; its eval hook included
        rank, world = trainer.info.rank, trainer.info.world_size
        parts = trainer.build()
        # the benchmark suite's hook beside it, on the same data as one found set (the seam of
        # eval.suite: a root would go through catalog.find_sets), every eval.every steps
        found = [FoundSet("synthetic", args.data / "eval", "all images",
                          classification=load_class_folders(args.data / "eval/classes"),
                          retrieval=load_caption_json(args.data / "eval/captions.json"))]
        parts.hooks.append(make_eval_hook(run.eval, parts.bundle, rank, world, args.out / "suite_eval", run.steps,
                                          suite=found))
        summary = trainer.train()
        engine, bundle = trainer.parts.engine, trainer.parts.bundle
        # the trained model's retrieval embeddings, through the ZeRO-3 engine
        sets = EvalSets.from_config(run.eval)
        engine.eval()
        embedder = Embedder(engine, bundle, run.eval.batch_size, rank, world, engine.device, progress=False)
        image_emb, text_emb = embedder.embed(sets.retrieval.image_paths, sets.retrieval.captions, "retrieval")
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
            state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        if rank == 0:
            evals = [e for e in summary["evals"] if "zero_shot/top1" in e]   # the eval hook's, not the suite's
            full = new_dual_encoder(bundle.model.config, run.loss.name)
            full.load_state_dict(state)
            save_pretrained(full, bundle.tokenizer, args.out / "export", bundle.image_mean, bundle.image_std)
            torch.save({"image": image_emb, "text": text_emb}, args.out / "embeddings.pt")
            (args.out / "result.json").write_text(json.dumps({
                "world": world, "stage": summary["zero_stage"], "before": evals[0], "evals": evals,
                "suite_evals": [e for e in summary["evals"] if "zero_shot/top1" not in e],
                "losses": summary["losses"], "lrs": summary["lrs"]}, indent=2))


if __name__ == "__main__":
    sys.exit(main())

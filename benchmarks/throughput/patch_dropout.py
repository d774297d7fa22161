"""Patch dropout 0 / 0.5 / 0.75: samples/s, activation bytes, and quality at equal compute.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module benchmarks.throughput.patch_dropout \\
        --out benchmarks/results/patch_dropout.json

The model is git-rsclip-base's shape where patch dropout acts -- 224 px images in 16 px patches
(196 tokens), head dim 64, 64 text tokens -- cut in width (384) and depth (2 layers per tower) to
train on 2 CPU cores. Every run is `rsclip-ds train`'s Trainer (the `model=` seam brings the cut
model; `model.patch_dropout` and `model.patch_dropout_off_last_steps` are set as users set them) on
synthetic shards of 224 px images, zero-shot and retrieval sets from the held-out split.

  samples/s     global samples/s over the masked steps after step 1, from a step hook's clock
  activations   bytes per sample saved for backward, measured on this CPU (saved_tensors_hooks on a
                real training forward of both towers: memory.saved_bytes) beside the planner's
                estimate (memory.activation_bytes_per_sample: GPU flash attention, bf16 -> here fp32)
  equal compute p = 0 trains `--steps` steps; a masked run trains as many steps as the same matmul
                FLOPs buy (planning/flops.py's count), the last `--tail` of them unmasked (the
                switch-off FLIP ends with); then both are evaluated in eval mode (all patches):
                zero-shot top-1, retrieval mean recall, and the mean train loss of the last 3 steps
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.harness import base_parser, environment, finish, process_group, rank0_print, synthetic_data
from rsclip_ds.config import load_config
from rsclip_ds.hub import ModelSource
from rsclip_ds.model import IMAGE_MEAN, IMAGE_STD, ModelBundle, load_tokenizer, new_dual_encoder
from rsclip_ds.model import apply_patch_dropout
from rsclip_ds.planning.flops import text_flops, vision_flops
from rsclip_ds.planning.memory import activation_bytes_per_sample, saved_bytes
from rsclip_ds.trainer import Trainer

CASES = (0.0, 0.5, 0.75)
RESULTS = Path(__file__).resolve().parents[1] / "results" / "patch_dropout.json"


def cut_config(width: int, layers: int, vocab: int, patch_dropout: float = 0.0):
    """git-rsclip-base's image and text shapes at `width` (head dim 64) and `layers` per tower; a
    planning `patch_dropout` rides along in the vision config (planning/dropout.py)."""
    from transformers import SiglipConfig

    shape = dict(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                 num_attention_heads=width // 64)
    return SiglipConfig(
        text_config=dict(shape, max_position_embeddings=64, vocab_size=vocab, pad_token_id=1, bos_token_id=None,
                         eos_token_id=1),
        vision_config=dict(shape, image_size=224, patch_size=16, **({"patch_dropout": patch_dropout}
                                                                   if patch_dropout else {})))


def train_flops(config) -> int:
    """Matmul FLOPs of one training sample (3 x forward), the kept tokens counted."""
    return 3 * (vision_flops(config.vision_config).total + text_flops(config.text_config).total)


def measured_activations(config, p: float, samples: int = 4) -> dict:
    """Bytes per sample saved for backward by a real training forward on this CPU (fp32)."""
    torch.manual_seed(0)
    model = new_dual_encoder(config).train()
    apply_patch_dropout(model, p)
    pixels = torch.randint(0, 256, (samples, 3, 224, 224), dtype=torch.uint8)
    ids = torch.randint(0, config.text_config.vocab_size, (samples, 64))
    params = list(model.parameters())
    return {"vision": saved_bytes(lambda: model.vision_model(pixel_values=pixels.float() / 127.5 - 1), params)
            // samples,
            "both": saved_bytes(lambda: model(pixels, ids), params) // samples}


def one_run(p: float, steps: int, tail: int, args, data: dict, tokenizer, out_dir: Path) -> dict | None:
    """A Trainer run at patch dropout p -> its row on rank 0 (None elsewhere)."""
    run = load_config(None, [
        "profile=zero2", "precision=fp32", f"steps={steps}", "seed=0", f"output_dir={out_dir}",
        f"model.patch_dropout={p}", f"model.patch_dropout_off_last_steps={tail if p else 0}",
        f"model.tokenizer={data['tokenizer']}", f"data.train_shards={data['train_pattern']}", "data.num_workers=1",
        "data.shuffle_buffer=256", f"batch.micro_batch_size={args.micro}", "optim.lr=1e-3", "optim.warmup_steps=5",
        "optim.weight_decay=0.05", f"eval.every={steps}", f"eval.zero_shot_dir={data['zero_shot_dir']}",
        f"eval.retrieval_json={data['retrieval_json']}", "checkpoint.at_end=false", "checkpoint.every=0",
        "logging.progress=plain", f"logging.log_every={steps}", "checkpoint.overwrite=true"])
    model = new_dual_encoder(cut_config(args.width, args.layers, len(tokenizer)), "siglip", seed=0)
    bundle = ModelBundle(model, tokenizer, 224, IMAGE_MEAN, IMAGE_STD, 64,
                         ModelSource("preset", f"git-rsclip-base cut to {args.width} wide, {args.layers} layers"))
    marks: dict[int, float] = {}

    def clock(step: int, engine) -> None:   # runs before the evaluation hook: evaluation is not timed
        marks[step] = time.perf_counter()

    with Trainer(run, model=bundle, hooks=[clock]) as trainer:
        summary = trainer.train()
    if dist.get_rank() != 0:
        return None
    masked = steps - (tail if p else 0)   # the last masked step
    global_batch = summary["global_batch"]
    evals = {e["step"]: e for e in summary["evals"]}
    last = evals[steps]
    return {"patch_dropout": p, "steps": steps, "masked_steps": masked if p else 0, "global_batch": global_batch,
            "samples_per_s": global_batch * (masked - 1) / (marks[masked] - marks[1]),
            "losses": summary["losses"], "final_train_loss": sum(summary["losses"][-3:]) / 3,
            "zero_shot_top1": last["zero_shot/top1"], "retrieval_mean_recall": last["retrieval/mean_recall"],
            "chance_zero_shot_top1": evals[0]["zero_shot/top1"]}


def print_table(report: dict) -> None:
    for r in report["rows"]:
        print(f"p {r['patch_dropout']:<4} {r['samples_per_s_ratio']:.2f}x samples/s ({r['samples_per_s']:.1f}), "
              f"activations {r['activation_ratio']:.2f}x measured / {r['planned_activation_ratio']:.2f}x planned, "
              f"{r['steps']} steps at equal compute: zero-shot {100 * r['zero_shot_top1']:.1f}%, recall "
              f"{100 * r['retrieval_mean_recall']:.1f}%, loss {r['final_train_loss']:.3f}")


def parse_args(argv=None):
    parser = base_parser(__doc__, out=RESULTS)
    parser.add_argument("--data", type=Path, default=Path("runs/bench_data"),
                        help="where the synthetic shards are written (reused when present) and the runs write")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of the p = 0 run")
    parser.add_argument("--tail", type=int, default=3, help="unmasked last steps of the masked runs")
    parser.add_argument("--micro", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--layers", type=int, default=2)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    with process_group(args.threads) as info:
        say, t0 = rank0_print(info.rank), time.perf_counter()
        data = synthetic_data(args.data, info.rank, num_train=2048, num_val=128, shard_size=256, image_size=224,
                              eval_layout=True)
        tokenizer = load_tokenizer(Path(data["tokenizer"]))
        configs = {p: cut_config(args.width, args.layers, len(tokenizer), p) for p in CASES}
        flops = {p: train_flops(c) for p, c in configs.items()}
        rows = []
        for p in CASES:
            # equal matmul FLOPs: masked steps x F_p + tail x F_0 = steps x F_0
            steps = args.steps if not p else round((args.steps - args.tail) * flops[0.0] / flops[p]) + args.tail
            row = one_run(p, steps, args.tail, args, data, tokenizer, args.data / f"patch_dropout_{p}")
            if row is not None:
                planned = activation_bytes_per_sample(configs[p], "fp32")
                row.update(train_flops_per_sample=flops[p], measured_activation_bytes=measured_activations(configs[p], p),
                           planned_activation_bytes=planned)
                rows.append(row)
                say(f"p {p}: {steps} steps, {row['samples_per_s']:.1f} samples/s, zero-shot "
                    f"{100 * row['zero_shot_top1']:.1f}%, {time.perf_counter() - t0:.0f} s so far")
            dist.barrier()
        base = rows[0] if rows else None
        for r in rows:
            r.update(samples_per_s_ratio=r["samples_per_s"] / base["samples_per_s"],
                     flops_ratio=base["train_flops_per_sample"] / r["train_flops_per_sample"],
                     activation_ratio=base["measured_activation_bytes"]["both"] / r["measured_activation_bytes"]["both"],
                     planned_activation_ratio=sum(base["planned_activation_bytes"].values())
                     / sum(r["planned_activation_bytes"].values()))
        report = {"config": {"model": f"git-rsclip-base shape, width {args.width}, {args.layers} layers per tower, "
                                      "224 px / 16 px patches (196 tokens), 64 text tokens",
                             "cases": list(CASES), "steps_p0": args.steps, "tail": args.tail, "micro": args.micro,
                             "profile": "zero2", "precision": "fp32", "data": "synthetic 224 px, 2048 train, 128 val"},
                  "environment": environment(args.threads), "rows": rows, "seconds": time.perf_counter() - t0}
        finish(report, args.out, info.rank, print_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

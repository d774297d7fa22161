"""Distillation's cost per step: samples/s and seconds per step with and without a teacher.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module benchmarks.throughput.distill \\
        --out benchmarks/results/distill.json

The student is git-rsclip-base's shape (224 px images in 16 px patches, 64 text tokens, head dim 64)
cut in width (384) and depth (2 layers per tower) to train on 2 CPU cores; the teacher is
git-rsclip-large's (256 px, 16 px patches) cut to 512 wide and 3 layers per tower: about 2.5x the
student's parameters, its forward about as many FLOPs as the student's training step. The teacher
is a saved Hugging Face folder (`distill.teacher=FOLDER`, as users point at Git-RSCLIP), in its
'auto' dtype (fp32 on CPU ranks), replicated. Every run is `rsclip-ds train`'s Trainer (the `model=`
seam brings the cut student) on synthetic 256 px shards, `zero2`, fp32, micro x 2 micro-batches
per step, 'plain' and 'global' accumulation; the four cases run in turn within each repeat
(interleaved), and the ratios are paired within a repeat, so a load change on the shared machine
moves both sides of a ratio.

  samples/s       global samples/s over steps 2..steps, from a step hook's clock
  s/step          seconds per optimizer step over the same steps
  ratio           samples/s with the teacher / without, per accumulation, paired per repeat
  planned ratio   matmul FLOPs per sample without / with the teacher (planning/flops.py's count:
                  3 x the student's forward, + 1 for 'global''s cached pass; + the teacher's forward)
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch.distributed as dist

from benchmarks.harness import base_parser, environment, finish, process_group, rank0_print, synthetic_data
from benchmarks.throughput.patch_dropout import cut_config
from rsclip_ds.config import load_config
from rsclip_ds.hub import ModelSource
from rsclip_ds.model import IMAGE_MEAN, IMAGE_STD, ModelBundle, load_tokenizer, new_dual_encoder, save_pretrained
from rsclip_ds.planning.flops import flops_per_sample
from rsclip_ds.trainer import Trainer

RESULTS = Path(__file__).resolve().parents[1] / "results" / "distill.json"
CASES = [(acc, teacher) for acc in ("plain", "global") for teacher in (False, True)]


def teacher_config(width: int, layers: int, vocab: int):
    """git-rsclip-large's image shape (256 px, 16 px patches) at `width` and `layers`."""
    config = cut_config(width, layers, vocab)
    config.vision_config.image_size = 256
    return config


def teacher_folder(root: Path, rank: int, args, tokenizer) -> Path:
    """The teacher as a Hugging Face folder, written by rank 0 (random weights: cost only)."""
    folder = root / f"distill_teacher_{args.teacher_width}w{args.teacher_layers}l"
    if rank == 0 and not (folder / "config.json").is_file():
        model = new_dual_encoder(teacher_config(args.teacher_width, args.teacher_layers, len(tokenizer)), seed=7)
        save_pretrained(model, tokenizer, folder)
    dist.barrier()
    return folder


def one_run(accumulation: str, teacher: Path | None, args, data: dict, tokenizer, out_dir: Path) -> dict | None:
    run = load_config(None, [
        "profile=zero2", "precision=fp32", f"steps={args.steps}", "seed=0", f"output_dir={out_dir}",
        f"model.tokenizer={data['tokenizer']}", f"data.train_shards={data['train_pattern']}", "data.num_workers=1",
        "data.shuffle_buffer=64", f"batch.micro_batch_size={args.micro}", "batch.gradient_accumulation_steps=2",
        f"batch.accumulation={accumulation}", "optim.warmup_steps=1", "checkpoint.at_end=false",
        "checkpoint.every=0", "checkpoint.overwrite=true", "logging.progress=plain", f"logging.log_every={args.steps}",
        *([f"distill.teacher={teacher}"] if teacher else [])])
    model = new_dual_encoder(cut_config(args.width, args.layers, len(tokenizer)), "siglip", seed=0)
    bundle = ModelBundle(model, tokenizer, 224, IMAGE_MEAN, IMAGE_STD, 64,
                         ModelSource("preset", f"git-rsclip-base cut to {args.width} wide, {args.layers} layers"))
    marks: dict[int, float] = {}

    def clock(step: int, engine) -> None:
        marks[step] = time.perf_counter()

    with Trainer(run, model=bundle, hooks=[clock]) as trainer:
        summary = trainer.train()
    if dist.get_rank() != 0:
        return None
    seconds = (marks[args.steps] - marks[1]) / (args.steps - 1)
    return {"accumulation": accumulation, "teacher": teacher is not None, "global_batch": summary["global_batch"],
            "seconds_per_step": seconds, "samples_per_s": summary["global_batch"] / seconds,
            "losses": summary["losses"]}


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarise(runs: list[dict], flops: dict) -> dict:
    cases = {}
    for acc, teacher in CASES:
        mine = [r for r in runs if (r["accumulation"], r["teacher"]) == (acc, teacher)]
        cases[f"{acc}, {'teacher' if teacher else 'no teacher'}"] = {
            "samples_per_s": _spread([r["samples_per_s"] for r in mine]),
            "seconds_per_step": _spread([r["seconds_per_step"] for r in mine])}
    ratios = {}
    for acc in ("plain", "global"):
        off = [r for r in runs if r["accumulation"] == acc and not r["teacher"]]
        on = [r for r in runs if r["accumulation"] == acc and r["teacher"]]
        student = (3 + (acc == "global")) * flops["student_forward"]   # 'global': one more forward
        ratios[acc] = {**_spread([b["samples_per_s"] / a["samples_per_s"] for a, b in zip(off, on)]),
                       "planned": student / (student + flops["teacher_forward"])}
    return {"cases": cases, "ratios": ratios}


def print_table(report: dict) -> None:
    if report.get("preliminary"):
        print(f"PRELIMINARY: {report['preliminary']}")
    for name, c in report["summary"]["cases"].items():
        s = c["samples_per_s"]
        print(f"{name:<22} {s['median']:.2f} samples/s ({s['min']:.2f}..{s['max']:.2f}), "
              f"{c['seconds_per_step']['median']:.2f} s/step")
    for acc, r in report["summary"]["ratios"].items():
        print(f"{acc}: teacher / none {r['median']:.2f} ({r['min']:.2f}..{r['max']:.2f}), planned {r['planned']:.2f}")


def parse_args(argv=None):
    parser = base_parser(__doc__, out=RESULTS)
    parser.add_argument("--data", type=Path, default=Path("runs/bench_data"),
                        help="where the synthetic shards and the teacher folder are written (reused when present)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run (timed: 2..steps)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the four cases")
    parser.add_argument("--micro", type=int, default=4, help="samples per rank per micro-batch (2 per step)")
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--teacher-width", type=int, default=512)
    parser.add_argument("--teacher-layers", type=int, default=3)
    parser.add_argument("--preliminary", default="",
                        help="a note that marks the JSON as preliminary (a smoke run on a shared machine)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    with process_group(args.threads) as info:
        say, t0 = rank0_print(info.rank), time.perf_counter()
        data = synthetic_data(args.data, info.rank, num_train=512, num_val=32, shard_size=128, image_size=256)
        tokenizer = load_tokenizer(Path(data["tokenizer"]))
        folder = teacher_folder(args.data, info.rank, args, tokenizer)
        student = cut_config(args.width, args.layers, len(tokenizer))
        teacher = teacher_config(args.teacher_width, args.teacher_layers, len(tokenizer))
        flops = {"student_forward": flops_per_sample(student).forward, "teacher_forward": flops_per_sample(teacher).forward}
        params = {name: sum(p.numel() for p in new_dual_encoder(c).parameters())
                  for name, c in (("student", student), ("teacher", teacher))}
        runs = []
        for repeat in range(args.repeats):
            for acc, with_teacher in CASES:
                row = one_run(acc, folder if with_teacher else None, args, data, tokenizer, args.data / "distill_run")
                if row is not None:
                    runs.append({**row, "repeat": repeat})
                    say(f"repeat {repeat} {acc} teacher={with_teacher}: {row['samples_per_s']:.2f} samples/s, "
                        f"{time.perf_counter() - t0:.0f} s so far")
                dist.barrier()
        report = {"config": {"student": f"git-rsclip-base shape, width {args.width}, {args.layers} layers per tower, "
                                        "224 px / 16 px patches, 64 text tokens",
                             "teacher": f"git-rsclip-large image shape, width {args.teacher_width}, "
                                        f"{args.teacher_layers} layers per tower, 256 px / 16 px patches, fp32, "
                                        "replicated",
                             "parameters": params, "forward_flops_per_sample": flops, "steps": args.steps,
                             "repeats": args.repeats, "micro": args.micro, "accumulation_steps": 2,
                             "profile": "zero2", "precision": "fp32", "data": "synthetic 256 px, 512 train"},
                  "environment": environment(args.threads), "runs": runs,
                  "summary": summarise(runs, flops) if runs else {}, "seconds": time.perf_counter() - t0}
        if args.preliminary:
            report["preliminary"] = args.preliminary
        finish(report, args.out, info.rank, print_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

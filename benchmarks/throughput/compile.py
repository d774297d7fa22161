"""Eager against compiled (compile.enabled) per ZeRO profile: samples/s, compile seconds, losses.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module benchmarks.throughput.compile \\
        --out benchmarks/results/compile.json    # est. 15-25 min on 2 idle cores; --quick ~5

The model is git-rsclip-base's shape -- 224 px images in 16 px patches (196 tokens), head dim 64,
64 text tokens, its 32,000-token vocabulary -- cut in width (384) and depth (2 layers per tower)
to train on 2 CPU cores. Every run is `rsclip-ds train`'s Trainer (the `model=` seam brings the
cut model, the `loader=` seam a few fixed-shape micro-batches held in memory, cycled: the loader's
work stays out of the comparison); compile.enabled and compile.backend are set as users set them.
Per profile, eager and compiled runs alternate (`--repeats` pairs, eager first): the ratio is
compiled / eager samples/s of each pair, so a load change on the machine touches both sides.
torch.compile's caches are emptied before each compiled run (torch._dynamo.reset()), and the
inductor cache directory is fresh per rank at the start: the first pair compiles cold; later
pairs may find inductor's on-disk FX-graph cache warm (their compile seconds say so).

  samples/s     global samples/s over steps 2..N, from a step hook's clock
  compile s     compiled first step minus its mean later step (what the start-up line says)
  loss diff     largest |compiled - eager| / |eager| over the steps of a pair (same seed, same batches)
A profile the config check refuses (ZeRO-3) is a row with the reason, as the Trainer says it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.harness import base_parser, environment, finish, process_group, rank0_print
from benchmarks.throughput.patch_dropout import cut_config
from rsclip_ds.config import ConfigError, load_config
from rsclip_ds.hub import ModelSource
from rsclip_ds.model import IMAGE_MEAN, IMAGE_STD, ModelBundle, new_dual_encoder
from rsclip_ds.trainer import Trainer, check_run

RESULTS = Path(__file__).resolve().parents[1] / "results" / "compile.json"
VOCAB = 32000


def batches(micro: int, rank: int, distinct: int = 4):
    """`distinct` fixed-shape micro-batches of this rank, cycled (uint8 pixels, as the loader sends)."""
    g = torch.Generator().manual_seed(1000 + rank)
    held = [{"pixel_values": torch.randint(0, 256, (micro, 3, 224, 224), dtype=torch.uint8, generator=g),
             "input_ids": torch.randint(0, VOCAB, (micro, 64), generator=g)} for _ in range(distinct)]
    while True:
        yield from held


def one_run(profile: str, compiled: bool, args, out_dir: Path) -> dict:
    """A Trainer run -> {samples_per_s, first_step_s, compile, losses} (the same on every rank)."""
    run = load_config(None, [
        f"profile={profile}", f"precision={args.precision}", f"steps={args.steps}", "seed=0", f"output_dir={out_dir}",
        f"batch.micro_batch_size={args.micro}", "optim.lr=1e-3", "optim.warmup_steps=2", "checkpoint.at_end=false",
        "checkpoint.every=0", "checkpoint.overwrite=true", "logging.progress=plain", f"logging.log_every={args.steps}",
        f"compile.enabled={str(compiled).lower()}", f"compile.backend={args.backend}"])
    model = new_dual_encoder(cut_config(args.width, args.layers, VOCAB), "siglip", seed=0)
    bundle = ModelBundle(model, None, 224, IMAGE_MEAN, IMAGE_STD, 64,
                         ModelSource("preset", f"git-rsclip-base cut to {args.width} wide, {args.layers} layers"))
    marks: dict[int, float] = {}

    def clock(step: int, engine) -> None:
        marks[step] = time.perf_counter()

    if compiled:
        torch._dynamo.reset()   # a fresh module: compile from nothing, not from the last run's guards
    with Trainer(run, model=bundle, loader=batches(args.micro, dist.get_rank()), hooks=[clock]) as trainer:
        summary = trainer.train()
        global_batch = trainer.parts.batch.global_batch
    row = {"samples_per_s": global_batch * (args.steps - 1) / (marks[args.steps] - marks[1]),
           "first_step_s": trainer.startup["first_step"], "global_batch": global_batch}
    if summary is not None:
        row.update(losses=summary["losses"], compile=summary.get("compile"))
    return row


def profile_row(profile: str, args, say) -> dict:
    """Eager and compiled runs of one profile, alternating; or the refusal."""
    try:
        check_run(load_config(None, [f"profile={profile}", "compile.enabled=true", f"compile.backend={args.backend}",
                                     f"batch.micro_batch_size={args.micro}"]), shards=False)   # the Trainer's check
    except ConfigError as err:
        say(f"{profile}: refused: {err}")
        return {"profile": profile, "status": "refused", "reason": str(err)}
    pairs = []
    for k in range(args.repeats):
        pair = {}
        for compiled in (False, True):
            pair["compiled" if compiled else "eager"] = one_run(profile, compiled, args,
                                                               args.data / f"compile_{profile}_{k}_{int(compiled)}")
            dist.barrier()
        e, c = pair["eager"], pair["compiled"]
        pair["ratio"] = c["samples_per_s"] / e["samples_per_s"]
        if "losses" in e:
            pair["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(c["losses"], e["losses"]))
            say(f"{profile} pair {k + 1}: eager {e['samples_per_s']:.2f} samples/s, compiled "
                f"{c['samples_per_s']:.2f} ({pair['ratio']:.2f}x), compile {c['compile']['compile_s']:.1f} s, "
                f"loss diff {pair['loss_max_rel_diff']:.1e}")
        pairs.append(pair)
    ratios = sorted(p["ratio"] for p in pairs)
    return {"profile": profile, "status": "ok", "pairs": pairs, "ratio_median": ratios[len(ratios) // 2],
            "eager_samples_per_s": [p["eager"]["samples_per_s"] for p in pairs],
            "compiled_samples_per_s": [p["compiled"]["samples_per_s"] for p in pairs],
            "compile_s": [p["compiled"].get("compile", {}).get("compile_s") for p in pairs],
            "loss_max_rel_diff": max(p.get("loss_max_rel_diff", 0.0) for p in pairs)}


def print_table(report: dict) -> None:
    for r in report["rows"]:
        if r["status"] == "refused":
            print(f"{r['profile']:<6} refused: {r['reason']}")
            continue
        print(f"{r['profile']:<6} compiled/eager {r['ratio_median']:.2f}x samples/s (eager "
              f"{', '.join(f'{v:.2f}' for v in r['eager_samples_per_s'])}; compiled "
              f"{', '.join(f'{v:.2f}' for v in r['compiled_samples_per_s'])}), compile "
              f"{', '.join(f'{v:.0f}' for v in r['compile_s'])} s, loss diff {r['loss_max_rel_diff']:.1e}")


def parse_args(argv=None):
    parser = base_parser(__doc__, out=RESULTS)
    parser.add_argument("--data", type=Path, default=Path("runs/bench_compile"), help="where the runs write")
    parser.add_argument("--profiles", nargs="+", default=None, help="default zero1 zero2 zero3 (--quick: zero2 zero3)")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="eager/compiled pairs per profile")
    parser.add_argument("--micro", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="one pair of 8 steps, zero2 compiled, zero3's refusal "
                        "(~5 min on 2 idle cores: the cold inductor compile is most of it)")
    parser.add_argument("--note", default="", help="recorded in the JSON (e.g. 'smoke: machine shared')")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 8, 1
    args.profiles = args.profiles or (["zero2", "zero3"] if args.quick else ["zero1", "zero2", "zero3"])
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    with process_group(args.threads) as info:
        # cold compiles: a fresh inductor cache per rank (inductor reads the variable when it caches)
        cache = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"rsclip_inductor_{info.rank}_")
        say, t0 = rank0_print(info.rank), time.perf_counter()
        try:
            rows = [profile_row(p, args, say) for p in args.profiles]
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        report = {"config": {"model": f"git-rsclip-base shape, width {args.width}, {args.layers} layers per tower, "
                                      "224 px / 16 px patches (196 tokens), 64 text tokens, 32,000-token vocabulary",
                             "profiles": args.profiles, "backend": args.backend, "precision": args.precision,
                             "steps": args.steps, "repeats": args.repeats, "micro": args.micro, "quick": args.quick,
                             "data": "4 fixed micro-batches per rank held in memory, cycled", "note": args.note},
                  "environment": environment(args.threads), "rows": rows, "seconds": time.perf_counter() - t0}
        finish(report, args.out, info.rank, print_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

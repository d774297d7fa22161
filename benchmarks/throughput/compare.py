"""Throughput of the rsclip_ds training loop against a bare DeepSpeed loop and the HF Trainer.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module benchmarks.throughput.compare --out benchmarks/results/throughput.json
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module benchmarks.throughput.compare --tiny --out /tmp/throughput.json

    python -m benchmarks.throughput.compare --open-clip VENV_DIR --out benchmarks/results/throughput_openclip.json

The last form (--open-clip) is another mode, in benchmarks/throughput/openclip.py: a plain
process that launches open_clip's trainer and `rsclip-ds train` on the same model and data.

Writes the JSON given by --out and a PNG beside it; rank 0 prints the tables. The full run takes
~8 minutes on 2 CPU ranks of a 2-core machine; --tiny ~2 minutes (start-up and engine builds).
The Trainer column uses `accelerate`, which rsclip_ds installs (transformers' DeepSpeed
integration needs it); `--no-trainer` skips that column.

Same model (tiny preset), profile (zero2), precision, synthetic shards, micro-batch, number of
steps and batches (every loop builds a fresh model and loader with the same seeds, so each sees
the same batch sequence) for the loops of throughput_loops.py:
  ours        rsclip_ds.trainer.Trainer: the run as `rsclip-ds train` builds it (global-batch
              SigLIP loss: the product default)
  bare        deepspeed.initialize + forward / loss / backward / step in a for loop, the same
              loss and loader: the floor for our overhead
  trainer     transformers.Trainer with the same DeepSpeed config and loader, compute_loss =
              the per-rank SigLIP loss (what the Trainer computes)
  ours_local  ours with loss.negatives=local: the Trainer's loss, so ours_local / trainer
              compares the loops at equal work
Repeats are interleaved (ours, bare, trainer, ours_local, ours, ...) and every ratio is taken
within one repeat, so the shared machine's slow phases cancel; the report gives medians and the
min..max spread. Rates are global samples/s from the end of the first optimizer step (lazy
init, loader start-up) to the end of the last, on the slowest rank. Targets: ours >= 0.97 x bare,
ours > trainer. Each run also records its per-step losses (mean over ranks) and the samples its
model's forward saw: same model, seed and data, so ours and bare start from the same loss.

Also measured: the loader alone (samples/s it delivers on all ranks at once, against what
training consumes), the time each loop waits in next(batch) (loader stalls), the Python self
time per step spent in each loop's own code (cProfile, one extra run per loop), and quality at
equal compute: held-out retrieval R@1 on the synthetic val split after the same steps with our
global-batch loss against the per-rank loss.
"""

from __future__ import annotations

import cProfile
import gc
import pstats
import statistics
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.harness import (base_parser, environment, finish, max_over_ranks, process_group, rank0_print, shared_run_dir,
                     sum_over_ranks, synthetic_data)
from rsclip_ds.trainer import Trainer
from benchmarks.throughput.loops import LOOPS, Ctx, TimedBatches, loop_ours, run_config
from benchmarks.throughput.report import plot, print_tables

RATIOS = (("ours", "bare"), ("ours", "trainer"), ("ours_local", "trainer"), ("trainer", "bare"))


@dataclass(frozen=True)
class BenchConfig:
    steps: int            # optimizer steps per timed run (the first is not timed)
    repeats: int          # interleaved repeats of every loop
    micro: int            # samples per rank per step
    loader_batches: int   # batches per rank pulled from the loader alone (after the first)
    quality_steps: int    # steps of each run of the quality comparison
    num_train: int        # synthetic training samples
    num_val: int          # synthetic held-out samples (retrieval pool)
    shard_size: int
    profile_steps: int    # steps of the cProfile'd run of each loop


FULL = BenchConfig(steps=30, repeats=5, micro=32, loader_batches=60, quality_steps=150, num_train=4096,
                   num_val=512, shard_size=256, profile_steps=20)
TINY = BenchConfig(steps=4, repeats=1, micro=8, loader_batches=4, quality_steps=4, num_train=256,
                   num_val=32, shard_size=32, profile_steps=3)


# --------------------------------------------------------------------------- timed runs

def run_loop(ctx: Ctx, name: str, steps: int) -> dict:
    dist.barrier()
    m = LOOPS[name](ctx, steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(ctx.threads)   # accelerate sets its own count; never let it leak into the next loop
    gc.collect()
    elapsed, wait = max_over_ranks([m.elapsed, m.data_wait])
    samples, cpu = sum_over_ranks([m.samples, m.cpu])
    timed_samples = ctx.micro * ctx.world * (steps - 1)
    return {"loop": name, "steps": steps, "samples": int(samples), "elapsed_s": elapsed,
            "samples_per_s": timed_samples / elapsed, "data_wait_s": wait,
            "cpu_ms_per_sample": 1e3 * cpu / timed_samples, "data_wait_fraction": wait / elapsed,
            "losses": m.losses, "final_loss": m.losses[-1] if m.losses else None, "threads_at_end": threads}


def summarize(rows: list[dict], loops: list[str]) -> dict:
    """Medians and spread per loop, and ratios paired within each repeat."""
    by = {name: [r for r in rows if r["loop"] == name] for name in loops}
    out = {"loops": {}, "ratios": {}}
    for name, rs in by.items():
        rates = [r["samples_per_s"] for r in rs]
        out["loops"][name] = {"median_samples_per_s": statistics.median(rates), "min": min(rates),
                              "max": max(rates), "runs": len(rates),
                              "median_cpu_ms_per_sample": statistics.median(r["cpu_ms_per_sample"] for r in rs),
                              "median_data_wait_fraction": statistics.median(r["data_wait_fraction"] for r in rs),
                              "samples_per_run": sorted({r["samples"] for r in rs})}
    for num, den in RATIOS:
        if num in by and den in by:
            ratios = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(by[num], by[den])]
            # CPU time per sample: work done, blind to the time a rank sat descheduled on a
            # shared machine (busy-waiting collectives still count); den / num, so > 1 = faster
            cpu = [b["cpu_ms_per_sample"] / a["cpu_ms_per_sample"] for a, b in zip(by[num], by[den])]
            out["ratios"][f"{num}/{den}"] = {"median": statistics.median(ratios), "min": min(ratios),
                                             "max": max(ratios), "per_repeat": ratios,
                                             "cpu_median": statistics.median(cpu), "cpu_per_repeat": cpu}
    return out


def loader_rate(ctx: Ctx, batches: int) -> dict:
    """The Trainer's loader alone, all ranks pulling at once (their workers compete as in
    training); the engine it builds beside it stays idle."""
    with shared_run_dir() as out_dir, Trainer(run_config(ctx, 2, extra=(f"output_dir={out_dir}",))) as trainer:
        loader = TimedBatches(trainer.build().loader)
        dist.barrier()
        next(loader)                      # worker start-up, not counted
        t0 = time.perf_counter()
        for _ in range(batches):
            next(loader)
        elapsed = time.perf_counter() - t0
        loader.close()
    rate, = sum_over_ranks([batches * ctx.micro / elapsed])
    return {"batches_per_rank": batches, "samples_per_s": rate}


def summary_rate_with_checkpoint(ctx: Ctx, steps: int) -> dict:
    """`ours` as users run it by default (checkpoint.at_end=true): the summary's samples/s
    (which leaves the saves out) against the step-hook rate of the same run."""
    dist.barrier()
    m = loop_ours(ctx, steps, overrides=("checkpoint.at_end=true",))
    steps_rate = ctx.micro * ctx.world * (steps - 1) / max_over_ranks([m.elapsed])[0]
    reported = m.extra["summary_samples_per_s"]   # rank 0's own clock, as the summary says
    return {"steps": steps, "step_hook_samples_per_s": steps_rate, "summary_samples_per_s": reported,
            "summary_over_steps": reported / steps_rate if reported else None,
            "checkpoints": m.extra["checkpoints"]}


# --------------------------------------------------------------------------- Python time per step

# The loop's own code (not the model, the loss or DeepSpeed, which all loops run alike).
# The loader's main-process side (rsclip_ds/data/) runs in every loop alike: reported apart.
OWN_CODE = {"ours": ("rsclip_ds/train.py", "rsclip_ds/trainer.py", "rsclip_ds/reporting/", "rsclip_ds/engine.py",
                     "rsclip_ds/runtime/distributed.py", "rsclip_ds/checkpoint.py"),
            "bare": ("benchmarks/throughput/loops.py",),
            "trainer": ("transformers/trainer", "transformers/integrations/deepspeed", "transformers/training_args",
                        "accelerate/")}
LOADER_CODE = "rsclip_ds/data/"


def profiled(ctx: Ctx, name: str, steps: int) -> dict:
    """Run a loop under cProfile on every rank (the step loop only); -> per-step self time
    (tottime) of functions whose file path contains one of OWN_CODE[name] (the framework's own
    code, outside torch/deepspeed), and the top such functions. Self time: what removing Python
    work in the hot path can save."""
    prof, own = cProfile.Profile(), OWN_CODE[name]
    dist.barrier()
    torch.manual_seed(0)
    LOOPS[name](replace(ctx, profiler=prof), steps)
    rows, loader = [], 0.0
    for (path, line, func), (_cc, _nc, tottime, _ct, _callers) in pstats.Stats(prof).stats.items():
        if any(o in path for o in own):
            rows.append((tottime, f"{Path(path).parent.name}/{Path(path).name}:{line}:{func}"))
        if LOADER_CODE in path:
            loader += tottime
    rows.sort(reverse=True)
    total, loader = max_over_ranks([sum(t for t, _ in rows), loader])
    gc.collect()
    return {"loop": name, "steps": steps, "own_code": list(own), "self_ms_per_step": 1e3 * total / steps,
            "loader_main_process_ms_per_step": 1e3 * loader / steps,
            "top": [{"function": f, "ms_per_step": 1e3 * t / steps} for t, f in rows[:6]]}


# --------------------------------------------------------------------------- quality

def read_val(urls: list[str], bundle) -> tuple[torch.Tensor, torch.Tensor]:
    """The val shards in key order -> uint8 pixel_values (N,3,S,S), input_ids (N,L), through the
    training transform with augmentation off (what evaluation uses; the model normalises)."""
    from rsclip_ds.data.tokenizer import tokenize
    from rsclip_ds.evaluation.embed import eval_transform, uint8_batch

    samples: dict[str, dict] = {}
    for url in urls:
        with tarfile.open(url) as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                if ext in ("jpg", "txt"):
                    samples.setdefault(key, {})[ext] = tar.extractfile(member).read()
    keys = sorted(samples)
    pixels = uint8_batch(eval_transform(bundle), [samples[k]["jpg"] for k in keys])         # (N,3,S,S) u8
    captions = [samples[k]["txt"].decode().strip() for k in keys]
    return pixels, tokenize(bundle.tokenizer, captions, bundle.max_text_length)             # (N,L)


def retrieval(module, pixels: torch.Tensor, ids: torch.Tensor) -> dict:
    from rsclip_ds.evaluation.metrics import retrieval_metrics

    module.eval()
    with torch.no_grad():
        image, text, _, _ = module(pixels, ids)                                       # (N, D) x2
    module.train()
    m = retrieval_metrics(image, text, torch.arange(len(image)))   # one caption per val image
    return {k: m[k] for k in ("i2t_R@1", "t2i_R@1", "i2t_R@5", "t2i_R@5", "mean_recall", "num_images")}


def quality(ctx: Ctx, steps: int) -> list[dict]:
    """Ours with the global-batch loss and with the per-rank loss, same steps and data; each
    rank evaluates the final model (ZeRO-1/2 keep all of it on every rank) on the val split."""
    rows, val = [], {}

    def evaluate(engine, bundle):
        if not val:
            val["pixels"], val["ids"] = read_val(ctx.data["val_urls"], bundle)
        return retrieval(engine.module, val["pixels"].to(engine.device), val["ids"].to(engine.device))

    for negatives in ("global", "local"):
        dist.barrier()
        m = loop_ours(ctx, steps, negatives=negatives, final_hook=evaluate)
        rows.append({"negatives": negatives, "steps": steps, "global_batch": ctx.micro * ctx.world,
                     "final_train_loss": m.losses[-1] if m.losses else None,
                     **{k: v for k, v in m.extra.items() if k not in ("summary_samples_per_s", "checkpoints")}})
        gc.collect()
    return rows


# --------------------------------------------------------------------------- entry point

def wants_open_clip(argv: list[str]) -> bool:
    """--open-clip VENV hands the whole command to benchmarks.throughput.openclip (its own flags)."""
    return any(a == "--open-clip" or a.startswith("--open-clip=") for a in argv)


def parse_args(argv):
    if wants_open_clip(argv):
        from benchmarks.throughput.openclip import parse_args as openclip_args

        return openclip_args(argv)
    parser = base_parser(__doc__, tiny=True)
    parser.add_argument("--data", type=Path, default=Path("runs/bench_data"),
                        help="where the synthetic shards are written (reused when present)")
    parser.add_argument("--profile", default="zero2", help="ds_profiles/ name")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--repeats", type=int, default=None, help="override the interleaved repeats")
    parser.add_argument("--steps", type=int, default=None, help="override the steps per timed run")
    parser.add_argument("--skip-quality", action="store_true", help="throughput only")
    parser.add_argument("--no-trainer", action="store_true", help="leave out the Hugging Face Trainer column")
    return parser.parse_args(argv)


def bench_config(args) -> BenchConfig:
    over = {k: v for k, v in (("repeats", args.repeats), ("steps", args.steps)) if v is not None}
    return replace(TINY if args.tiny else FULL, **over)


def loops_to_run(no_trainer: bool) -> tuple[list[str], list[str]]:
    """-> (loop names, notes): the HF Trainer column unless --no-trainer."""
    if no_trainer:
        return [n for n in LOOPS if n != "trainer"], ["--no-trainer: the trainer column is skipped"]
    return list(LOOPS), []


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if wants_open_clip(argv):
        from benchmarks.throughput.openclip import main as openclip_main

        return openclip_main(argv)
    args = parse_args(argv)
    cfg = bench_config(args)
    if not torch.cuda.is_available():
        from rsclip_ds.runtime.host_memory import keep_freed_memory

        keep_freed_memory()   # what `rsclip-ds train` does on CPU ranks; every loop here shares it
    with process_group(args.threads) as info:
        rank, world = info.rank, info.world_size
        say = rank0_print(rank)
        t0 = time.perf_counter()
        data = synthetic_data(args.data, rank, num_train=cfg.num_train, num_val=cfg.num_val,
                              shard_size=cfg.shard_size)
        ctx = Ctx(rank, world, info.on_gpu, data, args.precision, args.profile, cfg.micro, args.threads)
        loops, notes = loops_to_run(args.no_trainer)
        for note in notes:
            say(f"note: {note}")
        rows = []
        for repeat in range(cfg.repeats):
            for name in loops:
                rows.append({"repeat": repeat, **run_loop(ctx, name, cfg.steps)})
                r = rows[-1]
                say(f"repeat {repeat} {name:<10} {r['samples_per_s']:8.1f} samples/s  data wait "
                    f"{100 * r['data_wait_fraction']:.1f}%  ({r['samples']} samples, final loss {r['final_loss']})")
        summary = summarize(rows, loops)
        loader = loader_rate(ctx, cfg.loader_batches)
        loader["headroom_over_ours"] = loader["samples_per_s"] / summary["loops"]["ours"]["median_samples_per_s"]
        say(f"loader alone {loader['samples_per_s']:.0f} samples/s")
        report = {"config": {**asdict(cfg), "tiny": args.tiny, "profile": args.profile,
                             "precision": args.precision, "preset": "tiny", "loops": loops},
                  "environment": environment(args.threads), "runs": rows, "summary": summary, "loader": loader,
                  "summary_rate_with_final_checkpoint": summary_rate_with_checkpoint(ctx, cfg.steps),
                  "python_self_time": [profiled(ctx, name, cfg.profile_steps) for name in OWN_CODE if name in loops],
                  "quality": [] if args.skip_quality else quality(ctx, cfg.quality_steps), "notes": notes}
        report["seconds"] = time.perf_counter() - t0
        finish(report, args.out, rank, print_tables, plot)
        say(f"wrote {args.out} in {report['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

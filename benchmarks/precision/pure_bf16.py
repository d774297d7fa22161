"""The quality cost of bf16 master weights: fp32, bf16 (fp32 masters) and bf16 masters at equal steps.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module benchmarks.precision.pure_bf16 --out benchmarks/results/pure_bf16.json
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module benchmarks.precision.pure_bf16 --tiny --out /tmp/pure_bf16.json

Three modes of one run, the demo's (configs/tiny_demo.yaml: tiny preset, ZeRO-2, micro 32 per
rank, AdamW at lr 1e-3 with 5 warmup steps and a cosine to 0), same seed, same data, same steps:
  fp32          precision=fp32: the reference
  bf16          precision=bf16: bf16 weights, activations and gradients, fp32 master weights and
                AdamW states (DeepSpeed's mixed precision; the default)
  bf16_masters  precision=bf16 + bf16.master_weights=bf16: no fp32 copy (open_clip's pure_bf16)
Each run is `rsclip_ds.trainer.Trainer` as `rsclip-ds train` builds it, with the product's
evaluation after the last step (eval.every) on the synthetic held-out split (make_synthetic's
eval layout): retrieval recall (several captions per image; R@1, R@5, mean recall over i2t/t2i
R@1/5/10) and zero-shot land-cover top-1. Per mode and seed the report gives those, the final
train loss (mean of the last 10 steps), samples/s (the summary's: global, after step 1), and what
rounding did to the masters (read with deepspeed.utils.safe_get_full_fp32_param, whatever their
dtype): the fraction of trainable elements whose master ended where it started, the tensors that
never moved, and the final logit scale and bias. Then the mean over seeds per mode.

Full: 300 steps x 3 modes x seeds 0-3 (~8 minutes on 2 CPU ranks of 2 cores); --tiny: 6 steps,
micro 8, one seed (~1 minute, used by tests/integration/test_benchmark_pure_bf16.py). Writes the
JSON given by --out and a PNG beside it; rank 0 prints the table. Measured here: docs/guides/precision.md.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from benchmarks.harness import (ROOT, base_parser, environment, finish, process_group, pyplot, rank0_print, save_figure,
                     synthetic_data)
from rsclip_ds.config import load_config
from rsclip_ds.profiles import load_profile
from rsclip_ds.trainer import Trainer

DEMO = ROOT / "configs" / "tiny_demo.yaml"
MODES = {"fp32": ("precision=fp32",),
         "bf16": ("precision=bf16",),
         "bf16_masters": ("precision=bf16", "bf16.master_weights=bf16")}
METRICS = ("retrieval/i2t_R@1", "retrieval/t2i_R@1", "retrieval/i2t_R@5", "retrieval/t2i_R@5",
           "retrieval/mean_recall", "zero_shot/top1", "final_train_loss", "samples_per_s", "unchanged_fraction")


@dataclass(frozen=True)
class BenchConfig:
    steps: int          # optimizer steps of every run
    micro: int          # samples per rank per step
    seeds: tuple[int, ...]
    num_train: int      # synthetic training samples
    num_val: int        # held-out images (evaluation)
    shard_size: int


FULL = BenchConfig(steps=300, micro=32, seeds=(0, 1, 2, 3), num_train=4096, num_val=512, shard_size=256)
TINY = BenchConfig(steps=6, micro=8, seeds=(0,), num_train=256, num_val=32, shard_size=32)


# --------------------------------------------------------------------------- one run

class MasterWatch:
    """A Trainer hook: the trainable masters before the first step and after the last; -> which
    elements rounding (or a zero gradient) left where they started. safe_get_full_fp32_param
    returns them in fp32 whatever they are held in; the held dtype is the ZeRO optimizer's."""

    def __init__(self, steps: int):
        self.steps, self.start, self.end, self.names, self.dtype = steps, None, None, [], None

    def __call__(self, step: int, engine):
        if step in (0, self.steps):
            from deepspeed.utils import safe_get_full_fp32_param

            named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
            self.names = [n for n, _ in named]
            values = [safe_get_full_fp32_param(p).detach().clone() for _, p in named]   # collective at ZeRO-3
            if step == 0:
                self.start, self.dtype = values, master_dtype(engine.optimizer)
            else:
                self.end = values
        return None

    def report(self) -> dict:
        same = [int((a == b).sum()) for a, b in zip(self.start, self.end)]
        total = sum(t.numel() for t in self.start)
        value = dict(zip(self.names, self.end))
        by_kind = {}
        for name, s, t in zip(self.names, same, self.start):
            k = kind(name, t.ndim)
            unchanged, elements = by_kind.get(k, (0, 0))
            by_kind[k] = (unchanged + s, elements + t.numel())
        return {"master_dtype": self.dtype,
                "unchanged_fraction": sum(same) / total,
                "unchanged_by_kind": {k: {"fraction": u / n, "elements": n} for k, (u, n) in sorted(by_kind.items())},
                "unchanged_tensors": [n for n, s, t in zip(self.names, same, self.start) if s == t.numel()],
                "logit_scale": float(value["logit_scale"].float().reshape(-1)[0]),
                "logit_bias": float(value["logit_bias"].float().reshape(-1)[0])}


def kind(name: str, ndim: int) -> str:
    """What a parameter is, for the unchanged-masters breakdown."""
    if name.startswith("logit_"):
        return "logit scale, bias"
    if "layer_norm" in name or "layernorm" in name:
        return "norm gains" if name.endswith("weight") else "norm biases"   # 1 and 0 at init
    if "embedding" in name:
        return "embeddings"
    return "other matrices" if ndim >= 2 else "other vectors"


def master_dtype(optimizer) -> str:
    """The dtype of the ZeRO optimizer's master partitions (stage 1/2 and 3 name them differently)."""
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        if hasattr(optimizer, name):
            return str(getattr(optimizer, name)[0].dtype).removeprefix("torch.")
    raise AttributeError(f"{type(optimizer).__name__} is not a ZeRO optimizer with master partitions")


def run_mode(mode: str, seed: int, cfg: BenchConfig, data: dict, out_dir: Path, profile: str) -> dict | None:
    """One Trainer run -> its row on rank 0 (None elsewhere)."""
    # bf16 masters with optimizer offload need DeepSpeedCPUAdam (profiles.bf16_master_flags): then
    # every mode gets it, so that the modes differ in precision only
    impl = ("optim.impl=deepspeed",) if load_profile(profile).offload_optimizer else ()
    run = load_config(DEMO, [
        *MODES[mode], *impl, f"profile={profile}", f"seed={seed}", f"steps={cfg.steps}", f"output_dir={out_dir}",
        f"optim.warmup_steps={min(5, cfg.steps - 1)}", f"batch.micro_batch_size={cfg.micro}",
        f"model.tokenizer={data['tokenizer']}", f"data.train_shards={data['train_pattern']}",
        f"eval.every={cfg.steps}", f"eval.retrieval_json={data['retrieval_json']}",
        f"eval.zero_shot_dir={data['zero_shot_dir']}", "checkpoint.at_end=false", "logging.progress=plain",
        f"logging.log_every={max(1, cfg.steps // 6)}"])
    watch = MasterWatch(cfg.steps)
    with Trainer(run, hooks=[watch]) as trainer:
        summary = trainer.train()
    if dist.get_rank() != 0:
        return None
    evals = {e["step"]: {k: v for k, v in e.items() if k != "step"} for e in summary["evals"]}   # flat metrics
    losses = summary["losses"]
    return {"mode": mode, "seed": seed, "steps": cfg.steps, "precision": run.precision,
            "master_weights": run.bf16.master_weights if run.precision == "bf16" else "fp32",
            "losses": losses, "final_train_loss": statistics.mean(losses[-10:]),
            "samples_per_s": summary["samples_per_s"], **evals[cfg.steps], "chance": evals[0], **watch.report()}


def mode_means(rows: list[dict]) -> dict:
    """Per mode: the mean over seeds of every METRICS number, and its spread (max - min)."""
    out = {}
    for mode in MODES:
        rs = [r for r in rows if r["mode"] == mode]
        out[mode] = {m: statistics.mean(r[m] for r in rs) for m in METRICS}
        out[mode]["spread"] = {m: max(r[m] for r in rs) - min(r[m] for r in rs) for m in METRICS}
        out[mode]["seeds"] = [r["seed"] for r in rs]
    return out


# --------------------------------------------------------------------------- report

def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg = report["config"]
    table = Table(title=f"tiny, {cfg['profile']}, {cfg['steps']} steps, micro {cfg['micro']} x "
                        f"{report['environment']['world_size']} ranks, mean over seeds {list(cfg['seeds'])}")
    for col in ("mode", "i2t R@1", "t2i R@1", "i2t R@5", "t2i R@5", "mean recall", "zero-shot top1",
                "final loss", "samples/s", "masters unchanged"):
        table.add_column(col, justify="right")
    for mode, m in report["modes"].items():
        table.add_row(mode, *(f"{100 * m[k]:.1f}" for k in METRICS[:6]), f"{m['final_train_loss']:.3f}",
                      f"{m['samples_per_s']:.0f}", f"{100 * m['unchanged_fraction']:.1f}%")
    Console(width=160).print(table)


def plot(report: dict, path: Path) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4.5))
    seed = report["config"]["seeds"][0]
    window = max(1, report["config"]["steps"] // 30)
    for row in (r for r in report["runs"] if r["seed"] == seed):
        losses = row["losses"]
        smooth = [statistics.mean(losses[max(0, i + 1 - window):i + 1]) for i in range(len(losses))]
        curves.plot(range(1, len(losses) + 1), smooth, label=row["mode"], lw=1)
    curves.set(xlabel="optimizer step", ylabel=f"train loss (SigLIP, mean of {window} steps)", title=f"seed {seed}")
    curves.legend()
    names, modes = ("retrieval/i2t_R@1", "retrieval/t2i_R@1", "retrieval/mean_recall", "zero_shot/top1"), report["modes"]
    width = 0.8 / len(modes)
    for i, (mode, m) in enumerate(modes.items()):
        bars.bar([j + i * width for j in range(len(names))], [100 * m[n] for n in names], width, label=mode,
                 yerr=[100 * m["spread"][n] / 2 for n in names])
    bars.set_xticks([j + width for j in range(len(names))], [n.split("/")[1] for n in names])
    bars.set(ylabel="% (mean over seeds, bar: half the spread)", title="held-out synthetic split")
    bars.legend()
    fig.suptitle(f"fp32 vs bf16 vs bf16 masters, {report['config']['steps']} steps")
    return save_figure(plt, fig, path)


# --------------------------------------------------------------------------- entry point

def parse_args(argv=None) -> argparse.Namespace:
    parser = base_parser(__doc__, tiny=True)
    parser.add_argument("--data", type=Path, default=Path("runs/bench_data"),
                        help="where the synthetic shards are written (reused when present) and the runs write")
    parser.add_argument("--profile", default="zero2", help="ds_profiles/ name (with optimizer offload every mode "
                        "runs DeepSpeedCPUAdam, which bf16 masters need: a JIT build on first use)")
    parser.add_argument("--steps", type=int, default=None, help="override the steps of every run")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = TINY if args.tiny else FULL
    if args.steps:
        cfg = BenchConfig(**{**asdict(cfg), "steps": args.steps})
    with process_group(args.threads) as info:
        say, t0 = rank0_print(info.rank), time.perf_counter()
        data = synthetic_data(args.data, info.rank, num_train=cfg.num_train, num_val=cfg.num_val,
                              shard_size=cfg.shard_size, eval_layout=True)
        runs_dir = args.data / f"pure_bf16_runs{'_tiny' if args.tiny else ''}"
        rows = []
        for seed in cfg.seeds:
            for mode in MODES:
                row = run_mode(mode, seed, cfg, data, runs_dir / f"{mode}-seed{seed}", args.profile)
                if row is not None:
                    rows.append(row)
                    say(f"seed {seed} {mode:<13} mean recall {100 * row['retrieval/mean_recall']:.1f}  zero-shot "
                        f"{100 * row['zero_shot/top1']:.1f}  loss {row['final_train_loss']:.3f}  "
                        f"{row['samples_per_s']:.0f} samples/s  masters unchanged {100 * row['unchanged_fraction']:.1f}%")
                dist.barrier()
        report = {"config": {**asdict(cfg), "tiny": args.tiny, "profile": args.profile, "preset": "tiny",
                             "base_config": "configs/tiny_demo.yaml", "modes": {k: list(v) for k, v in MODES.items()}},
                  "environment": environment(args.threads), "runs": rows,
                  "modes": mode_means(rows) if rows else {}, "seconds": time.perf_counter() - t0}
        finish(report, args.out, info.rank, print_table, plot)
        if info.rank == 0:
            shutil.rmtree(runs_dir, ignore_errors=True)   # the runs' logs and eval JSONs are in the report
        say(f"wrote {args.out} in {report['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Checkpoint bytes per rank against the number of ranks, under ZeRO-3 (where DeepSpeed writes the
client state into every rank's model-state file): the tiny model trained --steps steps on 2 and 3
CPU ranks with `rsclip-ds train`, one checkpoint at the end, its files summed by kind.

    python -m benchmarks.memory.checkpoint_bytes --out benchmarks/results/checkpoint_bytes.json
    python -m benchmarks.memory.checkpoint_bytes --tree /path/to/older/checkout --out /tmp/old.json   # another version

Kinds: DeepSpeed's model-state files (`zero_pp_rank_*_model_states.pt`: the client state, plus
ZeRO-3's small bookkeeping), its optimizer-state shards (`*_optim_states.pt`: the model state
proper), and rsclip_ds's own files (per-rank RNG/data files, the history, the meta, hf/). The
model state splits over the ranks; what grows per rank with the ranks or the steps is overhead.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import ROOT, base_parser, deepspeed_cmd, free_port, synthetic_data, write_report
from benchmarks.results_tables.memory import checkpoint_bytes


def kind(path: Path) -> str:
    name = path.name
    if name.endswith("_model_states.pt"):
        return "deepspeed_model_states"
    if name.endswith("_optim_states.pt"):
        return "deepspeed_optim_states"
    return "rsclip_ds"


def run(tree: Path, data: dict, ranks: int, steps: int, out: Path) -> dict:
    sets = ["profile=zero3", "precision=fp32", f"steps={steps}", "optim.warmup_steps=2", "model.preset=tiny",
            f"model.tokenizer={data['tokenizer']}", f"data.train_shards={data['train_pattern']}",
            "data.num_workers=1", "batch.micro_batch_size=8", "logging.log_every=50", "logging.progress=plain",
            f"output_dir={out}", "checkpoint.every=0", "checkpoint.at_end=true"]
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(tree), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    cmd = deepspeed_cmd() + ["--num_gpus", str(ranks), "--master_port", str(free_port()), "--module", "rsclip_ds",
                             "train"] + [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return {"ranks": ranks, "ok": False, "output_tail": (proc.stdout + proc.stderr)[-3000:]}
    tag, = [p for p in (out / "checkpoints").iterdir() if p.is_dir() and p.name.startswith("step")]
    sizes: dict[str, int] = {}
    for path in tag.rglob("*"):
        if path.is_file():
            sizes[kind(path)] = sizes.get(kind(path), 0) + path.stat().st_size
    model_files = sorted(tag.glob("*_model_states.pt"))
    return {"ranks": ranks, "steps": steps, "ok": True, "bytes": sizes, "total": sum(sizes.values()),
            "model_states_file_bytes": [p.stat().st_size for p in model_files],
            "overhead_per_rank": (sizes.get("deepspeed_model_states", 0) + sizes.get("rsclip_ds", 0)) / ranks}


def print_tables(report: dict) -> None:
    """The results page's table of the runs that worked, then the output of each that failed."""
    print("\n".join(checkpoint_bytes({"checkpoint_bytes.json": report})))
    for r in report["runs"]:
        if not r["ok"]:
            print(f"{r['ranks']} ranks: failed\n{r['output_tail']}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = base_parser(__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tree", type=Path, default=ROOT, help="the rsclip_ds checkout to run (default: this one)")
    parser.add_argument("--data", type=Path, default=Path("runs/bench_data"))
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    data = synthetic_data(args.data.resolve(), num_train=1024, num_val=64, shard_size=128)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            runs.append(run(args.tree.resolve(), data, ranks, args.steps, Path(tmp) / f"w{ranks}"))
            print(f"{ranks} ranks done", file=sys.stderr)
    report = {"config": {"ranks": args.ranks, "steps": args.steps, "tree": str(args.tree)}, "runs": runs,
              "seconds": time.perf_counter() - t0}
    write_report(report, args.out, print_tables)
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

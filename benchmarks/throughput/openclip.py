"""Throughput against open_clip: open_clip's own trainer and `rsclip-ds train` on the same SigLIP
model, shards and settings, each launched the way its users launch it.

    bash benchmarks/throughput/openclip_env.sh runs/openclip-venv          # once: open_clip's own environment
    python -m benchmarks.throughput.openclip --open-clip runs/openclip-venv --out benchmarks/results/throughput_openclip.json
    python -m benchmarks.throughput.openclip --open-clip runs/openclip-venv --tiny --out /tmp/oc.json   # ~90 s

The full run: 7 cases x 3 interleaved repeats of 60 steps, ~25 minutes on 2 idle cores (on a
shared machine add --wait-quiet 1800 --max-foreign 0.1: see parse_args). This is a plain
process; every run is a subprocess, one at a time:
  open_clip   VENV/bin/python -m torch.distributed.run --nproc_per_node 2 benchmarks/throughput/openclip_main.py
              --siglip --precision fp32 | amp_bf16 | pure_bf16 ...  (open_clip_train.main, DDP)
  rsclip_ds   deepspeed --num_gpus 2 --module rsclip_ds train --set profile=zero1 | zero2
              --set precision=fp32 | bf16 ...  (DS_ACCELERATOR=cpu without a GPU)
Same on both sides: the model (benchmarks/throughput/openclip_shapes.py: siglip-20m, 20.05M parameters,
counted on both sides), the shards (128 px JPEG, synthetic), the tokenizer, micro-batch 16 per
rank, global negatives (SigLIP: every rank's images against every rank's texts), AdamW (lr 5e-4,
betas 0.9/0.98, eps 1e-6, weight decay 0.1 on matrices), warmup 10 then cosine, gradient
clipping 1.0, random resized crop (0.9..1.0 of the area), one loader worker and one torch thread
(OMP_NUM_THREADS=1) per rank, a log line every step, no checkpoint, no evaluation. `--style users`
sets no thread variable (each tool's default decides) and keeps both tools' end-of-run checkpoint;
`--peers patch_dropout compile huge_pages` adds each feature on both sides at the same setting
(openclip_cases.py has the cases and both command lines).

Measured per run, from each tool's own log: samples/s over steps skip+1..N (default 6..60),
start-up (launch to the end of step 1: the step-1 log line's arrival), and, from the kernel, the
minor page faults and the system (kernel) CPU time of the whole launched process tree: over the
same steps (/proc/<pid>/stat of every process of the tree, read when the step-`skip` and step-N
lines arrive) and over the whole run (getrusage(RUSAGE_CHILDREN) before and after); the tree's
peak PSS (smaps_rollup of every process, sampled every --pss-interval s); and the share of the
cores other processes took meanwhile (/proc/stat less the tree). Repeats are
interleaved (every case once per repeat); ratios are paired within a repeat (rsclip_ds case / the
open_clip case of the same precision: fp32 / fp32, bf16 / amp_bf16 and bf16 / pure_bf16); the
report gives medians and min..max.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from benchmarks.harness import environment, free_port, synthetic_data, write_report
from benchmarks.throughput.launch_measure import foreign_share, launch, wait_quiet
from benchmarks.throughput.openclip_cases import (KIT, OPENCLIP_MAIN, OPENCLIP_PRECISIONS, PAIRED, PEER_ENV, PEERS,
                                                  RSCLIP_SETS, STYLES, Case, cases, openclip_cmd, openclip_python,
                                                  rsclip_cmd, tool_env)
from benchmarks.throughput.openclip_shapes import SHAPES, write_hf_folder, write_openclip_dir
from benchmarks.throughput.openclip_report import plot, print_tables

SETUP = "bash benchmarks/throughput/openclip_env.sh VENV_DIR"


@dataclass(frozen=True)
class Bench:
    shape: str            # openclip_shapes.SHAPES key
    steps: int            # optimizer steps per run
    repeats: int          # interleaved repeats of every case
    skip: int             # steps 1..skip are left out of the rate (start-up, lazy init, warm caches)
    micro: int            # samples per rank per step
    ranks: int
    workers: int          # loader worker processes per rank
    threads: int          # torch threads per rank (OMP_NUM_THREADS)
    device: str           # "cpu" or "cuda" (open_clip's --device; rsclip_ds: DS_ACCELERATOR=cpu or not)
    num_train: int        # synthetic training samples (>= steps x micro x ranks: no epoch ends in a run)
    shard_size: int
    warmup: int = 10
    lr: float = 5e-4
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    timeout_s: float = 600.0
    pss_interval: float = 2.0   # seconds between samples of the tree's PSS (launch_measure.PeakPss)
    style: str = "harness"  # openclip_cases.STYLES: harness (threads set by the driver) or users (tools' defaults)
    checkpointing: bool = False   # activation checkpointing on both sides (open_clip --grad-checkpointing)


FULL = Bench("siglip-20m", steps=60, repeats=3, skip=5, micro=16, ranks=2, workers=1, threads=1, device="cpu",
             num_train=2048, shard_size=256)
TINY = Bench("tiny", steps=8, repeats=1, skip=3, micro=8, ranks=2, workers=1, threads=1, device="cpu",
             num_train=256, shard_size=32, warmup=3, timeout_s=240.0)


def one_rank_bench(shape: str, micro: int, steps: int, workers: int, timeout_s: float, device: str,
                   checkpointing: bool = False) -> Bench:
    """benchmarks/gpu/run.py --open-clip: one rank (a GPU; a CPU rank in its smoke test). The first
    quarter of the steps is left out (CUDA context, allocator and kernel selection warm up); the
    shards hold every sample the run trains on, at least one shard per loader worker (open_clip
    asserts it). `checkpointing`: both sides recompute the forward (the planner's pick may ask for it)."""
    shard = max(micro, 64)
    shards = max(-(-steps * micro // shard), workers)
    return Bench(shape, steps=steps, repeats=1, skip=max(1, steps // 4), micro=micro, ranks=1, workers=workers,
                 threads=1, device=device, num_train=shards * shard, shard_size=shard, warmup=min(10, steps - 1),
                 timeout_s=timeout_s, checkpointing=checkpointing)


# --------------------------------------------------------------------------- set-up

@dataclass(frozen=True)
class Inputs:
    venv: Path
    train_pattern: str    # absolute brace pattern
    tokenizer: Path
    hf_folder: Path       # rsclip_ds: model.pretrained
    openclip_dir: Path    # openclip_main.py --model-dir


def check_venv(venv: Path) -> Path:
    if venv == KIT:   # the GPU kit (benchmarks/gpu/run.py --open-clip kit)
        if not os.path.isdir(os.environ.get("OPENCLIP_PYTHONPATH", "")):
            raise SystemExit("--open-clip kit: OPENCLIP_PYTHONPATH names no folder; start the command with "
                             "`source .gpu/env.sh &&` (the kit: bash ../shared/gpu/kit.sh)")
        return KIT
    python = venv / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"no open_clip environment at {venv} (no {python}): create it with `{SETUP}`")
    return venv.resolve()


def prepare(bench: Bench, venv: Path, data_root: Path) -> tuple[Inputs, dict]:
    """Shards + tokenizer, the two model definitions, and both sides' parameter counts."""
    shape = SHAPES[bench.shape]
    needed = bench.steps * bench.micro * bench.ranks
    if needed > bench.num_train:
        raise ValueError(f"{bench.steps} steps x {bench.micro} x {bench.ranks} ranks = {needed} samples > "
                         f"num_train {bench.num_train}: an epoch would end inside the timed steps")
    data = synthetic_data(data_root.resolve(), num_train=bench.num_train, num_val=16,
                          shard_size=bench.shard_size, image_size=shape.image)
    tokenizer = Path(data["tokenizer"])
    models = tokenizer.parent / "models" / shape.name
    hf_params = write_hf_folder(shape, tokenizer, models / "hf")
    inputs = Inputs(venv, data["train_pattern"], tokenizer, models / "hf",
                    write_openclip_dir(shape, tokenizer, models / "open_clip"))
    counted = openclip_count(inputs, shape.openclip_name)
    return inputs, {"shape": asdict(shape), "rsclip_ds_parameters": hf_params,
                    "open_clip_parameters": counted["parameters"], "open_clip_towers": counted,
                    "open_clip_over_rsclip_ds": counted["parameters"] / hf_params,
                    "open_clip_env": counted["versions"]}


def openclip_count(inputs: Inputs, name: str) -> dict:
    cmd = [*openclip_python(inputs.venv), str(OPENCLIP_MAIN), "--model-dir", str(inputs.openclip_dir),
           "--count-params", name]
    proc = subprocess.run(cmd, env=tool_env("open_clip", "cpu", 1), capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- the logs

# open_clip_train/train.py, rank 0, every --log-every-n-steps: samples so far (all ranks), and
# the last step's rate (global batch / that step's time, data wait included)
OPENCLIP_LINE = re.compile(r"Train Epoch: \d+ \[\s*(\d+)/\s*\d+ .*?Batch \(t\): [\d.]+, ([\d.eE+-]+)/s, .*?"
                           r" Loss: (\S+) ")
# rsclip_ds/reporting/progress.py (plain), rank 0, every logging.log_every: the rate since the end
# of step 1, global batch x (k - 1) / (t_k - t_1); 'nan' at step 1
RSCLIP_LINE = re.compile(r" step (\d+)/\d+\s+loss (\S+)\s.*?samples/s (\S+)")


def parse_openclip(line: str, global_batch: int) -> dict | None:
    m = OPENCLIP_LINE.search(line)
    if not m:
        return None
    samples = int(m[1])
    return {"step": samples // global_batch, "samples": samples, "samples_per_s": float(m[2]), "loss": float(m[3])}


def parse_rsclip(line: str, global_batch: int) -> dict | None:
    m = RSCLIP_LINE.search(line)
    return {"step": int(m[1]), "loss": float(m[2]), "samples_per_s": float(m[3])} if m else None


def openclip_rate(steps: dict[int, dict], first: int, last: int, global_batch: int) -> float:
    """Steps first..last: each step's time is global batch / its logged rate."""
    seconds = sum(global_batch / steps[s]["samples_per_s"] for s in range(first, last + 1))
    return global_batch * (last - first + 1) / seconds


def rsclip_rate(steps: dict[int, dict], first: int, last: int, global_batch: int) -> float:
    """Steps first..last from the cumulative rates logged at steps first-1 and last."""
    since_step1 = lambda k: global_batch * (k - 1) / steps[k]["samples_per_s"] if k > 1 else 0.0   # t_k - t_1
    return global_batch * (last - first + 1) / (since_step1(last) - since_step1(first - 1))


TOOLS = {"open_clip": (parse_openclip, openclip_rate), "rsclip_ds": (parse_rsclip, rsclip_rate)}


# --------------------------------------------------------------------------- one run

def run_case(bench: Bench, case: Case, inputs: Inputs, run_dir: Path, quiet_s: float = 0.0) -> dict:
    """One launch -> its row (ok False with the reason and the log's tail when it failed). First
    waits up to `quiet_s` for the machine to go quiet; the CPU busy fraction then is recorded."""
    run_dir.mkdir(parents=True, exist_ok=True)
    port, global_batch = free_port(), bench.micro * bench.ranks
    if case.tool == "open_clip":
        cmd = openclip_cmd(bench, case, inputs, port, run_dir.name, bench.style)
    else:
        cmd = rsclip_cmd(bench, case, inputs, port, run_dir / "out", bench.style)
    parse, rate = TOOLS[case.tool]
    busy = wait_quiet(quiet_s)
    threads = bench.threads if bench.style == "harness" else None   # users: each tool's own default
    r = launch(cmd, tool_env(case.tool, bench.device, threads, case.peer), run_dir, bench.timeout_s,
               lambda line: parse(line, global_batch), {bench.skip, bench.steps}, run_dir / "log.txt",
               bench.pss_interval)
    row = {"case": case.name, **asdict(case), "ok": False, "cpu_busy_before": busy, "wall_s": r.wall_s,
           "peak_pss_bytes": r.peak_pss, "peak_pss_by_command": r.peak_pss_by_command,
           "pss_sampler_cpu_s": r.pss_sampler_cpu_s,
           "threads": threads_said(case, run_dir / "log.txt"),
           "log": str(run_dir / "log.txt"), "command": cmd}
    missing = [s for s in (1, bench.skip, bench.steps) if s not in r.steps]
    if r.rc != 0 or missing or set(r.marks) != {bench.skip, bench.steps}:
        tail = (run_dir / "log.txt").read_text(errors="replace").splitlines()[-20:]
        reason = f"timed out after {bench.timeout_s:.0f}s" if r.timed_out else f"exit {r.rc}"
        return {**row, "error": f"{reason}; steps without a log line: {missing}", "log_tail": tail}
    n, window = bench.steps - bench.skip, (r.marks[bench.skip], r.marks[bench.steps])
    steady = {k: window[1][k] - window[0][k] for k in ("minflt", "sys_s", "user_s")}
    row.update(
        ok=True,
        samples_per_s=rate(r.steps, bench.skip + 1, bench.steps, global_batch),
        samples_per_s_wall=global_batch * n / (window[1]["t"] - window[0]["t"]),   # line arrivals: a cross-check
        startup_s=r.steps[1]["t"],
        steps_logged=len(r.steps), first_loss=r.steps[1]["loss"], final_loss=r.steps[bench.steps]["loss"],
        samples_trained=trained_samples(case, r.steps[bench.steps], run_dir),
        steady={"steps": n, "processes": window[1]["processes"], **steady,
                "pss_bytes_at_first": window[0]["pss"], "pss_bytes_at_last": window[1]["pss"],   # growth over the steps
                "foreign_cpu_share": foreign_share(*window),   # other jobs' share of the cores meanwhile
                "minflt_per_step_per_rank": steady["minflt"] / n / bench.ranks,
                "sys_ms_per_step": 1e3 * steady["sys_s"] / n, "user_ms_per_step": 1e3 * steady["user_s"] / n},
        whole_run={**r.rusage, "minflt_per_step_per_rank": r.rusage["minflt"] / bench.steps / bench.ranks,
                   "sys_ms_per_step": 1e3 * r.rusage["sys_s"] / bench.steps})
    return row


# what sets each rank's threads, as the tools say it: torchrun's warning when it sets
# OMP_NUM_THREADS itself, rsclip_ds's start-up line
THREAD_LINES = {"open_clip": re.compile(r"Setting OMP_NUM_THREADS environment variable for each process to be (\d+)"),
                "rsclip_ds": re.compile(r"threads per rank: (\d+) \((.*)\)")}


def threads_said(case: Case, log: Path) -> str | None:
    """The thread count the launch used, from its log; None when the log does not say (open_clip
    with OMP_NUM_THREADS given: torchrun passes it on silently)."""
    m = THREAD_LINES[case.tool].search(log.read_text(errors="replace")) if log.is_file() else None
    if not m:
        return None
    return m[1] if case.tool == "open_clip" else f"{m[1]} ({m[2]})"


def trained_samples(case: Case, last: dict, run_dir: Path) -> int:
    """Samples the run trained on, as the tool itself counts them (open_clip's last log line,
    rsclip_ds's summary.json)."""
    if case.tool == "open_clip":
        return last["samples"]
    summary = json.loads((run_dir / "out" / "summary.json").read_text())
    return summary["optimizer_steps"] * summary["global_batch"]


# --------------------------------------------------------------------------- repeats and summary

def compare(bench: Bench, todo: list[Case], venv: Path, data_root: Path, work: Path,
            say: Callable[[str], None] = print, quiet_s: float = 0.0, max_foreign: float = 1.0,
            attempts: int = 3, partial: Path | None = None) -> dict:
    """Every case once per repeat, interleaved -> the report (rows, summary, models, config). A
    run during which other processes took more than `max_foreign` of the cores is run again
    (after waiting up to `quiet_s` for quiet), `attempts` times at most; the row keeps what the
    discarded attempts measured. `partial`: the report so far is written there after every run
    (a long run stopped early keeps what it measured)."""
    t0 = time.perf_counter()
    config = {**asdict(bench), "cases": [c.name for c in todo], "paired": PAIRED,
              "peers": {c.peer: PEERS[c.peer] for c in todo if c.peer},
              "peer_env": {c.peer: PEER_ENV[c.peer] for c in todo if c.peer in PEER_ENV},
              "thread_env": f"OMP_NUM_THREADS={bench.threads}" if bench.style == "harness" else "none (tools' defaults)"}
    inputs, models = prepare(bench, check_venv(venv), data_root)
    say(f"model {bench.shape}: rsclip_ds {models['rsclip_ds_parameters']:,} parameters, open_clip "
        f"{models['open_clip_parameters']:,} ({models['open_clip_over_rsclip_ds']:.4f}x)")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows = []
    for repeat in range(bench.repeats):
        for case in todo:
            run_dir = work.resolve() / stamp / f"r{repeat}-{case.name.replace('/', '-')}"
            discarded = []
            for attempt in range(attempts):
                r = {"repeat": repeat, **run_case(bench, case, inputs, run_dir.with_name(f"{run_dir.name}-a{attempt}"),
                                                  quiet_s)}
                foreign = r["steady"]["foreign_cpu_share"] if r["ok"] else 0.0
                if foreign <= max_foreign or attempt == attempts - 1:
                    break
                say(f"repeat {repeat} {case.name}: other processes took {100 * foreign:.0f}% of the cores "
                    f"({r['samples_per_s']:.2f} samples/s): run again")
                discarded.append({"samples_per_s": r["samples_per_s"], "foreign_cpu_share": foreign, "log": r["log"]})
            rows.append({**r, "discarded_attempts": discarded})
            if partial is not None:
                partial.write_text(json.dumps({"config": config, "models": models, "runs": rows,
                                               "summary": summarize(rows, todo)}, indent=2) + "\n")
            status = (f"{r['samples_per_s']:7.2f} samples/s, start-up {r['startup_s']:5.1f}s, "
                      f"{r['steady']['minflt_per_step_per_rank']:8.0f} minor faults/step/rank"
                      if r["ok"] else r["error"])
            say(f"repeat {repeat} {case.name:<26} {status}  (CPU {100 * r['cpu_busy_before']:.0f}% busy before)")
    return {"config": config, "models": models, "environment": environment(bench.threads, ranks=bench.ranks, device=bench.device),
            "runs": rows, "summary": summarize(rows, todo), "work": str(work.resolve() / stamp),
            "seconds": time.perf_counter() - t0}


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(rows: list[dict], todo: list[Case]) -> dict:
    """Per case: medians and spreads; ratios paired within each repeat."""
    ok = {c.name: {r["repeat"]: r for r in rows if r["case"] == c.name and r["ok"]} for c in todo}
    out = {"cases": {}, "ratios": {}}
    for name, runs in ok.items():
        rs = list(runs.values())
        if not rs:
            out["cases"][name] = {"runs": 0}
            continue
        out["cases"][name] = {
            "runs": len(rs), "samples_per_s": _spread([r["samples_per_s"] for r in rs]),
            "samples_per_s_wall": _spread([r["samples_per_s_wall"] for r in rs]),
            "startup_s": _spread([r["startup_s"] for r in rs]),
            "cpu_busy_before": _spread([r["cpu_busy_before"] for r in rs]),
            "foreign_cpu_share": _spread([r["steady"]["foreign_cpu_share"] for r in rs]),
            "minflt_per_step_per_rank": _spread([r["steady"]["minflt_per_step_per_rank"] for r in rs]),
            "sys_ms_per_step": _spread([r["steady"]["sys_ms_per_step"] for r in rs]),
            "user_ms_per_step": _spread([r["steady"]["user_ms_per_step"] for r in rs]),
            "cpu_ms_per_step": _spread([r["steady"]["user_ms_per_step"] + r["steady"]["sys_ms_per_step"] for r in rs]),
            "peak_pss_gb": _spread([r.get("peak_pss_bytes", 0) / 1e9 for r in rs]),
            "whole_run_minflt_per_step_per_rank": _spread([r["whole_run"]["minflt_per_step_per_rank"] for r in rs]),
            "whole_run_sys_ms_per_step": _spread([r["whole_run"]["sys_ms_per_step"] for r in rs])}
    for case in todo:
        if case.tool != "rsclip_ds":
            continue
        for partner in case.partners():
            ours, theirs = ok[case.name], ok.get(partner, {})
            pairs = [(ours[k], theirs[k]) for k in sorted(ours) if k in theirs]
            if pairs:
                per_repeat = [a["samples_per_s"] / b["samples_per_s"] for a, b in pairs]
                pss = [a["peak_pss_bytes"] / b["peak_pss_bytes"] for a, b in pairs
                       if a.get("peak_pss_bytes") and b.get("peak_pss_bytes")]
                out["ratios"][f"{case.name} / {partner}"] = {**_spread(per_repeat), "per_repeat": per_repeat,
                                                             "peak_pss_ratio": _spread(pss) if pss else None}
    return out


# --------------------------------------------------------------------------- entry point

def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    parser.add_argument("--open-clip", type=Path, required=True, metavar="VENV",
                        help=f"open_clip's environment (create it with `{SETUP}`)")
    parser.add_argument("--out", type=Path, required=True, help="JSON path; a PNG goes beside it")
    parser.add_argument("--tiny", action="store_true", help="seconds-long runs of a tiny model (the test's)")
    parser.add_argument("--repeats", type=int, help="interleaved repeats (default 3; --tiny 1)")
    parser.add_argument("--steps", type=int, help="steps per run (default 60; --tiny 8)")
    parser.add_argument("--skip", type=int, help="steps left out of the rate (default 5: the rate is over 6..N)")
    parser.add_argument("--openclip-precisions", nargs="*", default=list(OPENCLIP_PRECISIONS),
                        choices=OPENCLIP_PRECISIONS)
    parser.add_argument("--profiles", nargs="*", default=["zero1", "zero2"], help="rsclip_ds profiles")
    parser.add_argument("--precisions", nargs="*", default=["fp32", "bf16"], choices=list(RSCLIP_SETS),
                        help="rsclip_ds precisions (bf16_masters: bf16 with bf16.master_weights=bf16)")
    parser.add_argument("--data", type=Path, default=Path("runs/bench_data"),
                        help="where the synthetic shards and the model folders go (reused when present)")
    parser.add_argument("--work", type=Path, default=Path("runs/bench_openclip"), help="every run's log and output")
    parser.add_argument("--timeout", type=float, help="seconds before a run is killed")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (--style harness)")
    parser.add_argument("--style", choices=STYLES, default="harness",
                        help="harness: the driver sets OMP_NUM_THREADS=--threads for both tools; users: it sets no "
                             "thread variable and each tool's own default decides (torchrun's 1 per rank, "
                             "rsclip_ds's distributed.threads_per_rank=auto), and both keep their default "
                             "end-of-run checkpoint (openclip_cases.py)")
    parser.add_argument("--peers", nargs="*", default=[], choices=list(PEERS),
                        help="also run each feature on both sides at the same setting: patch_dropout (open_clip "
                             "--force-patch-dropout 0.5 / model.patch_dropout=0.5), compile (--torchcompile / "
                             "compile.enabled=true)")
    parser.add_argument("--peer-profile", default="zero2", help="the rsclip_ds profile of the peer cases")
    parser.add_argument("--peer-precisions", nargs="*", choices=list(RSCLIP_SETS),
                        help="rsclip_ds precisions of the peer cases, each against its first open_clip partner "
                             "(default: --precisions)")
    parser.add_argument("--peers-only", action="store_true", help="run the peer cases only")
    parser.add_argument("--pss-interval", type=float, default=2.0, metavar="SECONDS",
                        help="seconds between samples of the process tree's PSS (each costs ~0.1 s of CPU)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help="before each run, wait up to this long for other processes to leave the cores idle "
                             "(a shared machine); the busy fraction before each run is recorded either way")
    parser.add_argument("--max-foreign", type=float, default=1.0, metavar="SHARE",
                        help="run a case again (3 attempts at most) when other processes took more than this "
                             "share of the cores during its timed steps (e.g. 0.1 on a shared machine)")
    return parser.parse_args(argv)


def bench_config(args) -> Bench:
    over = {k: v for k, v in (("repeats", args.repeats), ("steps", args.steps), ("skip", args.skip),
                              ("timeout_s", args.timeout), ("threads", args.threads), ("style", args.style),
                              ("pss_interval", args.pss_interval)) if v is not None}
    bench = replace(TINY if args.tiny else FULL, **over)
    if not 1 <= bench.skip < bench.steps:
        raise SystemExit(f"--skip {bench.skip} must be at least 1 and below --steps {bench.steps}")
    return replace(bench, warmup=min(bench.warmup, bench.steps - 1))   # rsclip_ds wants warmup < steps


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # unwinds through launch(), which stops the run
    bench = bench_config(args)
    if args.peers_only and not args.peers:
        raise SystemExit("--peers-only needs --peers NAME...")
    todo = cases(args.openclip_precisions, args.profiles, args.precisions, args.peers, args.peer_profile,
                 args.peer_precisions, base=not args.peers_only)
    partial = args.out.with_suffix(".partial.json")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = compare(bench, todo, args.open_clip, args.data, args.work, say=lambda m: print(m, flush=True),
                     quiet_s=args.wait_quiet, max_foreign=args.max_foreign, partial=partial)
    partial.unlink(missing_ok=True)
    report["config"].update(wait_quiet_s=args.wait_quiet, max_foreign=args.max_foreign)
    report["config"]["tiny"] = args.tiny
    write_report(report, args.out, print_tables, plot)
    print(f"wrote {args.out} in {report['seconds']:.0f}s")
    return 0 if all(r["ok"] for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())

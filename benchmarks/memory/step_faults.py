"""Where a training step's freshly touched host memory comes from: minor page faults and kernel
(sys) time per phase (forward, loss, backward, optimizer step) of one step on CPU ranks, for the
DeepSpeed engine as rsclip_ds configures it and for DDP + torch's AdamW (what open_clip runs),
with glibc's default allocator and with `rsclip_ds.runtime.host_memory.keep_freed_memory`, and
with torch's tensors of 2 MiB and more in transparent huge pages (THP_MEM_ALLOC_ENABLE=1, what
`rsclip-ds train` sets on CPU ranks) or in 4 KiB pages.

    python -m benchmarks.memory.step_faults --out benchmarks/results/step_faults.json
    python -m benchmarks.memory.step_faults --tiny --out /tmp/step_faults.json      # seconds-long

Every case is its own `deepspeed --num_gpus 2` launch (the allocator setting is process-wide and
cannot be undone): the model of benchmarks/throughput/compare.py --open-clip (SigLIP-shaped, vision and
text width 256, depth 4, patch 16, 128 px, 64 tokens, 20.05M parameters), micro-batch 16 per
rank of in-memory batches (no loader: the engine alone), global SigLIP loss, one torch thread
per rank. Faults and sys time are getrusage(RUSAGE_SELF) deltas on rank 0 around each phase,
summed over the steps after --warmup and divided by their count; MB = faults x 4096 bytes.
Each case also records how its rank-0 process was set up, for tests on any machine: what
`keep_freed_memory` returned (glibc's mallopt calls succeeded), whether a fresh 64 MiB block then
lies in the brk heap (kept) or in a mapping of its own (glibc's default), and whether its AdamW
is torch's fused one, and how much of its memory was in huge pages at the end (AnonHugePages).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness import base_parser, environment, process_group, rank0_print, run_script, write_report

PHASES = ("forward", "loss", "backward", "step")
# name -> (engine, allocator, optimizer, pages): engine "ddp" or a profile (rsclip_ds's DeepSpeed
# config for it); pages "huge": THP_MEM_ALLOC_ENABLE=1 in the launch, "small": =0
CASES = {
    "ddp_default": ("ddp", "default", "foreach", "small"),     # open_clip's DDP as its users run it
    "ddp_keep": ("ddp", "keep", "foreach", "small"),
    "ddp_huge": ("ddp", "default", "foreach", "huge"),
    "zero2_before": ("zero2", "default", "foreach", "small"),  # what rsclip_ds ran before issue 16
    "zero2_keep": ("zero2", "keep", "foreach", "small"),
    "zero2_after": ("zero2", "keep", "fused", "small"),        # ... before huge pages (issue 28)
    "zero2_huge": ("zero2", "keep", "fused", "huge"),          # what it runs now
    "zero1_before": ("zero1", "default", "foreach", "small"),
    "zero1_after": ("zero1", "keep", "fused", "small"),
    "zero1_huge": ("zero1", "keep", "fused", "huge"),
}


def model(tiny: bool):
    from transformers import SiglipConfig

    from rsclip_ds.model import new_dual_encoder

    width, depth, size = (64, 2, 64) if tiny else (256, 4, 128)
    tower = dict(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=depth, num_attention_heads=4)
    config = SiglipConfig(text_config={**tower, "max_position_embeddings": 64, "vocab_size": 49408},
                          vision_config={**tower, "image_size": size, "patch_size": 16})
    return new_dual_encoder(config), size


def block_in_heap(nbytes: int = 64 * 2**20) -> bool:
    """Whether a fresh block of `nbytes` (above glibc's 32 MiB mmap ceiling) comes from the brk
    heap ([heap] in /proc/self/maps) rather than from a mapping of its own: where malloc serves
    DeepSpeed's per-step buffers, and so whether freeing one gives its pages back."""
    block = torch.empty(nbytes, dtype=torch.uint8)   # untouched: no page is faulted in
    address = block.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return fields[-1] == "[heap]"
    raise RuntimeError(f"address {address:#x} of a live tensor is in no mapping of /proc/self/maps")


def worker(args) -> None:
    from rsclip_ds.runtime.host_memory import TORCH_HUGE_PAGES, anon_huge_bytes, keep_freed_memory

    # before the process group: gloo's threads then share the one arena
    applied = keep_freed_memory() if args.allocator == "keep" else None
    with process_group(1) as info:
        from rsclip_ds.config import load_config
        from rsclip_ds.losses import build_loss
        from rsclip_ds.profiles import build_ds_config, load_profile

        net, size = model(args.tiny)
        params = sum(p.numel() for p in net.parameters())
        micro = 16
        g = torch.Generator().manual_seed(info.rank)
        pixels = torch.randint(0, 256, (micro, 3, size, size), dtype=torch.uint8, generator=g)
        ids = torch.randint(0, 49408, (micro, 64), generator=g)
        loss_fn = build_loss("siglip", negatives="global", rank=info.rank, world_size=info.world_size)
        if args.engine == "ddp":
            ddp = torch.nn.parallel.DistributedDataParallel(net)
            opt = torch.optim.AdamW(net.parameters(), lr=1e-4, foreach=True)
            forward, backward = (lambda: ddp(pixels, ids)), (lambda loss: loss.backward())

            def step():
                opt.step()
                opt.zero_grad(set_to_none=True)
        else:
            from rsclip_ds.engine import build_engine, lr_scheduler
            from rsclip_ds.finetune import param_groups

            run = load_config(None, [f"profile={args.engine}", "precision=fp32", "steps=100",
                                     f"batch.micro_batch_size={micro}", "optim.warmup_steps=2"])
            ds_config = build_ds_config(run, load_profile(run.profile), info.world_size, on_gpu=False)
            if args.optimizer == "foreach":
                ds_config["optimizer"]["params"].pop("fused")
            engine = build_engine(net, ds_config, param_groups(net, run.optim), lr_scheduler(2, 100, 0.0))
            forward, backward, step = (lambda: engine(pixels, ids)), engine.backward, engine.step
            opt = engine.basic_optimizer   # the torch AdamW inside DeepSpeed's ZeRO optimizer
        totals = {p: [0, 0.0, 0.0] for p in PHASES}   # faults, sys s, wall s
        step_faults = 0                                # the same steps' faults, first mark to last

        def mark():
            r = resource.getrusage(resource.RUSAGE_SELF)
            return r.ru_minflt, r.ru_stime, time.perf_counter()
        for i in range(args.warmup + args.steps):
            marks = [mark()]
            out = forward()
            marks.append(mark())
            loss = loss_fn(*out)
            marks.append(mark())
            backward(loss)
            marks.append(mark())
            step()
            marks.append(mark())
            if i >= args.warmup:
                step_faults += marks[-1][0] - marks[0][0]
                for phase, a, b in zip(PHASES, marks, marks[1:]):
                    for j in range(3):
                        totals[phase][j] += b[j] - a[j]
        n = args.steps
        if info.rank == 0:
            report = {"parameters": params, "steps": n, "allocator": args.allocator, "allocator_applied": applied,
                      "large_block_in_heap": block_in_heap(), "optimizer": type(opt).__name__,
                      "adamw_fused": bool(opt.defaults.get("fused")), "faults_total_per_step": step_faults / n,
                      TORCH_HUGE_PAGES: os.environ.get(TORCH_HUGE_PAGES), "anon_huge_pages_bytes": anon_huge_bytes(),
                      "faults_per_step": {p: v[0] / n for p, v in totals.items()},
                      "sys_ms_per_step": {p: 1e3 * v[1] / n for p, v in totals.items()},
                      "wall_ms_per_step": {p: 1e3 * v[2] / n for p, v in totals.items()}}
            report["mb_per_step"] = sum(report["faults_per_step"].values()) * 4096 / 1e6
            report["sys_ms_total"] = sum(report["sys_ms_per_step"].values())
            args.result.write_text(json.dumps(report))


def print_tables(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Host memory touched per step, rank 0 (2 CPU ranks)")
    for col in ("case", "engine", "allocator", "AdamW", "pages", "MB faulted/step", *[f"{p} MB" for p in PHASES],
                "sys ms/step", "wall ms/step"):
        table.add_column(col, justify="left" if col in ("case", "engine", "allocator", "AdamW", "pages") else "right")
    for name, r in report["cases"].items():
        if not r.get("ok", True):
            table.add_row(name, *CASES[name], r.get("error", "failed"))
            continue
        table.add_row(name, *CASES[name], f"{r['mb_per_step']:.0f}",
                      *[f"{r['faults_per_step'][p] * 4096 / 1e6:.0f}" for p in PHASES],
                      f"{r['sys_ms_total']:.0f}", f"{sum(r['wall_ms_per_step'].values()):.0f}")
    Console(width=160).print(table)


def parse_args(argv=None) -> argparse.Namespace:
    parser = base_parser(__doc__, tiny=True)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 15; --tiny 3)")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured steps first (default 5; --tiny 2)")
    parser.add_argument("--worker", nargs=3, metavar=("ENGINE", "ALLOCATOR", "OPTIMIZER"), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.steps = args.steps or (3 if args.tiny else 15)
    args.warmup = args.warmup or (2 if args.tiny else 5)
    if args.worker:
        args.engine, args.allocator, args.optimizer = args.worker
        worker(args)
        return 0
    say = rank0_print(0)
    t0, cases = time.perf_counter(), {}
    for name in args.cases:
        result = args.out.with_suffix(f".{name}.part.json")
        engine, allocator, optimizer, pages = CASES[name]
        flags = ["--worker", engine, allocator, optimizer, "--result", str(result), "--out", str(args.out),
                 "--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--tiny"] if args.tiny else [])
        cases[name] = run_script("benchmarks.memory.step_faults", flags, result, timeout=900, ranks=2,
                                 env={"DS_ACCELERATOR": "cpu", "THP_MEM_ALLOC_ENABLE": "1" if pages == "huge" else "0"})
        result.unlink(missing_ok=True)
        r = cases[name]
        say(f"{name}: {r['mb_per_step']:.0f} MB faulted/step, sys {r['sys_ms_total']:.0f} ms/step"
            if r.get("ok", True) else f"{name}: {r.get('error')} {r.get('output_tail', '')}")
    report = {"config": {"tiny": args.tiny, "steps": args.steps, "warmup": args.warmup, "cases": CASES},
              "environment": environment(1), "cases": cases, "seconds": time.perf_counter() - t0}
    write_report(report, args.out, print_tables)
    return 0 if all(r.get("ok", True) for r in cases.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

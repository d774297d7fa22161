"""`rsclip-ds plan`: which profile fits a GPU budget, at what micro-batch, and how fast.

    rsclip-ds plan --model git-rsclip-large --gpus 4 --gpu-mem 24GiB --global-batch 4096
    rsclip-ds plan --params 5e9 --gpus 4 --gpu-mem 24GiB --global-batch 1024 --json
    rsclip-ds plan --nodes 4 --gpus-per-node 8 --inter-node-gbps 100 --gpu-mem 141GB --global-batch 32768
    rsclip-ds plan --model git-rsclip-large --gpus 4 --gpu-mem 24GiB --global-batch 256 \
        --shards 'rsicd/train-{000000..000087}.tar'

The numbers come from `rsclip_ds.planning.memory` (the peak's terms) and `rsclip_ds.planning.planner` (fit and
speed, the reason for the pick, the nearest fit); formulas and assumptions are in their docstrings.
Exit codes: 0 a row fits, 2 a bad argument (ConfigError), EXIT_NOTHING_FITS when nothing fits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from pathlib import Path

from rsclip_ds.config import ConfigError

# Nothing fits: the plan ran and its answer is no (as check-leakage's 3); 2 stays a bad argument.
EXIT_NOTHING_FITS = 3
_UNITS = {"": 2**30, "gib": 2**30, "gb": 10**9, "mib": 2**20, "mb": 10**6, "tib": 2**40, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """'24GiB' -> 24 x 2^30, '80GB' -> 80 x 10^9, '1.5TiB'; a bare number is GiB ('24')."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read memory size {text!r}: use e.g. 24GiB, 80GB, 512MiB or 24 (GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def register(subparsers) -> argparse.ArgumentParser:
    from rsclip_ds.model import PRESETS
    from rsclip_ds.precision import PRECISIONS

    p = subparsers.add_parser(
        "plan", help="predict memory per GPU for every profile and pick one",
        description="Predict memory per GPU for every profile and pick one: the fastest that fits, by modelled "
                    "step time (compute, communication, offload and each ZeRO stage's host and hook cost, measured on "
                    "an H200), ties to the lighter stage; the line under the table (`reason` in --json) says why. "
                    f"When nothing fits it names the nearest fit and what would make it fit, and exits "
                    f"{EXIT_NOTHING_FITS}.")
    p.add_argument("--model", default="git-rsclip-large", choices=sorted(PRESETS), help="model preset")
    p.add_argument("--params", type=float, help="instead of --model: a hypothetical size, e.g. 5e9 "
                   "(git-rsclip-large's towers scaled in width and depth)")
    p.add_argument("--gpus-per-node", "--gpus", dest="gpus", type=int, required=True, help="GPUs per node")
    p.add_argument("--nodes", type=int, default=1, help="nodes (the hybrid profiles zero3_hpz, zero3_zeropp, "
                   "zero3_mics are recommended only when > 1)")
    p.add_argument("--intra-bw", type=float, default=360.0, metavar="GB/s",
                   help="a GPU's collective bandwidth inside a node (default 360: NVLink 4, H100/H200 SXM; "
                        "A100 NVLink 3: 230; PCIe 4 without NVLink: 20)")
    p.add_argument("--inter-bw", type=float, default=45.0, metavar="GB/s",
                   help="a GPU's share of its node's network (default 45: one 400 Gb/s InfiniBand NDR NIC per "
                        "GPU; HDR 200 Gb/s: 22.5; one 100 GbE NIC per node of 8 GPUs: 1.4)")
    p.add_argument("--inter-node-gbps", type=float, metavar="Gb/s",
                   help="instead of --inter-bw: a node's network line rate in Gb/s, all its NICs together, shared "
                        "by its GPUs, at 90%% achieved: 100 (one 100 GbE NIC), 400, or 3200 (8 x 400 Gb/s NDR, one "
                        "NIC per GPU)")
    p.add_argument("--overlap", type=float, default=0.0, metavar="0..1",
                   help="share of min(compute, communication) hidden behind compute (default 0: none)")
    p.add_argument("--gpu-mem", required=True, help="memory per GPU: 24GiB, 80GB, 24 (= GiB)")
    p.add_argument("--cpu-mem", help="memory per node (same units); not checked when omitted")
    p.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    p.add_argument("--precision", default="auto", choices=["auto", *PRECISIONS],
                   help="the run's precision (docs/guides/precision.md): auto (the run config's default: amp_bf16 on "
                        "the ddp row, bf16 under ZeRO), bf16/fp16 (16-bit weights, fp32 masters), fp32, amp_bf16/amp "
                        "(fp32 weights, 16-bit matmuls under torch.autocast; amp with a gradient scaler, stage 0 "
                        "only); rows a precision is refused on are shown, not recommended")
    p.add_argument("--master-weights", default="fp32", choices=["fp32", "bf16"],
                   help="the run's bf16.master_weights: bf16 keeps no fp32 master copy (10 instead of 16 bytes "
                        "per trainable parameter; --precision bf16 only; docs/guides/precision.md)")
    p.add_argument("--communication-data-type", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="the run's distributed.communication_data_type: the gradients' dtype on the wire (auto: "
                        "the precision; fp16 under qgZ, which refuses any other)")
    p.add_argument("--loss", default="siglip", choices=["siglip", "clip"])
    p.add_argument("--negatives", default="global", choices=["global", "local"])
    p.add_argument("--accumulation", default="global", choices=["global", "plain"])
    p.add_argument("--set", action="append", default=[], metavar="finetune.KEY=VALUE",
                   help="fine-tuning controls, as for `rsclip-ds train` (locked towers and LoRA have no "
                   "gradients or optimizer states for their frozen weights), e.g. --set finetune.lock_image=true "
                   "or --set 'finetune.lora.towers=[image,text]'; and model.patch_dropout (the image tower's "
                   "FLOPs and activations on the kept patches), e.g. --set model.patch_dropout=0.5; and distill.teacher "
                   "(a preset or a SigLIP folder), distill.dtype, distill.placement: the teacher's weights, inputs, "
                   "forward and FLOPs, e.g. --set distill.teacher=git-rsclip-large")
    p.add_argument("--shards", metavar="PATTERN",
                   help="your training shards (data.train_shards' syntax): each row also says how much of the data "
                        "one epoch delivers at its micro-batch (data.policy=exact: every sample less fewer than one "
                        "global batch), read from the shards' counts (index.json, else the tars' headers), nothing "
                        "decoded; --set data.where=... / data.train_weights=... / data.policy=... apply")
    p.add_argument("--workers", type=int, metavar="K",
                   help="--shards: DataLoader workers per rank (default: what data.num_workers=auto gives here: this "
                        "machine's cores shared by --gpus ranks, less one each); the epoch's size does not depend on it")
    p.add_argument("--micro", type=int, metavar="M",
                   help="--shards: the micro-batch you will run, for every row's coverage (default: each row's own)")
    p.add_argument("--json", action="store_true", help="print rows, the recommendation and its `reason` as JSON "
                   "(`recommended` null and `nearest_fit` set when nothing fits)")
    p.add_argument("--write-config", type=Path, metavar="PATH",
                   help="write the recommended row's resolved DeepSpeed JSON here and print the launch command")
    p.set_defaults(handler=run)
    return p


def _overrides(row, args) -> list[str]:
    return [f"profile={row.profile}", f"precision={row.precision or args.precision}", f"model.preset={args.model}",
            f"model.activation_checkpointing={str(row.checkpointing).lower()}",
            f"batch.micro_batch_size={row.micro}", f"batch.gradient_accumulation_steps={row.accumulation}",
            f"batch.accumulation={args.accumulation}", f"loss.name={args.loss}", f"loss.negatives={args.negatives}",
            *([f"bf16.master_weights={args.master_weights}"] if args.master_weights != "fp32" else []),
            *([f"distributed.communication_data_type={args.communication_data_type}"]
              if args.communication_data_type != "auto" else []), *args.set]


def _plan_config(args):
    """The --set fine-tuning controls and patch dropout, validated as the run config validates them."""
    from rsclip_ds.config import load_config

    wrong = [s for s in args.set if not s.startswith(("finetune.", "model.patch_dropout=", "distill.", "data."))]
    if wrong:
        raise ConfigError(f"rsclip-ds plan --set takes finetune.*, distill.* and data.* keys and model.patch_dropout "
                          f"only, not {wrong}")
    if any(s.startswith("data.") for s in args.set) and not args.shards:
        raise ConfigError("rsclip-ds plan --set data.*: the data keys shape an epoch's coverage, which needs "
                          "--shards PATTERN")
    return load_config(None, args.set)


def epoch_coverage(args, data, micros: set[int], world_size: int) -> dict[int, dict]:
    """--shards: epoch 0's coverage (schedule.EpochSchedule.coverage) at each micro-batch, on `world_size`
    ranks of --workers workers: what a run of those shards delivers per epoch, from their counts."""
    from rsclip_ds.data.schedule import build_epoch_schedule
    from rsclip_ds.data.workers import available_cores
    from rsclip_ds.resolve import loader_workers

    workers = args.workers if args.workers is not None else loader_workers("auto", available_cores(), args.gpus)[0]
    cfg = data.model_copy(update={"train_shards": args.shards, "num_workers": workers})
    out = {}
    for micro in sorted(m for m in micros if m > 0):
        try:
            schedule = build_epoch_schedule(cfg, micro_batch_size=micro, world_size=world_size, seed=0,
                                            num_workers=workers)
        except (ConfigError, ValueError) as err:   # a shard set the run refuses outright: say it per row
            out[micro] = {"coverage": None, "refused": str(err), "line": f"micro {micro}: refused: {err}"}
            continue
        out[micro] = {**schedule.coverage(0), "workers": workers, "line": schedule.describe(0)}
    return out


def launch_command(row, args, gpus_per_node: int, nodes: int) -> str:
    where = f"--num_gpus {gpus_per_node}" + (f" --num_nodes {nodes} --hostfile HOSTFILE" if nodes > 1 else "")
    sets = " ".join(f"--set {o}" for o in _overrides(row, args))
    return f"deepspeed {where} --module rsclip_ds train --config CONFIG {sets}"


AUTO_TITLE = "precision auto (amp_bf16 on ddp, bf16 under ZeRO)"


def _print_table(rows, best, args, spec, why: str, coverage: dict[int, dict] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{spec.name} ({spec.params / 1e6:.0f}M params, {spec.trainable / 1e6:.1f}M trainable) on {args.nodes} x {args.gpus} GPUs "
                        f"of {args.gpu_mem}, global batch {args.global_batch}, "
                        f"{AUTO_TITLE if args.precision == 'auto' else args.precision}"
                        f"{', bf16 masters' if args.master_weights == 'bf16' else ''}")
    for col in ("profile", "precision", "act. ckpt", "fits", "GiB/GPU", "allocated", "peak in", "CPU GiB/node",
                "max micro",
                "micro x accum", "step s", "compute s", "comm intra s", "comm inter s", "host s", "rel. speed",
                *(["epoch coverage"] if coverage is not None else [])):
        table.add_column(col, justify="left" if col in ("profile", "peak in") else "right", no_wrap=col == "profile")
    for r in rows:
        mark = " *" if r is best else ("" if r.candidate else " (-)")
        cov = [_coverage_cell(coverage, args.micro or r.micro) if r.fits else "-"] if coverage is not None else []
        table.add_row(r.profile + mark, r.precision, "on" if r.checkpointing else "off", "yes" if r.fits else "no",
                      f"{r.gpu_gib:.1f}", f"{r.allocated_gib:.1f}", r.phase, f"{r.cpu_gib_node:.1f}", str(r.max_micro),
                      f"{r.micro} x {r.accumulation}" if r.fits else "-", *(
                          (f"{r.step_s:.3g}", f"{r.compute_s:.3g}", f"{r.comm_intra_s:.3g}", f"{r.comm_inter_s:.3g}",
                           f"{r.host_s:.3g}", f"{r.relative_speed:.2f}") if r.fits else ["-"] * 6), *cov)
    console = Console()
    if console.width < 180:   # pipes and CI logs default to 80 columns: keep the table readable
        console = Console(width=180)
    console.print(table)
    console.print("GiB/GPU: the predicted peak that must fit (allocated + allocator headroom + 1 GiB for the "
                  "CUDA context and NCCL); allocated: what torch.cuda.max_memory_allocated would show.")
    console.print("step s = compute + communication (per collective the slower of intra-node and inter-node time) "
                  f"- {args.overlap:g} x the overlap + offload + host s; comm intra/inter s: each link's time per step; "
                  "host s: the ZeRO stage's own host and hook time (ZeRO-3's hooks, measured on an H200).")
    if coverage is not None:
        workers = next((c["workers"] for c in coverage.values() if "workers" in c), args.workers)
        console.print(f"epoch coverage: the share of {args.shards}'s samples one epoch delivers ({workers} worker(s) "
                      f"per rank; data.policy=exact leaves out fewer than one global batch):", soft_wrap=True)
        for micro, c in coverage.items():
            console.print(f"  micro {micro}: {c['line']}", soft_wrap=True)
    for profile, note in sorted({(r.profile, r.note) for r in rows if r.note}):
        console.print(f"{profile}{'' if any(r.candidate for r in rows if r.profile == profile) else ' (-)'}: {note}")
    console.print(f"* recommended: {why}" if best else why, soft_wrap=True)


def _coverage_cell(coverage: dict[int, dict], micro: int) -> str:
    c = coverage.get(micro) or {}
    if c.get("refused"):
        return "refused"
    return f"{100 * c['coverage']:.1f} %" if c.get("coverage") is not None else "-"


def run(args) -> int:
    """0 when a row fits, EXIT_NOTHING_FITS when none does (a ConfigError, exit 2, for bad arguments)."""
    if not args.json:
        return _run(args)[1]
    # `plan --json | jq`: stdout carries the JSON only. DeepSpeed's logger writes to stdout
    # (its accelerator warning on a machine without a GPU comes at import): everything but the
    # JSON goes to stderr while the plan is made; the JSON is printed after.
    out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        doc, code = _run(args)
    print(json.dumps(doc, indent=2), file=out)
    return code


def _run(args) -> tuple[dict | None, int]:
    """Makes the plan; prints the table, or returns the JSON document (--json); and the exit code."""
    from rsclip_ds.planning import comms
    from rsclip_ds.planning.dropout import with_patch_dropout
    from rsclip_ds.planning.memory import preset_spec, scaled_spec
    from rsclip_ds.planning.planner import Budget, Hardware, nearest_fit, plan, reason, recommend
    from rsclip_ds.planning.teacher import teacher_plan
    from rsclip_ds.precision import compute_dtype, is_autocast
    from rsclip_ds.profiles import available_profiles

    run_config = _plan_config(args)
    finetune = run_config.finetune
    if args.params and args.set:
        raise ConfigError("--set finetune.* needs a --model preset (a --params model has no towers to lock)")
    if args.master_weights != "fp32" and args.precision not in ("bf16", "auto"):
        raise ConfigError(f"--master-weights {args.master_weights} applies to --precision bf16 only")
    if args.communication_data_type != "auto" and is_autocast(args.precision):
        # profiles.communication_dtype refuses it too: DeepSpeed never reads the key under torch.autocast
        raise ConfigError(f"--communication-data-type {args.communication_data_type} with --precision "
                          f"{args.precision}: under torch.autocast the wire dtype is per layer "
                          f"({compute_dtype(args.precision)} for Linear and Conv, fp32 for the rest); use auto, or "
                          f"--precision bf16 / fp32 for one dtype")
    spec = scaled_spec(args.params) if args.params else preset_spec(args.model, finetune)
    spec = with_patch_dropout(spec, run_config.model.patch_dropout)
    d = run_config.distill
    teacher = teacher_plan(d.teacher, d.dtype, d.placement) if d.teacher else None
    budget = Budget(args.gpus, args.nodes, parse_bytes(args.gpu_mem),
                    parse_bytes(args.cpu_mem) if args.cpu_mem else None)
    try:
        if args.intra_bw <= 0 or args.inter_bw <= 0 or (args.inter_node_gbps or 1) <= 0:
            raise ValueError("--intra-bw, --inter-bw and --inter-node-gbps are bandwidths: give positive numbers")
        if not 0 <= args.overlap <= 1:
            raise ValueError(f"--overlap {args.overlap}: a share between 0 and 1")
        inter = comms.network_bw(args.inter_node_gbps) / args.gpus if args.inter_node_gbps else args.inter_bw * 1e9
        hw = Hardware(intra_bw=args.intra_bw * 1e9, inter_bw=inter, overlap=args.overlap)
        kw = dict(precision=args.precision, loss=args.loss, negatives=args.negatives, accumulation=args.accumulation,
                  hw=hw, master=args.master_weights, comm=args.communication_data_type, teacher=teacher)
        rows = plan(spec, budget, args.global_batch, **kw)
        best = recommend(rows)
        nearest = None if best else nearest_fit(spec, budget, args.global_batch, rows, **kw)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    why = reason(best, rows, budget) if best else nearest.text
    coverage = None
    if args.shards:
        micros = {args.micro} if args.micro else {r.micro for r in rows if r.fits}
        coverage = epoch_coverage(args, run_config.data, micros, budget.gpus * budget.nodes)
    command = launch_command(best, args, args.gpus, args.nodes) if best and not args.params else None
    if command and best.profile not in available_profiles():   # a hybrid modelled from planner.HYBRID
        command += (f"   # ds_profiles/{best.profile}.json is not in this checkout: --write-config writes "
                    f"the DeepSpeed config with its zero_optimization block")
    doc = None
    if args.json:
        doc = {"model": spec.name, "params": spec.params, "trainable": spec.trainable,
               "finetune": finetune.model_dump(), "master_weights": args.master_weights, "gpus": budget.gpus,
               "gpu_bytes": budget.gpu_bytes, "global_batch": args.global_batch, "nodes": args.nodes,
               "intra_bw_gbs": args.intra_bw, "inter_bw_gbs": hw.inter_bw / 1e9, "overlap": args.overlap,
               "rows": [_row_doc(r, coverage, args.micro) for r in rows],
               "recommended": _row_doc(best, coverage, args.micro) if best else None,
               "reason": why, "nearest_fit": nearest.to_dict() if nearest else None, "command": command}
    else:
        _print_table(rows, best, args, spec, why, coverage)
        if command:
            print(command)
    if args.write_config and best is None:
        print(f"rsclip-ds plan: nothing fits, so no DeepSpeed config was written to {args.write_config}",
              file=sys.stderr)
    elif args.write_config:
        if args.params:
            raise ConfigError("--write-config needs a --model preset (a --params model has no config to write)")
        write_config(best, args, budget.gpus, args.write_config)
        if not args.json:
            print(f"DeepSpeed config written to {args.write_config}")
    return doc, 0 if best else EXIT_NOTHING_FITS


def _row_doc(row, coverage: dict[int, dict] | None, micro: int | None) -> dict:
    """A row for --json; with --shards, `coverage` (the fraction of the data one epoch delivers at the
    row's micro-batch, or --micro's; None where the row does not fit or the data is refused) and `epoch`."""
    doc = row.to_dict()
    if coverage is not None:
        c = coverage.get(micro or row.micro) if row.fits else None
        doc["coverage"] = c.get("coverage") if c else None
        doc["epoch"] = {k: v for k, v in c.items() if k != "line"} if c else None
    return doc


def write_config(row, args, world_size: int, path: Path) -> dict:
    """The recommended row as the resolved DeepSpeed dict (run config defaults + the row's values)."""
    from rsclip_ds.config import load_config
    from rsclip_ds.planning.planner import HYBRID, hybrid_profile
    from rsclip_ds.profiles import load_profile
    from rsclip_ds.resolve import build_ds_config

    profile = hybrid_profile(row.profile, args.gpus) if row.profile in HYBRID else load_profile(row.profile)
    cfg = load_config(None, [o for o in _overrides(row, args) if not o.startswith("profile=")])
    ds = build_ds_config(cfg, profile, world_size, on_gpu=True, local_world_size=args.gpus)   # we plan for GPUs
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ds, indent=2))
    return ds

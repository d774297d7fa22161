"""Scaling on paper: time per Git-10M epoch of git-rsclip-large on 1-64 nodes x 8 H200, per
ZeRO strategy and network, from the planner's models (no GPU, no ranks).

    python -m benchmarks.comms.scaling --out benchmarks/results/scaling.json      # ~3-5 min on 2 cores
    python -m benchmarks.comms.scaling --mfu 0.3 --overlap 1 --out /tmp/scaling_overlap.json

Per (network, nodes, profile) the planner (`rsclip_ds.planning.planner.plan`, the strategy's profile only)
picks the largest micro-batch that fits an H200 (141 GB) with and without activation checkpointing
for a fixed global batch (--global-batch, 32768 as in the SigLIP papers: the per-GPU batch halves
when the GPUs double) under 'global' accumulation (every micro-batch's loss sees all negatives),
and the faster of the two rows is kept. Its step time is
    compute  flops.py's matmul FLOPs of the step (x 4/3 with checkpointing or with 'global'
             accumulation's cached forward at k > 1) at --mfu x --peak-tflops per GPU
    comm     rsclip_ds.planning.comms: what DeepSpeed 0.19.8 sends per step (the loss's features included),
             intra-node bytes at --intra-gbs (NVLink 4: 450 GB/s per direction, ~80% achieved),
             inter-node bytes at the network's per-GPU share (below, ~90% of line rate);
             a collective over both levels takes the slower one
    step     compute + comm - --overlap x min(compute, comm)
and an epoch is --samples / --global-batch steps (Git-10M: 10.5M pairs).

The 4 x A100 check (--a100): "4 x A100 = 3.2x one card" at a fixed per-GPU batch (weak scaling),
A100 80GB (312 TFLOP/s bf16 dense at the same MFU) on NVLink 3 or PCIe 4, git-rsclip-base and
-large, with and without overlap: speed-up = 4 x step(1 GPU) / step(4 GPUs), each with the profile
the planner recommends.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.harness import base_parser, page_tables, pyplot, save_figure, write_report
from benchmarks.results_tables.comms import scaling as scaling_tables
from rsclip_ds.planning import comms
from rsclip_ds.planning.memory import preset_spec
from rsclip_ds.planning.planner import Budget, Hardware, plan, recommend

# name -> (what, a GPU's share of the network in bytes/s)
NETWORKS = {
    "ib-ndr": ("InfiniBand NDR 400 Gb/s, one NIC per GPU", comms.IB_NDR_PER_GPU),
    "eth-100g": ("100 Gb/s Ethernet, one NIC per node shared by its 8 GPUs", comms.network_bw(100) / 8),
}
PROFILES = ("zero2", "zero3", "zero3_hpz", "zero3_zeropp", "zero3_mics")
H200_BYTES, A100_BYTES = 141 * 10**9, 80 * 10**9
A100_LINKS = {"nvlink3": comms.NVLINK3_BW, "pcie4": comms.PCIE4_BW}


def hardware(args, inter_bw: float, peak_tflops: float | None = None, intra_bw: float | None = None) -> Hardware:
    return Hardware(flops=args.mfu * (peak_tflops or args.peak_tflops) * 1e12,
                    intra_bw=intra_bw or args.intra_gbs * 1e9, inter_bw=inter_bw, overlap=args.overlap)


def best_row(spec, budget: Budget, global_batch: int, hw: Hardware, profiles) -> dict | None:
    """The fastest fitting row of `profiles` (None: the planner's own recommendation among all)."""
    rows = plan(spec, budget, global_batch, profiles=list(profiles) if profiles else None, hw=hw)
    if profiles:
        fitting = [r for r in rows if r.fits]
        row = min(fitting, key=lambda r: (r.step_s, r.gpu_gib)) if fitting else None
    else:
        row = recommend(rows)
    return row.to_dict() if row else None


def scaling_row(spec, profile: str, nodes: int, network: str, args) -> dict:
    """One line of the table: the planner's row for the profile, and what it makes of an epoch."""
    budget = Budget(args.gpus_per_node, nodes, int(args.gpu_mem_gb * 1e9))
    row = best_row(spec, budget, args.global_batch, hardware(args, NETWORKS[network][1]), [profile])
    out = {"network": network, "nodes": nodes, "gpus": budget.gpus, "profile": profile, "fits": row is not None}
    if row is None:
        return out
    steps = args.samples / args.global_batch
    out.update({k: row[k] for k in ("checkpointing", "micro", "accumulation", "gpu_gib", "compute_s", "comm_intra_s",
                                    "comm_inter_s", "comm_s", "host_s", "step_s", "candidate", "note")})
    out.update(steps_per_epoch=steps, epoch_h=steps * row["step_s"] / 3600,
               samples_per_s=args.global_batch / row["step_s"],
               effective_mfu=args.mfu * row["compute_s"] / row["step_s"])
    return out


def scaling_table(args) -> list[dict]:
    spec = preset_spec(args.model)
    rows = []
    for network in args.networks:
        for nodes in args.nodes:
            for profile in args.profiles:
                rows.append(scaling_row(spec, profile, nodes, network, args))
                r = rows[-1]
                print(f"{network:9s} {nodes:3d} nodes {profile:13s} "
                      + (f"{r['epoch_h']:7.2f} h  step {r['step_s']:.3f} s = compute {r['compute_s']:.3f} + comm "
                         f"{r['comm_s']:.3f} (inter {r['comm_inter_s']:.3f}) + host {r['host_s']:.3f}"
                         if r["fits"] else "does not fit"),
                      flush=True)
    for r in rows:   # speed-up over the same profile and network on one node, per GPU
        one = next((o for o in rows if o["network"] == r["network"] and o["profile"] == r["profile"]
                    and o["nodes"] == min(args.nodes) and o["fits"]), None)
        if r["fits"] and one:
            r["scaling_efficiency"] = one["epoch_h"] * one["gpus"] / (r["epoch_h"] * r["gpus"])
    return rows


def a100_check(args) -> list[dict]:
    """Weak scaling 1 -> 4 A100 at each of --a100-per-gpu samples per GPU (module docstring)."""
    out, ones = [], {}
    for model in ("git-rsclip-base", "git-rsclip-large"):
        spec = preset_spec(model)
        for per_gpu in args.a100_per_gpu:
            for link, bw in A100_LINKS.items():
                for overlap in (0.0, 1.0):
                    hw = replace(hardware(args, comms.IB_NDR_PER_GPU, peak_tflops=312, intra_bw=bw), overlap=overlap)
                    if (model, per_gpu) not in ones:   # one GPU sends nothing: link and overlap do not matter
                        ones[model, per_gpu] = best_row(spec, Budget(1, 1, A100_BYTES), per_gpu, hw, None)
                    one = ones[model, per_gpu]
                    four = best_row(spec, Budget(4, 1, A100_BYTES), 4 * per_gpu, hw, None)
                    speedup = 4 * one["step_s"] / four["step_s"]
                    out.append({"model": model, "link": link, "overlap": overlap, "per_gpu": per_gpu,
                                "one": one, "four": four, "speedup": speedup})
                    print(f"A100 {model} {per_gpu}/GPU {link} overlap {overlap:g}: 1 GPU {one['profile']} "
                          f"{one['micro']}x{one['accumulation']}{' ckpt' if one['checkpointing'] else ''} "
                          f"{one['step_s']:.3f} s; 4 GPUs {four['profile']} {four['micro']}x{four['accumulation']}"
                          f"{' ckpt' if four['checkpointing'] else ''} {four['step_s']:.3f} s (comm {four['comm_s']:.3f}): "
                          f"{speedup:.2f}x", flush=True)
    return out


def plot(report: dict, path: Path) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    networks = report["config"]["networks"]
    fig, axes = plt.subplots(1, len(networks), figsize=(6 * len(networks), 4.5), sharey=True, squeeze=False)
    for ax, network in zip(axes[0], networks):
        for p in report["config"]["profiles"]:
            pts = [(r["gpus"], r["epoch_h"]) for r in report["rows"] if r["network"] == network
                   and r["profile"] == p and r["fits"]]
            ax.plot(*zip(*pts), marker="o", label=p)
        gpus = [r["gpus"] for r in report["rows"] if r["network"] == network and r["profile"] == "zero2"]
        first = next(r for r in report["rows"] if r["network"] == network and r["profile"] == "zero2")
        ax.plot(gpus, [first["epoch_h"] * first["gpus"] / g for g in gpus], "k:", label="linear")
        ax.set(xscale="log", yscale="log", xlabel="H200 GPUs", title=NETWORKS[network][0])
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("hours per Git-10M epoch (git-rsclip-large)")
    axes[0][-1].legend()
    return save_figure(plt, fig, path)


def parse_args(argv):
    parser = base_parser(__doc__)
    parser.add_argument("--model", default="git-rsclip-large")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-mem-gb", type=float, default=141.0, help="H200: 141 GB")
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES))
    parser.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=list(NETWORKS))
    parser.add_argument("--global-batch", type=int, default=32768)
    parser.add_argument("--samples", type=float, default=10.5e6, help="pairs per epoch (Git-10M)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="H200 bf16 dense")
    parser.add_argument("--mfu", type=float, default=0.4, help="share of the peak the matmuls reach")
    parser.add_argument("--intra-gbs", type=float, default=comms.NVLINK4_BW / 1e9,
                        help="a GPU's achieved NVLink bandwidth, GB/s per direction")
    parser.add_argument("--overlap", type=float, default=0.0,
                        help="share of min(compute, comm) hidden (0: none, 1: perfect)")
    parser.add_argument("--a100", action=argparse.BooleanOptionalAction, default=True, help="run the 4 x A100 check")
    parser.add_argument("--a100-per-gpu", type=int, nargs="+", default=[32, 128, 256], help="samples per GPU per step")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    report = {"config": {k: v for k, v in vars(args).items() if k not in ("out", "local_rank", "threads")},
              "networks": {k: {"what": w, "inter_bw_per_gpu": bw} for k, (w, bw) in NETWORKS.items()},
              "rows": scaling_table(args)}
    report["config"]["out"] = str(args.out)
    if args.a100:
        report["a100"] = a100_check(args)
    report["seconds"] = time.perf_counter() - t0
    write_report(report, args.out, page_tables(scaling_tables, "scaling.json"), plot)
    print(f"wrote {args.out} in {report['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The tables and the figure of benchmarks/throughput/openclip.py, from its JSON report."""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness import pyplot, save_figure

COLORS = {"open_clip": "C3", "rsclip_ds": "C0"}


def _mm(s: dict, fmt: str = ".1f") -> str:
    return f"{s['min']:{fmt}}..{s['max']:{fmt}}"


def print_tables(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg, m = report["config"], report["models"]
    console = Console(width=190)
    console.print(f"model {cfg['shape']}: rsclip_ds {m['rsclip_ds_parameters']:,} parameters, open_clip "
                  f"{m['open_clip_parameters']:,} ({m['open_clip_over_rsclip_ds']:.4f}x); open_clip env "
                  f"{m['open_clip_env']}")
    table = Table(title=f"global samples/s over steps {cfg['skip'] + 1}..{cfg['steps']}, from each tool's log "
                        f"({cfg['ranks']} ranks, {cfg['device']}, micro {cfg['micro']}, {cfg['threads']} thread(s) "
                        f"per rank, {cfg['repeats']} interleaved repeats, threads: {cfg.get('thread_env', 'OMP_NUM_THREADS=1')})")
    table.add_column("case", no_wrap=True)
    for col in ("median", "min..max", "line-arrival median", "peak PSS GB", "start-up s", "minor faults /step/rank",
                "sys ms/step", "user ms/step", "whole run: faults /step/rank", "sys ms/step", "others' CPU share, max"):
        table.add_column(col, justify="right")
    for name, c in report["summary"]["cases"].items():
        if not c["runs"]:
            table.add_row(name, "failed", *[""] * 10)
            continue
        rate = c["samples_per_s"]
        pss = c.get("peak_pss_gb")
        table.add_row(name, f"{rate['median']:.2f}", _mm(rate), f"{c['samples_per_s_wall']['median']:.2f}",
                      f"{pss['median']:.2f}" if pss and pss["median"] else "-",
                      f"{c['startup_s']['median']:.1f}", f"{c['minflt_per_step_per_rank']['median']:.0f}",
                      f"{c['sys_ms_per_step']['median']:.0f}", f"{c['user_ms_per_step']['median']:.0f}",
                      f"{c['whole_run_minflt_per_step_per_rank']['median']:.0f}",
                      f"{c['whole_run_sys_ms_per_step']['median']:.0f}", f"{100 * c['foreign_cpu_share']['max']:.0f}%")
    console.print(table)
    ratios = Table(title="rsclip_ds / open_clip, paired within each repeat (> 1: rsclip_ds faster)")
    ratios.add_column("ratio", no_wrap=True)
    for col in ("median", "min..max", "per repeat", "peak PSS ratio (median)"):
        ratios.add_column(col, justify="right")
    for name, r in report["summary"]["ratios"].items():
        pss = r.get("peak_pss_ratio")
        ratios.add_row(name, f"{r['median']:.3f}", _mm(r, ".3f"), " ".join(f"{x:.3f}" for x in r["per_repeat"]),
                       f"{pss['median']:.2f}" if pss else "-")
    console.print(ratios)
    discarded = sum(len(r.get("discarded_attempts", [])) for r in report["runs"])
    if discarded:
        console.print(f"{discarded} attempt(s) run again: other processes took more than "
                      f"{100 * cfg.get('max_foreign', 1):.0f}% of the cores during their timed steps")
    for r in report["runs"]:
        if not r["ok"]:
            console.print(f"FAILED repeat {r['repeat']} {r['case']}: {r['error']} (log: {r['log']})", markup=False)


def plot(report: dict, path: Path) -> str | None:
    """Rates per case (median, min..max) and the paired ratios -> PNG, or None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    cases = {k: v for k, v in report["summary"]["cases"].items() if v["runs"]}
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    names = list(cases)
    med = [cases[n]["samples_per_s"]["median"] for n in names]
    err = [[m - cases[n]["samples_per_s"]["min"] for m, n in zip(med, names)],
           [cases[n]["samples_per_s"]["max"] - m for m, n in zip(med, names)]]
    axes[0].bar(range(len(names)), med, yerr=err, capsize=4, color=[COLORS[n.split("/")[0]] for n in names])
    axes[0].set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
    cfg = report["config"]
    axes[0].set(title=f"global samples/s, steps {cfg['skip'] + 1}..{cfg['steps']}", ylabel="samples/s")
    ratios = report["summary"]["ratios"]
    for i, r in enumerate(ratios.values()):
        axes[1].plot([i] * len(r["per_repeat"]), r["per_repeat"], "o", alpha=0.5, color="C0")
        axes[1].plot([i], [r["median"]], "D", color="C3", label="median" if i == 0 else None)
    axes[1].axhline(1.0, ls=":", color="gray", lw=1)
    axes[1].set_xticks(range(len(ratios)), [n.replace(" / ", "\n/ ") for n in ratios], rotation=25, ha="right",
                       fontsize=7)
    axes[1].set(title="rsclip_ds / open_clip, paired per repeat")
    if ratios:
        axes[1].legend(fontsize=8)
    faults = [cases[n]["minflt_per_step_per_rank"]["median"] for n in names]
    sys_ms = [cases[n]["sys_ms_per_step"]["median"] for n in names]
    axes[2].bar(range(len(names)), faults, color=[COLORS[n.split("/")[0]] for n in names])
    axes[2].set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
    axes[2].set(title="minor page faults per step per rank (bars) / sys ms per step (x)", ylabel="faults")
    twin = axes[2].twinx()
    twin.plot(range(len(names)), sys_ms, "kx")
    twin.set_ylabel("sys ms / step (whole tree)")
    m = report["models"]
    fig.suptitle(f"open_clip vs rsclip_ds, {cfg['shape']} ({m['rsclip_ds_parameters'] / 1e6:.2f}M parameters), "
                 f"{cfg['ranks']} ranks on {cfg['device']}")
    return save_figure(plt, fig, path)

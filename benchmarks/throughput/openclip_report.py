"""The tables and the figure of benchmarks/throughput/openclip.py, from its JSON report (the tables
are the results page's: benchmarks/results_tables/throughput.py)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness import pyplot, save_figure
from benchmarks.results_tables.throughput import openclip_tables

COLORS = {"open_clip": "C3", "rsclip_ds": "C0"}


def print_tables(report: dict) -> None:
    """The results page's tables of the comparison, then each run that failed."""
    print("\n".join(openclip_tables(report)))
    for r in report["runs"]:
        if not r["ok"]:
            print(f"FAILED repeat {r['repeat']} {r['case']}: {r['error']} (log: {r['log']})")


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

"""The tables and the figure of benchmarks/throughput/compare.py, from its JSON report (rank 0)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness import pyplot, save_figure

TARGETS = {"ours/bare": ">= 0.97", "ours/trainer": "> 1"}
COLORS = {"ours": "C0", "bare": "C7", "trainer": "C3", "ours_local": "C1"}


def print_tables(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    s, cfg = report["summary"], report["config"]
    table = Table(title=f"throughput, global samples/s ({report['environment']['world_size']} ranks, "
                        f"{cfg['precision']}, {cfg['profile']}, micro {cfg['micro']}, {cfg['steps']} steps x "
                        f"{cfg['repeats']} interleaved repeats)")
    for col in ("loop", "median", "min..max", "CPU ms/sample", "data wait", "samples/run"):
        table.add_column(col, justify="right")
    for name, r in s["loops"].items():
        table.add_row(name, f"{r['median_samples_per_s']:.1f}", f"{r['min']:.1f}..{r['max']:.1f}",
                      f"{r['median_cpu_ms_per_sample']:.2f}",
                      f"{100 * r['median_data_wait_fraction']:.1f}%", str(r["samples_per_run"]))
    ratios = Table(title="ratios, paired within each repeat")
    for col in ("ratio", "median", "min..max", "CPU-time ratio", "target"):
        ratios.add_column(col, justify="right")
    for name, r in s["ratios"].items():
        ratios.add_row(name, f"{r['median']:.3f}", f"{r['min']:.3f}..{r['max']:.3f}", f"{r['cpu_median']:.3f}",
                       TARGETS.get(name, ""))
    console = Console(width=140)
    console.print(table)
    console.print(ratios)
    ld = report["loader"]
    console.print(f"loader alone: {ld['samples_per_s']:.0f} samples/s on all ranks = "
                  f"{ld['headroom_over_ours']:.1f} x what 'ours' consumes")
    c = report["summary_rate_with_final_checkpoint"]
    if c["summary_over_steps"] is not None:
        console.print(f"with the default end-of-run checkpoint, summary.json says {c['summary_samples_per_s']:.1f} "
                      f"samples/s where the steps ran at {c['step_hook_samples_per_s']:.1f} "
                      f"({c['summary_over_steps']:.2f} x)")
    for p in report["python_self_time"]:
        console.print(f"{p['loop']}: {p['self_ms_per_step']:.2f} ms/step Python self time in its own code "
                      f"(+ {p['loader_main_process_ms_per_step']:.2f} ms in the loader's main-process side)")
    q = report["quality"]
    quality = Table(title=f"quality at equal compute: held-out retrieval ({q[0]['num_images']} val pairs) after "
                          f"{q[0]['steps']} steps" if q else "quality")
    for col in ("negatives", "i2t R@1", "t2i R@1", "mean recall", "final train loss"):
        quality.add_column(col, justify="right")
    for r in q:
        quality.add_row(r["negatives"], f"{r['i2t_R@1']:.3f}", f"{r['t2i_R@1']:.3f}", f"{r['mean_recall']:.3f}",
                        f"{r['final_train_loss']:.3f}")
    console.print(quality)
    for note in report["notes"]:
        console.print(f"note: {note}", markup=False)


def plot(report: dict, path: Path) -> str | None:
    """Rates, paired ratios, quality -> PNG; returns the path, or None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    loops = report["summary"]["loops"]
    names = list(loops)
    med = [loops[n]["median_samples_per_s"] for n in names]
    err = [[m - loops[n]["min"] for m, n in zip(med, names)], [loops[n]["max"] - m for m, n in zip(med, names)]]
    axes[0].bar(names, med, yerr=err, capsize=4, color=[COLORS.get(n, "C4") for n in names])
    axes[0].set(title=f"global samples/s (median, min..max); loader alone "
                      f"{report['loader']['samples_per_s']:.0f}", ylabel="samples/s")
    axes[0].tick_params(axis="x", labelrotation=15)
    ratios = report["summary"]["ratios"]
    for i, (name, r) in enumerate(ratios.items()):
        axes[1].plot([i] * len(r["per_repeat"]), r["per_repeat"], "o", alpha=0.5, color="C0")
        axes[1].plot([i], [r["median"]], "D", color="C3", label="median (wall)" if i == 0 else None)
        axes[1].plot([i + 0.15], [r["cpu_median"]], "x", color="k", label="median (CPU time)" if i == 0 else None)
    axes[1].axhline(0.97, ls="--", color="k", lw=1, label="target ours/bare 0.97")
    axes[1].axhline(1.0, ls=":", color="gray", lw=1)
    axes[1].set_xticks(range(len(ratios)), list(ratios), rotation=15)
    axes[1].set(title="ratios paired per repeat (dots: wall, per repeat)")
    axes[1].legend(fontsize=8)
    q = report["quality"]
    if q:
        keys = ("i2t_R@1", "t2i_R@1", "mean_recall")
        for j, r in enumerate(q):
            axes[2].bar([k + 0.4 * j - 0.2 for k in range(len(keys))], [r[k] for k in keys], 0.4,
                        label=f"negatives={r['negatives']}")
        axes[2].set_xticks(range(len(keys)), keys)
        top = max(r[k] for r in q for k in keys)
        axes[2].set(title=f"held-out retrieval ({q[0]['num_images']} pairs) after {q[0]['steps']} steps",
                    ylim=(0, 1.3 * top + 1e-3))
        axes[2].legend(fontsize=8)
    env = report["environment"]
    fig.suptitle(f"tiny preset, {env['world_size']} ranks ({env['device']}), "
                 f"{report['config']['profile']} {report['config']['precision']}")
    return save_figure(plt, fig, path)

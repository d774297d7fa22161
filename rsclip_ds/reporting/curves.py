"""Training curves: loss, learning rate and evaluation metrics against the optimizer step.

    plot_curves(json.load(open("runs/x/summary.json")), "runs/x/curves.png")

matplotlib is optional (the `bench` extra): without it the plot is skipped with one log line,
so training never fails for want of a plotting library.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("rsclip_ds")
# The evaluation metrics drawn (when present), in this order; other keys are left out.
EVAL_KEYS = ("zero_shot/top1", "zero_shot/top5", "zero_shot/mean_per_class", "retrieval/t2i_R@1",
             "retrieval/i2t_R@1", "retrieval/mean_recall")


def curve_series(summary_or_result: Any) -> dict[str, Any]:
    """-> {"steps": [1..N], "loss": [...], "lr": [...], "eval_steps": [...], "eval": {key: [...]}}
    from a summary dict (summary.json) or a TrainResult (anything with .to_dict())."""
    data = summary_or_result.to_dict() if hasattr(summary_or_result, "to_dict") else dict(summary_or_result)
    losses, lrs = list(data.get("losses") or []), list(data.get("lrs") or [])
    if not losses:
        raise ValueError("no 'losses' to plot: pass a run's summary.json contents or a TrainResult")
    evals = sorted(data.get("evals") or [], key=lambda e: e["step"])
    keys = [k for k in EVAL_KEYS if any(k in e for e in evals)]
    return {"steps": list(range(1, len(losses) + 1)), "loss": losses, "lr": lrs[:len(losses)],
            "eval_steps": [e["step"] for e in evals],
            "eval": {k: [e.get(k, float("nan")) for e in evals] for k in keys}}


def plot_curves(summary_or_result: Any, out_png: str | Path) -> Path | None:
    """Write the PNG (2 panels, 3 with evaluation results); None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        log.info("matplotlib is not installed: training curves skipped (pip install 'rsclip_ds[plots]')")
        return None
    matplotlib.use("Agg")   # no display on cluster nodes
    import matplotlib.pyplot as plt

    s = curve_series(summary_or_result)
    panels = 3 if s["eval"] else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.6), dpi=100, squeeze=False)
    ax = axes[0]
    ax[0].plot(s["steps"], s["loss"], lw=1.2)
    ax[0].set(title="training loss", xlabel="optimizer step", ylabel="loss")
    ax[1].plot(s["steps"][:len(s["lr"])], s["lr"], lw=1.2, color="tab:orange")
    ax[1].set(title="learning rate", xlabel="optimizer step", ylabel="lr")
    ax[1].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if s["eval"]:
        for key, values in s["eval"].items():
            ax[2].plot(s["eval_steps"], [100 * v for v in values], marker="o", ms=3, label=key)
        ax[2].set(title="evaluation", xlabel="optimizer step", ylabel="%", ylim=(0, 100))
        ax[2].legend(fontsize=7)
    for a in ax:
        a.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out

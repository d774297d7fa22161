"""The end-of-run summary: one dict (written as summary.json) and a rich table."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from rsclip_ds.precision import uses_fp16
from rsclip_ds.profiles import Profile
from rsclip_ds.reporting.load import HOST_PEAK, load_summary
from rsclip_ds.loop import TrainResult
from rsclip_ds.resolve import BatchSizes


def _window_mean(values: list[float], head: bool, n: int = 5) -> float:
    window = values[:n] if head else values[-n:]
    return sum(window) / max(1, len(window))


def latest_report(output_dir: str | Path) -> str | None:
    """The evaluation report of the run's latest suite step, {output_dir}/eval/step{N:08d}/report.html
    with the highest N that has one (as a path from where output_dir is given); None without one."""
    reports = [(int(m.group(1)), p) for p in Path(output_dir).glob("eval/step*/report.html")
               if (m := re.fullmatch(r"step(\d+)", p.parent.name))]
    return str(max(reports)[1]) if reports else None


def build_summary(result: TrainResult, *, profile: Profile, batch: BatchSizes, precision: str,
                  source, num_parameters: int, activation_checkpointing: bool,
                  loss: str, negatives: str, accumulation: str,
                  output_dir: str | Path | None = None) -> dict[str, Any]:
    """``source``: where the model came from (a hub.ModelSource, or a preset name). ``output_dir``:
    the run's folder, where the latest evaluation report is looked for ("report")."""
    return {
        "profile": profile.name, "zero_stage": profile.stage,
        "offload_optimizer": profile.offload_optimizer, "offload_param": profile.offload_param,
        "activation_checkpointing": activation_checkpointing, "precision": precision,
        "model": str(source), "model_source": source.to_dict() if hasattr(source, "to_dict") else None,
        "parameters": num_parameters, "loss": loss,
        "negatives": negatives, "accumulation_mode": accumulation,
        "micro_batch": batch.micro, "accumulation": batch.accumulation, "world_size": batch.world,
        "global_batch": batch.global_batch, "batch_arithmetic": str(batch),
        "loss_start": _window_mean(result.losses, head=True),
        "loss_end": _window_mean(result.losses, head=False),
        **result.to_dict(),
        # per-rank means over the log windows, and the slowest / fastest / max-data-wait ranks
        "load": load_summary(result.rank_load),
        "report": latest_report(output_dir) if output_dir is not None else None,
    }


def write_summary(summary: dict[str, Any], out_dir: Path) -> Path:
    path = Path(out_dir) / "summary.json"
    path.write_text(json.dumps(summary, indent=2))
    return path


def print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    s = summary
    table = Table(title="rsclip_ds run summary", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    offload = "+".join(k for k in ("optimizer", "param") if s[f"offload_{k}"]) or "none"
    rows = [
        ("profile", f"{s['profile']} (ZeRO-{s['zero_stage']}, offload: {offload}, "
                    f"activation checkpointing: {'on' if s['activation_checkpointing'] else 'off'})"),
        ("model", f"{s['model']} ({s['parameters'] / 1e6:.2f}M parameters, {s['loss']} loss)"),
        ("precision", s["precision"]),
        ("batch", f"micro x accumulation x world = global: {s['batch_arithmetic']} "
                  f"({s['negatives']} negatives, {s['accumulation_mode']} accumulation)"),
        ("steps", f"{s['optimizer_steps']} optimizer steps, {s['micro_steps']} micro-steps" + _skipped(s)),
        ("throughput", f"{s['samples_per_s']:.1f} samples/s (global, after step 1); {s['seconds']:.1f} s total"),
        ("loss", f"{s['loss_start']:.4f} -> {s['loss_end']:.4f} (mean of first / last 5 steps)"),
    ]
    if s.get("loss_scale") is not None:
        rows.append(("fp16 loss scale", f"{s['loss_scale']:g}"))
    rows += _epoch_rows(s.get("epochs"))
    rows += _load_rows(s.get("load"))
    rows += _fault_rows(s)
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def _skipped(s: dict[str, Any]) -> str:
    """', 2 skipped (gradient norm not finite: steps 40, 41)', or under a loss scale (fp16, amp) ', 3 skipped
    (loss scaler)': it skips steps of its own while it finds its scale."""
    if not s["skipped_steps"]:
        return ""
    steps = s.get("skipped") or []
    if uses_fp16(s["precision"]):
        return f", {s['skipped_steps']} skipped (loss scaler)"
    if not steps:
        return f", {s['skipped_steps']} skipped"
    shown = ", ".join(str(x) for x in steps[:5]) + (f", ... {steps[-1]}" if len(steps) > 5 else "")
    return f", {s['skipped_steps']} skipped (gradient norm not finite: step{'s' if len(steps) > 1 else ''} {shown})"


def _epoch_rows(epochs: list[dict[str, Any]] | None) -> list[tuple[str, str]]:
    """'2 complete, epoch 2 at 40 %; an epoch: 21 batches per rank = 1,008 of 1,024 samples (98.4 %)'
    (the last full epoch's size; a remap's transition epoch is said apart)."""
    if not epochs:
        return []
    done = [e for e in epochs if e["complete"]]
    said = f"{len(done)} complete"
    last = epochs[-1]
    if not last["complete"] and last["delivered"]:
        said += f", epoch {last['epoch']} at {100 * last['delivered'] / last['samples']:.0f} %"
    full = next((e for e in reversed(epochs) if not e["transition"]), epochs[-1])
    size = f"{full['batches_per_rank']:,} batches per rank = {full['samples']:,}"
    if full["epoch_samples"] is not None and full["policy"] == "exact":
        size += f" of {full['epoch_samples']:,} samples ({100 * full['coverage']:.1f} %)"
    else:
        size += " samples drawn with replacement"
    return [("epochs", f"{said}; an epoch: {size}")]


# the metrics the summary table shows when they exist (summary.json and eval/*.json have all)
_HEADLINE = ("zero_shot/top1", "zero_shot/mean_per_class", "retrieval/i2t_R@1", "retrieval/t2i_R@1",
             "retrieval/mean_recall")


def _headline(ev: dict[str, Any]) -> str:
    keys = [k for k in _HEADLINE if k in ev] or [k for k in ev if k != "step"]
    return ", ".join(f"{k} {ev[k]:.4g}" if isinstance(ev[k], float) else f"{k} {ev[k]}" for k in keys)


def _load_rows(load: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The per-rank load (reporting.load): which rank was slowest, which waited most for data."""
    if not load or len(load["step_s"]) < 2:
        return []
    step_s, wait, peak = load["step_s"], load["data_wait"], load["peak_mem_bytes"]
    slow, fast, waits, big = (load[k] for k in ("slowest_rank", "fastest_rank", "max_data_wait_rank",
                                                "max_peak_mem_rank"))
    what = "host RSS high-water" if load["peak_mem_kind"] == HOST_PEAK else "GPU max allocated"
    return [("step time per rank", f"slowest rank {slow} ({step_s[slow]:.3f} s), fastest rank {fast} "
                                   f"({step_s[fast]:.3f} s)"),
            ("data wait per rank", f"max rank {waits} ({100 * wait[waits]:.0f}% of its step time); "
                                   + ", ".join(f"rank {r} {100 * w:.0f}%" for r, w in enumerate(wait))),
            ("peak memory per rank", f"max rank {big} ({peak[big] / 2**30:.2f} GiB {what})")]


def _fault_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """Bad data, evaluations, checkpoints, resumes and pre-emption: shown when they happened."""
    rows = []
    bad = {k: v for k, v in s.get("bad_data", {}).items() if v}
    if bad:
        rows.append(("bad data skipped", ", ".join(f"{v} {k}" for k, v in bad.items()) + " (all ranks)"))
    evals = s.get("evals", [])
    for ev in evals[:1] + evals[-1:] if len(evals) > 1 else evals:   # first and last; all in summary.json
        rows.append((f"eval @ step {ev['step']}", _headline(ev)))
    if s.get("report"):
        rows.append(("eval report", f"{s['report']} (open it in a browser)"))
    if s.get("resumed_from"):
        rows.append(("resumed", "at step " + ", ".join(str(x) for x in s["resumed_from"])))
    if s.get("checkpoints"):
        rows.append(("checkpoints", ", ".join(s["checkpoints"][-3:]) + " (newest last)"))
    if s.get("stopped"):
        rows.append(("stopped", f"{s['stopped']}: checkpoint saved, continue with --resume latest"))
    return rows

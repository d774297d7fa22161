"""Evaluation during training: the hook the train loop calls, its log line, JSON and monitor events."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rsclip_ds.data.geotiff import BandChoice
from rsclip_ds.evaluation.datasets import EvalSets
from rsclip_ds.evaluation.embed import Embedder, evaluate
from rsclip_ds.evaluation.metrics import flat_metrics
from rsclip_ds.model import ModelBundle

log = logging.getLogger("rsclip_ds")

def log_results(results: dict, step: int | None = None) -> None:
    prefix = f"eval at step {step}: " if step is not None else "eval: "
    log.info(prefix + "  ".join(f"{k} {100 * v:.2f}" for k, v in flat_metrics(results).items()))


def write_monitor(monitor, results: dict, step: int) -> None:
    """DeepSpeed's MonitorMaster (TensorBoard / CSV / W&B as the DeepSpeed config says);
    events 'Eval/<group>/<metric>' at the optimizer step, the names training writes
    (reporting.metrics.MetricsLog.eval)."""
    if monitor is not None and monitor.enabled:
        monitor.write_events([(f"Eval/{k}", v, step) for k, v in flat_metrics(results).items()])


def build_monitor(ds_config: dict):
    """MonitorMaster from a DeepSpeed config dict, None when it enables no monitor."""
    from deepspeed.monitor.config import get_monitor_config
    from deepspeed.monitor.monitor import MonitorMaster

    config = get_monitor_config(ds_config)
    return MonitorMaster(config) if config.enabled else None


# --------------------------------------------------------------------------- during training

def build_eval_hook(run, bundle: ModelBundle, rank: int, world_size: int):
    """-> hook(step, engine) evaluating every `run.eval.every` steps and after the last, through
    the engine's forward (ZeRO-3 safe); None when run.eval.every is 0. The data sets are read
    now, so a wrong path fails before training starts. Returns the flat metrics, None on other
    steps; rank 0 writes {output_dir}/eval/step{N:08d}.json (the train loop writes the returned
    metrics to metrics.jsonl and the engine's monitor)."""
    cfg = run.eval
    if cfg.every == 0:
        return None
    sets = EvalSets.from_config(cfg)
    out_dir = Path(run.output_dir) / "eval"

    def hook(step: int, engine) -> dict | None:
        if step % cfg.every and step != run.steps:
            return None
        was_training = engine.module.training
        engine.eval()
        try:
            embedder = Embedder(engine, bundle, cfg.batch_size, rank, world_size, engine.device, progress=False,
                                bands=BandChoice.parse(cfg.bands, cfg.band_scale))
            results = evaluate(embedder, sets)
        finally:
            engine.train(was_training)
        if rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / f"step{step:08d}.json").write_text(json.dumps({"step": step, **results}, indent=2))
            log_results(results, step)
        return flat_metrics(results)

    return hook


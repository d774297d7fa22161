"""Evaluation during training: the hook the train loop calls, its log line, JSON and monitor events, and the
report folder of each evaluation (suite.json, per-sample files, report.html), which `rsclip-ds eval` writes too."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rsclip_ds.config import ConfigError, EvalConfig
from rsclip_ds.data.geotiff import BandChoice
from rsclip_ds.evaluation.catalog import FoundSet, find_sets
from rsclip_ds.evaluation.datasets import EvalSets
from rsclip_ds.evaluation.embed import Embedder, evaluate
from rsclip_ds.evaluation.metrics import flat_metrics
from rsclip_ds.evaluation.prompts import TemplateSet, load_template_set, zero_shot_templates
from rsclip_ds.evaluation.suite import CLASSIFICATION, RETRIEVAL, RETRIEVAL_KEYS, evaluate_suite, suite_metrics
from rsclip_ds.model import ModelBundle

log = logging.getLogger("rsclip_ds")


def evaluation_records(results: dict, cfg: EvalConfig) -> list[dict]:
    """embed.evaluate's results as the suite's records (suite.py: one per set and protocol), the set named by
    its folder (eval.zero_shot_dir) or caption file (eval.retrieval_json), so that one report (report.py:
    suite.json, samples/, report.html) shows them; each record holds its group's rows where it has them."""
    records = []
    if "zero_shot" in results:
        z, folder = results["zero_shot"], Path(str(cfg.zero_shot_dir))
        record = {"name": folder.name, "root": str(folder), "split": "all images", "known": False, "warnings": [],
                  "protocol": CLASSIFICATION, "images": z["num_images"], "classes": z["num_classes"],
                  "templates": zero_shot_templates(cfg.templates, cfg.templates_set),
                  **{k: z[k] for k in ("class_phrases", "top1", "top5", "mean_per_class", "per_class",
                                       "skipped_images")}}
        records.append({**record, **({"rows": z["rows"]} if "rows" in z else {})})
    if "retrieval" in results:
        r, path = results["retrieval"], Path(str(cfg.retrieval_json))
        record = {"name": path.stem, "root": str(path), "split": cfg.retrieval_split, "known": False, "warnings": [],
                  "protocol": RETRIEVAL, "images": r["num_images"], "captions": r["num_texts"],
                  **{k: r[k] for k in (*RETRIEVAL_KEYS, "skipped_images", "skipped_captions")}}
        records.append({**record, **({"rows": r["rows"]} if "rows" in r else {})})
    return records


def write_evaluation(folder: Path, model: str, step: int | None, template_set: str,
                     records: list[dict]) -> list[Path]:
    """Rank 0's report of one evaluation's records (the suite's and evaluation_records'): folder/suite.json,
    suite.md, suite.png, samples/ and report.html (report.write_report), the published numbers beside ours
    where a set is a known one. Each record's rows leave it for the samples file it then names."""
    from rsclip_ds.evaluation.catalog import published_results
    from rsclip_ds.evaluation.report import write_report

    results = {"model": model, "step": step, "template_set": template_set, "sets": records}
    return write_report(results, folder, published_results())


def link_samples(results: dict, records: list[dict], prefix: str) -> None:
    """After write_evaluation: each of embed.evaluate's groups names its samples file (prefix: the report folder,
    relative to where the results JSON lies) as "samples", and holds its rows no more."""
    kinds = {CLASSIFICATION: "zero_shot", RETRIEVAL: "retrieval"}
    for record in records:
        group = results.get(kinds[record["protocol"]])
        if group is not None and "samples" in record:
            group.pop("rows", None)
            group["samples"] = f"{prefix}/{record['samples']}"


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
    """-> hook(step, engine) evaluating every `run.eval.every` steps (the suite every
    `eval.suite_every`, default the same) and after the last, through the engine's forward
    (ZeRO-3 safe); None when nothing is due ever. The data sets are read and the suite root
    searched now, so a wrong path fails before training starts."""
    cfg = run.eval
    if cfg.every == 0 and cfg.suite_every == 0:
        return None
    sets = EvalSets.from_config(cfg) if (cfg.zero_shot_dir or cfg.retrieval_json) else None
    found = find_suite(cfg.suite, cfg.suite_overrides, rank) if cfg.suite is not None else None
    templates = load_template_set(cfg.templates if cfg.templates is not None else cfg.templates_set)
    return make_eval_hook(cfg, bundle, rank, world_size, Path(run.output_dir) / "eval", run.steps,
                          sets=sets, suite=found, templates=templates)


def find_suite(root: Path, overrides: Path | None, rank: int) -> list[FoundSet]:
    """catalog.find_sets, with the folders it did not recognise logged; none found: ConfigError.
    Sorted by name and folder: every rank must walk the sets in the same order (each is a collective)."""
    found, unrecognised = find_sets(root, overrides)
    found = sorted(found, key=lambda s: (s.name, str(s.root)))
    if rank == 0:
        for s in found:
            log.info("suite: %s in %s, %s", s.name, s.root, s.split)
            for warning in s.warnings:
                log.warning("suite: %s: %s", s.name, warning)
        if unrecognised:
            log.warning("suite: not recognised under %s (not evaluated): %s", root,
                        ", ".join(str(p) for p in unrecognised))
    if not found:
        raise ConfigError(f"eval.suite / --suite {root}: no standard set found (not recognised: "
                          f"{', '.join(str(p) for p in unrecognised) or 'nothing there'}); the layouts "
                          f"recognised are listed in docs/guides/evaluation.md")
    return found


def make_eval_hook(cfg: EvalConfig, bundle: ModelBundle, rank: int, world_size: int, out_dir: Path,
                   last_step: int, *, sets: EvalSets | None = None, suite: list[FoundSet] | None = None,
                   templates: TemplateSet | None = None):
    """The hook of build_eval_hook on sets already read (a seam: tests and workers pass their
    own). Returns the flat metrics (zero_shot/..., retrieval/..., suite/<set>/top1 or
    mean_recall), None on steps where nothing is due; rank 0 writes out_dir/step{N:08d}.json
    (the train loop writes the returned metrics to metrics.jsonl and the engine's monitor).
    Every rank decides from the step alone, so all join the same collectives."""
    suite_every = cfg.suite_every or cfg.every
    templates = templates or load_template_set(None)

    def due(every: int, step: int) -> bool:
        return bool(every) and (step % every == 0 or step == last_step)

    def hook(step: int, engine) -> dict | None:
        do_sets, do_suite = sets is not None and due(cfg.every, step), bool(suite) and due(suite_every, step)
        if not (do_sets or do_suite):
            return None
        was_training = engine.module.training
        engine.eval()
        try:
            embedder = Embedder(engine, bundle, cfg.batch_size, rank, world_size, engine.device, progress=False,
                                bands=BandChoice.parse(cfg.bands, cfg.band_scale))
            results = evaluate(embedder, sets, samples=True) if do_sets else {}
            suite_results = (evaluate_suite(suite, embedder, templates, cfg.max_bad_fraction, samples=True)
                             if do_suite else None)
        finally:
            engine.train(was_training)
        flat = {**flat_metrics(results), **(suite_metrics(suite_results) if suite_results else {})}
        if rank == 0:
            out = out_dir / f"step{step:08d}.json"
            # this step's report: eval/step{N}/ (suite.json, samples/, report.html) of every set evaluated
            plain = evaluation_records(results, cfg)
            suite_sets = suite_results["sets"] if suite_results else []
            write_evaluation(out.with_suffix(""), str(out_dir.parent), step, templates.name, suite_sets + plain)
            link_samples(results, plain, out.stem)
            for r in suite_sets:   # step{N}.json names the same files, from eval/
                if "samples" in r:
                    r["samples"] = f"{out.stem}/{r['samples']}"
            record = {"step": step, **results, **({"suite": suite_results} if suite_results else {})}
            out.write_text(json.dumps(record, indent=2, ensure_ascii=False), encoding="utf-8")
            log.info(f"eval at step {step}: " + "  ".join(f"{k} {100 * v:.2f}" for k, v in flat.items()))
        return flat

    return hook

"""`rsclip-ds eval`: zero-shot classification and retrieval for a checkpoint or a Hugging Face
folder, alone or under the deepspeed launcher (items split over ranks).

    rsclip-ds eval --model runs/export/ --zero-shot data/AID --retrieval data/RSICD/dataset_rsicd.json
    rsclip-ds eval --model lcybuaa/Git-RSCLIP --suite data/rs --templates-set git-rsclip
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import torch

from rsclip_ds.config import TEMPLATE_SET_NAMES, ConfigError, EvalConfig
from rsclip_ds.data.bad import DataError
from rsclip_ds.data.geotiff import BandChoice, BandsError
from rsclip_ds.evaluation import Embedder, EvalSets, evaluate, flat_metrics
from rsclip_ds.evaluation.hook import (build_monitor, evaluation_records, link_samples, log_results,
                                       write_evaluation, write_monitor)
from rsclip_ds.model import ModelBundle

log = logging.getLogger("rsclip_ds")


def print_results(results: dict, title: str) -> None:
    """A rich table of the scalar metrics, and one of the per-class zero-shot accuracies."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=title)
    for col in ("metric", "value"):
        table.add_column(col)
    for key, value in flat_metrics(results).items():
        table.add_row(key, f"{100 * value:.2f} %")
    if "zero_shot" in results:
        r = results["zero_shot"]
        table.add_row("zero_shot/size", f"{r['num_images']} images, {r['num_classes']} classes"
                      + (f", {r['skipped_images']} unreadable skipped" if r.get("skipped_images") else ""))
    if "retrieval" in results:
        r = results["retrieval"]
        table.add_row("retrieval/size", f"{r['num_images']} images, {r['num_texts']} captions"
                      + (f", {r['skipped_images']} unreadable images and their {r['skipped_captions']} "
                         "captions skipped" if r.get("skipped_images") else ""))
    console.print(table)
    if "zero_shot" in results:
        per_class = Table(title="zero-shot accuracy per class")
        per_class.add_column("class")
        per_class.add_column("top-1")
        for name, acc in results["zero_shot"]["per_class"].items():
            per_class.add_row(name, f"{100 * acc:.1f} %")
        console.print(per_class)



def register(sub) -> None:
    p = sub.add_parser("eval", help="zero-shot classification and retrieval for a checkpoint or a "
                       "Hugging Face folder (alone, or under the deepspeed launcher: data split over ranks)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", type=Path, help="a training checkpoint: {output_dir}/checkpoints/"
                       "step{N:08d}, the checkpoints folder or the run's output_dir (newest checkpoint)")
    which.add_argument("--model", help="a Hugging Face SigLIP folder or hub id (e.g. lcybuaa/Git-RSCLIP), "
                       "with tokenizer and image processor, e.g. from `rsclip-ds export`")
    p.add_argument("--zero-shot", type=Path, help="class-folder data set (default for a checkpoint: "
                   "the run's eval.zero_shot_dir)")
    p.add_argument("--retrieval", type=Path, help="Karpathy-style caption JSON (default for a "
                   "checkpoint: the run's eval.retrieval_json)")
    p.add_argument("--retrieval-images", type=Path, help="folder of the caption JSON's images")
    p.add_argument("--split", default=None, help="caption JSON split (default: test)")
    templates = p.add_mutually_exclusive_group()
    templates.add_argument("--templates", type=Path, help="prompt templates file (default: the set 'ours')")
    templates.add_argument("--templates-set", choices=TEMPLATE_SET_NAMES, default=None,
                           help="a shipped template set: ours (default), git-rsclip, remoteclip, georsclip")
    p.add_argument("--suite", type=Path, help="a folder of the standard remote-sensing sets as released "
                   "(AID, NWPU-RESISC45, WHU-RS19, ..., RSICD, RSITMD): evaluates each one found, with the "
                   "published numbers beside ours (JSON, markdown table, PNG)")
    p.add_argument("--overrides", type=Path, help="with --suite: JSON of {set name: {folder name: prompt "
                   "phrase}} over the shipped class phrases")
    p.add_argument("--compare", help="with --suite: a second model (folder, hub id or checkpoint) "
                   "evaluated on the same sets, its columns beside")
    p.add_argument("--batch-size", type=int, default=None, help="per rank (default 64)")
    p.add_argument("--max-bad-fraction", type=float, default=None, help="unreadable or missing images "
                   "are skipped and counted; past this fraction of a set the evaluation stops (default 0.01)")
    p.add_argument("--bands", default=None, help="multispectral TIFFs: 1-based bands as R,G,B (Sentinel-2: "
                   "4,3,2); without it a > 3-band TIFF stops the evaluation")
    p.add_argument("--band-scale", default=None, help="with --bands: percentile:LO,HI (default 2,98) or range:MIN,MAX")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--out", type=Path, help="results JSON (default: {output_dir}/eval/<tag>.json for a "
                   "checkpoint, eval/<folder name>.json for a model folder); with --suite a folder (default: "
                   "suite-<tag> / suite-<folder name> there)")
    p.add_argument("--ds-config", type=Path, help="DeepSpeed config JSON whose tensorboard / csv_monitor "
                   "sections receive the metrics (default for a checkpoint: the run's ds_config.json); W&B gets "
                   "the evaluations a training run makes, in its own W&B run, not a standalone eval's")
    p.set_defaults(handler=run)


def _eval_config(args, base: EvalConfig) -> EvalConfig:
    """--flags over the run's eval section (a checkpoint) or the defaults (a model folder)."""
    given = {"zero_shot_dir": args.zero_shot, "retrieval_json": args.retrieval,
             "retrieval_images": args.retrieval_images, "retrieval_split": args.split,
             "templates": args.templates, "templates_set": args.templates_set, "batch_size": args.batch_size,
             "max_bad_fraction": args.max_bad_fraction, "bands": args.bands, "band_scale": args.band_scale}
    update = {k: v for k, v in given.items() if v is not None}
    if args.templates is not None or args.templates_set is not None:   # the flag replaces the run's choice
        update.setdefault("templates", None)
        update.setdefault("templates_set", None)
    return base.model_copy(update=update)


def _load_for_eval(args, loss: str = "siglip"):
    """-> (bundle, step or None, EvalConfig defaults, default out path, DeepSpeed config or None)."""
    from rsclip_ds.config import ModelConfig
    from rsclip_ds.model import build_model

    if args.model is not None:
        bundle = build_model(ModelConfig(pretrained=args.model), seed=0, loss=loss)
        name = Path(args.model).resolve().name if Path(args.model).exists() else args.model.rsplit("/", 1)[-1]
        return bundle, None, EvalConfig(), Path("eval") / f"{name}.json", None
    from rsclip_ds.checkpoint import consolidated_state_dict, resolve_checkpoint

    try:
        root, tag = resolve_checkpoint(args.checkpoint)
        run, state = consolidated_state_dict(Path(root) / tag)
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from None
    hf = Path(root) / tag / "hf"   # the checkpoint's own model config + tokenizer, when it has them
    bundle = _bundle_from_hf_folder(hf, run.loss.name) if (hf / "config.json").is_file() else \
        build_model(run.model, run.seed, loss=run.loss.name)
    if run.finetune.lora.towers:   # the adapters merged, as `rsclip-ds export` writes them
        from rsclip_ds.finetune import merge_lora_state

        state = merge_lora_state(state, run.finetune.lora)
    bundle.model.load_state_dict(state)
    step = int(m.group(1)) if (m := re.fullmatch(r"step(\d+)", str(tag))) else None
    ds_path = Path(root).parent / "ds_config.json"
    ds_config = json.loads(ds_path.read_text()) if ds_path.is_file() else None
    return bundle, step, run.eval, Path(root).parent / "eval" / f"{tag}.json", ds_config


def _bundle_from_hf_folder(folder: Path, loss: str) -> ModelBundle:
    """A randomly initialised model with the folder's architecture, tokenizer and normalisation
    (the weights come from the checkpoint): independent of the run's original paths."""
    from transformers import SiglipConfig, SiglipImageProcessorPil

    from rsclip_ds.model import load_tokenizer, new_dual_encoder

    model = new_dual_encoder(SiglipConfig.from_pretrained(str(folder)), loss)
    proc = SiglipImageProcessorPil.from_pretrained(str(folder))
    vc, tc = model.config.vision_config, model.config.text_config
    return ModelBundle(model, load_tokenizer(folder), vc.image_size, tuple(proc.image_mean),
                       tuple(proc.image_std), tc.max_position_embeddings)


def _device_and_dtype(info, precision: str) -> tuple[torch.device, torch.dtype]:
    """This rank's accelerator (the CPU on CPU ranks) and the --precision dtype."""
    device = torch.device("cpu")
    if info.on_gpu:
        from deepspeed.accelerator import get_accelerator
        device = torch.device(get_accelerator().device_name(info.local_rank))
    return device, {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def run(args) -> int:
    """The `rsclip-ds eval` handler: every rank embeds its share, rank 0 reports."""
    from rsclip_ds.runtime.distributed import configure_logging, destroy_distributed, init_distributed

    if args.suite is not None:
        return run_suite(args)
    if args.overrides is not None or args.compare is not None:
        raise ConfigError("--overrides and --compare go with --suite ROOT")
    # everything that can fail (paths, checkpoint, data sets) before a process group exists
    bundle, step, base, default_out, ds_config = _load_for_eval(args)
    cfg = _eval_config(args, base)
    try:
        bands = BandChoice.parse(cfg.bands, cfg.band_scale)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    sets = EvalSets.from_config(cfg)
    if args.ds_config is not None:
        if not args.ds_config.is_file():
            raise ConfigError(f"--ds-config {args.ds_config}: file not found")
        ds_config = json.loads(args.ds_config.read_text())
    info = init_distributed()
    try:
        configure_logging(info.rank)
        device, dtype = _device_and_dtype(info, args.precision)
        model = bundle.model.to(device, dtype).eval()
        try:
            results = evaluate(Embedder(model, bundle, cfg.batch_size, info.rank, info.world_size, device,
                                        bands=bands), sets, samples=True)
        except BandsError as err:   # a multispectral TIFF without --bands: every rank stops with the fix
            raise ConfigError(str(err)) from None
        except DataError as err:   # every rank counted the same gathered marks: rank 0 says it
            if info.rank == 0:
                print(f"rsclip-ds: DataError: {err}", file=sys.stderr)
            return 5
        if info.rank == 0:
            source = str(bundle.source) if args.model else str(args.checkpoint)
            out = args.out or default_out
            out.parent.mkdir(parents=True, exist_ok=True)
            records = evaluation_records(results, cfg)
            templates = str(cfg.templates) if cfg.templates is not None else cfg.templates_set or "ours"
            report = write_evaluation(out.with_suffix(""), source, step, templates, records)
            link_samples(results, records, out.stem)
            record = {"source": source, "step": step, "precision": args.precision, **results}
            out.write_text(json.dumps(record, indent=2, ensure_ascii=False), encoding="utf-8")
            log_results(results, step)
            print_results(results, f"rsclip-ds eval: {source}")
            log.info("results written to %s; the report (per-sample results, report.html) to %s", out,
                     report[-1].parent)
        write_monitor(build_monitor(ds_config) if ds_config else None, results, step or 0)
        return 0
    finally:
        destroy_distributed()


# --------------------------------------------------------------------------- --suite

def _load_compare(value: str):
    """--compare: a checkpoint when the path resolves to one, else a model folder or hub id."""
    from argparse import Namespace

    from rsclip_ds.checkpoint import resolve_checkpoint

    is_checkpoint = False
    if Path(value).exists():
        try:
            resolve_checkpoint(value)
            is_checkpoint = True
        except FileNotFoundError:
            pass
    args = Namespace(model=None if is_checkpoint else value, checkpoint=Path(value) if is_checkpoint else None)
    bundle = _load_for_eval(args)[0]
    return bundle, {"model": value, "source": value if is_checkpoint else str(bundle.source)}


def print_suite(found, unrecognised, results: dict) -> None:
    """What was found (with its split), what was not recognised, and the headline numbers."""
    from rich.console import Console
    from rich.table import Table

    from rsclip_ds.evaluation.suite import CLASSIFICATION

    console = Console()
    table = Table(title=f"rsclip-ds eval --suite: {results['model']} (templates {results['template_set']})")
    for col in ("set", "protocol", "split", "images", "top-1 / mean recall", "folder"):
        table.add_column(col)
    for r in results["sets"]:
        key = "top1" if r["protocol"] == CLASSIFICATION else "mean_recall"
        value = f"failed: {r['error']}" if "error" in r else f"{100 * r[key]:.2f} %"
        table.add_row(r["name"], r["protocol"], r["split"], str(r.get("images", "-")), value, r["root"])
    console.print(table)
    for s in found:
        for warning in s.warnings:
            console.print(f"[yellow]{s.name}: {warning}[/yellow]")
    if unrecognised:
        console.print("not recognised (not evaluated): " + ", ".join(str(p) for p in unrecognised))


def _suite_inputs(args) -> dict:
    """Everything --suite reads (models, the suite root, templates, published numbers), checked
    before a process group exists."""
    from rsclip_ds.evaluation.catalog import find_sets, published_results
    from rsclip_ds.evaluation.prompts import load_template_set

    if args.zero_shot is not None or args.retrieval is not None:
        raise ConfigError("--suite evaluates the sets found under its folder; run --zero-shot / --retrieval "
                          "as a separate `rsclip-ds eval`")
    if not args.suite.is_dir():
        raise ConfigError(f"--suite {args.suite}: not a folder")
    bundle, step, base, default_out, ds_config = _load_for_eval(args)
    cfg = _eval_config(args, base)
    try:
        bands = BandChoice.parse(cfg.bands, cfg.band_scale)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    found, unrecognised = find_sets(args.suite, args.overrides)
    if not found:
        raise ConfigError(f"--suite {args.suite}: no standard set found (not recognised: "
                          f"{', '.join(str(p) for p in unrecognised) or 'nothing there'}); the layouts "
                          f"recognised are listed in docs/guides/evaluation.md")
    if args.ds_config is not None:
        if not args.ds_config.is_file():
            raise ConfigError(f"--ds-config {args.ds_config}: file not found")
        ds_config = json.loads(args.ds_config.read_text())
    return dict(bundle=bundle, step=step, cfg=cfg, bands=bands, ds_config=ds_config,
                templates=load_template_set(cfg.templates if cfg.templates is not None else cfg.templates_set),
                found=sorted(found, key=lambda s: (s.name, str(s.root))),   # the same order on every rank
                unrecognised=unrecognised, compare=_load_compare(args.compare) if args.compare else None,
                published=published_results(), out_dir=args.out or default_out.with_name(f"suite-{default_out.stem}"))


def run_suite(args) -> int:
    """`rsclip-ds eval --suite ROOT`: every standard set under ROOT, the model (and --compare's)
    on each, the report beside the published numbers; exit 5 when a set had too many unreadable
    images (it is in the report as failed)."""
    from rsclip_ds.evaluation.report import write_report
    from rsclip_ds.evaluation.suite import evaluate_suite, suite_metrics
    from rsclip_ds.runtime.distributed import configure_logging, destroy_distributed, init_distributed

    x = _suite_inputs(args)
    cfg, step, out_dir = x["cfg"], x["step"], x["out_dir"]
    info = init_distributed()
    try:
        configure_logging(info.rank)
        device, dtype = _device_and_dtype(info, args.precision)

        def run_model(b: ModelBundle, samples: bool) -> dict:
            model = b.model.to(device, dtype).eval()
            try:
                embedder = Embedder(model, b, cfg.batch_size, info.rank, info.world_size, device, bands=x["bands"])
                return evaluate_suite(x["found"], embedder, x["templates"], cfg.max_bad_fraction, samples=samples)
            except BandsError as err:   # a multispectral TIFF without --bands: every rank stops with the fix
                raise ConfigError(str(err)) from None
            finally:
                b.model.to("cpu")   # the compared model gets the device to itself

        results = {"model": args.model or str(args.checkpoint),
                   "source": str(x["bundle"].source) if args.model else str(args.checkpoint),
                   "step": step, "precision": args.precision, **run_model(x["bundle"], samples=True),
                   "unrecognised": [str(p) for p in x["unrecognised"]]}
        if x["compare"] is not None:
            results["compare"] = {**x["compare"][1], **run_model(x["compare"][0], samples=False)}   # its numbers
        if info.rank == 0:
            print_suite(x["found"], x["unrecognised"], results)
            for path in write_report(results, out_dir, x["published"]):
                log.info("suite: wrote %s", path)
        monitor = build_monitor(x["ds_config"]) if x["ds_config"] else None
        if monitor is not None and monitor.enabled:
            monitor.write_events([(f"Eval/{k}", v, step or 0) for k, v in suite_metrics(results).items()])
        failed = [r["name"] for r in results["sets"] if "error" in r]
        if failed and info.rank == 0:
            print(f"rsclip-ds: DataError: too many unreadable images in {', '.join(failed)} (see the log); "
                  f"the other sets are in {out_dir}", file=sys.stderr)
        return 5 if failed else 0
    finally:
        destroy_distributed()

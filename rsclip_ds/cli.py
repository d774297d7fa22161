"""`rsclip-ds` entry point: the only place that configures logging, starts process groups and
tears them down. Under the `deepspeed` launcher: `deepspeed --num_gpus N --module rsclip_ds train ...`
(the launcher appends `--local_rank=N`; we accept and ignore it, LOCAL_RANK is in the environment).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from rsclip_ds.config import ConfigError, RunConfig, describe, load_config

log = logging.getLogger("rsclip_ds")


def _strip_local_rank(argv: list[str]) -> list[str]:
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg.startswith("--local_rank=") or arg.startswith("--local-rank="):
            continue
        elif arg in ("--local_rank", "--local-rank"):
            skip = True
        else:
            out.append(arg)
    return out


def _configure_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s rank{rank}] %(message)s", datefmt="%H:%M:%S", force=True)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# --------------------------------------------------------------------------- train

def _prepare(run: RunConfig):
    """Everything that can fail without a process group: profile, batch, shards."""
    from rsclip_ds.data import expand_urls
    from rsclip_ds.distributed import accelerator_is_gpu, world_size_from_env
    from rsclip_ds.profiles import build_ds_config, load_profile

    profile = load_profile(run.profile)
    ds_config = build_ds_config(run, profile, world_size_from_env(), on_gpu=accelerator_is_gpu())
    if not run.data.train_shards:
        raise ConfigError("data.train_shards is not set: point it at webdataset shards, e.g. "
                          "--set data.train_shards='data/synthetic/train-{000000..000007}.tar' "
                          "(make some with `rsclip-ds make-synthetic --out data/synthetic`)")
    try:
        expand_urls(run.data.train_shards)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return profile, ds_config


def run_training(run: RunConfig, hooks: Sequence[Callable] = ()) -> dict | None:
    """Train; returns the summary on rank 0 (None elsewhere). `hooks(step, engine)` run after
    every optimizer step (train.train). Raises train.Preempted after a SIGTERM (checkpoint
    saved) and train.NonFiniteLoss; main() turns them into exit codes 75 and 3."""
    import torch

    from rsclip_ds.distributed import Heartbeat, StopFlag, destroy_distributed, init_distributed
    from rsclip_ds.engine import build_engine
    from rsclip_ds.evaluate import build_eval_hook
    from rsclip_ds.losses import build_loss
    from rsclip_ds.model import apply_activation_checkpointing, build_model
    from rsclip_ds.profiles import activation_checkpointing_enabled, derive_batch
    from rsclip_ds.progress import ProgressReporter
    from rsclip_ds.train import Preempted, train

    profile, ds_config = _prepare(run)
    stop = StopFlag().install()
    info = init_distributed()
    heartbeat = Heartbeat(info.rank, info.world_size, interval=run.faults.heartbeat_s,
                          timeout=run.faults.peer_timeout_s, stopping=stop).start()
    try:
        _configure_logging(info.rank)
        plan = derive_batch(run, info.world_size)
        bundle = build_model(run.model, run.seed, loss=run.loss.name)
        ac = activation_checkpointing_enabled(run, profile)
        if ac:
            apply_activation_checkpointing(bundle.model)
        if info.rank == 0:
            _write_run_files(run, ds_config)
            log.info("profile %s | precision %s | batch micro x accumulation x world = global: %s | "
                     "%.2fM parameters", profile.name, run.precision, plan, bundle.num_parameters() / 1e6)
        eval_hook = build_eval_hook(run, bundle, info.rank, info.world_size)  # reads the eval sets now
        hooks = list(hooks) + ([eval_hook] if eval_hook else [])
        engine = build_engine(bundle.model, ds_config)
        checkpointer = _build_checkpointer(run, info, bundle)
        resume = checkpointer.load(engine, run.checkpoint.resume) if run.checkpoint.resume else None
        loader = _build_loader(run, bundle, plan, info, resume)
        torch.manual_seed(run.seed + 1000 * info.rank)   # dropout / augmentation differ per rank
        reporter = ProgressReporter(run.steps, run.logging.progress, enabled=info.rank == 0)
        try:
            loss_fn = build_loss(run.loss.name, negatives=run.loss.negatives, rank=info.rank,
                                 world_size=info.world_size, chunk_size=run.loss.chunk_size)
            result = train(engine, iter(loader), loss_fn, plan, run.steps, run.logging.log_every,
                           reporter, accumulation=run.batch.accumulation, hooks=hooks,
                           checkpointer=checkpointer, guard=_build_guard(run, stop), loader=loader,
                           resume=resume, stop_after=run.checkpoint.stop_after)
        finally:
            reporter.close()
        summary = _finish(run, result, info.rank, profile, plan, bundle, ac)
        if result.stopped:
            raise Preempted(f"stopped by SIGTERM after step {len(result.losses)}; checkpoint "
                            f"{result.checkpoints[-1] if result.checkpoints else '(none)'} saved; continue "
                            f"with `rsclip-ds train ... --resume latest`")
        return summary
    finally:
        heartbeat.close()
        destroy_distributed()


def _build_checkpointer(run: RunConfig, info, bundle):
    from functools import partial

    from rsclip_ds.checkpoint import Checkpointer, checkpoint_root, write_hf_extras

    extras = partial(write_hf_extras, model_config=bundle.model.config, tokenizer=bundle.tokenizer,
                     image_size=bundle.image_size, mean=bundle.image_mean, std=bundle.image_std)
    return Checkpointer(run.checkpoint, checkpoint_root(run.output_dir), rank=info.rank,
                        world_size=info.world_size, run_config=run.model_dump(mode="json"),
                        write_extras=extras, kill_in_save_at=run.faults.inject_kill_in_save_at_step)


def _build_loader(run: RunConfig, bundle, plan, info, resume: dict | None):
    from rsclip_ds.data import build_train_loader

    return build_train_loader(
        run.data, tokenizer=bundle.tokenizer, image_size=bundle.image_size,
        image_mean=bundle.image_mean, image_std=bundle.image_std,
        max_text_length=bundle.max_text_length, micro_batch_size=plan.micro,
        rank=info.rank, world_size=info.world_size, seed=run.seed,
        state=resume["data"] if resume else None)


def _build_guard(run: RunConfig, stop):
    from rsclip_ds.train import Guard

    f = run.faults
    return Guard(stop_requested=stop, stop_check_every=f.stop_check_every,
                 max_nonfinite_steps=f.max_nonfinite_steps, check_nonfinite=run.precision != "fp16",
                 inject_nan_at_step=f.inject_nan_at_step, inject_kill_at_step=f.inject_kill_at_step,
                 inject_freeze_at_step=f.inject_freeze_at_step)


def _finish(run: RunConfig, result, rank: int, profile, plan, bundle, ac: bool) -> dict | None:
    """Rank 0 writes and prints the summary."""
    from rsclip_ds.curves import plot_curves
    from rsclip_ds.report import build_summary, print_summary, write_summary

    if rank != 0:
        return None
    summary = build_summary(result, profile=profile, plan=plan, precision=run.precision,
                            preset=run.model.preset, num_parameters=bundle.num_parameters(),
                            activation_checkpointing=ac, loss=run.loss.name,
                            negatives=run.loss.negatives, accumulation=run.batch.accumulation)
    write_summary(summary, run.output_dir)
    print_summary(summary)
    plot_curves(summary, Path(run.output_dir) / "curves.png")   # skipped (one log line) without matplotlib
    return summary


def _write_run_files(run: RunConfig, ds_config: dict) -> None:
    out = Path(run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(run.model_dump_json(indent=2))
    (out / "ds_config.json").write_text(json.dumps(ds_config, indent=2))


# --------------------------------------------------------------------------- other commands

def cmd_train(args) -> int:
    """Exit codes (docs/checkpoints.md): 0 done, 2 bad config, 3 non-finite loss, 4 a rank died
    (from the heartbeat thread), 5 too much bad data, 75 stopped by SIGTERM after saving a
    checkpoint."""
    from rsclip_ds.data import DataError
    from rsclip_ds.train import RunStopped

    resume = [f"checkpoint.resume={args.resume}"] if args.resume else []
    try:
        run_training(load_config(args.config, args.set + resume))
    except RunStopped as err:
        print(f"rsclip-ds: {type(err).__name__}: {err}", file=sys.stderr)
        return err.exit_code
    except DataError as err:
        print(f"rsclip-ds: DataError: {err}", file=sys.stderr)
        return 5
    return 0


def cmd_export(args) -> int:
    from rsclip_ds.checkpoint import export_hf

    try:
        out = export_hf(args.checkpoint, args.out_dir, dtype=args.dtype)
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from None
    print(f"Hugging Face folder written to {out} ({args.dtype}, safetensors); load it with "
          f"transformers.AutoModel.from_pretrained('{out}') or train from it with --set model.pretrained={out}")
    return 0


def cmd_make_synthetic(args) -> int:
    from rsclip_ds.synthetic import make_synthetic

    info = make_synthetic(args.out, num_train=args.num_train, num_val=args.num_val,
                          shard_size=args.shard_size, image_size=args.image_size, seed=args.seed,
                          eval_layout=args.eval)
    print(json.dumps({k: v for k, v in info.items() if k not in ("train", "val")}, indent=2))
    return 0


def cmd_train_tokenizer(args) -> int:
    from rsclip_ds.data import expand_urls
    from rsclip_ds.tokenizer import iter_captions, train_tokenizer

    tok = train_tokenizer(iter_captions(expand_urls(args.shards), args.caption_key), args.out,
                          vocab_size=args.vocab_size, max_length=args.max_length)
    print(f"tokenizer with {len(tok)} tokens written to {args.out}")
    return 0


def cmd_show_config(args) -> int:
    from rich.console import Console
    from rich.table import Table

    run = load_config(args.config, args.set)
    resolved = json.loads(run.model_dump_json())
    table = Table(title="run config (defaults < file < --set)")
    for col in ("key", "value", "description"):
        table.add_column(col)
    for key, _default, desc in describe():
        value = resolved
        for part in key.split("."):
            value = value[part]
        table.add_row(key, json.dumps(value), desc)
    Console().print(table)
    return 0


def cmd_profiles(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from rsclip_ds.profiles import available_profiles, load_profile

    table = Table(title="ds_profiles")
    for col in ("profile", "stage", "offload", "act. ckpt", "what it is for"):
        table.add_column(col)
    for name in available_profiles():
        p = load_profile(name)
        offload = "+".join(k for k, on in (("opt", p.offload_optimizer), ("param", p.offload_param)) if on)
        table.add_row(name, str(p.stage), offload or "-", "on" if p.activation_checkpointing else "off",
                      p.description)
    Console().print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rsclip-ds", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p):
        p.add_argument("--config", help="YAML or JSON run config")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set batch.micro_batch_size=8 (repeatable)")
        return p

    p = with_config(sub.add_parser("train", help="train (under the deepspeed launcher or alone)"))
    p.add_argument("--resume", metavar="latest|TAG", help="continue from {output_dir}/checkpoints: "
                   "'latest' or a tag like step00000040 (same as --set checkpoint.resume=...)")
    p = sub.add_parser("export", help="write a Hugging Face folder (safetensors) from a checkpoint")
    p.add_argument("checkpoint", help="run output_dir, its checkpoints/ folder, or a step######## folder")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="weight dtype (default fp32)")
    with_config(sub.add_parser("show-config", help="print the resolved config with every key's description"))
    sub.add_parser("profiles", help="list ds_profiles/")
    from rsclip_ds.plan_cli import add_plan_parser

    add_plan_parser(sub)
    from rsclip_ds.evaluate import add_eval_parser

    add_eval_parser(sub)
    from rsclip_ds.shards import add_make_shards_parser

    add_make_shards_parser(sub)
    p = sub.add_parser("make-synthetic", help="write synthetic remote-sensing image-caption shards")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--num-train", type=int, default=4096)
    p.add_argument("--num-val", type=int, default=512)
    p.add_argument("--eval", action="store_true", help="also write the val split as a class-folder "
                   "tree (eval/classes/) and a caption JSON (eval/captions.json) for `rsclip-ds eval`")
    p.add_argument("--shard-size", type=int, default=512)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("train-tokenizer", help="train a tokenizer on the captions of shards")
    p.add_argument("--shards", required=True, help="brace pattern / glob / list file of shards")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--vocab-size", type=int, default=1000)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--caption-key", default="txt")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(_strip_local_rank(sys.argv[1:] if argv is None else argv))
    try:
        if args.command == "train":
            return cmd_train(args)
        if args.command == "export":
            return cmd_export(args)
        if args.command == "make-shards":
            from rsclip_ds.shards import cmd_make_shards

            return cmd_make_shards(args)
        from rsclip_ds.plan_cli import cmd_plan

        from rsclip_ds.evaluate import cmd_eval

        handlers = {"eval": cmd_eval, "make-synthetic": cmd_make_synthetic, "train-tokenizer": cmd_train_tokenizer,
                    "show-config": cmd_show_config, "profiles": cmd_profiles, "plan": cmd_plan}
        return handlers[args.command](args)
    except ConfigError as err:
        print(f"rsclip-ds: error: {err}", file=sys.stderr)
        return 2


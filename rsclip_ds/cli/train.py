"""`rsclip-ds train`: parse, load the config, hand it to the Trainer, map outcomes to exit codes.

Exit codes (docs/reference/exit-codes.md): 0 done, 2 bad config, 3 non-finite loss, 4 a rank died (from
the heartbeat thread), 5 too much bad data, 6 a checkpoint save found the disk full (DiskFull), 75
stopped by SIGTERM after saving a checkpoint.
"""

from __future__ import annotations

import os
import sys

from rsclip_ds.config import load_config


def with_config(p):
    """--config FILE and repeatable --set KEY=VALUE, shared by the commands that read a run config."""
    p.add_argument("--config", help="YAML or JSON run config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set batch.micro_batch_size=8 (repeatable)")
    return p


def register(sub) -> None:
    p = with_config(sub.add_parser("train", help="train (under the deepspeed launcher or alone)"))
    p.add_argument("--resume", metavar="auto|latest|TAG", help="continue from {output_dir}/checkpoints: "
                   "'auto' (the newest checkpoint if any, else start fresh), 'latest' (the newest; an error "
                   "without one) or a tag like step00000040 (same as --set checkpoint.resume=...)")
    p.set_defaults(handler=run)


def run(args) -> int:
    from rsclip_ds.data import DataError
    from rsclip_ds.train import DiskFull, RunStopped
    from rsclip_ds.trainer import run_training

    resume = [f"checkpoint.resume={args.resume}"] if args.resume else []
    try:
        run_training(load_config(args.config, args.set + resume))
    except RunStopped as err:
        # DiskFull: every rank raises rank 0's message; rank 0 says it
        if not isinstance(err, DiskFull) or os.environ.get("RANK", "0") == "0":
            print(f"rsclip-ds: {type(err).__name__}: {err}", file=sys.stderr)
        return err.exit_code
    except DataError as err:
        print(f"rsclip-ds: DataError: {err}", file=sys.stderr)
        return 5
    return 0

"""`rsclip-ds train`: parse, load the config, hand it to the Trainer, map outcomes to exit codes.

Exit codes (docs/reference/exit-codes.md): 0 done, 1 an error of no known kind, 2 bad config, 3 steps skipped
in a row for a non-finite gradient norm, 4 a rank died (from the heartbeat thread), 5 too much bad data, 6 a
checkpoint save found the disk full (DiskFull), 7 a DataLoader worker died, 8 a save or resume refused non-finite
weights (NonFiniteWeights), 75 stopped by SIGTERM after saving a checkpoint. An error inside the run was already
said, once, by the Trainer's error path (runtime/rank_errors.py), which every rank leaves with the failing rank's
code.
"""

from __future__ import annotations

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
    from rsclip_ds.config import ConfigError
    from rsclip_ds.runtime.rank_errors import failure_of
    from rsclip_ds.assembly import run_training

    resume = [f"checkpoint.resume={args.resume}"] if args.resume else []
    run_config = load_config(args.config, args.set + resume)
    try:
        run_training(run_config)
    except Exception as err:
        failure = failure_of(err)
        if failure.reported:       # said once (or by the failing rank), told to every rank
            return failure.code
        if isinstance(err, ConfigError) or not failure.known:
            raise                  # before the process group: cli.main says it; else the traceback
        print(f"rsclip-ds: {failure.line}", file=sys.stderr)
        return failure.code
    return 0

"""`rsclip-ds` entry point: one module per command (train, eval, plan, export, checkpoint, data, leakage, info).

Under the `deepspeed` launcher: `deepspeed --num_gpus N --module rsclip_ds train ...` (the
launcher appends `--local_rank=N`; we accept and ignore it, LOCAL_RANK is in the environment).
Every command turns a ConfigError into one line on stderr (rank 0's only, under a launcher) and
exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from rsclip_ds.cli import checkpoint, data, eval, export, info, leakage, plan, train
from rsclip_ds.config import ConfigError

def strip_local_rank(argv: list[str]) -> list[str]:
    """Drop the launcher's `--local_rank=N` / `--local_rank N`."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.startswith("--local_rank=") or arg.startswith("--local-rank="):
            continue
        elif arg in ("--local_rank", "--local-rank"):
            skip = True
        else:
            out.append(arg)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The parser; each sub-command's handler is its `handler` default (module.register)."""
    parser = argparse.ArgumentParser(prog="rsclip-ds", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (train, eval, plan, export, checkpoint, data, leakage, info):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(strip_local_rank(sys.argv[1:] if argv is None else argv))
    try:
        return args.handler(args)
    except ConfigError as err:
        # under a launcher every rank finds the same error: rank 0 says it, the others exit quietly
        if os.environ.get("RANK", "0") == "0":
            print(f"rsclip-ds: error: {err}", file=sys.stderr)
        return 2

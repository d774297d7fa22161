"""Run under the deepspeed launcher: a training run as `rsclip-ds train` assembles it (the Trainer),
with a tap on each rank's loader (loader.tap, through the Trainer's wrap_loader seam) that appends
every batch it hands out -- index on the rank, epoch, the samples' __key__s -- to
KEYS/rank<r>.jsonl: what the ranks were delivered, read independently of the schedule.

    deepspeed --num_gpus 2 tests/integration/epoch_worker.py --config C --keys DIR [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rsclip_ds.config import load_config
from rsclip_ds.assembly import Trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--keys", type=Path, required=True)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    run = load_config(args.config, args.set)

    def tapped(loader):
        sink = (args.keys / f"rank{loader.rank}.jsonl").open("a")

        def tap(index: int, epoch: int, keys: list[str]) -> None:
            sink.write(json.dumps({"index": index, "epoch": epoch, "keys": list(keys)}) + "\n")
            sink.flush()

        loader.tap = tap
        return loader

    with Trainer(run, wrap_loader=tapped) as trainer:
        trainer.train()


if __name__ == "__main__":
    main()

"""Run a function as the ranks of a gloo process group in forked processes (no launcher, no
DeepSpeed): for the collectives of one module, in a unit test's time. Import from here."""

from __future__ import annotations

import json
import multiprocessing
import os
import traceback
from pathlib import Path
from typing import Callable


def _rank_main(fn: Callable, rank: int, world: int, folder: str, args: tuple, port: int | None) -> None:
    import torch
    import torch.distributed as dist

    # the parent's OpenMP pool does not survive fork (its threads are gone): a parallel region
    # would wait for them forever; one thread per rank runs ops inline
    torch.set_num_threads(1)
    out, code = Path(folder) / f"rank{rank}.json", 1
    try:
        if port is None:
            dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
        else:   # what a launcher sets: fn starts the group itself (the Trainer does, with its heartbeat store)
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        try:
            result = {"value": fn(rank, world, *args)}
        except Exception as err:   # what the rank raised, for the test to assert on
            result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        out.write_text(json.dumps(result))
        if dist.is_initialized():
            dist.destroy_process_group()
        code = 0
    finally:
        os._exit(code)


def run_ranks(fn: Callable, world: int, folder: Path, *args, timeout: float = 120,
              launcher_env: bool = False) -> list[dict]:
    """fn(rank, world, *args) on each rank of a fresh gloo group -> per rank {"value": the JSON-able
    return} or {"error": "Type: message"}. ``folder`` holds the store file and the results.
    ``launcher_env``: no group is started; each rank gets the variables the deepspeed launcher sets
    (RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...) and fn starts the group (e.g. through the Trainer)."""
    folder.mkdir(parents=True, exist_ok=True)
    port = None
    if launcher_env:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, str(folder), args, port)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        if p.exitcode is None:
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0] * world, f"a rank died: exit codes {[p.exitcode for p in procs]}"
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]

"""A DataLoader worker killed with a real SIGKILL (what the OOM killer sends), in one process with the
real shard loader and its worker processes (data/workers.py): nothing is raised at a random point
of the rank's code, the death is named with the likely cause and this rank's numbers, the workers
start again at the same position (the batches stay the uninterrupted loader's), a second death
stops the rank with LoaderWorkerDied (exit code 7), and no worker process is left behind."""

from __future__ import annotations

import itertools
import os
import signal
import time

import psutil
import pytest

from rsclip_ds.config import DataConfig
from rsclip_ds.data import build_train_loader
from rsclip_ds.data.workers import LoaderWorkerDied, WorkerDeath
from tests.helpers import deadline, wait_for, write_shards

B = 2


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("workers"), [12, 12, 12, 12])


@pytest.fixture(autouse=True)
def _no_tokenizer_threads(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")   # workers fork after the tokenizer ran


def make_loader(spec, tokenizer):
    cfg = DataConfig(train_shards=spec, num_workers=2, shuffle_buffer=4)
    return build_train_loader(cfg, tokenizer=tokenizer, image_size=8, max_text_length=16, micro_batch_size=B,
                              rank=1, world_size=2, seed=1, return_keys=True)


def _children() -> list[psutil.Process]:
    return [c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]


def _kill_a_worker(loader) -> int:
    pid = loader.worker_pids()[0]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
             "the worker to die")
    time.sleep(0.2)   # torch's own SIGCHLD handler would raise out of this sleep
    return pid


def test_a_killed_worker_is_named_replaced_at_the_same_position_then_stops_the_rank(shards, tiny_tokenizer):
    before = {c.pid for c in _children()}
    with deadline(60):
        ref = [b["keys"] for b in itertools.islice(iter(make_loader(shards, tiny_tokenizer)), 12)]
        loader = make_loader(shards, tiny_tokenizer)
        heard: list[str] = []
        loader.on_worker_death = heard.append
        batches = iter(loader)
        got = [next(batches)["keys"] for _ in range(3)]
        pid = _kill_a_worker(loader)
        got += [next(batches)["keys"] for _ in range(9)]
        assert got == ref                                # the same batches as without the death
        death = WorkerDeath(1, 0, pid, -signal.SIGKILL)
        assert loader.deaths == [death]
        assert heard == [f"rank 1: DataLoader worker 0 (pid {pid}) was killed by SIGKILL (the likely cause and the "
                         f"fix: rank 1's warning)"]
        message = death.message(workers=2, batch_bytes=loader.batch_bytes, prefetch=2, local_ranks=1,
                                shuffle_buffer=4)
        assert message.startswith(f"rank 1: DataLoader worker 0 (pid {pid}) was killed by SIGKILL. ")
        batch_mib = B * (3 * 8 * 8 + 8 * 16) / 2 ** 20   # uint8 pixels + int64 token ids
        assert loader.batch_bytes == B * (3 * 8 * 8 + 8 * 16)
        for part in ("the kernel's OOM killer", "data.num_workers=2 worker(s) x 2 batches in flight",
                     f"4 batch(es) of {batch_mib:.1f} MiB in /dev/shm", "Fix: lower data.num_workers"):
            assert part in message, message
        _kill_a_worker(loader)                           # a second death: the rank stops
        with pytest.raises(LoaderWorkerDied, match=r"worker 0 \(pid \d+\) was killed by SIGKILL.*second death"
                                                   r".*no checkpoint was saved") as stop:
            for _ in range(6):
                next(batches)
        assert stop.value.exit_code == 7
    # every worker of both loaders has ended (the loader shut its workers down, the dead were reaped)
    wait_for(lambda: {c.pid for c in _children()} <= before, "the loader workers to end", timeout=15,
             detail=lambda: str(_children()))


def test_the_message_for_other_deaths():
    kw = dict(workers=3, batch_bytes=2 ** 20, prefetch=2, local_ranks=4, shuffle_buffer=1000)
    bus = WorkerDeath(0, 2, 99, -signal.SIGBUS).message(**kw)
    assert bus.startswith("rank 0: DataLoader worker 2 (pid 99) was killed by SIGBUS. SIGBUS in a loader worker is "
                          "a full /dev/shm") and "6.0 MiB, 24.0 MiB for the node's 4 rank(s)" in bus
    exited = WorkerDeath(0, 1, 98, 3).message(**kw)
    assert "exited with code 3" in exited and "data.num_workers=0" in exited

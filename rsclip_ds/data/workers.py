"""DataLoader workers: the cores a process may use (how many workers a rank runs is resolve.loader_workers'
rule), and a worker that dies: named, replaced at the same data position, then an agreed stop.

What the OOM killer does to a loader worker is a SIGKILL. torch's own SIGCHLD handler then raises
"DataLoader worker (pid N) is killed by signal: Killed." inside whatever Python code the rank runs
at that moment -- mid forward, inside a DeepSpeed hook -- where nothing can be saved, and says
nothing about memory. Here instead (`supervised`):

- this process's SIGCHLD handler only notes that a child exited (`watch_children`, installed after
  torch's); the next batch request checks the iterator's workers and finds the dead one. Its
  errors (torch's 5 s liveness check, or an EOFError from a batch the dead worker was handing
  over) are caught there when a worker is dead, and raised as they are otherwise;
- the death is named (`WorkerDeath.message`): rank, worker id, pid, signal; for SIGKILL the likely
  cause (host memory) with this rank's numbers -- workers, batches in flight, their /dev/shm bytes
  -- and the fixes; for SIGBUS a full /dev/shm;
- the rank's workers are started again from the position after the last batch handed out (the
  exact-resume path of loader.py: the batches stay those an uninterrupted loader yields), so the
  rank can reach the next sync point, where the Trainer turns the death into an agreed stop: every
  rank saves that step's checkpoint and the run exits with code 7 (`LoaderWorkerDied`);
- a second death before that stop raises LoaderWorkerDied at once: the rank cannot go on, so no
  checkpoint (the last one is intact) -- the other ranks learn it through rank_errors.py.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from rsclip_ds.runtime.rank_errors import RunStopped

log = logging.getLogger("rsclip_ds.data")
EXIT_LOADER_WORKER_DIED = 7


class LoaderWorkerDied(RunStopped):
    """A DataLoader worker of a rank died (the message names it, the likely cause and the fix).
    ``shared``: raised on that rank at an agreed stop (checkpoint saved), not alone."""
    exit_code = EXIT_LOADER_WORKER_DIED

    def __init__(self, message: str, shared: bool = False):
        super().__init__(message)
        self.shared = shared


@dataclass(frozen=True)
class WorkerDeath:
    rank: int
    worker: int
    pid: int
    exitcode: int | None      # multiprocessing's: -N for signal N

    @property
    def signal_name(self) -> str | None:
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def headline(self) -> str:
        how = f"was killed by {self.signal_name}" if self.signal_name else f"exited with code {self.exitcode}"
        return f"rank {self.rank}: DataLoader worker {self.worker} (pid {self.pid}) {how}"

    def message(self, *, workers: int, batch_bytes: int, prefetch: int, local_ranks: int,
                shuffle_buffer: int) -> str:
        """What happened, the likely cause and the fix, with this rank's numbers."""
        head = self.headline()
        mib, in_flight = 2 ** 20, workers * prefetch
        rank_bytes = in_flight * batch_bytes
        numbers = (f"This rank runs data.num_workers={workers} worker(s) x {prefetch} batches in flight (the "
                   f"prefetch) = {in_flight} batch(es) of {batch_bytes / mib:.1f} MiB in /dev/shm: "
                   f"{rank_bytes / mib:.1f} MiB, {local_ranks * rank_bytes / mib:.1f} MiB for the node's "
                   f"{local_ranks} rank(s), besides each worker's own memory (its decoder, its shuffle buffer "
                   f"of data.shuffle_buffer={shuffle_buffer} undecoded samples)")
        if self.signal_name == "SIGKILL":
            cause = ("SIGKILL of a loader worker is almost always the kernel's OOM killer: the host ran out of "
                     f"memory (`dmesg | grep -i -e oom -e killed` on the node shows it). {numbers}. Fix: lower "
                     "data.num_workers or data.shuffle_buffer, or batch.micro_batch_size (fewer bytes per "
                     "batch); give the job more host memory (a container's --memory, its --shm-size for /dev/shm)")
        elif self.signal_name == "SIGBUS":
            cause = (f"SIGBUS in a loader worker is a full /dev/shm: it could not grow a batch there. {numbers}. "
                     "Fix: a larger /dev/shm (docker run --shm-size=..., Kubernetes: an emptyDir with medium: "
                     "Memory), or lower data.num_workers")
        else:
            cause = ("A crash in native code (an image decoder, a library the worker loaded) or a signal from "
                     "outside; run with --set data.num_workers=0 to see the error in the rank itself")
        return f"{head}. {cause}"


# --------------------------------------------------------------------------- how many

def available_cores() -> int:
    """CPU cores this process may run on: its affinity mask (a container's cpuset, taskset,
    numactl), not the machine's count. A CPU quota (docker --cpus) does not show here."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return os.cpu_count() or 1


# --------------------------------------------------------------------------- SIGCHLD

# A plain flag, not a threading.Event: a handler runs between two bytecodes of the main thread, so
# one that takes a lock (Event.set) deadlocks when a second SIGCHLD lands inside the first's set
# (two workers ending together at shutdown). Assigning a list item takes no lock.
_child_exited = [False]


def _note_child(signum, frame) -> None:
    _child_exited[0] = True


def watch_children() -> None:
    """Make this process's SIGCHLD handler note child exits only (see the module docstring). torch
    installs its raising handler once, when the process's first DataLoader iterator with workers
    starts: call this after that. Only the main thread can set a handler; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGCHLD) is not _note_child:
        signal.signal(signal.SIGCHLD, _note_child)


def dead_workers(iterator, rank: int, wait_s: float = 0.0) -> list[WorkerDeath]:
    """The workers of a torch DataLoader iterator that have exited (reaped: their exit code),
    waiting up to ``wait_s`` for one: a killed worker's sockets close before it can be reaped."""
    processes = list(getattr(iterator, "_workers", []))
    deadline = time.monotonic() + wait_s
    while True:
        found = [WorkerDeath(rank, i, p.pid, p.exitcode) for i, p in enumerate(processes)
                 if not p.is_alive() and p.exitcode is not None]
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.02)


def worker_pids(iterator) -> list[int]:
    return [p.pid for p in getattr(iterator, "_workers", []) if p.is_alive()]


def _shutdown(iterator) -> None:
    """Stop an iterator's workers now (the live ones too), not whenever it is collected."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


# --------------------------------------------------------------------------- iteration

class Supervisor:
    """Batches from ``make_loader()``'s DataLoader; a dead worker -> ``on_death(death)``, then a
    fresh DataLoader from ``make_loader()`` (built from the position after the last batch handed
    out). ``on_death`` raises to stop instead."""

    def __init__(self, make_loader: Callable[[], Any], rank: int, on_death: Callable[[WorkerDeath], None]):
        self.make_loader, self.rank, self.on_death = make_loader, rank, on_death
        self.iterator = None

    def pids(self) -> list[int]:
        return worker_pids(self.iterator) if self.iterator is not None else []

    def __iter__(self) -> Iterator[dict]:
        while True:
            self.iterator = iter(self.make_loader())
            if getattr(self.iterator, "_workers", None):
                watch_children()
            try:
                death = yield from self._batches()
            finally:
                _shutdown(self.iterator)
            if death is None:   # the DataLoader ended (a finite dataset)
                return
            self.on_death(death)   # raises to stop; else a fresh loader at the same position

    def _batches(self) -> Iterator[dict]:
        """The iterator's batches until a worker is found dead -> that WorkerDeath (None at its end)."""
        it = self.iterator
        while True:
            if _child_exited[0]:
                _child_exited[0] = False   # before the check: a death after it sets the flag again
                dead = dead_workers(it, self.rank)   # SIGCHLD comes once the child can be reaped
                if dead:
                    return dead[0]
            try:
                batch = next(it)
            except StopIteration:
                return None
            except Exception:   # noqa: BLE001 -- torch's "worker exited unexpectedly", or a batch whose shared
                dead = dead_workers(it, self.rank, wait_s=2.0)   # memory a dead worker was handing over (EOFError)
                if not dead:
                    raise
                return dead[0]
            yield batch

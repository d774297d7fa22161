"""The heartbeat: find a dead or hung rank within `faults.peer_timeout_s`, with O(W) store traffic.

Every rank bumps its own counter in the rendezvous store (the TCPStore on rank 0) every
`interval` s from a daemon thread. Rank 0 alone watches: one `check` and one `multi_get` of all
counters per interval, then writes its own counter together with its verdict (the ranks it found
silent). Every other rank reads that one key: rank 0's counter (a rank 0 that stopped beating is
hung) and the verdict. Per interval that is about 3W store requests for the whole job (a set, a check and a get per rank); the
first version had every rank read every other rank's key (2W² requests: 131k per interval at 256
ranks, all into the one store; docs/results/comms.md#heartbeat has both, measured).

A counter that has not moved for `timeout` s, or a store that stopped answering (rank 0 died),
means a rank is gone: log which one and end this process with EXIT_PEER_LOST. This bounds the
wait where a collective would block for DEEPSPEED_TIMEOUT (10 min) -- or forever, in DeepSpeed's
busy-waiting CPU shm all-reduce. It uses its own store connection and needs no GIL-free main
thread.

The same keys carry a failing rank's error (rank_errors.py): a rank's value is "COUNT ERROR" once
its main thread failed, rank 0 relays the first error it reads in its own "COUNT DEAD ERROR", and
a rank that reads another rank's error there ends its process with that rank's exit code and
message. That adds no request to a beat.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable

from rsclip_ds.runtime.rank_errors import EXIT_PEER_LOST, HEARTBEAT_KEY, RankError, RankErrors, format_beat, parse_beat

log = logging.getLogger("rsclip_ds")

KEY = HEARTBEAT_KEY
__all__ = ["EXIT_PEER_LOST", "KEY", "Heartbeat", "default_store"]


def _key(rank: int) -> str:
    return KEY.format(rank)


def default_store(timeout: float):
    """A client connection to the launcher's rendezvous store (MASTER_ADDR:MASTER_PORT)."""
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout), wait_for_workers=False)


class Heartbeat:
    """One rank's heartbeat thread (see the module docstring). ``stopping()`` is true once
    SIGTERM arrived; ``store_factory(timeout)`` makes the store connection (a seam for the
    simulation); ``on_dead(message)`` ends the process (default: log and os._exit(4));
    ``errors`` (rank_errors.RankErrors) carries this rank's error out and receives the others'."""

    def __init__(self, rank: int, world_size: int, *, interval: float, timeout: float,
                 stopping: Callable[[], bool] = lambda: False,
                 store_factory: Callable[[float], Any] = default_store,
                 on_dead: Callable[[str], None] | None = None, errors: RankErrors | None = None):
        self.rank, self.world_size = rank, world_size
        self.interval, self.timeout = interval, timeout
        # Once SIGTERM arrived (the launcher sends it to the survivors when a rank died, a
        # scheduler before pre-emption) a peer silent for a few heartbeats is conclusive: the
        # healthy ranks' heartbeat threads keep beating while they save. Without this a survivor
        # spinning in DeepSpeed's shm all-reduce waits out `timeout` or the launcher's SIGKILL.
        self.stopping, self.stop_timeout = stopping, max(5 * interval, 5.0)
        self.store_factory, self.on_dead = store_factory, on_dead or self._exit
        self.errors = errors
        if errors is not None:
            errors.stop_heartbeat = self._stop_beating
        self.relayed = ""   # rank 0: the first error it read, relayed in its own key from then on
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rsclip-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        if self.world_size > 1:
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _stop_beating(self) -> None:
        """No beat after this returns (a beat under way finishes), from any thread."""
        self.close()
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self.join(min(self.timeout, 5 * self.interval + 5.0))

    def limit(self) -> float:
        return min(self.timeout, self.stop_timeout) if self.stopping() else self.timeout

    # ---- one beat (each returns a message when a rank is gone, another rank's error, else None)
    def _own_error(self) -> str:
        return (self.errors.published or "") if self.errors is not None else ""

    def _peer_error(self, text: str) -> RankError | None:
        error = RankError.from_json(text)
        return error if error is not None and error.rank != self.rank else None

    def _watch_all(self, store, count: int, seen: dict, now: float) -> str | RankError | None:
        """Rank 0: read every counter at once, publish own counter + the silent ranks + the first error."""
        keys = [_key(r) for r in seen]
        if store.check(keys):
            values = store.multi_get(keys)
        else:   # start-up: a rank that has not beaten yet (its clock runs from our start)
            values = [store.get(k) if store.check([k]) else None for k in keys]
        for r, value in zip(seen, values):
            if value != seen[r][0]:
                seen[r] = (value, now)
        self.relayed = self.relayed or self._own_error() or next(
            (e for e in (parse_beat(r, v)[2] for r, v in zip(seen, values)) if RankError.from_json(e)), "")
        limit = self.limit()
        dead = [r for r in seen if now - seen[r][1] > limit]
        store.set(_key(0), format_beat(0, count, self.relayed, ",".join(map(str, dead))))
        if dead:
            return (f"rank(s) {dead} sent no heartbeat for {limit:.0f} s (faults.peer_timeout_s, "
                    f"{self.stop_timeout:.0f} s once SIGTERM arrived); a process died or hangs")
        return self._peer_error(self.relayed)

    def _watch_rank0(self, store, count: int, seen: dict, now: float) -> str | RankError | None:
        """Other ranks: publish own counter (+ own error), read rank 0's counter, verdict and relayed error."""
        store.set(_key(self.rank), format_beat(self.rank, count, self._own_error()))
        key = _key(0)
        beat, verdict, error = parse_beat(0, store.get(key) if store.check([key]) else None)
        if beat != seen[0][0]:
            seen[0] = (beat, now)
        if self._peer_error(error):
            return self._peer_error(error)
        if verdict:
            return (f"rank 0 reports rank(s) [{verdict}] sent no heartbeat for {self.limit():.0f} s "
                    f"(faults.peer_timeout_s); a process died or hangs")
        if now - seen[0][1] > self.limit():
            return f"rank 0 sent no heartbeat for {self.limit():.0f} s (faults.peer_timeout_s); it hangs"
        return None

    def _run(self) -> None:
        watched = range(1, self.world_size) if self.rank == 0 else [0]
        seen = {r: (None, time.monotonic()) for r in watched}   # rank -> (last value, when it changed)
        last_contact, count, store = time.monotonic(), 0, None
        beat = self._watch_all if self.rank == 0 else self._watch_rank0
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            try:
                store = store or self.store_factory(self.timeout)
                count += 1
                dead = beat(store, count, seen, now)
                last_contact = now
            except Exception as err:   # noqa: BLE001 -- any store failure means rank 0's store is gone
                store = None
                if now - last_contact > self.timeout and self._claim():
                    self._stop.set()
                    self.on_dead(f"the rendezvous store on rank 0 has not answered for {now - last_contact:.0f} "
                                 f"s ({type(err).__name__}: {err}); rank 0 is gone")
                continue
            if isinstance(dead, RankError):
                if self.errors is not None:
                    self.errors.peer_failed(dead)   # ends the process, unless its main thread reports already
            elif dead and not self._stop.is_set() and self._claim():
                self._stop.set()
                if self.rank == 0:
                    # the others read the verdict from rank 0's store: give them two beats
                    time.sleep(2 * self.interval)
                self.on_dead(dead)

    def _claim(self) -> bool:
        """Whether this thread may end the process (not while the main thread reports an error)."""
        return self.errors is None or self.errors.claim()

    def _exit(self, why: str) -> None:
        log.error("rank %d: %s. Exiting with code %d; restart with `rsclip-ds train --resume latest` "
                  "to continue from the last checkpoint.", self.rank, why, EXIT_PEER_LOST)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_PEER_LOST)   # the main thread may be blocked inside a collective

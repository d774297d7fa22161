"""One rank's fatal error, told to every rank as itself.

Without this, a rank that fails alone (a DataError in its loader, a ConfigError only it finds, any
Python error) leaves the others blocked in their next collective: they end with gloo's "Connection
closed by peer", a raw traceback or the heartbeat's exit 4 -- and under the launcher those lines
come first. Instead (`RankErrors.fail`, called by the Trainer on the way out):

  1. the failing rank prints its own line once (`rsclip-ds: DataError: ...`; an error of no known
     kind: its traceback, once, on this rank only);
  2. it publishes the error -- rank, exit code, type, message -- in its heartbeat key of the
     rendezvous store: rank 0's heartbeat reads every key each beat anyway and relays the first
     error in its own key, which every other rank reads each beat (heartbeat.py): no request is
     added to a beat;
  3. it waits, at most `wait_s`, until every other rank has acknowledged (a store counter), then
     exits with its code. Its sockets stay open meanwhile: no peer sees a broken connection first.
     Rank 0, whose process hosts the store, leaves last: once every other rank has said it is done
     with the store (a second counter), so that none of them meets a closed store.

Every other rank's heartbeat thread prints `rsclip-ds: rank R failed: <Type>: <message>` and ends
its process with the same code (rank 0, which hosts the store, once all have acknowledged). A rank
whose main thread got a *secondary* error -- a collective broke because a peer is gone -- reports
the published error when one comes, else the ranks whose heartbeat stopped (a SIGKILL: nothing
could be published), with exit code 4. Errors every rank raises at the same sync point (SIGTERM's
Preempted, NonFiniteLoss: `shared`) are not published; those with the same text everywhere are
said by rank 0 alone.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable

from rsclip_ds.config import ConfigError

log = logging.getLogger("rsclip_ds")

EXIT_PEER_LOST = 4
HEARTBEAT_KEY = "rsclip/heartbeat/{}"   # each rank's counter (heartbeat.py); its error rides along
ACK_KEY = "rsclip/error/acks"           # how many ranks have seen the published error
LEFT_KEY = "rsclip/error/left"          # how many ranks other than 0 are done with the store
FIRST_KEY = "rsclip/error/first"        # the first rank to fail says its error; equal ones stay quiet
STOP_KEY = "rsclip/stop/reason"         # why an agreed stop was asked for (a loader worker died)


class RunStopped(RuntimeError):
    """The run ended early; `exit_code` is the process exit status (docs/reference/exit-codes.md).
    `shared`: every rank raises it at the same sync point (nothing to publish); `said_by_rank0`:
    with the same text on every rank, so rank 0 alone prints it."""
    exit_code = 1
    shared = False
    said_by_rank0 = False


class PeerFailed(RunStopped):
    """Raised on the other ranks at an agreed stop that one rank asked for (its loader worker
    died): that rank's error, its exit code."""
    shared = True

    def __init__(self, error: "RankError", detail: str = ""):
        super().__init__(f"{error.line()}{detail}")
        self.exit_code, self.error = error.code, error


@dataclass(frozen=True)
class RankError:
    """What a failing rank publishes."""
    rank: int
    code: int
    kind: str
    message: str

    def line(self) -> str:
        return f"rank {self.rank} failed: {self.kind}: {self.message}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes | None) -> "RankError | None":
        if not text:
            return None
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError):
            return None


@dataclass
class Failure:
    """An exception as the command line reports it."""
    code: int
    kind: str
    message: str
    known: bool            # one of ours (an exit code of its own): one line, no traceback
    shared: bool = False
    said_by_rank0: bool = False
    line: str = ""         # what this rank prints after "rsclip-ds: "
    reported: bool = False


def describe(err: BaseException) -> Failure:
    """-> the exit code and line of ``err``: ConfigError 2 ("error: ..."), an error class with an
    `exit_code` (RunStopped and its kin, DataError) that code, anything else 1 with its traceback."""
    kind, message = type(err).__name__, str(err)
    if isinstance(err, ConfigError):
        return Failure(2, "ConfigError", message, True, line=f"error: {message}")
    code = getattr(err, "exit_code", None)
    if code is None:
        return Failure(1, kind, message, False, line=f"{kind}: {message}")
    line = message if isinstance(err, PeerFailed) else f"{kind}: {message}"
    return Failure(int(code), kind, message, True, bool(getattr(err, "shared", False)),
                   bool(getattr(err, "said_by_rank0", False)), line)


def failure_of(err: BaseException) -> Failure:
    """The Failure the Trainer's error path attached to ``err`` (reported), else describe(err)."""
    return getattr(err, "rsclip_failure", None) or describe(err)


# gloo's and torch's words for a broken connection: the peer at the other end is gone
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket timeout",
              "timed out", "connection refused", "no route to host")


def is_peer_loss(err: BaseException) -> bool:
    """Whether ``err`` is a collective that broke because another rank is gone (a secondary error)."""
    try:
        from torch.distributed import DistError
    except ImportError:   # an old torch
        DistError = ()
    text = str(err).lower()
    return isinstance(err, (RuntimeError, DistError)) and not hasattr(err, "exit_code") and \
        any(word in text for word in _PEER_GONE)


def format_beat(rank: int, count: int, error: str = "", dead: str = "") -> str:
    """A rank's heartbeat value: "COUNT ERROR" (rank 0: "COUNT DEAD ERROR", DEAD its verdict, the
    silent ranks as "1,3"); ERROR is the JSON of a RankError or empty."""
    return f"{count} {dead} {error}" if rank == 0 else (f"{count} {error}" if error else str(count))


def parse_beat(rank: int, value: str | bytes | None) -> tuple[str | None, str, str]:
    """format_beat's value -> (count, dead, error JSON); (None, "", "") for no value."""
    if value is None:
        return None, "", ""
    text = value.decode() if isinstance(value, bytes) else value
    count, _, rest = text.partition(" ")
    if rank != 0:
        return count, "", rest
    dead, _, error = rest.partition(" ")
    return count, dead, error


def say(line: str) -> None:
    """One user-facing line on stderr, flushed before the process may end with os._exit."""
    print(f"rsclip-ds: {line}", file=sys.stderr, flush=True)
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except (OSError, ValueError):   # a handler whose stream is closed: the line above is what counts
            pass


class RankErrors:
    """This rank's side of the protocol. The heartbeat writes `published` into this rank's key and
    calls `peer_failed` when it reads another rank's error; the Trainer calls `fail` on its way
    out and `publish_stop` / `stop_reason` for an agreed stop. ``store_factory(timeout)`` makes a
    store client (heartbeat.default_store); ``exit`` ends the process (os._exit)."""

    def __init__(self, rank: int, world_size: int, *, interval: float, store_factory: Callable[[float], Any],
                 exit: Callable[[int], None] = os._exit, timeout: float = 30.0):
        self.rank, self.world_size, self.interval = rank, world_size, interval
        self.store_factory, self.exit, self.timeout = store_factory, exit, timeout
        self.wait_s = 5 * interval + 5.0   # two beats to relay, one to read, and slack for a busy host
        self.published: str | None = None
        self._claim = threading.Lock()
        self._store = None
        self._local_stop: RankError | None = None
        self.stop_heartbeat: Callable[[], None] = lambda: None   # set by the Heartbeat it rides on

    # ---- the once-guard between the main thread and the heartbeat thread
    def claim(self) -> bool:
        """True for the first caller in this process: that one reports and ends the process."""
        return self._claim.acquire(blocking=False)

    def claimed(self) -> bool:
        """Whether this process is reporting a failure (its own or a peer's)."""
        return self._claim.locked()

    def store(self):
        if self._store is None:
            self._store = self.store_factory(self.timeout)
        return self._store

    # ---- the main thread's error path
    def fail(self, err: BaseException) -> Failure:
        """Report ``err`` the way the module docstring says; attaches the Failure to ``err``
        (`failure_of`) for the command line, which then prints nothing more."""
        f = describe(err)
        if self.world_size > 1 and not f.shared and is_peer_loss(err):
            f = self._secondary(err, f)
        elif f.shared or self.world_size == 1:
            if self.rank == 0 or not f.said_by_rank0:
                self._say_own(err, f)
        elif self.claim():
            self._publish(err, f)
        else:   # the heartbeat thread is already ending this process for a peer's error
            time.sleep(self.wait_s + 5.0)
        f.reported = True
        err.rsclip_failure = f
        return f

    def _say_own(self, err: BaseException, f: Failure) -> None:
        if f.known:
            say(f.line)
        else:
            traceback.print_exception(err, file=sys.stderr)
            sys.stderr.flush()

    def _publish(self, err: BaseException, f: Failure) -> None:
        mine = RankError(self.rank, f.code, f.kind, f.message)
        self.published = mine.to_json()   # the next beat carries it
        try:
            first = RankError.from_json(self.store().compare_set(FIRST_KEY, "", mine.to_json()))
        except Exception:   # noqa: BLE001 -- the store is gone (rank 0 died): say it here, nobody can hear more
            first = mine
        if first == mine or (first.kind, first.message) != (f.kind, f.message):
            self._say_own(err, f)
        if first != mine:   # another rank failed first: it waits for us too
            self._ack()
        self._wait_for(ACK_KEY)
        self._leave()

    def _secondary(self, err: BaseException, f: Failure) -> Failure:
        """A collective broke: a published error if one comes, else the ranks that went silent."""
        if not self.claim():
            time.sleep(self.wait_s + 5.0)
            return f
        try:
            found = self._watch_peers()
        except Exception as store_err:   # noqa: BLE001 -- the store on rank 0 no longer answers
            found = f"rank 0 is gone (the rendezvous store it hosts stopped answering: {type(store_err).__name__})"
        if isinstance(found, RankError):
            self._say_peer(found)
            self._leave()
            return Failure(found.code, found.kind, found.message, True, line=found.line())
        broke = re.sub(r"^\[[^\]]*\]\s*", "", str(err).strip().split("\n")[0])[:120]   # gloo's source path off
        say(f"rank {self.rank}: {found} without reporting an error: killed (SIGKILL: the OOM killer, a job "
            f"scheduler) or crashed in native code; this rank's collective broke with it ({type(err).__name__}: "
            f"{broke}). The launcher's exit code names the signal (247 = SIGKILL), the host's log the cause "
            f"(`dmesg | grep -i oom`); then `rsclip-ds train ... --resume latest`. Exiting with code {EXIT_PEER_LOST}")
        return Failure(EXIT_PEER_LOST, "PeerLost", found, True)

    def _watch_peers(self) -> "RankError | str":
        """Watch every rank's heartbeat key for up to wait_s: the first published error, else
        (after three beats) the ranks whose counter did not move."""
        store, keys = self.store(), [HEARTBEAT_KEY.format(r) for r in range(self.world_size)]
        start, first = time.monotonic(), None
        while True:
            beats = [parse_beat(r, store.get(k) if store.check([k]) else None) for r, k in enumerate(keys)]
            for _, _, text in beats:
                error = RankError.from_json(text)
                if error is not None and error.rank != self.rank:
                    return error
            counts = [count for count, _, _ in beats]
            first = first or counts
            waited = time.monotonic() - start
            silent = [r for r in range(self.world_size) if r != self.rank and counts[r] == first[r]]
            if (waited > 3 * self.interval + 1.0 and silent) or waited > self.wait_s:
                who = f"rank {silent[0]}" if len(silent) == 1 else (f"ranks {silent}" if silent else "a peer rank")
                return f"{who} is gone (no heartbeat for {waited:.0f} s)"
            time.sleep(self.interval / 2)

    # ---- the heartbeat thread: another rank published its error
    def peer_failed(self, error: RankError) -> None:
        """Say ``error`` once for this rank and end the process with its code (the heartbeat
        thread calls it; the main thread may be blocked in a collective)."""
        if not self.claim():
            return
        self._say_peer(error)
        self._leave()
        self.exit(error.code)

    def _say_peer(self, error: RankError) -> None:
        say(f"{error.line()} (seen by rank {self.rank}; exiting with its code {error.code})")
        self._ack()
        if self.rank == 0:   # the store lives in this process: the others must have read the error
            self._wait_for(ACK_KEY)

    def _ack(self) -> None:
        self._add(ACK_KEY)

    def _add(self, key: str) -> None:
        try:
            self.store().add(key, 1)
        except Exception:   # noqa: BLE001 -- the store is gone: nobody waits for this count any more
            pass

    def _leave(self) -> None:
        """Done with the store: stop this rank's heartbeat; rank 0 waits for the others first."""
        self.stop_heartbeat()
        if self.rank == 0:
            self._wait_for(LEFT_KEY)
        else:
            self._add(LEFT_KEY)

    def _wait_for(self, key: str) -> None:
        """Until the counter ``key`` reaches world_size - 1, at most wait_s."""
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            try:
                if self.store().add(key, 0) >= self.world_size - 1:
                    return
            except Exception:   # noqa: BLE001 -- the store is gone: nothing to wait for
                return
            time.sleep(min(0.1, self.interval))

    # ---- an agreed stop one rank asks for (its loader worker died)
    def publish_stop(self, reason: RankError) -> None:
        """Record why this rank asked for an agreed stop (first one wins), for the others to read
        at the stop."""
        self._local_stop = self._local_stop or reason
        if self.world_size > 1:
            self.store().compare_set(STOP_KEY, "", reason.to_json())

    def stop_reason(self) -> RankError | None:
        """At an agreed stop: the reason a rank published, None for a SIGTERM stop."""
        if self.world_size == 1:
            return self._local_stop
        store = self.store()
        return RankError.from_json(store.get(STOP_KEY)) if store.check([STOP_KEY]) else None

"""The heartbeat against a real TCPStore with simulated ranks (threads, one client each): store
traffic grows with W, not W²; a rank that stops beating is reported by rank 0 and, through its
verdict, by every other rank; a closed heartbeat reports nothing."""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import timedelta

import torch.distributed as dist

from rsclip_ds.runtime.heartbeat import KEY, Heartbeat
from tests.helpers import wait_for


class Counting:
    """A store client that counts its requests by method."""

    def __init__(self, port: int):
        self.store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10),
                                   wait_for_workers=False)
        self.calls: Counter[str] = Counter()
        self.lock = threading.Lock()

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args):
            with self.lock:
                self.calls[name] += 1
            return method(*args)
        return counted


def _ranks(world: int, interval: float, timeout: float):
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    stores = [Counting(master.port) for _ in range(world)]
    reports: dict[int, str] = {}
    hearts = [Heartbeat(r, world, interval=interval, timeout=timeout, store_factory=lambda _t, s=stores[r]: s,
                        on_dead=lambda why, r=r: reports.setdefault(r, why)) for r in range(world)]
    return master, stores, hearts, reports


def test_store_requests_per_beat_do_not_grow_with_ranks():
    """Each beat of each rank is 3 requests, whatever W (rank 0: check + multi_get + set; every
    other rank: set + check + get), so the job makes 3W per interval; all-to-all would make ~W per
    rank and beat (2W² per interval: 480 at 16). Counted per beat (every beat sets the rank's own
    key once), not per second: how often a busy machine gets round to beating does not matter.
    Every key is there from the start, so no beat takes the start-up path (reads key by key)."""
    for world in (4, 16):
        master, stores, hearts, reports = _ranks(world, interval=0.02, timeout=30)
        for r in range(world):
            master.set(KEY.format(r), "0")
        for h in hearts:
            h.start()
        wait_for(lambda stores=stores: all(s.calls["set"] >= 5 for s in stores), f"5 beats of each of {world} ranks")
        for h in hearts:
            h.close()
        for h in hearts:
            h.join(10)                          # a beat under way finishes: whole beats only
        assert not reports
        for rank, s in enumerate(stores):
            beats = s.calls["set"]
            per_beat = ("check", "multi_get", "set") if rank == 0 else ("set", "check", "get")
            assert s.calls == Counter({name: beats for name in per_beat}), (world, rank, s.calls)


def test_a_silent_rank_is_reported_by_rank0_and_through_it_by_the_others():
    world, interval, timeout = 5, 0.05, 0.6
    master, stores, hearts, reports = _ranks(world, interval, timeout)
    for h in hearts:
        h.start()
    time.sleep(0.3)
    hearts[3].close()                         # rank 3 stops beating
    stopped = time.perf_counter()
    while len(reports) < world - 1 and time.perf_counter() - stopped < timeout + 3:
        time.sleep(0.02)
    for h in hearts:
        h.close()
    assert sorted(reports) == [0, 1, 2, 4], reports
    assert "rank(s) [3] sent no heartbeat" in reports[0]
    assert all("rank 0 reports rank(s) [3]" in reports[r] for r in (1, 2, 4)), reports
    assert time.perf_counter() - stopped < timeout + 1.5


def test_other_ranks_notice_a_silent_rank0():
    world, interval, timeout = 3, 0.05, 0.5
    master, stores, hearts, reports = _ranks(world, interval, timeout)
    for h in hearts:
        h.start()
    time.sleep(0.3)
    hearts[0].close()                         # rank 0 hangs: its store still answers, its counter stops
    stopped = time.perf_counter()
    while len(reports) < world - 1 and time.perf_counter() - stopped < timeout + 3:
        time.sleep(0.02)
    for h in hearts:
        h.close()
    assert sorted(reports) == [1, 2] and all("rank 0 sent no heartbeat" in m for m in reports.values()), reports

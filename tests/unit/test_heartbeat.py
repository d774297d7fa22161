"""The heartbeat against a real TCPStore with simulated ranks (threads, one client each): store
traffic grows with W, not W²; a rank that stops beating is reported by rank 0 and, through its
verdict, by every other rank; a closed heartbeat reports nothing."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from rsclip_ds.runtime.heartbeat import Heartbeat


class Counting:
    def __init__(self, port: int):
        self.store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10),
                                   wait_for_workers=False)
        self.requests = 0
        self.lock = threading.Lock()

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args):
            with self.lock:
                self.requests += 1
            return method(*args)
        return counted


def _ranks(world: int, interval: float, timeout: float):
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    stores = [Counting(master.port) for _ in range(world)]
    reports: dict[int, str] = {}
    hearts = [Heartbeat(r, world, interval=interval, timeout=timeout, store_factory=lambda _t, s=stores[r]: s,
                        on_dead=lambda why, r=r: reports.setdefault(r, why)) for r in range(world)]
    return master, stores, hearts, reports


def test_store_requests_per_interval_grow_linearly_with_ranks():
    per_interval = {}
    for world in (4, 16):
        interval = 0.1
        master, stores, hearts, reports = _ranks(world, interval, timeout=30)
        for h in hearts:
            h.start()
        time.sleep(0.25)                       # past start-up (keys appear)
        before, t0 = sum(s.requests for s in stores), time.perf_counter()
        time.sleep(1.0)
        after, t1 = sum(s.requests for s in stores), time.perf_counter()
        for h in hearts:
            h.close()
        per_interval[world] = (after - before) / ((t1 - t0) / interval)
        assert not reports
    # rank 0: check + multi_get + set; every other rank: set + check + get -> 3W per interval
    for world, n in per_interval.items():
        assert 2 * world <= n <= 3.6 * world, per_interval       # all-to-all would be ~2W² (480 at 16)
    assert per_interval[16] / per_interval[4] < 5.5               # x4 ranks, ~x4 requests (W² would be x16)


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
    time.sleep(timeout + 0.6)
    for h in hearts:
        h.close()
    assert sorted(reports) == [1, 2] and all("rank 0 sent no heartbeat" in m for m in reports.values()), reports

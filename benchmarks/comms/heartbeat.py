"""Store traffic of the heartbeat at scale: W simulated ranks in one process, each with its own
client connection to one TCPStore (the rendezvous store rank 0 hosts in a real run), beating
for --seconds; the all-to-all protocol of rsclip_ds <= 0.1 (every rank reads every other rank's
counter: about 2W² requests per interval) against rsclip_ds.runtime.heartbeat (rank 0 reads all counters
with one multi_get and publishes a verdict; the others read one key: about 3W).

    python -m benchmarks.comms.heartbeat --out benchmarks/results/heartbeat.json          # 256 ranks, ~1 min
    python -m benchmarks.comms.heartbeat --ranks 16 --seconds 2 --out /tmp/heartbeat.json # what the test runs

Per protocol: store requests counted on the clients (set, get, check and multi_get, one each),
requests per second over the run, requests per interval of the whole job (what one beat of every
rank costs), and the share of an interval each rank spent waiting on the store (above 1, beats
fall behind the interval; all-to-all also reports beats done against beats due). A dead-rank check runs too:
one simulated rank stops beating, and the new protocol must report it (rank 0 itself, the others
through its verdict) within peer timeout + 2 intervals.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from datetime import timedelta

from benchmarks.harness import base_parser, write_report

from rsclip_ds.runtime.heartbeat import Heartbeat


class CountingStore:
    """A TCPStore client that counts its requests and the seconds spent waiting on them."""

    def __init__(self, port: int, timeout: float, counter: list[float]):
        import torch.distributed as dist

        self._store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout),
                                    wait_for_workers=False)
        self._counter = counter   # [requests, seconds]

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def counted(*args):
            t0 = time.perf_counter()
            result = method(*args)
            self._counter[0] += 1
            self._counter[1] += time.perf_counter() - t0
            return result
        return counted


def all_to_all_beats(rank: int, world: int, store, stop: threading.Event, interval: float, beats: list[int]):
    """rsclip_ds <= 0.1's loop body: set own counter, then check + get every peer's."""
    peers = [r for r in range(world) if r != rank]
    count = 0
    while not stop.wait(interval):
        count += 1
        store.set(f"rsclip/heartbeat/{rank}", str(count))
        for r in peers:
            key = f"rsclip/heartbeat/{r}"
            if store.check([key]):
                store.get(key)
        beats[0] += 1


def simulate(protocol: str, world: int, seconds: float, interval: float, dead: int | None = None,
             timeout: float = 3.0) -> dict:
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    port = master.port
    counters = [[0, 0.0] for _ in range(world)]
    beats = [[0] for _ in range(world)]   # all_to_all: completed beats per rank
    reports: dict[int, str] = {}
    stop, threads, hearts = threading.Event(), [], []
    for rank in range(world):
        store = CountingStore(port, 30, counters[rank])
        if protocol == "all_to_all":
            threads.append(threading.Thread(target=all_to_all_beats, daemon=True,
                                            args=(rank, world, store, stop, interval, beats[rank])))
        else:
            hearts.append(Heartbeat(rank, world, interval=interval, timeout=timeout,
                                    store_factory=lambda _t, s=store: s,
                                    on_dead=lambda why, r=rank: reports.setdefault(r, why)))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for h in hearts:
        h.start()
    if dead is not None and hearts:
        time.sleep(seconds / 2)
        hearts[dead].close()         # this rank stops beating: a dead or frozen process
        killed_at = time.perf_counter()
        deadline = killed_at + timeout + 4 * interval
        while len(reports) < world - 1 and time.perf_counter() < deadline:
            time.sleep(interval / 4)
        reported_at = time.perf_counter()
    else:
        time.sleep(seconds)
    stop.set()
    for h in hearts:
        h.close()
    for t in threads:
        t.join(timeout=30)
    for h in hearts:
        h.join(timeout=30)
    elapsed = time.perf_counter() - t0
    requests = sum(c[0] for c in counters)
    waits = [c[1] for c in counters]   # seconds each rank spent in store requests
    intervals = elapsed / interval
    out = {"protocol": protocol, "ranks": world, "interval_s": interval, "seconds": elapsed,
           "requests": requests, "requests_per_s": requests / elapsed,
           "requests_per_interval": requests / intervals,
           # per rank: the share of each interval spent waiting on the store (> 1: beats fall behind)
           "store_wait_per_interval_median": statistics.median(waits) / intervals,
           "store_wait_per_interval_max": max(waits) / intervals}
    if protocol == "all_to_all":
        out["beats_per_rank_median"] = statistics.median(b[0] for b in beats)
        out["beats_expected_per_rank"] = int(intervals)
    if dead is not None and hearts:
        out["dead_rank"] = dead
        out["reported_by"] = sorted(reports)
        out["reports"] = {str(r): reports[r] for r in sorted(reports)[:3]}
        out["seconds_to_report_after_death"] = reported_at - killed_at
    return out


def print_tables(report: dict) -> None:
    for r in report["runs"]:
        extra = (f", dead rank {r['dead_rank']} reported by {len(r['reported_by'])} ranks "
                 f"{r['seconds_to_report_after_death']:.1f} s after it stopped") if "dead_rank" in r else ""
        print(f"{r['protocol']:>10} W={r['ranks']}: {r['requests_per_s']:9.0f} requests/s, "
              f"{r['requests_per_interval']:9.0f} per {r['interval_s']} s interval, store wait "
              f"{100 * r['store_wait_per_interval_median']:.1f}% of an interval (max "
              f"{100 * r['store_wait_per_interval_max']:.1f}%){extra}")
    for w, ratio in report["ratio_requests_per_s"].items():
        print(f"all_to_all / rank0 requests per second at W={w}: {ratio:.0f}x")


def parse_args(argv=None) -> argparse.Namespace:
    parser = base_parser(__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--interval", type=float, default=2.0, help="faults.heartbeat_s (default 2)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    runs, ratios = [], {}
    for world in args.ranks:
        old = simulate("all_to_all", world, args.seconds, args.interval)
        new = simulate("rank0", world, args.seconds, args.interval)
        dead = simulate("rank0", world, args.seconds, args.interval, dead=world - 1, timeout=3 * args.interval)
        runs += [old, new, dead]
        ratios[str(world)] = old["requests_per_s"] / new["requests_per_s"]
    config = {"ranks": args.ranks, "seconds": args.seconds, "interval": args.interval}
    write_report({"config": config, "runs": runs, "ratio_requests_per_s": ratios},
                 args.out, print_tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())

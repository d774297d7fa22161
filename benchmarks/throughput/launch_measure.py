"""Launch a command in its own process group and measure it from outside: each output line
stamped with its arrival time, the /proc counters (minor page faults, user and system CPU time) of
the whole process tree when chosen lines arrive, and getrusage(RUSAGE_CHILDREN) around the whole
run (every descendant reaped by then: launcher, ranks, loader workers). Used by
benchmarks/throughput/openclip.py; nothing here knows a trainer."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


def tree_counters(pid: int) -> dict:
    """Minor faults and user/system CPU seconds of a process and all its live descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        pids = [pid] + [p.pid for p in root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    tick, minflt, utime, stime, n = os.sysconf("SC_CLK_TCK"), 0, 0, 0, 0
    for p in pids:
        try:   # fields after "pid (comm)": state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        minflt, utime, stime, n = minflt + int(fields[7]), utime + int(fields[11]), stime + int(fields[12]), n + 1
    return {"minflt": minflt, "user_s": utime / tick, "sys_s": stime / tick, "processes": n}


def tree_pss(pid: int) -> dict[int, tuple[str, int]]:
    """pid -> (a short command, bytes of PSS) for a process and its live descendants ({} when it
    is gone). A tree's PSS sum is the memory the tree holds: each shared page counted once, in
    shares among the processes that map it."""
    import psutil

    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for p in procs:
        try:
            for line in Path(f"/proc/{p.pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    out[p.pid] = (short_command(p.cmdline()), int(line.split()[1]) * 1024)   # kB
                    break
        except (OSError, psutil.Error):
            continue
    return out


def short_command(argv: list[str]) -> str:
    """The program a process runs, for grouping: 'python -u -m rsclip_ds --local_rank=0 train' ->
    'rsclip_ds', 'python .../bin/deepspeed --num_gpus 2' -> 'deepspeed', '.../openclip_main.py'.
    A loader worker (a fork) has its parent's command line, so a rank's workers count with it."""
    first = next((a for a in argv[1:] if not a.startswith("-")), argv[0] if argv else "?")
    return Path(first).name


class PeakPss:
    """A daemon thread sampling tree_pss(pid) every `interval` seconds: .peak, the highest sum,
    .at_peak, that sample's shares summed per program (short_command -> bytes), and .cpu_s, the
    CPU seconds the sampling itself took. Reading smaps_rollup walks the process's page tables in
    the kernel: measured here 20-30 ms of CPU per rank of ~1 GB RSS, ~0.1 s per sample of a
    6-process tree, and more the more memory a process maps. Sampled every 0.5 s that is a tenth
    of a 2-core machine, taken from the runs it measures and the more from the tool with the
    larger resident set: hence the 2 s default (the tree's PSS only grows between samples of a
    run in steady state, and the marks sample it too)."""

    def __init__(self, pid: int, interval: float = 2.0):
        self.pid, self.interval, self.peak, self.at_peak, self.cpu_s = pid, interval, 0, {}, 0.0
        self._stop, self._lock = threading.Event(), threading.Lock()
        self._thread = threading.Thread(target=self._run, name="peak-pss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> int:
        """One sample (the thread's, or a mark's from the caller), kept when it is the peak -> bytes."""
        t0 = time.thread_time()
        sample = tree_pss(self.pid)
        total = sum(b for _, b in sample.values())
        with self._lock:
            self.cpu_s += time.thread_time() - t0
            if total > self.peak:
                self.peak, self.at_peak = total, {}
                for name, b in sample.values():
                    self.at_peak[name] = self.at_peak.get(name, 0) + b
        return total

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


@dataclass
class Launched:
    rc: int
    timed_out: bool
    wall_s: float
    steps: dict[int, dict]    # step -> the parsed log line + "t" (seconds since launch at its arrival)
    marks: dict[int, dict]    # step -> tree_counters and machine_seconds when its line arrived
    rusage: dict              # the whole tree, whole run: RUSAGE_CHILDREN deltas
    peak_pss: int = 0         # bytes: the tree's highest sampled PSS sum (PeakPss)
    peak_pss_by_command: dict | None = None   # that sample's shares: short command -> bytes
    pss_sampler_cpu_s: float = 0.0            # CPU seconds the PSS sampling took (the driver's)


def launch(cmd: list[str], env: dict, cwd: Path, timeout: float, parse: Callable[[str], dict | None],
           mark_steps: set[int], log_path: Path, pss_interval: float = 2.0) -> Launched:
    """Run cmd in its own process group (stdout and stderr into `log_path`); `parse(line)` -> a
    dict with "step" for the lines that report a step, None for the others. The first line of each
    step is kept (with "t", seconds since launch); when it is one of `mark_steps`, the tree's
    counters are read. The tree's PSS is sampled every `pss_interval` s throughout (peak_pss). The group is
    killed after `timeout` seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    killed = threading.Event()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", bufsize=1, start_new_session=True)

    def kill():
        killed.set()
        kill_tree(proc.pid)

    timer = threading.Timer(timeout, kill)
    timer.start()
    pss = PeakPss(proc.pid, pss_interval)
    steps, marks = {}, {}
    try:
        with open(log_path, "w") as log:
            for line in proc.stdout:
                t = time.perf_counter() - t0
                log.write(line)
                parsed = parse(line)
                if parsed and parsed["step"] not in steps:
                    steps[parsed["step"]] = {**parsed, "t": t}
                    if parsed["step"] in mark_steps:
                        marks[parsed["step"]] = {"t": t, **tree_counters(proc.pid), "machine": machine_seconds(),
                                                 "pss": pss.sample()}
        rc = proc.wait()
    except BaseException:
        # the driver itself stopped (Ctrl-C, SIGTERM): the group is in its own session, so nothing
        # else would stop it (the deepspeed runner does not forward SIGTERM to the ranks)
        kill_tree(proc.pid)
        proc.wait()
        raise
    finally:
        timer.cancel()
        peak_pss = pss.stop()
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    usage = {"minflt": after.ru_minflt - before.ru_minflt, "majflt": after.ru_majflt - before.ru_majflt,
             "sys_s": after.ru_stime - before.ru_stime, "user_s": after.ru_utime - before.ru_utime}
    return Launched(rc, killed.is_set(), wall, steps, marks, usage, peak_pss, pss.at_peak, pss.cpu_s)


def kill_tree(pid: int) -> None:
    """SIGKILL the launched group and every descendant outside it: torchrun starts each rank in
    a session of its own, which killing the group alone leaves running."""
    import psutil

    try:
        rest = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        rest = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for p in rest:
        with contextlib.suppress(psutil.Error):
            p.kill()


def machine_seconds() -> dict:
    """CPU seconds of all cores since boot, all and busy (/proc/stat)."""
    # cpu  user nice system idle iowait irq softirq steal (guest time is already in user)
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    tick = os.sysconf("SC_CLK_TCK")
    return {"all_s": sum(ticks) / tick, "busy_s": (sum(ticks) - ticks[3] - ticks[4]) / tick}


def cpu_busy(seconds: float = 1.0) -> float:
    """The fraction of all cores' time spent busy over the next `seconds`."""
    before = machine_seconds()
    time.sleep(seconds)
    after = machine_seconds()
    return (after["busy_s"] - before["busy_s"]) / max(1e-9, after["all_s"] - before["all_s"])


def foreign_share(first: dict, last: dict) -> float:
    """Between two marks: the share of all cores' time that processes outside the tree used (other
    jobs on a shared machine; 0 on an idle one, up to the kernel's own work)."""
    all_s = last["machine"]["all_s"] - first["machine"]["all_s"]
    busy = last["machine"]["busy_s"] - first["machine"]["busy_s"]
    tree = (last["user_s"] + last["sys_s"]) - (first["user_s"] + first["sys_s"])
    return max(0.0, busy - tree) / max(1e-9, all_s)


def wait_quiet(limit_s: float, threshold: float = 0.15, say: Callable[[str], None] = print) -> float:
    """Before a timed launch on a shared machine: wait until other processes leave the cores
    idle (busy below `threshold`), at most `limit_s` seconds -> the last busy fraction."""
    busy, t0, told = cpu_busy(), time.perf_counter(), False
    while busy >= threshold and time.perf_counter() - t0 < limit_s:
        if not told:
            say(f"machine {100 * busy:.0f}% busy: waiting up to {limit_s:.0f}s for it to go quiet")
            told = True
        time.sleep(5.0)
        busy = cpu_busy()
    return busy

"""Helpers for the launch tests: the command line of a `deepspeed` run on CPU ranks, its
environment, and timing a job from its output. Import them from here
(`from tests.integration.helpers import ...`), never from a test file; the fixtures that use them
live in conftest.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = ROOT / "configs" / "tiny_demo.yaml"
# Shorter than the demo; every launch test starts from these and adds its own --set.
BASE_OVERRIDES = ["steps=30", "precision=fp32", "batch.micro_batch_size=16", "optim.warmup_steps=3",
                  "logging.log_every=5", "data.num_workers=1", "logging.progress=plain"]
# The checkpoint and fault tests' run (on top of BASE_OVERRIDES): ZeRO-2, 8 steps, a checkpoint
# every 4, a loss line every 2.
CHECKPOINT_RUN = ["profile=zero2", "steps=8", "optim.warmup_steps=2", "logging.log_every=2",
                  "checkpoint.every=4"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env() -> dict[str, str]:
    # PYTHONPATH: the ranks import the tree under test, whatever an editable install points at
    env = dict(os.environ, DS_ACCELERATOR="cpu", DEEPSPEED_TIMEOUT="3", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def deepspeed_cmd() -> list[str]:
    exe = shutil.which("deepspeed")
    return [exe] if exe else [sys.executable, "-m", "deepspeed.launcher.runner"]


def train_args(data: dict, out_dir: Path, overrides: list[str]) -> list[str]:
    sets = BASE_OVERRIDES + [f"output_dir={out_dir}", f"data.train_shards={data['shards']}",
                             f"model.tokenizer={data['tokenizer']}"] + list(overrides)
    return ["--module", "rsclip_ds", "train", "--config", str(DEMO_CONFIG)] + \
        [a for s in sets for a in ("--set", s)]


def run_checked(cmd: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)}\nexit {proc.returncode}\n--- output tail ---\n"
                    f"{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def launch_summary(data: dict, out: Path, overrides: list[str], nproc: int = 2) -> dict:
    """A `deepspeed --num_gpus nproc` training run that must succeed -> its summary.json."""
    port = free_port()
    cmd = deepspeed_cmd() + ["--num_gpus", str(nproc), "--master_port", str(port)]
    run_checked(cmd + train_args(data, out, overrides))
    # DeepSpeed's CPU all-reduce buffers (64 MiB per rank) must not outlive the run
    leaked = list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    assert not leaked, f"shared-memory buffers left behind: {leaked}"
    return summary(out)


def launch_nodes(hostfile: Path, slots: list[int], args: list[str], timeout: int = 600) -> list[str]:
    """A cluster launch on this machine: a hostfile with one line per "node" (node-0 slots=...),
    then one `deepspeed --no_ssh --node_rank R` launcher per node, as SLURM starts them; `args`
    follow the launcher's options (a script or --module ...). Fails the test unless every node
    exits 0; returns each node's output."""
    hostfile.write_text("".join(f"node-{i} slots={n}\n" for i, n in enumerate(slots)))
    port = free_port()
    procs = []
    for node_rank in range(len(slots)):
        cmd = deepspeed_cmd() + ["--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node_rank),
                                 "--master_addr", "127.0.0.1", "--master_port", str(port)] + list(args)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:   # a node that hangs (its peer died) must not outlive the test
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    codes = [p.returncode for p in procs]
    if codes != [0] * len(procs):
        pytest.fail(f"node exit codes {codes}\n" + "\n".join(f"--- node {i} ---\n{o[-3000:]}"
                                                              for i, o in enumerate(outputs)))
    return outputs


def launch_run(data: dict, out: Path, *overrides: str, timeout: int = 300,
               extra: list[str] = ()) -> subprocess.CompletedProcess:
    """One `deepspeed --num_gpus 2` run of CHECKPOINT_RUN; returns the finished process (any exit code)."""
    cmd = deepspeed_cmd() + ["--num_gpus", "2", "--master_port", str(free_port())]
    cmd += train_args(data, out, CHECKPOINT_RUN + list(overrides)) + list(extra)
    return subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=timeout)


class TimedJob:
    """A launcher started in its own session whose merged output a thread reads line by line,
    stamping each line with time.monotonic() as it arrives: durations between a log line and the
    job's exit are measured on this clock, not from the wall-clock times in the log (which have
    whole seconds and wrap at midnight)."""

    def __init__(self, cmd: list[str]):
        # SIGINT at its default, as from a terminal: a test run started in the background by a
        # shell without job control ignores SIGINT, and an ignored signal stays ignored across
        # fork and exec (Python then installs no KeyboardInterrupt handler in the launcher)
        cmd = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
               "os.execvp(sys.argv[1], sys.argv[1:])", *cmd]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[tuple[float, str]] = []   # (monotonic time read, line)
        self.exited_at: float | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def wait(self, timeout: float) -> int:
        """Wait for the launcher to exit; its time is `exited_at`. Returns its exit code."""
        code = self.proc.wait(timeout=timeout)
        self.exited_at = time.monotonic()
        return code

    def kill(self) -> None:
        """SIGKILL whatever is left of the launcher's session (the launcher, ranks, workers)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:   # nothing left
            pass
        self.proc.wait()

    def finish_output(self, timeout: float = 60) -> str:
        """All output, once every process of the job has closed the pipe."""
        self._reader.join(timeout)
        assert not self._reader.is_alive(), "a process of the job still holds its output open"
        return self.text

    @property
    def text(self) -> str:
        return "".join(line for _, line in self.lines)

    def time_of(self, pattern: str) -> float:
        """When the first line matching the regex `pattern` was read."""
        for t, line in self.lines:
            if re.search(pattern, line):
                return t
        raise AssertionError(f"no output line matching {pattern!r}; tail:\n{self.text[-3000:]}")


def pretrained_worker_config(*overrides: str):
    """For the workers launched on a folder of the published shape (pretrained_worker.py,
    finetune_worker.py): their arguments (--folder, --shards, --out, --set; the launcher's
    --local_rank) and a short run config from that folder, `overrides` and then --set."""
    import argparse

    from rsclip_ds.config import load_config

    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--shards", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    run = load_config(DEMO_CONFIG, [
        "steps=4", "optim.warmup_steps=1", "batch.micro_batch_size=8", "logging.log_every=1",
        "logging.progress=plain", "data.num_workers=0", f"output_dir={args.out}",
        f"model.pretrained={args.folder}", "model.tokenizer=null", f"data.train_shards={args.shards}",
        *overrides, *args.set])
    return args, run

"""Running a benchmark script the way its docstring says, for tests/integration/test_benchmark_*.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.integration.helpers import deepspeed_cmd, free_port, run_checked


def run_benchmark(module: str, *args: str, out: Path, ranks: int | None = 2, timeout: int = 600) -> dict:
    """`deepspeed --num_gpus <ranks> --module benchmarks.<module> <args> --out <out>` (ranks=None:
    plain `python -m`), from the repository root -> the JSON report. A non-zero exit fails the test with the output's tail; a
    launch that leaves DeepSpeed's shared-memory all-reduce buffers behind fails it too."""
    port = free_port()
    launcher = [sys.executable, "-m"] if ranks is None else \
        deepspeed_cmd() + ["--num_gpus", str(ranks), "--master_port", str(port), "--module"]
    run_checked(launcher + [f"benchmarks.{module}", *args, "--out", str(out)], timeout=timeout)
    if ranks is not None:
        leaked = list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
        assert not leaked, f"shared-memory buffers left behind: {leaked}"
    return json.loads(out.read_text())

"""The first run on a GPU machine (1-8 GPUs): one command, steps in order, stop at the first
failure, one JSON to send with a bug report (docs/guides/clusters.md, "First run on GPUs").

    python -m benchmarks.gpu.first_run --out first_run.json          # a GPU host, < 10 min on one GPU
    DS_ACCELERATOR=cpu python -m benchmarks.gpu.first_run --smoke --out /tmp/first_run.json   # CPU, ~1 min

Steps: environment (driver, CUDA, NCCL, nvcc or not, GPUs, topology); the loss and accumulation
parity tests (reference twins; tests/unit/test_losses.py, test_global_accumulation.py); one ddp
and one ZeRO-1/2/3 step each at the run's default precision (benchmarks.gpu --precisions auto:
amp_bf16 on ddp, bf16 under ZeRO; a few steps, the tiny model under --smoke); the MFU cases
(benchmarks.gpu, git-rsclip-base, ddp, zero2 and zero3 at auto, beside the eager plain-loop twin;
skipped under --smoke); the planner check (`rsclip-ds plan` for this machine's GPUs). The JSON lists, under
"gpu_checks", every finding that only a GPU can confirm, so the first GPU run closes them or reports
them open.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:
    sys.exit("run as a module from the repository root: python -m benchmarks.gpu.first_run --out first_run.json")

from benchmarks.harness import base_parser

# What the GPU-less review (issue 27) fixed or guarded without seeing it run on a GPU: each names
# the row of this JSON that confirms it.
GPU_CHECKS = [
    "qgZ (zero3_zeropp, 2+ nodes): gradients reach swizzle_quant as fp16 (communication_data_type fp16) -- "
    "needs 2 nodes: benchmarks/comms/multigpu_hybrid.sh; not covered here",
    "threads per rank: DeepSpeedCPUAdam's OpenMP loop follows torch.set_num_threads (offload profiles)",
    "pin_memory and device RNG follow the accelerator: no CUDA context on GPU 0 from CPU ranks",
    "MFU per device with the device's own peak (steps.mfu rows: device name, peak_tflops)",
    "ZeRO-3 peak memory of the steps, apart from the engine build (steps.*: peak_memory_bytes, "
    "build_peak_memory_bytes)",
    "bytes outside the allocator after step 2 (after_warmup.outside_allocator_bytes) against the planner's "
    "1 GiB reserve",
    "loss / accumulation parity on NCCL with 2 and 3 GPUs (the parity step runs the reference twins in one "
    "process; the multi-rank form runs on gloo: tests/integration/test_loss_parity.py)",
    "ddp's overlapped bucketed all-reduce (rsclip_ds/gradients.py) on NCCL with 2+ GPUs: one GPU has nothing to "
    "reduce (zero_steps runs ddp on one); the CPU tests run it on gloo",
    "NCCL's /dev/shm use (not in the loader's shared-memory check) and the autograd all-gather's backward "
    "(a reduce-scatter under NCCL)",
]


def environment() -> dict:
    """Driver, CUDA, NCCL, nvcc, GPUs and their topology, as far as this host tells."""
    import torch

    def run(cmd: list[str]) -> str | None:
        if not shutil.which(cmd[0]):
            return None
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        return (done.stdout or done.stderr).strip()

    gpus = [{"name": torch.cuda.get_device_name(i), "bytes": torch.cuda.get_device_properties(i).total_memory}
            for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    return {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl, "gpus": gpus,
            "driver": run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
            "nvcc": run(["nvcc", "--version"]), "topology": run(["nvidia-smi", "topo", "-m"]),
            "cores": len(os.sched_getaffinity(0)), "ds_accelerator": os.environ.get("DS_ACCELERATOR")}


def steps(args, gpus: int, tmp: Path) -> list[tuple[str, list[str]]]:
    """(name, command) in order; each runs from the repository root."""
    py, model = sys.executable, "tiny" if args.smoke else "git-rsclip-base"
    # --variants base: the feature variants (benchmarks/gpu/variants.py) are benchmarks.gpu's own default run;
    # --twins alone: one step of each stage needs no plain-loop twin
    short = ["--seconds", "1", "--max-steps", "2", "--warmup", "2", "--ac", "off", "--model", model,
             "--variants", "base", "--twins"]
    # --precisions auto: what a run does by default (amp_bf16 on ddp, bf16 under ZeRO)
    todo = [("parity", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/test_losses.py",
                        "tests/unit/test_global_accumulation.py"]),
            ("zero_steps", [py, "-m", "benchmarks.gpu", *short, "--profiles", "ddp", "zero1", "zero2", "zero3",
                            "--precisions", "auto", *(["--micro", "2"] if args.smoke else []),
                            "--out", str(tmp / "zero_steps.json")])]
    if not args.smoke:
        todo.append(("mfu", [py, "-m", "benchmarks.gpu", "--model", "git-rsclip-base", "--profiles", "ddp", "zero2",
                             "zero3", "--precisions", "auto", "--ac", "off", "--seconds", "5", "--variants", "base",
                             "--twins", "eager", "--out", str(tmp / "mfu.json")]))
    todo.append(("plan", [py, "-m", "rsclip_ds", "plan", "--model", "git-rsclip-base", "--gpus", str(max(gpus, 1)),
                          "--gpu-mem", f"{args.gpu_mem_gib}GiB", "--global-batch", str(32 * max(gpus, 1)), "--json"]))
    return todo


def parse_args(argv):
    parser = base_parser(__doc__)
    parser.add_argument("--smoke", action="store_true", help="CPU smoke test: tiny model, no MFU cases")
    parser.add_argument("--gpu-mem-gib", type=int, default=80, help="the planner check's GPU memory (GiB)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    report = {"environment": environment(), "steps": [], "gpu_checks": GPU_CHECKS, "ok": True}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cmd in steps(args, len(report["environment"]["gpus"]), Path(tmp)):
            s0 = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            row = {"step": name, "command": " ".join(cmd), "ok": done.returncode == 0, "rc": done.returncode,
                   "seconds": round(time.perf_counter() - s0, 1), "output_tail": (done.stdout + done.stderr)[-3000:]}
            result = Path(tmp) / f"{name}.json"
            if result.is_file():
                row["result"] = json.loads(result.read_text())
            elif name == "plan" and done.returncode == 0:
                row["result"] = json.loads(done.stdout)
            report["steps"].append(row)
            print(f"[{name}] {'ok' if row['ok'] else 'FAILED rc=%d' % row['rc']} in {row['seconds']:.0f}s", flush=True)
            if not row["ok"]:
                report["ok"], report["stopped_at"] = False, name
                break
    report["seconds"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print("needs a GPU to confirm:\n  - " + "\n  - ".join(GPU_CHECKS))
    print(f"wrote {args.out}: send it with a bug report")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

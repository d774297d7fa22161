"""Chaos: faults that end runs in the field, injected one at a time into a 2-rank `tiny` run on CPU
ranks, each followed by `--resume auto` to the end. Per fault: the exit code, the first message a
user sees, the steps lost, and the final loss against the run that was never interrupted.

    python -m benchmarks.faults.chaos --out benchmarks/results/faults_chaos.json
    python -m benchmarks.faults.chaos --only python_error,sigterm --out /tmp/chaos.json

The run: `configs/tiny_demo.yaml`, ZeRO-2, fp32, 12 steps, micro-batch 16 per rank, a loss line
(a sync point) every step, a checkpoint every 4 steps, one loader worker per rank, synthetic
shards of 64 px (benchmarks/harness.py), DEEPSPEED_TIMEOUT=3 min. Every run is a real `deepspeed
--num_gpus 2 --module rsclip_ds train` launch; the faults use real signals where there is one:

- `FAULTS` lists them by name, each a `Fault` of config overrides (faults.* injection keys), a
  signal sent from here at a step, or a change on disk between two runs. A fault whose keys this
  version's config rejects (a key another change adds) is skipped and the row says so, so a row
  can be added by name before its key exists. `disk_full_tmpfs` mounts a small tmpfs (root, Linux)
  over the checkpoint folder and is skipped, saying why, where `mount` fails.
- First message: the first line of the launcher's merged output that our code wrote (a line
  `rsclip-ds: ...` or an `[HH:MM:SS rankN]` log line; a raw traceback counts as its last line)
  after the fault (the injection's own line, or the moment the signal was sent), leaving out
  progress lines and routine start-up and checkpoint lines.
- Steps lost: the last step the faulted run completed (metrics.jsonl, every step logged) less the
  step the resumed run started from. Final loss: the resumed run's last loss against the
  uninterrupted run's, bit for bit (`equal`); every fault here resumes on the same 2 ranks, where
  rsclip_ds's resume is exact.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness import ROOT, base_parser, deepspeed_cmd, environment, free_port, synthetic_data

STEPS, EVERY = 12, 4
RUN = ["profile=zero2", "precision=fp32", f"steps={STEPS}", "optim.warmup_steps=2", "batch.micro_batch_size=16",
       "logging.log_every=1", "logging.progress=plain", "data.num_workers=1", f"checkpoint.every={EVERY}",
       "faults.heartbeat_s=1", "faults.stop_check_every=1"]
TMPFS_MIB, TMPFS_RESUME_MIB = 8, 64   # two tiny checkpoints (3.2 MB each) fit in 8 MiB, a third does not


@dataclass(frozen=True)
class Fault:
    """One row: `sets` (config overrides of the faulted run), or `signal` sent to rank `rank` once
    rank 0 has logged step `at`, or `disk`: 'truncate' (the newest checkpoint's largest file cut to
    half between a first run that stops at step 8 and the `--resume auto`; where that resume fails,
    the row's end is a resume of the tag before, named by hand) or 'tmpfs' (the checkpoint folder on
    a TMPFS_MIB tmpfs, made larger before the resume, as a user frees space)."""
    name: str
    what: str
    sets: tuple[str, ...] = ()
    signal: int | None = None
    rank: int = 0
    at: int = 7
    disk: str | None = None


FAULTS = (
    Fault("python_error", "rank 1 raises a Python error at step 7", ("faults.inject_error_at_step=7", "faults.inject_rank=1")),
    Fault("rank_sigkill", "rank 1 SIGKILLs itself at step 7 (a node's OOM killer)", ("faults.inject_kill_at_step=7",)),
    Fault("worker_sigkill", "SIGKILL to a DataLoader worker of rank 1 at step 7",
          ("faults.inject_worker_kill_at_step=7", "faults.inject_rank=1")),
    Fault("sigterm", "SIGTERM to rank 0 after step 7 (pre-emption)", signal=signal.SIGTERM),
    Fault("truncated_checkpoint", "the newest checkpoint's largest file cut to half on disk", disk="truncate"),
    Fault("enospc_injected", "ENOSPC inside the checkpoint save of step 8", ("faults.inject_enospc_in_save_at_step=8",)),
    Fault("disk_full_tmpfs", f"the checkpoint folder on a {TMPFS_MIB} MiB tmpfs (full at the third save)", disk="tmpfs"),
)

OURS = re.compile(r"^(rsclip-ds: |\[\d\d:\d\d:\d\d rank\d+\] )")
ROUTINE = re.compile(r"\] (step \d+/\d+ |checkpoint step\d+ saved|model |shard sample counts|threads per rank|"
                     r"start-up |fault injection: |data\.num_workers=auto|step \d+: rank \d+ waits for data|"
                     r"resumed step )")


def parse_args(argv: list[str] | None = None):
    parser = base_parser(__doc__, out=ROOT / "benchmarks" / "results" / "faults_chaos.json")
    parser.add_argument("--only", default="", help="comma-separated fault names (default: all of FAULTS)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    parser.add_argument("--work", type=Path, default=None, help="folder for the runs (default: a temporary one)")
    return parser.parse_args(argv)


def plan(args, faults=FAULTS, can_mount=None) -> list[tuple[Fault, str | None]]:
    """The faults to run, each with the reason it is skipped (None: it runs): not named by --only,
    overrides this version's config rejects, or a tmpfs that cannot be mounted."""
    from rsclip_ds.config import ConfigError, load_config

    only = {n.strip() for n in args.only.split(",") if n.strip()}
    unknown = only - {f.name for f in faults}
    if unknown:
        raise SystemExit(f"--only names no fault {sorted(unknown)}; the faults: {[f.name for f in faults]}")
    out = []
    for fault in faults:
        if only and fault.name not in only:
            continue
        why = None
        try:
            load_config(None, RUN + list(fault.sets))
        except ConfigError as err:
            said = [x.strip() for x in str(err).splitlines() if x.strip()]
            why = f"this version's config rejects it: {(said[1] if len(said) > 1 else said[0]).split(';')[0]}"
        if why is None and fault.disk == "tmpfs":
            why = (can_mount or tmpfs_works)()
        out.append((fault, why))
    return out


def first_message(lines: list[str], after: int = 0) -> str | None:
    """The first line of ours from ``lines[after:]`` that is not routine (see the module docstring);
    a traceback as its last line."""
    tail = lines[after:]
    for i, line in enumerate(tail):
        line = line.rstrip("\n")
        if line.startswith("Traceback (most recent call last)"):
            end = next((j for j in range(i + 1, len(tail)) if not tail[j].startswith((" ", "\t"))), None)
            return f"[traceback] {tail[end].strip()}" if end is not None else "[traceback]"
        if OURS.match(line) and not ROUTINE.search(line):
            return line
    return None


def steps_lost(metrics_text: str, resumed_from: int | None) -> int | None:
    """Last step of the faulted segment in metrics.jsonl (up to the resume marker) less the resumed step."""
    done = 0
    for raw in metrics_text.splitlines():
        record = json.loads(raw)
        if record.get("event") == "resume":
            break
        if record.get("kind") == "train":
            done = max(done, record["step"])
    return None if resumed_from is None else done - resumed_from


def make_row(fault: Fault, faulted: dict, resumed: dict | None, reference_loss: float | None) -> dict:
    """One table row from the two runs' records ({"code", "first", "lost", "final_loss", ...})."""
    final = resumed.get("final_loss") if resumed else None
    return {"fault": fault.name, "what": fault.what, "exit_code": faulted["code"],
            "first_message": faulted["first"], "steps_lost": resumed.get("lost") if resumed else None,
            "resume_exit_code": resumed["code"] if resumed else None, "final_loss": final,
            "reference_final_loss": reference_loss,
            "equal": None if final is None or reference_loss is None else final == reference_loss,
            "seconds": round(faulted["seconds"] + (resumed["seconds"] if resumed else 0.0), 1)}


# --------------------------------------------------------------------------- running

def tmpfs_works() -> str | None:
    """None when a tmpfs can be mounted here, else why not."""
    probe = Path(tempfile.mkdtemp(prefix="rsclip_tmpfs_probe_"))
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            return f"`mount -t tmpfs` failed here: {(proc.stderr or proc.stdout).strip()[:160]}"
        subprocess.run(["umount", str(probe)], check=True)
        return None
    except FileNotFoundError:
        return "no `mount` command"
    finally:
        shutil.rmtree(probe, ignore_errors=True)


@dataclass
class Launch:
    """A `deepspeed --num_gpus 2 ... rsclip_ds train` run whose merged output is read line by line."""
    cmd: list[str]
    lines: list[str] = field(default_factory=list)

    def start(self) -> "Launch":
        env = dict(os.environ, DS_ACCELERATOR="cpu", DEEPSPEED_TIMEOUT="3", HF_HUB_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()
        return self

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait()
        self.reader.join(60)
        return code

    def rank_pid(self, rank: int) -> int | None:
        import psutil

        for child in psutil.Process(self.proc.pid).children(recursive=True):
            if f"--local_rank={rank}" in child.cmdline():
                return child.pid
        return None


def launch(data: dict, out: Path, sets: list[str], resume: bool = False) -> Launch:
    args = ["--module", "rsclip_ds", "train", "--config", str(ROOT / "configs" / "tiny_demo.yaml")]
    for s in RUN + [f"output_dir={out}", f"data.train_shards={data['train_pattern']}",
                    f"model.tokenizer={data['tokenizer']}"] + sets:
        args += ["--set", s]
    cmd = deepspeed_cmd() + ["--num_gpus", "2", "--master_port", str(free_port())] + args
    return Launch(cmd + (["--resume", "auto"] if resume else [])).start()


def run_once(data, out: Path, sets: list[str], timeout: float, *, resume=False, fault: Fault | None = None) -> dict:
    """One launch -> {"code", "first", "seconds", "final_loss"}; a signal fault is sent from here."""
    t0 = time.monotonic()
    job = launch(data, out, sets, resume)
    marker = 0
    if fault is not None and fault.signal is not None:
        line = f"rank0] step {fault.at}/{STEPS}"
        while not any(line in x for x in job.lines) and job.proc.poll() is None:
            time.sleep(0.05)
        marker = len(job.lines)
        pid = job.rank_pid(fault.rank)
        if pid is not None:
            os.kill(pid, fault.signal)
    code = job.wait(timeout)
    logs = sorted(out.parent.glob(f"{out.name}.launch*.log"))
    (out.parent / f"{out.name}.launch{len(logs)}.log").write_text("".join(job.lines))   # for a look afterwards
    if fault is not None and fault.sets:
        marker = next((i for i, x in enumerate(job.lines) if OURS.match(x) and "fault injection: " in x), 0)
    summary = out / "summary.json"
    final = json.loads(summary.read_text())["losses"][-1] if code == 0 and summary.is_file() else None
    return {"code": code, "first": first_message(job.lines, marker), "seconds": time.monotonic() - t0,
            "final_loss": final, "output_tail": [x.rstrip() for x in job.lines[-12:]] if code else []}


def run_fault(fault: Fault, data: dict, work: Path, timeout: float) -> tuple[dict, dict | None]:
    out = work / fault.name
    ckpt = out / "checkpoints"
    mounted = False
    try:
        if fault.disk == "tmpfs":
            ckpt.mkdir(parents=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MIB}m", "tmpfs", str(ckpt)], check=True)
            mounted = True
        if fault.disk == "truncate":
            first = run_once(data, out, ["checkpoint.stop_after=8"], timeout)
            victim = max((p for p in (ckpt / "step00000008").iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
            victim.write_bytes(victim.read_bytes()[:victim.stat().st_size // 2])
            faulted = run_once(data, out, [], timeout, resume=True)   # `--resume auto` meets the torn file
            faulted.update(seconds=faulted["seconds"] + first["seconds"], truncated=str(victim.relative_to(out)))
            # without a fall-back to the tag before, a user names it by hand
            resumed = faulted if faulted["code"] == 0 else run_once(data, out, ["checkpoint.resume=step00000004"],
                                                                     timeout)
            resumed["lost"] = steps_lost((out / "metrics.jsonl").read_text(), _resumed_from(out))
            return faulted, resumed
        faulted = run_once(data, out, list(fault.sets), timeout, fault=fault)
        if mounted:
            subprocess.run(["mount", "-o", f"remount,size={TMPFS_RESUME_MIB}m", str(ckpt)], check=True)
        resumed = run_once(data, out, [], timeout, resume=True)
        resumed["lost"] = steps_lost((out / "metrics.jsonl").read_text(), _resumed_from(out))
        return faulted, resumed
    finally:
        if mounted:
            subprocess.run(["umount", str(ckpt)], check=False)


def _resumed_from(out: Path) -> int | None:
    path = out / "summary.json"
    if not path.is_file():
        return None
    starts = json.loads(path.read_text()).get("resumed_from") or []
    return starts[-1] if starts else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    planned = plan(args)
    work = args.work or Path(tempfile.mkdtemp(prefix="rsclip_chaos_"))
    data = synthetic_data(work / "data", 0, num_train=1024, num_val=64, shard_size=128)
    reference = run_once(data, work / "reference", [], args.timeout)
    print(f"uninterrupted: exit {reference['code']}, final loss {reference['final_loss']} "
          f"({reference['seconds']:.0f} s)", flush=True)
    rows = []
    for fault, skip in planned:
        if skip:
            rows.append({"fault": fault.name, "what": fault.what, "skipped": skip})
            print(f"{fault.name}: skipped ({skip})", flush=True)
            continue
        faulted, resumed = run_fault(fault, data, work, args.timeout)
        row = make_row(fault, faulted, resumed, reference["final_loss"])
        if faulted["code"] and not faulted["first"]:
            row["output_tail"] = faulted["output_tail"]
        if resumed is not None and resumed["code"]:
            row["resume_output_tail"] = resumed["output_tail"]
        if "truncated" in faulted:
            row["truncated"] = faulted["truncated"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {"config": {"run": RUN, "world_size": 2, "tmpfs_mib": TMPFS_MIB},
              "reference": {"exit_code": reference["code"], "final_loss": reference["final_loss"]},
              "rows": rows, "environment": environment(1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

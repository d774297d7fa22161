"""SIGTERM (pre-emption), non-finite gradients, one rank's error and a killed loader worker, with real 2-rank
launches (tiny, fp32, ZeRO-2)."""

from __future__ import annotations

import math
import re
import signal
import subprocess

import psutil
import pytest
import torch

from rsclip_ds.checkpoint import META, consolidated_state_dict, read_pointer, tag_for
from rsclip_ds.reporting.metrics import read_metrics
from tests.helpers import wait_for
from tests.integration.helpers import (CHECKPOINT_RUN, TimedJob, deepspeed_cmd, free_port, launch_run, summary,
                                     train_args)

pytestmark = pytest.mark.slow


def _rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        if f"--local_rank={rank}" in child.cmdline():
            return child.pid
    raise AssertionError(f"rank {rank} not found under the launcher")


def _long_run_at_step_4(launch_data, out) -> TimedJob:
    """A 400-step 2-rank run that checks for a stop every step, once rank 0 has logged step 4."""
    cmd = deepspeed_cmd() + ["--num_gpus", "2", "--master_port", str(free_port())]
    cmd += train_args(launch_data, out,
                      CHECKPOINT_RUN + ["steps=400", "checkpoint.every=0", "faults.stop_check_every=1"])
    job = TimedJob(cmd)
    try:
        wait_for(lambda: "rank0] step 4/400" in job.text or job.proc.poll() is not None,
                 "rank 0 to log step 4", timeout=300, poll=0.1, detail=lambda: job.text[-4000:])
        assert job.proc.poll() is None, job.text[-4000:]
    except BaseException:
        job.kill()
        raise
    return job


def test_sigterm_saves_on_every_rank_and_exits_75(launch_data, tmp_path):
    """SIGTERM reaches one rank (the deepspeed launcher forwards it rank by rank); the ranks
    agree on it through the sync-point all-reduce, save the same step, and exit with 75."""
    out = tmp_path / "run"
    job = _long_run_at_step_4(launch_data, out)
    try:
        psutil.Process(_rank_pid(job.proc, 0)).send_signal(signal.SIGTERM)
        code = job.wait(timeout=240)
        text = job.finish_output()
    finally:
        job.kill()
    assert code == 75, text[-4000:]
    assert "received SIGTERM" in text and "Preempted: stopped by SIGTERM" in text
    s = summary(out)
    step = s["optimizer_steps"]
    assert s["stopped"] == "sigterm" and 4 <= step < 400 and len(s["losses"]) == step
    root = out / "checkpoints"
    tag = tag_for(step)
    assert read_pointer(root) == tag and (root / tag / META).is_file()
    assert sorted(p.name for p in (root / tag).glob("zero_pp_rank_*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def test_repeated_nonfinite_gradients_are_skipped_then_stop_the_run_with_the_last_good_checkpoint(launch_data,
                                                                                                  tmp_path):
    """From step 5 on, rank 1's gradient of one token-embedding row is NaN (bf16 ZeRO-2: rsclip_ds's step
    guard skips). Both ranks skip steps 5 and 6 -- the reduced norm is the same on both -- and stop at 6."""
    out = tmp_path / "run"
    proc = launch_run(launch_data, out, "precision=bf16", "checkpoint.every=2", "faults.inject_nan_at_step=5",
                      "faults.max_nonfinite_steps=2")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 3, text[-4000:]
    assert "NonFiniteLoss: the gradient norm was not finite for 2 consecutive steps (5..6); each was skipped " \
           "(the weights are those after step 4)" in text
    assert "step 5 skipped: its gradient norm is not finite (nan)" in text   # a NaN gradient, its norm NaN
    root = out / "checkpoints"
    assert read_pointer(root) == "step00000004" and not (root / "step00000006").exists()
    _, state = consolidated_state_dict(out)
    assert all(torch.isfinite(t).all() for t in state.values())
    m = read_metrics(out / "metrics.jsonl")
    assert [e["step"] for e in m["events"] if e["event"] == "skipped"] == [5, 6]
    assert m["train"][-1]["step"] == 6 and m["train"][-1]["skipped_steps"] == 2


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_fp16_supported(),
                    reason="this processor has no fp16 support: DeepSpeed's CPU accelerator refuses fp16")
def test_fp16_overflow_steps_are_skipped_counted_and_do_not_stop_the_run(launch_data, tmp_path):
    out = tmp_path / "run"
    proc = launch_run(launch_data, out, "precision=fp16", "fp16.initial_scale_power=32",
                      "faults.max_nonfinite_steps=1")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    s = summary(out)
    assert s["skipped_steps"] >= 1 and s["optimizer_steps"] == 8
    assert math.isfinite(s["losses"][-1])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_deepspeed_command_alone_saves_and_leaves_no_orphans(launch_data, tmp_path, sig):
    """What `timeout`, a container stop or a plain `kill` does: signal only the `deepspeed`
    runner the user started. It does not forward the signal; the ranks see it gone (their
    launcher was re-parented), save the same step and exit 75, and every process of the job
    ends (the output pipe closes)."""
    out = tmp_path / "run"
    job = _long_run_at_step_4(launch_data, out)
    try:
        ranks = [_rank_pid(job.proc, r) for r in (0, 1)]
        job.proc.send_signal(sig)                      # the runner only, not its process group
        job.wait(timeout=60)
        text = job.finish_output(timeout=240)          # every process that held the pipe has ended
    finally:
        job.kill()
    assert not [p for p in ranks if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert "the deepspeed command that started this node's ranks" in text, text[-4000:]
    assert "Preempted: stopped by SIGTERM" in text and "return code = 75" in text, text[-4000:]
    s = summary(out)
    step = s["optimizer_steps"]
    assert s["stopped"] == "sigterm" and 4 <= step < 400
    assert read_pointer(out / "checkpoints") == tag_for(step)


def test_a_full_disk_in_a_save_exits_6_and_a_truncated_newest_checkpoint_falls_back(launch_data, tmp_path):
    """Rank 1's write of step 8's checkpoint fails with ENOSPC (the injection: a real OSError from
    inside the write path): both ranks stop with one DiskFull message, exit 6, step 8 removed, the
    pointer on step 6. Then step 6 is cut short too: `--resume auto` names the file, resumes from
    step 4 and ends with the losses of the first run. Also: the start-up estimate of a
    checkpoint's bytes against the real tag (tolerance below)."""
    from rsclip_ds.checkpoint import weights_only_loads
    from rsclip_ds.runtime.integrity import checkpoint_bytes
    from rsclip_ds.reporting.metrics import read_metrics

    out = tmp_path / "run"
    root = out / "checkpoints"
    proc = launch_run(launch_data, out, "checkpoint.every=2", "faults.inject_enospc_in_save_at_step=8")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 6, text[-4000:]
    shard = root / "step00000008" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert text.count("rsclip-ds: DiskFull: checkpoint step00000008 not saved: rank 1 found no space left on device "
                      f"(ENOSPC) writing {shard} (") == 1, text[-4000:]
    assert "The incomplete step00000008 was removed; the newest intact checkpoint is step00000006" in text
    assert "Traceback" not in text
    assert read_pointer(root) == "step00000006" and not (root / "step00000008").exists()
    # one checkpoint's bytes as estimated at start-up (16 per parameter in fp32 at ZeRO-2: the module
    # once, fp32 masters + Adam moments over the ranks) against the tag's files: within 5 % (the
    # rest is hf/, the RNG files, the history and DeepSpeed's headers: ~1 % here)
    tag = root / "step00000006"
    with weights_only_loads():
        module = torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu")["module"]
    params = sum(t.numel() for t in module.values() if t.is_floating_point())
    real = sum(p.stat().st_size for p in tag.rglob("*") if p.is_file())
    assert checkpoint_bytes(params, params, "fp32", "fp32", 2) == pytest.approx(real, rel=0.05)
    first = {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl")["train"]}

    cut = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    size = cut.stat().st_size
    with open(cut, "r+b") as f:
        f.truncate(1000)
    proc = launch_run(launch_data, out, "checkpoint.every=2", extra=["--resume", "auto"])
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert (f"checkpoint step00000006 is broken: {cut}: 1,000 bytes, the manifest says {size:,} (truncated); "
            f"resuming from step00000004, the newest intact checkpoint") in text
    s = summary(out)
    assert s["resumed_from"] == [4] and s["optimizer_steps"] == 8
    assert s["losses"][5] == first[6] and s["losses"][7] == first[8]   # fp32 ZeRO-2 resumes bit for bit
    assert read_pointer(root) == "step00000008"


def test_a_python_error_on_rank0_reaches_rank1_as_itself(launch_data, tmp_path):
    """Rank 0 (which hosts the rendezvous store) raises an error of no known kind at step 3: its
    traceback once, on rank 0; rank 1, blocked in a collective rank 0 never joins, says "rank 0
    failed: ..." and exits 1 too, before any connection error or heartbeat timeout."""
    out = tmp_path / "run"
    proc = launch_run(launch_data, out, "faults.inject_error_at_step=3", "faults.inject_rank=0")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-4000:]
    said = "InjectedError: fault injection: rank 0 raises at step 3 (faults.inject_error_at_step)"
    assert text.count("Traceback (most recent call last)") == 1, text[-4000:]
    assert text.count(f"\nrsclip_ds.faults.{said}\n") == 1, text[-4000:]   # the traceback's last line
    assert f"rsclip-ds: rank 0 failed: {said} (seen by rank 1; exiting with its code 1)" in text, text[-4000:]
    assert "Connection closed" not in text and "sent no heartbeat" not in text


def test_a_killed_loader_worker_saves_on_every_rank_and_exits_7_without_orphans(launch_data, tmp_path):
    """A real SIGKILL to rank 1's DataLoader worker at step 5 (what the OOM killer does): named on
    rank 1 with the likely cause, its worker replaced at the same data position; the ranks agree
    to stop at the next sync point (step 6, a log step), save that step there and exit 7; every
    process of the job (ranks, workers) ends."""
    out = tmp_path / "run"
    cmd = deepspeed_cmd() + ["--num_gpus", "2", "--master_port", str(free_port())]
    cmd += train_args(launch_data, out, CHECKPOINT_RUN + ["faults.inject_worker_kill_at_step=5", "faults.inject_rank=1"])
    job = TimedJob(cmd)
    try:
        wait_for(lambda: "rank0] step 2/8" in job.text or job.proc.poll() is not None, "rank 0 to log step 2",
                 timeout=300, poll=0.1, detail=lambda: job.text[-4000:])
        pids = [p.pid for p in psutil.Process(job.proc.pid).children(recursive=True)]   # ranks and workers
        code = job.wait(timeout=240)
        text = job.finish_output()        # every process that held the output pipe has ended
    finally:
        job.kill()
    assert code == 7, text[-4000:]
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    named = re.search(r"rank 1: DataLoader worker 0 \(pid (\d+)\) was killed by SIGKILL\. SIGKILL of a loader "
                      r"worker is almost always the kernel's OOM killer", text)
    assert named and text.count(named.group(0)) == 1, text[-4000:]   # the warning says it in full, once
    assert text.count("data.num_workers=1 worker(s) x 2 batches in flight") == 1
    head = f"LoaderWorkerDied: rank 1: DataLoader worker 0 (pid {named.group(1)}) was killed by SIGKILL (the likely " \
           f"cause and the fix: rank 1's warning). Checkpoint step00000006 saved at the agreed stop after step 6"
    assert f"\nrsclip-ds: {head}" in text and f"\nrsclip-ds: rank 1 failed: {head}" in text, text[-4000:]
    assert "Traceback" not in text
    s = summary(out)
    assert s["stopped"] == "loader_worker_died" and s["optimizer_steps"] == 6 and len(s["losses"]) == 6
    assert read_pointer(out / "checkpoints") == "step00000006"

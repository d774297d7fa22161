"""Checkpoints with real 2-rank launches: exact resume, a rank killed inside a save, a rank
killed mid-training. All runs: tiny model, fp32, ZeRO-2, 8 steps, micro 16 x 2 ranks.

The reference is one uninterrupted 8-step run with a checkpoint every 4 steps; every
interrupted-and-resumed run must reproduce its losses bit for bit and its final weights exactly
(fp32 on CPU is deterministic here, so 'equal to the printed precision' is 'equal')."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from rsclip_ds.checkpoint import (META, POINTER, consolidated_state_dict, read_pointer,
                                  resolve_checkpoint)
from rsclip_ds.reporting.metrics import read_metrics
from tests.integration.helpers import (CHECKPOINT_RUN, TimedJob, deepspeed_cmd, free_port, launch_run, summary,
                                     train_args)

pytestmark = pytest.mark.slow


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc


def weights(path: Path) -> dict[str, torch.Tensor]:
    return consolidated_state_dict(path)[1]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert worst == 0.0, f"final weights differ by up to {worst}"


@pytest.fixture(scope="module")
def reference(launch_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    ok(launch_run(launch_data, out))
    s = summary(out)
    assert s["optimizer_steps"] == 8 and s["checkpoints"] == ["step00000004", "step00000008"]
    return out


def test_resume_is_exact_and_a_kill_inside_a_save_keeps_the_previous_checkpoint(launch_data, reference, tmp_path):
    out = tmp_path / "run"
    # 1. the first half of the same run (same schedule: steps=8), stopping after step 4
    ok(launch_run(launch_data, out, "checkpoint.stop_after=4"))
    assert summary(out)["optimizer_steps"] == 4 and read_pointer(out / "checkpoints") == "step00000004"
    # 2. resume, but the last rank SIGKILLs itself inside the save of step 8, after writing
    #    its shards and before the pointer moves
    killed = launch_run(launch_data, out, "faults.inject_kill_in_save_at_step=8", extra=["--resume", "latest"])
    assert killed.returncode != 0
    assert "SIGKILLs itself inside the save of step00000008" in killed.stdout + killed.stderr
    root = out / "checkpoints"
    assert read_pointer(root) == "step00000004"
    assert (root / "step00000008").is_dir() and not (root / "step00000008" / META).exists()
    assert resolve_checkpoint(out) == (root, "step00000004")
    with pytest.raises(FileNotFoundError, match="incomplete checkpoint"):
        resolve_checkpoint(root / "step00000008")
    # 3. the previous checkpoint loads and the run finishes exactly like the uninterrupted one
    ok(launch_run(launch_data, out, extra=["--resume", "latest"]))
    s, ref = summary(out), summary(reference)
    assert s["losses"] == ref["losses"] and s["lrs"] == ref["lrs"]
    assert [f"{x:.4f}" for x in s["losses"]] == [f"{x:.4f}" for x in ref["losses"]]
    assert s["resumed_from"] == [4] and s["optimizer_steps"] == 8
    assert s["checkpoints"] == ["step00000004", "step00000008"]
    assert_same_weights(out, reference)
    assert (root / POINTER).read_text().strip() == "step00000008"


def test_sigkilled_rank_brings_the_job_down_and_resume_loses_only_steps_since_the_checkpoint(
        launch_data, reference, tmp_path, monkeypatch):
    """Also W&B (logging.wandb, offline): the killed run and its `--resume auto` are one W&B run whose
    history, read back from its two offline folders, holds every train line once, at its step."""
    from rsclip_ds.reporting.wandb_log import read_offline_run

    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)   # the launches' environment is a copy of this process's
    out = tmp_path / "run"
    cmd = deepspeed_cmd() + ["--num_gpus", "2", "--master_port", str(free_port())]
    job = TimedJob(cmd + train_args(launch_data, out, CHECKPOINT_RUN + ["faults.inject_kill_at_step=7",
                                                                       "logging.wandb=true"]))
    try:
        code = job.wait(timeout=300)
        text = job.finish_output()   # fails if a rank outlived the launcher
    finally:
        job.kill()
    assert code != 0, text[-4000:]
    # on the test's monotonic clock: the rank logs this line just before it SIGKILLs itself
    down = job.exited_at - job.time_of(r"rank1\] fault injection: rank 1 sends itself SIGKILL at step 7")
    print(f"job down {down:.1f} s after the SIGKILL")   # measured: see docs/guides/checkpoints.md
    assert down < 30, f"the job took {down:.0f} s to go down after a rank died"
    assert read_pointer(out / "checkpoints") == "step00000004"
    # rank 0's metrics.jsonl kept every log step before the kill (a line every 2 steps), with the
    # losses of the uninterrupted run
    ref_losses = summary(reference)["losses"]
    killed = read_metrics(out / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in killed["train"]] == [(k, ref_losses[k - 1]) for k in (2, 4, 6)]
    resumed = ok(launch_run(launch_data, out, "logging.wandb=true", extra=["--resume", "auto"]))
    s = summary(out)
    assert s["resumed_from"] == [4]          # steps 5 and 6 were lost, nothing before them
    assert s["losses"] == ref_losses
    assert_same_weights(out, reference)
    # the resumed run appended after a marker; step 6 was written twice, the later line wins
    m = read_metrics(out / "metrics.jsonl")
    assert [(e["event"], e.get("step")) for e in m["events"]] == [("start", None), ("resume", 4)]
    assert [(r["step"], r["loss"]) for r in m["train"]] == [(k, ref_losses[k - 1]) for k in (2, 4, 6, 8)]
    # W&B: one run over the two offline folders, every train line once at its step, nothing logged
    # at a step it had passed. The killed rank 0 takes wandb-core's buffer with it (what it held:
    # printed); the resumed run sends the lines up to its checkpoint it lacks again from metrics.jsonl
    run_id = json.loads((out / "monitor" / "wandb" / "run.json").read_text())["id"]
    said = resumed.stdout + resumed.stderr
    print(said[said.index(f"W&B: offline run {run_id}"):].splitlines()[0])
    assert f"W&B: offline run {run_id} (project rsclip_ds), continued" in said
    assert "Tried to log to step" not in text + said
    run = read_offline_run(out / "monitor" / "wandb", run_id)
    steps = [r["_step"] for r in run["history"]]
    assert run["segments"] == 2 and steps == sorted(set(steps)) and {5, 6, 7, 8} <= set(steps)
    assert [(r["_step"], r["Train/loss"]) for r in run["history"] if "Train/loss" in r] == \
        [(k, ref_losses[k - 1]) for k in (2, 4, 6, 8)]
    assert [r["_step"] for r in run["history"] if "Train/Samples/lr" in r][-4:] == [5, 6, 7, 8]
    assert run["config"]["checkpoint"]["resume"] == "auto" and run["summary"]["summary/optimizer_steps"] == 8


def test_frozen_rank_is_detected_by_the_heartbeat_within_the_peer_timeout(launch_data, tmp_path):
    """A rank that stops without closing its sockets (SIGSTOP: a hung host) makes gloo wait for
    the collective timeout; the heartbeat ends the others after faults.peer_timeout_s. Two
    launchers (two 'nodes'), so that no launcher sees a child exit."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    port, out = free_port(), tmp_path / "run"
    sets = ["faults.inject_freeze_at_step=5", "faults.peer_timeout_s=5", "faults.heartbeat_s=0.5"]
    jobs = []
    try:
        for node_rank in (0, 1):
            cmd = deepspeed_cmd() + ["--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node_rank),
                                     "--master_addr", "127.0.0.1", "--master_port", str(port)]
            jobs.append(TimedJob(cmd + train_args(launch_data, out, CHECKPOINT_RUN + sets)))
        code = jobs[0].wait(timeout=300)
    finally:
        for job in jobs:   # node b's rank is stopped: kill its whole session
            job.kill()
    node_a = jobs[0].finish_output()
    jobs[1].finish_output()
    # on the test's monotonic clock: rank 1 logs this line just before it SIGSTOPs itself
    down = jobs[0].exited_at - jobs[1].time_of(r"rank1\] fault injection")
    print(f"node a down {down:.1f} s after rank 1 froze (peer timeout 5 s)")
    assert code == 4, node_a[-4000:]
    assert "rank(s) [1] sent no heartbeat for 5 s" in node_a
    assert down < 5 + 10, f"node a took {down:.0f} s to give up on a frozen rank"
    assert read_pointer(out / "checkpoints") == "step00000004"


def test_ddp_amp_bf16_resumes_exactly(launch_data, tmp_path):
    """The fast path (ddp: stage 0 with rsclip_ds's overlapped all-reduce, amp_bf16: fp32 weights under
    torch.autocast) stops after step 4 and resumes to step 8 with the uninterrupted run's losses, learning
    rates and final weights, bit for bit."""
    fast = ["profile=ddp", "precision=amp_bf16"]
    reference, out = tmp_path / "reference", tmp_path / "run"
    ok(launch_run(launch_data, reference, *fast))
    ok(launch_run(launch_data, out, *fast, "checkpoint.stop_after=4"))
    proc = ok(launch_run(launch_data, out, *fast, extra=["--resume", "latest"]))
    assert "gradients averaged by rsclip_ds's overlapped all-reduce" in proc.stdout + proc.stderr
    s, ref = summary(out), summary(reference)
    assert s["losses"] == ref["losses"] and s["lrs"] == ref["lrs"] and s["resumed_from"] == [4]
    assert ref["precision"] == "amp_bf16" and ref["zero_stage"] == 0
    assert_same_weights(out, reference)

"""launch/cluster.sh on this machine (a one-node hostfile 'localhost slots=2'), then
`rsclip-ds eval` on the run's checkpoint with 2 ranks, `rsclip-ds export`, and `rsclip-ds eval`
on the exported folder in one process: the same numbers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from rsclip_ds.data.synthetic import make_synthetic
from rsclip_ds.data.tokenizer import iter_captions, train_tokenizer

from tests.integration.helpers import BASE_OVERRIDES, ROOT, deepspeed_cmd, free_port, launch_env, run_checked

pytestmark = pytest.mark.slow
STEPS = 6


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    # 33 held-out images: the 2 eval ranks get uneven shares (17 / 16)
    index = make_synthetic(tmp / "data", num_train=512, num_val=33, shard_size=128, seed=0,
                           progress=False, eval_layout=True)
    train_tokenizer(iter_captions([str(tmp / "data" / s["url"]) for s in index["train"]]),
                    tmp / "tok", vocab_size=300)
    (tmp / "hostfile").write_text("# one node, two CPU ranks\nlocalhost slots=2\n")
    (tmp / "env").write_text("# comments and blank lines are stripped for the launcher\n\nRSCLIP_MARK=1\n")
    out = tmp / "run"
    sets = BASE_OVERRIDES + [f"steps={STEPS}", "optim.warmup_steps=1", f"output_dir={out}",
                             f"data.train_shards={index['train_pattern']}", f"model.tokenizer={tmp / 'tok'}"]
    cmd = ["bash", str(ROOT / "launch/cluster.sh"), "--hostfile", str(tmp / "hostfile"),
           "--config", str(ROOT / "configs/tiny_demo.yaml"), "--profile", "zero3",
           "--master-port", str(free_port()), "--env-file", str(tmp / "env")]
    proc = run_checked(cmd + [a for s in sets for a in ("--set", s)], timeout=600)
    return tmp, index, out, proc


def test_cluster_script_trains_on_a_hostfile(cluster_run):
    _, _, out, proc = cluster_run
    assert "--hostfile" in proc.stderr and "profile=zero3" in proc.stderr   # the command it ran
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["zero_stage"] == 3
    assert summary["optimizer_steps"] == STEPS and len(summary["losses"]) == STEPS


def test_cluster_script_rejects_bad_arguments(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "launch/cluster.sh"), "--hostfile", str(tmp_path / "none"),
                           "--config", "x.yaml"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "hostfile not found" in proc.stderr


def test_eval_checkpoint_two_ranks_equals_exported_folder(cluster_run):
    tmp, index, out, _ = cluster_run
    data = ["--zero-shot", index["zero_shot_dir"], "--retrieval", index["retrieval_json"], "--batch-size", "8"]
    run_checked(deepspeed_cmd() + ["--num_gpus", "2", "--master_port", str(free_port()), "--module",
                                   "rsclip_ds", "eval", "--checkpoint", str(out)] + data, timeout=600)
    tag = f"step{STEPS:08d}"
    from_ckpt = json.loads((out / "eval" / f"{tag}.json").read_text())
    assert from_ckpt["step"] == STEPS
    assert from_ckpt["zero_shot"]["num_images"] == 33 and from_ckpt["retrieval"]["num_texts"] == 33 * 4
    run_checked([sys.executable, "-m", "rsclip_ds", "export", str(out), str(tmp / "export")], timeout=300)
    run_checked([sys.executable, "-m", "rsclip_ds", "eval", "--model", str(tmp / "export"),
                 "--out", str(tmp / "folder.json")] + data, timeout=300)
    from_folder = json.loads((tmp / "folder.json").read_text())
    compared = []
    for group in ("zero_shot", "retrieval"):
        for key, value in from_ckpt[group].items():
            if isinstance(value, float):
                assert from_folder[group][key] == pytest.approx(value, abs=1e-6), (group, key)
                compared.append(f"{group}/{key}")
    assert {"zero_shot/top1", "retrieval/t2i_R@1", "retrieval/i2t_R@1"} <= set(compared), compared
    assert from_folder["zero_shot"]["per_class"] == pytest.approx(from_ckpt["zero_shot"]["per_class"])


SRUN = """#!/usr/bin/env bash
# srun as the batch script uses it, on one node: drop the options, run the task as node 0
while [[ "$1" == --* ]]; do shift; done
export SLURM_NODEID=0
exec "$@"
"""
SCONTROL = """#!/usr/bin/env bash
# scontrol show hostnames LIST -> the nodes; scontrol requeue ID -> recorded
case "$1 $2" in
  "show hostnames") echo localhost ;;
  requeue*) echo "$*" >> "$SCONTROL_LOG" ;;
esac
"""


def _slurm_job(tmp, sets: list[str], port: int) -> subprocess.Popen:
    """launch/slurm.sbatch as SLURM runs it on one node: its environment, srun and scontrol."""
    env = launch_env()
    env.update(PATH=f"{tmp / 'bin'}:{env['PATH']}", SLURM_JOB_ID=str(port - 20000), SLURM_JOB_NODELIST="localhost",
               SLURM_GPUS_ON_NODE="2", SCONTROL_LOG=str(tmp / "scontrol.log"))
    cmd = ["bash", "launch/slurm.sbatch", str(ROOT / "configs/tiny_demo.yaml")] + [a for s in sets for a in ("--set", s)]
    log = open(tmp / "job.log", "a")
    return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def test_slurm_script_saves_on_slurms_sigterm_requeues_and_the_requeued_job_resumes(cluster_run, tmp_path):
    """SLURM's --signal=TERM@120 signals the job step's task (our cluster.sh, which srun
    started): the ranks save and exit 75, the script requeues the job; the requeued job, the
    same command, resumes from that checkpoint through --resume auto."""
    import psutil

    from rsclip_ds.checkpoint import read_pointer, tag_for
    from tests.helpers import wait_for

    data, index, _, _ = cluster_run
    (tmp_path / "bin").mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (tmp_path / "bin" / name).write_text(text)
        (tmp_path / "bin" / name).chmod(0o755)
    (tmp_path / "launch").symlink_to(ROOT / "launch")
    port = next(p for p in iter(free_port, None) if 20000 <= p < 40000)   # the script's port: 20000 + job id
    out = tmp_path / "run"
    sets = BASE_OVERRIDES + [f"output_dir={out}", f"data.train_shards={index['train_pattern']}",
                             f"model.tokenizer={data / 'tok'}", "steps=400", "optim.warmup_steps=1",
                             "faults.stop_check_every=1"]
    job = _slurm_job(tmp_path, sets, port)
    try:
        log = tmp_path / "job.log"
        wait_for(lambda: "rank0] step 5/400" in log.read_text() or job.poll() is not None,
                 "rank 0 to log step 5", timeout=300, poll=0.2, detail=lambda: log.read_text()[-3000:])
        task, = [p for p in psutil.Process(job.pid).children() if "cluster.sh" in " ".join(p.cmdline())]
        task.send_signal(signal.SIGTERM)                  # what SLURM's --signal=TERM@120 does
        code = job.wait(timeout=240)
    finally:
        _kill_session(job)
    text = log.read_text()
    assert code == 75, text[-4000:]
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", str(port - 20000)]
    first = json.loads((out / "summary.json").read_text())
    step = first["optimizer_steps"]
    assert first["stopped"] == "sigterm" and 5 <= step < 400
    assert read_pointer(out / "checkpoints") == tag_for(step)
    # the requeued job: the same command line (stop_after ends it soon, as a later time limit would)
    job = _slurm_job(tmp_path, sets + [f"checkpoint.stop_after={step + 3}"], port)
    try:
        code = job.wait(timeout=300)
    finally:
        _kill_session(job)
    assert code == 0, log.read_text()[-4000:]
    second = json.loads((out / "summary.json").read_text())
    assert second["resumed_from"] == [step] and second["optimizer_steps"] == step + 3
    assert len((tmp_path / "scontrol.log").read_text().splitlines()) == 1   # no second requeue


def _kill_session(job: subprocess.Popen) -> None:
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    job.wait()

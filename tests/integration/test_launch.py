"""The deepspeed launcher with 2 CPU ranks trains `tiny` on synthetic shards with every profile.

Golden behaviour, not existence: the loss falls by a stated margin, fp32 losses agree across
ZeRO stages, accumulation gives the documented number of optimizer steps, and two "nodes" joined
by a hostfile repeat the one-node run bit for bit (the same seed, the same trajectory). A launch
costs ~20 s of start-up on 2 cores whatever its steps, so each launch here checks several things.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tests.integration.helpers import (ROOT, deepspeed_cmd, free_port, launch_env, launch_summary, run_checked,
                                     train_args)

pytestmark = pytest.mark.slow
PROFILES = ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"]
# SigLIP starts near 9.3 here (b = -10 makes every positive pair cost ~10). After 30 steps of
# micro 16 x 2 ranks the tiny model is below 6 on every profile; we require a drop of 2.5.
MIN_LOSS_DROP = 2.5


@pytest.fixture(scope="module")
def profile_run(launch_data, tmp_path_factory):
    """profile_run(profile) -> summary of its 30-step run. Each profile is launched once per
    module, by the first test that asks for it, and shared with the tests that ask later."""
    root, runs = tmp_path_factory.mktemp("profiles"), {}

    def _run(profile: str) -> dict:
        if profile not in runs:
            runs[profile] = launch_summary(launch_data, root / profile, [f"profile={profile}"])
        return runs[profile]
    return _run


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_trains_and_loss_falls(profile_run, profile):
    s = profile_run(profile)
    assert s["profile"] == profile and s["world_size"] == 2
    assert s["optimizer_steps"] == 30 and s["global_batch"] == 32
    assert s["loss_start"] - s["loss_end"] >= MIN_LOSS_DROP, s["losses"]
    assert s["activation_checkpointing"] is (profile == "zero3_offload")


@pytest.mark.parametrize("profile", PROFILES)
def test_learning_rate_read_back_moves_from_the_first_step(profile_run, profile):
    """The lr each optimizer step used, as the engine reports it: warmup 3 at lr 1e-3 gives
    1/3, 2/3 and all of the peak on steps 1-3 (DeepSpeed's WarmupCosineLR gave steps 1-2 lr 0),
    then cosine decay over the remaining 27 steps."""
    lrs = profile_run(profile)["lrs"]
    assert len(lrs) == 30
    assert lrs[:4] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3], rel=1e-6)
    assert all(a > b for a, b in zip(lrs[3:], lrs[4:])) and lrs[-1] < 1e-5


def test_cpu_ranks_train_with_huge_pages(profile_run):
    """`deepspeed --module rsclip_ds train` on CPU ranks: the entry point asked torch for huge pages
    before importing it, rank 0 ended the run with memory in them, and the summary says so."""
    state = profile_run("zero2")["host_memory"]
    assert state["setting"] == "keep" and state["THP_MEM_ALLOC_ENABLE"] == "1" and state["huge_pages"], state
    if state["thp_mode"] in ("always", "madvise"):
        assert state["anon_huge_pages_bytes"] > 2 * 2**20, state


def test_fp32_losses_match_across_zero_stages(profile_run):
    """Same seed, same data: ZeRO 1/2/3 (with and without offload) are the same optimisation."""
    ref = torch.tensor(profile_run("zero1")["losses"][:10])
    for profile in PROFILES[1:]:
        got = torch.tensor(profile_run(profile)["losses"][:10])
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4), (profile, got, ref)


def test_bf16_trains_with_plain_accumulation_and_the_documented_steps(launch):
    s = launch("profile=zero2", "precision=bf16", "batch.micro_batch_size=8", "batch.gradient_accumulation_steps=2",
               "batch.accumulation=plain")
    assert (s["precision"], s["accumulation_mode"]) == ("bf16", "plain")
    # micro x accumulation x world = global; one optimizer step per `accumulation` micro-batches
    assert s["batch_arithmetic"] == "8 x 2 x 2 = 32"
    assert (s["optimizer_steps"], s["micro_steps"], len(s["losses"])) == (30, 60, 30)
    assert s["loss_start"] - s["loss_end"] >= MIN_LOSS_DROP, s["losses"]


def test_bf16_with_global_accumulation_and_clip_loss_trains(launch, launch_teacher):
    """Also distilling, at a small weight, from a SigLIP teacher partitioned over the ranks by its
    own ZeRO-3 engine (distill.placement=zero3): the Trainer, the loader's second view and the
    teacher's engine in a real launch."""
    s = launch("profile=zero3", "precision=bf16", "loss.name=clip", "batch.micro_batch_size=8",
               "batch.gradient_accumulation_steps=2", "batch.accumulation=global", f"distill.teacher={launch_teacher}",
               "distill.placement=zero3", "distill.weight=0.1")
    assert (s["loss"], s["accumulation_mode"], s["micro_steps"]) == ("clip", "global", 60)
    assert s["batch_arithmetic"] == "8 x 2 x 2 = 32" and s["optimizer_steps"] == len(s["losses"]) == 30
    assert s["loss_start"] - s["loss_end"] >= 1.0, s["losses"]   # InfoNCE starts at ln(32) ~ 3.5


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_fp16_supported(),
                    reason="this processor has no fp16 support: DeepSpeed's CPU accelerator refuses fp16")
@pytest.mark.parametrize("mode", ["plain", "global"])
def test_fp16_trains_with_a_loss_scale(launch, mode):
    s = launch("profile=zero2", "precision=fp16", "batch.micro_batch_size=8",
               "batch.gradient_accumulation_steps=2", f"batch.accumulation={mode}")
    assert s["loss_scale"] is not None and s["loss_scale"] > 0
    assert s["loss_start"] - s["loss_end"] >= MIN_LOSS_DROP, s["losses"]


def test_two_nodes_through_a_hostfile_repeat_the_one_node_run_exactly(launch_data, tmp_path, profile_run):
    """One launcher per node, as a cluster runs them (hostfile + --no_ssh + --node_rank), with the
    settings of the one-node zero2 run above: the same seed gives the same loss trajectory, bit for
    bit, whether the two ranks share a launcher or not."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    port, out = free_port(), tmp_path / "two_nodes"
    procs = []
    for node_rank in (0, 1):
        cmd = deepspeed_cmd() + ["--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node_rank),
                                 "--master_addr", "127.0.0.1", "--master_port", str(port)]
        cmd += train_args(launch_data, out, ["profile=zero2"])
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["world_size"] == 2 and s["optimizer_steps"] == 30 and s["global_batch"] == 32
    assert s["losses"] == profile_run("zero2")["losses"]


def test_console_script_trains_without_a_launcher(launch_data, tmp_path):
    """`rsclip-ds train` alone runs a one-rank group on localhost."""
    out = tmp_path / "single"
    args = train_args(launch_data, out, ["profile=zero1", "steps=5", "optim.warmup_steps=1"])[2:]
    run_checked(["rsclip-ds"] + args)
    s = json.loads((out / "summary.json").read_text())
    assert s["world_size"] == 1 and s["batch_arithmetic"] == "16 x 1 x 1 = 16"


def test_launcher_reports_a_bad_config_once_before_starting(launch_data, tmp_path):
    """A user error ends every rank with exit code 2 before any process group, said once (by
    rank 0), without a traceback. (Which errors are caught before starting, with which message:
    tests/unit/test_cli.py, in process.)"""
    message = "batch.micro_batch_size: Input should be greater than or equal to 1"
    cmd = deepspeed_cmd() + ["--num_gpus", "2", "--master_port", str(free_port())]
    cmd += train_args(launch_data, tmp_path, ["batch.micro_batch_size=0"])
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert text.count(message) == 1 and "Traceback" not in text, text[-3000:]


def test_too_little_shared_memory_stops_before_training_with_exit_code_2(launch_data, tmp_path):
    """The /dev/shm check against this machine's free space: a micro batch whose batches in
    flight (1 worker: 2 prefetched + 1 held, uint8 at 64 px) need about twice what is free."""
    free = shutil.disk_usage("/dev/shm").free
    micro = int(2 * free / (1.25 * 3 * (3 * 64 * 64 + 8 * 64)))
    args = train_args(launch_data, tmp_path, [f"batch.micro_batch_size={micro}", "profile=zero1"])[2:]
    proc = subprocess.run([sys.executable, "-m", "rsclip_ds"] + args, cwd=ROOT, env=launch_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "rsclip-ds: error: the data loader needs ~" in proc.stderr and "--shm-size=" in proc.stderr
    assert not (tmp_path / "summary.json").exists()


def test_metrics_monitors_and_a_slow_loader_on_one_rank(launch_data, tmp_path, monkeypatch):
    """Rank 1's loader hands each batch over 0.5 s late (faults.inject_data_delay_s). metrics.jsonl
    holds a line per log step with the summary's losses; TensorBoard and the CSV monitor hold
    Train/loss at the same optimizer steps with the same values (DeepSpeed's own Train/Samples/lr
    at step x global batch samples). W&B (offline by default: no WANDB_MODE, no WANDB_API_KEY), read
    back from the run's .wandb file: every train line at its optimizer step, every evaluation (the
    synthetic zero-shot and retrieval sets every 3 steps, the suite's two sets every 4, both before
    training and at the end) at its step, the suite's tables and plot, DeepSpeed's lr after every
    step on its sample axis, the resolved config and the summary, and no warning about a step W&B
    had passed -- with a global batch of 32 DeepSpeed's sample count ran W&B's step ahead of ours
    from step 1, which dropped every event of ours.
    The load, in what holds on any machine: rank 1 waits at least
    the 0.5 s for each step's batch (time.sleep's guarantee), in every window and over the run;
    rank 0 does not inherit that wait (it idles at the step's collective instead, while its own
    loader has the half second to spare); both ranks' step times agree (every step ends in a
    collective both wait at); the warnings name each rank exactly as often as the rule
    gives from the logged windows, and the summary names the rank with the largest fraction. How
    large the fractions are depends on the machine's load (rank 1's were 0.55-0.84 per window on
    busy cores), so they are printed, not asserted. Its global batch is 64 (micro 32 x 2 ranks), the
    issue's: DeepSpeed's own W&B monitor logged at the sample count and hid every one of our events
    at any global batch above 1."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rsclip_ds.data.synthetic import make_synthetic
    from rsclip_ds.reporting.load import data_wait_outliers
    from rsclip_ds.reporting.metrics import read_metrics
    from tests.rs_sets import write_suite

    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)   # the launch's environment is a copy of this process's
    evals = make_synthetic(tmp_path / "eval_data", num_train=1, num_val=16, shard_size=1, image_size=64,
                           progress=False, eval_layout=True)
    write_suite(tmp_path / "suite", ["WHU-RS19", "RSICD"])
    out = tmp_path / "run"
    cmd = deepspeed_cmd() + ["--num_gpus", "2", "--master_port", str(free_port())]
    cmd += train_args(launch_data, out, ["profile=zero2", "steps=8", "optim.warmup_steps=2", "logging.log_every=2",
                                         "checkpoint.at_end=false", "logging.tensorboard=true", "logging.csv=true",
                                         "logging.wandb=true", f"eval.zero_shot_dir={evals['zero_shot_dir']}",
                                         f"eval.retrieval_json={evals['retrieval_json']}", "eval.every=3",
                                         f"eval.suite={tmp_path / 'suite'}", "eval.suite_every=4",
                                         "faults.inject_data_delay_s=0.5", "faults.inject_data_delay_rank=1",
                                         "batch.micro_batch_size=32"])
    proc = run_checked(cmd)
    text = proc.stdout + proc.stderr
    s = json.loads((out / "summary.json").read_text())
    lines = read_metrics(out / "metrics.jsonl")["train"]
    want = [(r["step"], s["losses"][r["step"] - 1]) for r in lines]
    assert [(r["step"], r["loss"]) for r in lines] == want and [st for st, _ in want] == [2, 4, 6, 8]
    assert all(r["lr"] == s["lrs"][r["step"] - 1] and r["grad_norm"] > 0 for r in lines)
    # TensorBoard (float32) and CSV (the float's repr) on the optimizer-step axis
    acc = EventAccumulator(str(out / "monitor" / "tensorboard")).Reload()
    tb = [(e.step, e.value) for e in acc.Scalars("Train/loss")]
    assert [st for st, _ in tb] == [st for st, _ in want]
    assert [v for _, v in tb] == pytest.approx([v for _, v in want], rel=1e-6)
    # DeepSpeed's own lr event: after step k's scheduler step, at k x 64 samples: the lr of step k + 1
    ds_lr = acc.Scalars("Train/Samples/lr")
    assert [e.step for e in ds_lr] == [64 * k for k in range(1, 9)]
    assert [e.value for e in ds_lr[:-1]] == pytest.approx(s["lrs"][1:], rel=1e-6)
    rows = (out / "monitor" / "csv" / "Train_loss.csv").read_text().split()
    assert rows[0] == "step,loss" and [tuple(map(float, r.split(","))) for r in rows[1:]] == want
    _check_wandb(out, text, s, lines, read_metrics(out / "metrics.jsonl")["eval"])
    # the slow rank: one batch per optimizer step (micro 32 x 2 ranks = the global 64)
    delay = 0.5
    waits = [r["ranks"]["data_wait"] for r in lines]
    print("data wait per window (rank 0, rank 1):", waits, "step s:", [r["ranks"]["step_s"] for r in lines])
    load = s["load"]
    for fractions, step_s in [(r["ranks"]["data_wait"], r["ranks"]["step_s"]) for r in lines] + \
            [(load["data_wait"], load["step_s"])]:
        wait_s = [f * t for f, t in zip(fractions, step_s)]   # data-wait seconds per step
        assert wait_s[1] >= delay * (1 - 1e-9) and wait_s[0] < delay, (fractions, step_s)
    # a warning each time a rank becomes an outlier by the default rule (> 0.2 and > 3x the other)
    for rank in (0, 1):
        flagged = [rank in data_wait_outliers(w, 0.2, 3.0) for w in waits]
        entries = sum(now and not before for before, now in zip([False] + flagged, flagged))
        assert text.count(f"rank {rank} waits for data") == entries, (rank, waits, text[-4000:])
    assert load["max_data_wait_rank"] == max((0, 1), key=load["data_wait"].__getitem__) == 1, load
    assert {load["slowest_rank"], load["fastest_rank"]} == {0, 1}
    # every step ends in a collective both ranks wait at: their run totals differ by the windows'
    # edges only (~1% measured), against 15% of the 7 steps' time allowed
    assert abs(load["step_s"][1] - load["step_s"][0]) < 0.15 * max(load["step_s"]), load
    assert "data wait per rank" in text and "max rank 1" in text


def _check_wandb(out, text: str, s: dict, lines: list[dict], evals: list[dict]) -> None:
    """The monitors run's W&B run against metrics.jsonl and summary.json (see the test's docstring)."""
    from rsclip_ds.reporting.wandb_log import read_offline_run

    run_id = json.loads((out / "monitor" / "wandb" / "run.json").read_text())["id"]
    assert "W&B offline: neither WANDB_MODE nor WANDB_API_KEY is set" in text
    assert f"upload it with: wandb sync {out}/monitor/wandb/wandb/offline-run-*-{run_id}*" in text
    assert "Tried to log to step" not in text
    run = read_offline_run(out / "monitor" / "wandb", run_id)
    history = run["history"]
    assert run["segments"] == 1 and [r["_step"] for r in history] == list(range(0, 9))   # a row per step
    assert [(r["_step"], r["Train/loss"]) for r in history if "Train/loss" in r] == \
        [(r["step"], r["loss"]) for r in lines]
    assert [(r["_step"], r["Train/lr"]) for r in history if "Train/lr" in r] == [(r["step"], r["lr"]) for r in lines]
    assert [[r[f"Load/data_wait/rank{k}"] for k in (0, 1)] for r in history if "Train/loss" in r] == \
        [r["ranks"]["data_wait"] for r in lines]
    assert [e["step"] for e in evals] == [0, 3, 4, 6, 8]
    for e in evals:   # every number of every evaluation, at its step
        row = history[e["step"]]
        assert {k: row[f"Eval/{k}"] for k in e["eval"]} == e["eval"], e
    assert {"zero_shot/top1", "retrieval/mean_recall", "suite/WHU-RS19/top1", "suite/RSICD/mean_recall"} <= \
        {k for e in evals for k in e["eval"]}
    suite_rows = [r for r in history if "Suite/classification" in r]
    assert [r["_step"] for r in suite_rows] == [0, 4, 8]
    assert all(r["Suite/retrieval"]["_type"] == "table-file" and r["Suite/plot"]["_type"] == "image-file"
               for r in suite_rows)
    # DeepSpeed's lr after every step, beside ours on its own axis: the lr of the next step
    assert [(r["_step"], r["samples"]) for r in history if "samples" in r] == [(k, 64 * k) for k in range(1, 9)]
    assert [r["Train/Samples/lr"] for r in history if "Train/Samples/lr" in r][:-1] == pytest.approx(s["lrs"][1:])
    assert run["config"]["steps"] == 8 and run["config"]["logging"]["wandb"] is True
    assert run["config"]["deepspeed"]["zero_optimization"]["stage"] == 2 and run["config"]["global_batch"] == 64
    assert run["summary"]["summary/optimizer_steps"] == 8 and run["summary"]["summary/loss_end"] == s["loss_end"]
    log = next((out / "monitor" / "wandb" / "wandb").glob(f"offline-run-*-{run_id}/logs/debug-internal.log"))
    assert "ignoring partial history record" not in log.read_text()

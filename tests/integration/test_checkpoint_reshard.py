"""Resume on another number of ranks (DeepSpeed's universal checkpoint), with real launches.

A first run on 2 ranks (tiny model, fp32, 4 steps, a checkpoint at step 2; reshard_worker.py's
in-memory batches: the same global batch of 12 at every step on any number of ranks) dumps the
engine's state after step 2 and keeps going: it is also the run that never changed its ranks.
Each case resumes a copy of its step-2 checkpoint on W' ranks and checks:
  (a) the module's weights right after loading equal the checkpoint's consolidated fp32 weights
      (zero_to_fp32), and the fp32 masters those of the first run after step 2: exactly;
  (b) Adam's exp_avg / exp_avg_sq / step and every group's options (weight decay per group) came
      back exactly; the losses of steps 3 and 4 equal the first run's to 1e-5 relative (fp32:
      gradients reduced over 2 or 3 ranks add up in another order; measured equal). Step 4's
      loss is the one a lost or wrong optimizer state would change: step 3's update makes it;
  (c) the run finishes its 4 steps with finite losses and saves a checkpoint of W' ranks;
  (d) the learning rate of step 3 is the schedule's (warmup_cosine) and the first run's.
Matrix: 2 -> 3 ranks at ZeRO-1 and 3, and 2 -> 1 at ZeRO-3 (the stage whose load rsclip_ds
repairs), that one reusing a conversion made beforehand; 2 -> 3 with the ddp profile (stage 0: its one
file loads on any world, no conversion); bf16 with optimizer offload (zero2_offload)
through the shard loader's test at the end. ZeRO-2 loads through the same DeepSpeed
code as ZeRO-1 (stage_1_and_2.py; 2 -> 3 passed there too when written, left out to keep the
suite's time). The data position part is its own test at the end, through the shard loader.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from rsclip_ds.checkpoint import META, POINTER, UNIVERSAL_DIR, UNIVERSAL_DONE, consolidated_state_dict, tag_for
from rsclip_ds.engine import warmup_cosine
from rsclip_ds.reshard import convert_to_universal
from tests.integration.helpers import (ROOT, deepspeed_cmd, free_port, launch_env, run_checked, summary,
                                     train_args)

pytestmark = pytest.mark.slow

SAVED_AT, STEPS, WARMUP, GLOBAL_BATCH, LR = 2, 4, 2, 12, 1e-3
WORKER = ROOT / "tests" / "integration" / "reshard_worker.py"
RESUMED = re.compile(r"resumed step (\d+) written by (\d+) ranks on (\d+) ranks \(universal checkpoint, "
                     r"converted in ([\d.]+) s([^)]*)\)")


def worker(tokenizer: str, out: Path, nproc: int, stage: int, *args: str) -> str:
    """A reshard_worker.py launch that must succeed -> its output."""
    sets = [f"profile={'ddp' if stage == 0 else f'zero{stage}'}", f"steps={STEPS}", f"optim.warmup_steps={WARMUP}",
            f"optim.lr={LR}",
            f"checkpoint.every={SAVED_AT}"]
    cmd = deepspeed_cmd() + ["--num_gpus", str(nproc), "--master_port", str(free_port()), str(WORKER),
                             "--out", str(out), "--tokenizer", tokenizer, "--global-batch", str(GLOBAL_BATCH),
                             *args] + [a for s in sets for a in ("--set", s)]
    proc = run_checked(cmd, timeout=300)
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def first_run(launch_data, tmp_path_factory):
    """first_run(stage) -> output dir of the 2-rank run at that stage (made once per stage)."""
    made: dict[int, Path] = {}

    def get(stage: int) -> Path:
        if stage not in made:
            out = tmp_path_factory.mktemp(f"zero{stage}_2ranks") / "run"
            worker(launch_data["tokenizer"], out, 2, stage, "--dump-at", str(SAVED_AT))
            made[stage] = out
        return made[stage]
    return get


def copy_checkpoint(first: Path, out: Path) -> Path:
    """A new output dir whose checkpoints folder holds only the first run's step-2 tag."""
    root = out / "checkpoints"
    root.mkdir(parents=True)
    tag = tag_for(SAVED_AT)
    shutil.copytree(first / "checkpoints" / tag, root / tag)
    (root / POINTER).write_text(tag + "\n")
    return root


def assert_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: other parameters"
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst == 0.0, f"{what} differ by up to {worst}"


@pytest.mark.parametrize("stage,new_world", [(1, 3), (3, 3), (3, 1), (0, 3)],
                         ids=["zero1-2to3", "zero3-2to3", "zero3-2to1", "ddp-2to3"])
def test_resume_on_another_number_of_ranks(launch_data, first_run, tmp_path, stage, new_world):
    first = first_run(stage)
    out = tmp_path / "resumed"
    root = copy_checkpoint(first, out)
    tag = tag_for(SAVED_AT)
    converted_here = None
    if new_world == 1:   # converted beforehand, on one process without a process group: reused
        converted_here = convert_to_universal(root, tag)
        assert converted_here > 0 and convert_to_universal(root, tag) == 0.0
    text = worker(launch_data["tokenizer"], out, new_world, stage, "--resume", tag)

    if stage == 0:   # ddp: the whole model and optimizer in one file, which any world loads: no conversion
        assert f"resumed step {SAVED_AT} written by 2 ranks on {new_world} ranks (stage 0: the whole model and " \
               "optimizer in one file, no conversion)" in text, text[-4000:]
        assert not (root / tag / UNIVERSAL_DIR).exists()
    else:
        line = RESUMED.search(text)
        assert line, text[-4000:]
        assert line.group(1, 2, 3) == (str(SAVED_AT), "2", str(new_world))
        done = json.loads((root / tag / UNIVERSAL_DIR / UNIVERSAL_DONE).read_text())
        assert done["from_world_size"] == 2 and done["step"] == SAVED_AT
        if converted_here is not None:
            assert "reused" in line.group(5) and done["seconds"] == pytest.approx(converted_here)
        print(f"ZeRO-{stage} 2 -> {new_world} ranks: {line.group(0)}")   # the seconds: docs/guides/checkpoints.md

    saved = torch.load(first / f"state_at_{SAVED_AT}.pt", weights_only=False)
    loaded = torch.load(out / "state_resumed.pt", weights_only=False)
    # (a) weights, exactly
    assert_equal(consolidated_state_dict(first / "checkpoints" / tag)[1], loaded["module"],
                 "module weights after the load and the checkpoint's consolidated weights")
    assert_equal(saved["fp32"], loaded["fp32"], "fp32 masters")
    # (b) optimizer state, exactly, and the losses it makes
    assert_equal(saved["exp_avg"], loaded["exp_avg"], "Adam exp_avg")
    assert_equal(saved["exp_avg_sq"], loaded["exp_avg_sq"], "Adam exp_avg_sq")
    assert loaded["adam_step"] == saved["adam_step"] == [float(SAVED_AT)]
    assert loaded["groups"] == saved["groups"]
    assert [g["weight_decay"] for g in loaded["groups"]] == [0.05, 0.0]
    s, ref = summary(out), summary(first)
    assert s["losses"][:SAVED_AT] == ref["losses"][:SAVED_AT]   # the history, as saved
    assert s["losses"][SAVED_AT:] == pytest.approx(ref["losses"][SAVED_AT:], rel=1e-5)
    # (c) it carries on to the end and saves a checkpoint of its own ranks
    assert all(math.isfinite(x) for x in s["losses"]) and len(s["losses"]) == STEPS
    assert s["optimizer_steps"] == STEPS and s["resumed_from"] == [SAVED_AT]
    assert json.loads((root / tag_for(STEPS) / META).read_text())["world_size"] == new_world
    # (d) the schedule's learning rate at the resumed step; DeepSpeed's counters
    assert loaded["global_steps"] == loaded["scheduler_last_epoch"] == SAVED_AT
    assert loaded["lr"] == saved["lr"]
    assert s["lrs"] == ref["lrs"]
    assert s["lrs"][SAVED_AT] == pytest.approx(LR * warmup_cosine(SAVED_AT, warmup=WARMUP, total=STEPS,
                                                                  min_ratio=_min_lr_ratio(first)), rel=1e-12)
    # the client state for the new ranks: every old rank's data position, in old-rank order
    assert loaded["data"] == {"remap_from": [{"global_batches": SAVED_AT, "world": 2}] * 2}


def _min_lr_ratio(out: Path) -> float:
    return json.loads((out / "config.json").read_text())["optim"]["min_lr_ratio"]


def test_the_shard_loader_resumes_on_another_number_of_ranks(launch_data, tmp_path):
    """The whole `rsclip-ds train` path with the shard loader, under bf16 and optimizer offload
    (zero2_offload: the fp32 masters and Adam's moments in CPU memory): 2 ranks save step 2, 3 ranks
    go on from there with the same global batch (micro 12 x 2 = 8 x 3); the data position is re-mapped
    (data/remap.py: what it keeps is tested in tests/unit/test_data_remap.py) and says so once. The
    offloaded optimizer state came back: its Adam step counts on from 2 (a state rebuilt from scratch
    would count from 0), and the 3-rank step-4 weights are two small Adam steps from the step-2
    checkpoint's (a model that was not loaded would be a fresh initialisation, about as far as its norm).
    The resumed losses cannot equal the first run's: the re-mapped data order differs."""
    out = tmp_path / "run"
    base = ["profile=zero2_offload", "precision=bf16", "steps=4", "optim.warmup_steps=2", "logging.log_every=1",
            "checkpoint.every=2"]
    first = deepspeed_cmd() + ["--num_gpus", "2", "--master_port", str(free_port())]
    run_checked(first + train_args(launch_data, out, base + ["batch.micro_batch_size=12",
                                                             "checkpoint.stop_after=2"]))
    then = deepspeed_cmd() + ["--num_gpus", "3", "--master_port", str(free_port())]
    proc = subprocess.run(then + train_args(launch_data, out, base + ["batch.micro_batch_size=8"]) +
                          ["--resume", "latest"], cwd=ROOT, env=launch_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    s = summary(out)
    assert s["resumed_from"] == [2] and s["optimizer_steps"] == 4
    assert all(math.isfinite(x) for x in s["losses"])
    root = out / "checkpoints"
    assert json.loads((root / tag_for(4) / META).read_text())["world_size"] == 3
    log = proc.stdout + proc.stderr
    assert log.count("data remap: 2 -> 3 rank(s) at epoch 0") == 1, log[-4000:]
    assert "resumed step 2 written by 2 ranks on 3 ranks (universal checkpoint" in log
    ds = json.loads((out / "ds_config.json").read_text())   # the resumed run's, as DeepSpeed got it
    assert ds["bf16"]["enabled"] and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["checkpoint"]["load_universal"] is True
    resolved = json.loads((out / "resolved.json").read_text())   # the decisions that config was rendered from
    assert resolved["resume"] == {"mode": "universal", "tag": tag_for(2), "saved_world": 2}
    assert resolved["world"]["size"] == 3 and resolved["precision"]["name"] == "bf16"
    for rank in range(3):
        optim = torch.load(root / tag_for(4) / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                           map_location="cpu", weights_only=False)["optimizer_state_dict"]
        steps = {int(v["step"]) for v in optim["base_optimizer_state"]["state"].values()}
        assert steps == {4}, (rank, steps)
    w2, w4 = consolidated_state_dict(root / tag_for(2))[1], consolidated_state_dict(root / tag_for(4))[1]
    moved = (sum(((w4[k] - w2[k]) ** 2).sum() for k in w2) / sum((w2[k] ** 2).sum() for k in w2)).sqrt().item()
    assert 0 < moved < 0.05, moved   # measured 0.0074 (relative, all weights); another init: ~1.4

"""The learning-rate schedule: linear warmup that moves from the first optimizer step, then
cosine to the floor; read back from a torch optimizer as DeepSpeed steps it."""

from __future__ import annotations

import math

import pytest
import torch

from rsclip_ds.config import load_config
from rsclip_ds.engine import lr_scheduler, warmup_cosine
from rsclip_ds.profiles import load_profile
from rsclip_ds.resolve import build_ds_config


def test_warmup_is_linear_from_the_first_step_then_cosine_to_the_floor():
    f = [warmup_cosine(s, warmup=4, total=20, min_ratio=0.1) for s in range(20)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]            # step 1 already trains at lr / warmup
    assert f[4] == 1.0 and all(a > b for a, b in zip(f[4:], f[5:]))
    assert f[12] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 8 / 16)))
    assert warmup_cosine(20, warmup=4, total=20, min_ratio=0.1) == pytest.approx(0.1)   # floor at the end
    assert warmup_cosine(99, warmup=4, total=20, min_ratio=0.1) == pytest.approx(0.1)   # and after it
    assert warmup_cosine(0, warmup=0, total=10) == 1.0  # no warmup: the peak at once


def _lrs(optimizer, scheduler, steps):
    """lr of each group used by each optimizer step, stepping as DeepSpeed's engine does."""
    seen = []
    for _ in range(steps):
        seen.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return seen


def test_every_group_follows_the_schedule_from_its_own_peak_and_resume_continues_it():
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    make = lambda: torch.optim.AdamW([{"params": [params[0]], "lr": 1e-3}, {"params": [params[1]], "lr": 4e-3}])
    opt = make()
    sched = lr_scheduler(warmup=2, total=6, min_ratio=0.0)(opt)
    seen = _lrs(opt, sched, 3)
    assert seen[0] == pytest.approx([5e-4, 2e-3]) and seen[1] == pytest.approx([1e-3, 4e-3])
    assert seen[2] == pytest.approx([1e-3, 4e-3])   # cosine starts at the peak
    state = sched.state_dict()
    opt2 = make()
    sched2 = lr_scheduler(warmup=2, total=6, min_ratio=0.0)(opt2)
    sched2.load_state_dict(state)
    opt2.load_state_dict(opt.state_dict())
    rest = _lrs(opt2, sched2, 3)
    straight = _lrs(opt, sched, 3)
    assert rest == straight and straight[-1][0] < straight[0][0]


def test_deepspeed_config_uses_fused_torch_adamw_and_no_deepspeed_scheduler():
    run = load_config(None, ["profile=zero2", "steps=10", "optim.warmup_steps=2"])
    config = build_ds_config(run, load_profile("zero2"), 2, on_gpu=False)
    assert "scheduler" not in config   # engine.lr_scheduler replaces WarmupCosineLR (lr 0 for two steps)
    assert config["optimizer"]["params"]["torch_adam"] and config["optimizer"]["params"]["fused"] is True
    run = load_config(None, ["profile=zero2_offload", "steps=10", "optim.warmup_steps=2", "optim.impl=deepspeed"])
    params = build_ds_config(run, load_profile("zero2_offload"), 2, on_gpu=True)["optimizer"]["params"]
    assert not params["torch_adam"] and "fused" not in params   # DeepSpeedCPUAdam takes no `fused`

"""The DeepSpeed config every shipped profile x precision (and the demo) hands DeepSpeed, against a recorded
golden set (tests/unit/ds_config_golden.json): a restructuring of how a run is resolved must hand DeepSpeed
the same dict, key for key. Regenerate it, after a change that means to alter the dict, with

    python -m tests.unit.test_ds_config_golden --write

and say in the commit what changed and why."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).with_name("ds_config_golden.json")
ROOT = Path(__file__).resolve().parents[2]
PRECISIONS = ("auto", "fp32", "bf16", "fp16", "amp_bf16", "amp")
# (world size, ranks per node, on a GPU): one rank, a node of 2 CPU ranks, two nodes of 8 GPUs
WORLDS = ((1, 1, False), (2, 2, False), (16, 8, True))


def _cases() -> dict[str, dict]:
    """name -> the DeepSpeed dict, or {"refused": the ConfigError's message}."""
    from rsclip_ds.config import ConfigError, load_config
    from rsclip_ds.profiles import available_profiles, load_profile
    from rsclip_ds.resolve import build_ds_config

    out = {}
    runs = [(f"{p}/{q}", None, [f"profile={p}", f"precision={q}", "output_dir=runs/golden"])
            for p in available_profiles() for q in PRECISIONS]
    runs += [("demo", ROOT / "configs" / "tiny_demo.yaml", []),
             ("zero2/bf16/k4", None, ["profile=zero2", "precision=bf16", "batch.gradient_accumulation_steps=4",
                                      "output_dir=runs/golden"]),
             ("zero2/bf16/masters", None, ["profile=zero2", "precision=bf16", "bf16.master_weights=bf16",
                                           "output_dir=runs/golden"])]
    for name, config, sets in runs:
        for world, per_node, gpu in WORLDS:
            key = f"{name}@{world}x{'gpu' if gpu else 'cpu'}"
            try:
                run = load_config(config, sets)
                out[key] = build_ds_config(run, load_profile(run.profile), world, on_gpu=gpu,
                                           local_world_size=per_node)
            except ConfigError as err:
                out[key] = {"refused": str(err)}
    return out


def test_every_shipped_profile_and_precision_hands_deepspeed_the_recorded_config():
    golden = json.loads(GOLDEN.read_text())
    now = json.loads(json.dumps(_cases()))   # through JSON, as the golden file holds it
    assert sorted(now) == sorted(golden), "cases added or gone: regenerate the golden file (module docstring)"
    differ = [k for k in golden if now[k] != golden[k]]
    assert not differ, f"{len(differ)} DeepSpeed configs differ from the recorded ones, e.g. {differ[:3]}"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.unit.test_ds_config_golden --write")
    GOLDEN.write_text(json.dumps(_cases(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")

"""benchmarks/contrastive.py --tiny on 2 CPU ranks, launched the way users launch it.

One launch (~60 s on 2 cores, most of it start-up and engine builds); the assertions are on
what the benchmark measured, so a regression in the losses or in 'global' accumulation that
changes their memory shows up here, not only a missing file.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.integration.conftest import ROOT, deepspeed_cmd, free_port, launch_env

pytestmark = pytest.mark.slow
BENCH = ROOT / "benchmarks" / "contrastive.py"


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "contrastive.json"
    cmd = deepspeed_cmd() + ["--num_gpus", "2", "--master_port", str(free_port()),
                             str(BENCH), "--tiny", "--out", str(out)]
    # The script's own folder, not the repo, is sys.path[0]: PYTHONPATH finds rsclip_ds without
    # an install.
    env = dict(launch_env(), PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)}\nexit {proc.returncode}\n--- output tail ---\n"
                    f"{(proc.stdout + proc.stderr)[-6000:]}")
    return json.loads(out.read_text())


def _loss(report: dict, form: str, b: int) -> dict:
    return next(r for r in report["loss_forms"] if r["form"] == form and r["B_global"] == b)


def _acc(report: dict, mode: str, k: int) -> dict:
    return next(r for r in report["accumulation"] if r["mode"] == mode and r["k"] == k)


def test_ran_on_two_ranks(report):
    assert report["environment"]["world_size"] == 2
    assert report["config"]["tiny"] is True


def test_naive_siglip_saves_more_than_the_ring(report):
    """Naive: (B, B) logits and gathered features on every rank; ring: W blocks of (B/W, B/W)."""
    b = max(report["config"]["global_batches"])
    naive, ring = _loss(report, "siglip_naive", b), _loss(report, "siglip_ring", b)
    assert naive["saved_bytes_max_rank"] > 1.5 * ring["saved_bytes_max_rank"], (naive, ring)
    chunked = _loss(report, "siglip_ring_chunked", b)
    assert chunked["held_bytes_max_rank"] < ring["held_bytes_max_rank"], (chunked, ring)


def test_global_accumulation_keeps_one_micro_batch_of_activations(report):
    plain, glob = _acc(report, "plain", 2), _acc(report, "global", 2)
    assert glob["peak_saved_bytes"] == pytest.approx(plain["peak_saved_bytes"], rel=0.15), (glob, plain)


def test_big_batch_needs_k_times_the_activations(report):
    glob, big = _acc(report, "global", 2), _acc(report, "big_batch", 2)
    assert big["peak_saved_bytes"] >= 1.6 * glob["peak_saved_bytes"], (big, glob)

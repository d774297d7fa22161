"""benchmarks/loss/contrastive.py --tiny on 2 CPU ranks, launched the way users launch it.

One launch (~20 s on 2 idle cores, most of it start-up and engine builds); the assertions are on
the bytes the benchmark counted, against each other and against the memory model evaluated here
(`rsclip_ds.planning.memory`), so a regression in the losses or in 'global' accumulation that changes
their memory shows up here, not only a missing file.
"""

from __future__ import annotations

import pytest
from transformers import SiglipConfig

from rsclip_ds.planning import memory
from tests.integration.benchmark_helpers import run_benchmark

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "contrastive.json"
    return run_benchmark("loss.contrastive", "--tiny", out=out, timeout=180)


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
    assert naive["saved_bytes_max_rank"] >= memory.logits_bytes("siglip", b, b), naive
    chunked = _loss(report, "siglip_ring_chunked", b)
    assert chunked["held_bytes_max_rank"] < ring["held_bytes_max_rank"], (chunked, ring)


def test_the_chunked_ring_holds_one_logit_block(report):
    """What the chunked ring holds is one recomputed (chunk, B_local) block of logit-sized
    tensors, B_global nowhere: the memory model's 4 such tensors per block (`memory.logits_bytes`:
    the product before scaling, the labels, logsigmoid's input and its buffer, as torch 2.13 saves)."""
    for b in report["config"]["global_batches"]:
        row = _loss(report, "siglip_ring_chunked", b)
        chunk = max(1, row["B_local"] // 4)                  # contrastive.chunk_size
        block = memory.logits_bytes("siglip", chunk, row["B_local"])
        assert 3 / 4 * block <= row["recompute_block_bytes"] <= block + 64, row


def test_plain_accumulation_saves_one_micro_batch_as_the_memory_model_says(report):
    """Saved activations of one micro-batch of the benchmark's tower shapes against
    activation_bytes_per_sample x micro (+ the small loss), within 5%."""
    model = report["config"]["model"]
    config = SiglipConfig(vision_config=model["vision"], text_config=model["text"])
    predicted = sum(memory.activation_bytes_per_sample(config, "fp32").values()) * report["config"]["micro"]
    for k in report["config"]["ks"]:
        assert _acc(report, "plain", k)["peak_saved_bytes"] == pytest.approx(predicted, rel=0.05)


def test_global_accumulation_keeps_one_micro_batch_of_activations(report):
    plain, glob = _acc(report, "plain", 2), _acc(report, "global", 2)
    assert glob["peak_saved_bytes"] == pytest.approx(plain["peak_saved_bytes"], rel=0.05), (glob, plain)


def test_big_batch_needs_k_times_the_activations(report):
    glob, big = _acc(report, "global", 2), _acc(report, "big_batch", 2)
    assert big["peak_saved_bytes"] == pytest.approx(2 * glob["peak_saved_bytes"], rel=0.05), (big, glob)

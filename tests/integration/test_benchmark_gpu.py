"""benchmarks/gpu.py on CPU with the tiny preset, so the GPU script cannot rot.

Two cases (ZeRO-2 and ZeRO-3, both with activation checkpointing), each in its own process as on
a GPU: ~20 s on 2 idle cores, mostly imports and engine builds. Checks what each case measured
against numbers computed here: the parameters its engine holds against the model's count, the
FLOPs per sample it reports against torch's FLOP counter on a forward of the same model, and
that both ZeRO stages start from the same loss (same model, seed and batch).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rsclip_ds.model import new_dual_encoder, preset_config
from tests.integration.benchmark_helpers import run_benchmark

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("gpu")
    return run_benchmark("gpu", "--model", "tiny", "--profiles", "zero2", "zero3", "--ac", "on",
                         "--warmup", "1", "--seconds", "0.5", "--max-steps", "2", out=tmp / "gpu_tiny.json",
                         ranks=None, timeout=400)


def test_every_case_trained(report):
    rows = report["cases"]
    assert [(r["profile"], r["checkpointing"]) for r in rows] == [("zero2", True), ("zero3", True)]
    psi = sum(p.numel() for p in new_dual_encoder(preset_config("tiny")).parameters())
    for r in rows:
        assert r["ok"], r
        assert r["precision"] == "bf16" and r["world_size"] == 1
        assert r["activation_checkpointing"] is True      # the run config's switch reached the model
        assert r["parameters"] == psi                      # ZeRO-3 counts its partitioned params whole
        assert 1 <= r["timed_steps"] <= 2 and r["samples_per_s"] > 0
        assert math.isfinite(r["first_loss"]) and math.isfinite(r["final_loss"])
        assert r["mfu"] is None and r["peak_memory_bytes"] is None   # CPU: no peak FLOP/s, no CUDA memory


def test_zero2_and_zero3_start_from_the_same_loss(report):
    """Same model (seed 0), same batch (seeded by rank): the stages differ only in where the
    weights live, so the first forward agrees up to bf16 rounding."""
    zero2, zero3 = report["cases"]
    assert zero2["first_loss"] == pytest.approx(zero3["first_loss"], rel=1e-2), (zero2, zero3)


def test_flops_per_sample_match_torch_flop_counter(report):
    """One sample's forward through both towers, counted by torch (eager attention: the flop
    counter has no formula for CPU's fused kernel)."""
    config = copy.deepcopy(preset_config("tiny"))
    for c in (config, config.vision_config, config.text_config):
        c._attn_implementation = "eager"
    model = new_dual_encoder(config).eval()
    v, t = config.vision_config, config.text_config
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randn(1, 3, v.image_size, v.image_size), torch.zeros(1, t.max_position_embeddings, dtype=torch.long))
    for r in report["cases"]:
        assert r["flops_per_sample"]["forward"] == counter.get_total_flops(), r["flops_per_sample"]


@pytest.fixture(scope="module")
def loader_report(tmp_path_factory) -> dict:
    """The data-path mode: a tensor case and its loader twin reading 64 JPEGs through one worker;
    and the patch-dropout and distillation variants of the tensor case."""
    tmp = tmp_path_factory.mktemp("gpu_loader")
    return run_benchmark("gpu", "--model", "tiny", "--profiles", "zero2", "--ac", "off", "--data", "tensor", "loader",
                         "--variants", "base", "patch_dropout", "distill",
                         "--data-images", "64", "--data-px", "64", "--loader-workers", "1", "--warmup", "1",
                         "--seconds", "0.5", "--max-steps", "2", out=tmp / "gpu_tiny_loader.json", ranks=None,
                         timeout=400)


def test_the_loader_case_trains_from_shards_beside_its_tensor_twin(loader_report):
    [tensor, loader] = [c for c in loader_report["cases"] if c["variant"] == "base"]
    assert (tensor["data"], loader["data"]) == ("tensor", "loader")
    assert tensor["ok"] and loader["ok"], loader
    assert loader["case"] == tensor["case"] + "/loader"
    assert 1 <= loader["timed_steps"] <= 2 and math.isfinite(loader["final_loss"])
    assert 0 <= loader["data_wait_fraction"] <= 1
    assert loader["loader_workers"] == 1 and loader["loader_cpu_s"] > 0   # a worker process decoded
    [pair] = loader_report["loader_vs_tensor"]
    assert pair["loader_over_tensor"] == pytest.approx(loader["samples_per_s"] / tensor["samples_per_s"])


def test_the_patch_dropout_variant_is_the_same_case_with_half_the_patches(loader_report):
    """Same model, seed and batch as its base twin: only the image tokens differ (tiny: 64 px in
    8 px patches, 64 tokens, 32 kept), so the first loss moves but stays a SigLIP loss at init."""
    tensor = loader_report["cases"][0]
    [variant] = [c for c in loader_report["cases"] if c["variant"] == "patch_dropout"]
    assert variant["ok"], variant
    assert (variant["variant"], variant["case"]) == ("patch_dropout", tensor["case"] + "/+patch_dropout")
    assert 1 <= variant["timed_steps"] <= 2 and math.isfinite(variant["final_loss"])
    assert variant["first_loss"] != tensor["first_loss"]   # the override reached the model
    [pair] = [p for p in loader_report["variants_vs_base"] if p["variant"] == "patch_dropout"]
    assert pair["variant_over_base"] == pytest.approx(variant["samples_per_s"] / tensor["samples_per_s"])


def test_the_distill_variant_runs_the_teacher_in_every_step(loader_report):
    """Same student, seed and batch as its base twin, plus a random tiny teacher fed its own
    inputs (the tensor batch's teacher_pixel_values / teacher_input_ids): the step's loss is the
    contrastive loss plus the distillation term, so the first loss moves."""
    tensor = loader_report["cases"][0]
    [variant] = [c for c in loader_report["cases"] if c["variant"] == "distill"]
    assert variant["ok"], variant
    assert variant["case"] == tensor["case"] + "/+distill"
    assert math.isfinite(variant["final_loss"]) and variant["first_loss"] != tensor["first_loss"]

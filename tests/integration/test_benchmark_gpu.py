"""benchmarks/gpu.py on CPU with the tiny preset, in its smallest case, so the GPU script cannot rot.

One launch (~40 s on 2 idle cores, mostly imports and engine builds): ZeRO-2 without activation
checkpointing, four cases each in its own process as on a GPU -- a batch in memory (tensor), the
plain PyTorch twin of the step on the same model and batch (eager: the compiled twin compiles for
~90 s on these cores; benchmarks/gpu_step.sh's CPU form runs it), the case's patch-dropout variant,
and the same case fed by the Trainer's own loader from 64 JPEGs through one worker. Checks what
each case measured against numbers computed here: the parameters its engine holds against the
model's count, the FLOPs per sample it reports against torch's FLOP counter on a forward of the
same model, and the pairs the report derives (loader / tensor, variant / base, ours / twin).
That ZeRO stages give the same losses, and a distillation teacher in a real launch, are
tests/integration/test_launch.py's.
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
    return run_benchmark("gpu", "--model", "tiny", "--profiles", "zero2", "--ac", "off", "--data", "tensor", "loader",
                         "--variants", "base", "patch_dropout", "--twins", "eager", "--data-images", "64",
                         "--data-px", "64",
                         "--loader-workers", "1", "--warmup", "1", "--seconds", "0.5", "--max-steps", "2",
                         out=tmp / "gpu_tiny.json", ranks=None, timeout=400)


def _case(report: dict, data: str = "tensor", variant: str = "base", twin: str = "") -> dict:
    return next(c for c in report["cases"] if (c["data"], c["variant"], c["twin"]) == (data, variant, twin))


def test_every_case_trained_the_counted_model(report):
    psi = sum(p.numel() for p in new_dual_encoder(preset_config("tiny")).parameters())
    assert [(c["data"], c["variant"], c["twin"]) for c in report["cases"]] == [
        ("tensor", "base", ""), ("tensor", "base", "eager"), ("tensor", "patch_dropout", ""), ("loader", "base", "")]
    for r in report["cases"]:
        assert r["ok"], r
        assert (r["profile"], r["precision"], r["world_size"]) == ("plain" if r["twin"] else "zero2", "bf16", 1)
        assert r["parameters"] == psi
        assert 1 <= r["timed_steps"] <= 2 and r["samples_per_s"] > 0
        assert math.isfinite(r["first_loss"]) and math.isfinite(r["final_loss"])
        assert r["mfu"] is None and r["peak_memory_bytes"] is None   # CPU: no peak FLOP/s, no CUDA memory


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
    assert _case(report)["flops_per_sample"]["forward"] == counter.get_total_flops()


def test_the_pairs_are_the_quotients_of_their_cases(report):
    """The loader case read shards through a worker process; the patch-dropout variant is the same
    case with half of tiny's 64 image tokens, so its first loss moves."""
    tensor, loader, variant = _case(report), _case(report, "loader"), _case(report, variant="patch_dropout")
    assert loader["case"] == tensor["case"] + "/loader" and variant["case"] == tensor["case"] + "/+patch_dropout"
    assert loader["loader_workers"] == 1 and loader["loader_cpu_s"] > 0 and 0 <= loader["data_wait_fraction"] <= 1
    [pair] = report["loader_vs_tensor"]
    assert pair["loader_over_tensor"] == pytest.approx(loader["samples_per_s"] / tensor["samples_per_s"])
    assert variant["first_loss"] != tensor["first_loss"]   # the override reached the model
    [pair] = report["variants_vs_base"]
    assert pair["variant_over_base"] == pytest.approx(variant["samples_per_s"] / tensor["samples_per_s"])


def test_the_twin_trained_the_same_model_on_the_same_batch_and_ours_is_read_against_it(report):
    """The plain loop's process built the same seeded model and the same uint8 batch: its first
    loss (before any update) is ours up to bf16 rounding. ours_vs_twin is our rate over its rate,
    and the results table shows it beside MFU."""
    from benchmarks.results_tables.format import sig
    from benchmarks.results_tables.throughput import gpu as gpu_tables

    ours, twin = _case(report), _case(report, twin="eager")
    assert twin["case"] == "tiny/twin-eager/micro8" and twin["flops_per_sample"] == ours["flops_per_sample"]
    assert math.isfinite(twin["first_loss"]) and math.isfinite(twin["final_loss"])
    assert twin["first_loss"] == pytest.approx(ours["first_loss"], rel=2e-3)
    [pair] = report["ours_vs_twin"]   # the patch-dropout variant does other work: not paired
    assert pair["case"] == ours["case"] and pair["twin_compiled_samples_per_s"] is None
    assert pair["over_twin_eager"] == pytest.approx(ours["samples_per_s"] / twin["samples_per_s"])
    page = "\n".join(gpu_tables({"gpu_tiny.json": report}))
    rate = lambda r: sig(r["samples_per_s"], 4)
    assert f"| {twin['case']} | {rate(twin)} |" in page   # a row of the cases table
    # CPU: no MFU; no compiled twin in this launch
    ratio = f"{pair['over_twin_eager']:.3f}"
    assert f"| {ours['case']} | {rate(ours)} | - | {rate(twin)} | - | {ratio} | - | - | - |" in page

"""benchmarks/gpu/run.py on CPU with the tiny preset, in its smallest case, so the GPU script cannot rot.

One launch (~60 s on 2 idle cores, mostly imports and engine builds): ddp and ZeRO-2 at the run's
default precision (--precisions auto: ddp/amp_bf16, zero2/bf16) without activation checkpointing,
six cases each in its own process as on a GPU -- each profile on a batch in memory (tensor) and
fed by the Trainer's own loader from 64 JPEGs through one worker, the plain PyTorch twin of the
step on the same model and batch (eager: the compiled twin compiles for ~50 s on these cores;
benchmarks/gpu/step.sh's CPU form runs it), and zero2's patch-dropout variant. Checks what each
case measured against numbers computed here: the parameters its engine holds against the model's
count, the FLOPs per sample it reports against torch's FLOP counter on a forward of the same
model, the twin's losses against ours (amp_bf16 is its recipe: the same losses, step for step),
and the pairs the report derives (loader / tensor, variant / base, ours / twin). That ZeRO stages
give the same losses, and a distillation teacher in a real launch, are
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
    # --seconds 5 with --max-steps 2: every case times exactly 2 steps (tiny's take ~30 ms), so ours
    # and the twin's final losses are both step 3's
    return run_benchmark("gpu", "--model", "tiny", "--profiles", "ddp", "zero2", "--precisions", "auto", "--ac", "off",
                         "--data", "tensor", "loader", "--variants", "base", "patch_dropout", "--twins", "eager",
                         "--data-images", "64", "--data-px", "64", "--loader-workers", "1", "--warmup", "1",
                         "--seconds", "5", "--max-steps", "2", out=tmp / "gpu_tiny.json", ranks=None, timeout=400)


def _case(report: dict, data: str = "tensor", variant: str = "base", twin: str = "", profile: str = "zero2") -> dict:
    return next(c for c in report["cases"] if (c["data"], c["variant"], c["twin"]) == (data, variant, twin)
                and c["profile"] == ("plain" if twin else profile))


def test_every_case_trained_the_counted_model(report):
    psi = sum(p.numel() for p in new_dual_encoder(preset_config("tiny")).parameters())
    assert [(c["profile"], c["precision"], c["data"], c["variant"], c["twin"]) for c in report["cases"]] == [
        ("ddp", "amp_bf16", "tensor", "base", ""), ("plain", "bf16", "tensor", "base", "eager"),
        ("ddp", "amp_bf16", "loader", "base", ""),
        ("zero2", "bf16", "tensor", "base", ""), ("zero2", "bf16", "tensor", "patch_dropout", ""),
        ("zero2", "bf16", "loader", "base", "")]
    assert report["config"]["precision"] == "amp_bf16, bf16" and report["config"]["left_out"] == []
    for r in report["cases"]:
        assert r["ok"], r
        assert r["world_size"] == 1
        assert r["parameters"] == psi
        assert r["timed_steps"] == 2 and r["samples_per_s"] > 0
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
    ddp_pair, pair = report["loader_vs_tensor"]   # each profile's loader case with its own tensor case
    assert ddp_pair["case"] == "tiny/ddp/amp_bf16/no-ac/micro8" and pair["case"] == tensor["case"]
    assert pair["loader_over_tensor"] == pytest.approx(loader["samples_per_s"] / tensor["samples_per_s"])
    assert variant["first_loss"] != tensor["first_loss"]   # the override reached the model
    [pair] = report["variants_vs_base"]
    assert pair["variant_over_base"] == pytest.approx(variant["samples_per_s"] / tensor["samples_per_s"])


def test_the_twin_trained_the_same_model_on_the_same_batch_and_ours_is_read_against_it(report):
    """The plain loop's process built the same seeded model and the same uint8 batch: its first
    loss (before any update) is zero2/bf16's up to bf16 rounding (bf16 weights there), and it is
    ddp/amp_bf16's, first and last, after the same 3 steps: the same recipe (fp32 weights under
    autocast, the loss in fp32), the same clipping, AdamW and learning-rate schedule (the twin's is
    the run's `steps` long, as ours). ours_vs_twin is our rate over its rate, and the results table
    shows it beside MFU."""
    from benchmarks.results_tables.format import sig
    from benchmarks.results_tables.throughput import gpu as gpu_tables

    ours, twin, ddp = _case(report), _case(report, twin="eager"), _case(report, profile="ddp")
    assert twin["case"] == "tiny/twin-eager/bf16/micro8" and twin["flops_per_sample"] == ours["flops_per_sample"]
    assert math.isfinite(twin["first_loss"]) and math.isfinite(twin["final_loss"])
    assert twin["first_loss"] == pytest.approx(ours["first_loss"], rel=2e-3)
    assert (twin["timed_steps"], ddp["timed_steps"]) == (2, 2)   # warm-up 1 + 2 timed: the final loss is step 3's
    assert twin["first_loss"] == pytest.approx(ddp["first_loss"], rel=1e-5)
    assert twin["final_loss"] == pytest.approx(ddp["final_loss"], rel=1e-4)
    ddp_pair, pair = report["ours_vs_twin"]   # the patch-dropout variant does other work: not paired
    assert ddp_pair["case"] == ddp["case"] and ddp_pair["precision"] == "amp_bf16"
    assert ddp_pair["over_twin_eager"] == pytest.approx(ddp["samples_per_s"] / twin["samples_per_s"])
    assert pair["case"] == ours["case"] and pair["twin_compiled_samples_per_s"] is None
    assert pair["over_twin_eager"] == pytest.approx(ours["samples_per_s"] / twin["samples_per_s"])
    page = "\n".join(gpu_tables({"gpu_tiny.json": report}))
    rate = lambda r: sig(r["samples_per_s"], 4)
    assert f"| {twin['case']} | {rate(twin)} |" in page   # a row of the cases table
    # CPU: no MFU; no compiled twin in this launch
    ratio = f"{pair['over_twin_eager']:.3f}"
    assert f"| {ours['case']} | {rate(ours)} | - | {rate(twin)} | - | {ratio} | - | - | - |" in page

"""The CPU-testable parts of benchmarks/gpu.py's data-path mode, without an engine: the step
timer (warm-up, bounds, the time spent waiting for batches), the case list (a loader case beside
its tensor twin) and the pairing that gives loader / tensor samples/s. The whole script runs on
CPU in tests/integration/test_benchmark_gpu.py."""

from __future__ import annotations

import time

import pytest

from tests.unit.benchmark_modules import import_benchmark


@pytest.fixture(scope="module")
def gpu():
    yield from import_benchmark("gpu")


def _slow_batches(delay: float):
    i = 0
    while True:
        time.sleep(delay)
        i += 1
        yield {"i": i}


def test_timed_steps_counts_steps_and_the_wait_for_batches(gpu):
    """Each batch takes >= 20 ms to arrive and each step >= 30 ms (time.sleep sleeps at least
    that long on any machine): the wait counts the one and not the other."""
    seen, syncs = [], []

    def step(batch):
        seen.append(batch["i"])
        time.sleep(0.03)
        return float(batch["i"])
    timing = gpu.timed_steps(step, _slow_batches(0.02), warmup=2, seconds=10.0, max_steps=5,
                             sync=lambda: syncs.append(len(seen)))
    assert seen == [1, 2, 3, 4, 5, 6, 7]                    # 2 warm-up + 5 timed (max_steps bounds it)
    assert syncs == [2, 7]                                  # a device sync after the warm-up and at the end
    assert timing["timed_steps"] == 5 and timing["first_loss"] == 1.0 and timing["final_loss"] == 7.0
    assert timing["data_wait_s"] >= 5 * 0.02                      # the 5 timed batches' arrival
    assert timing["elapsed_s"] - timing["data_wait_s"] >= 5 * 0.03   # the steps' time is not data wait


def test_timed_steps_stops_after_seconds_but_takes_one_step(gpu):
    timing = gpu.timed_steps(lambda b: 0.0, _slow_batches(0.0), warmup=0, seconds=0.0, max_steps=100,
                             sync=lambda: None)
    assert timing["timed_steps"] == 1


def test_a_loader_case_follows_its_tensor_twin(gpu):
    todo = gpu.cases(["git-rsclip-base"], ["zero2"], [False], None, ["tensor", "loader"])
    assert [c.data for c in todo] == ["tensor", "loader"]
    assert todo[0].name == "git-rsclip-base/zero2/no-ac/micro256"
    assert todo[1].name == "git-rsclip-base/zero2/no-ac/micro256/loader"
    assert gpu.cases(["tiny"], ["zero2"], [True], None)[0].data == "tensor"   # the default is unchanged


def test_loader_rows_pair_with_their_tensor_twin(gpu):
    base = {"preset": "git-rsclip-base", "profile": "zero2", "checkpointing": False, "micro": 256, "ok": True}
    rows = [{**base, "case": "t", "data": "tensor", "samples_per_s": 2000.0},
            {**base, "case": "l", "data": "loader", "samples_per_s": 1500.0, "data_wait_fraction": 0.25,
             "loader_workers": 8, "loader_samples_per_cpu_s": 900.0},
            {**base, "profile": "zero3", "case": "l3", "data": "loader", "samples_per_s": 1.0,
             "data_wait_fraction": 0.0, "loader_workers": 8, "loader_samples_per_cpu_s": 1.0},   # no twin
            {**base, "micro": 8, "case": "f", "data": "loader", "ok": False}]
    [pair] = gpu.pair_with_tensor(rows)
    assert pair["loader_over_tensor"] == pytest.approx(0.75)
    assert (pair["case"], pair["data_wait_fraction"], pair["loader_samples_per_cpu_s"]) == ("t", 0.25, 900.0)


def test_profile_sets_expand_in_order_once(gpu):
    assert gpu.expand_profiles(["hybrid"]) == ["zero3", "zero3_hpz", "zero3_zeropp"]
    assert gpu.expand_profiles(["zero2", "zero3", "hybrid"]) == ["zero2", "zero3", "zero3_hpz", "zero3_zeropp"]


def test_one_rank_refuses_the_hybrid_profiles_naming_the_multi_node_script(gpu, capsys):
    # before: zero3_hpz / zero3_zeropp ran on one GPU and equalled zero3 (no gather on one rank, qgZ
    # needs 2+ nodes), with an nvcc build of the quantizer inside the case timeout
    assert gpu.main(["--profiles", "hybrid", "--out", "/nonexistent/x.json"]) == 2
    assert "multigpu_hybrid.sh" in capsys.readouterr().err
    assert gpu.refuse_one_rank_hybrid(["zero2", "zero3"]) is None


def test_mfu_is_per_device_at_the_runs_precision(gpu):
    from benchmarks.gpu_peaks import mfu_per_device, peak_flops

    assert peak_flops("NVIDIA H100 PCIe", "bf16") == pytest.approx(756.5e12)
    assert peak_flops("NVIDIA H100 NVL", "bf16") == pytest.approx(835.5e12)
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H200", "fp32") == pytest.approx(66.9e12)
    assert peak_flops("NVIDIA H200", "bf16", override_tflops=500) == 5e14
    # 8 ranks at 800 samples/s in all, 1e12 FLOPs each, on 1e15 FLOP/s devices: 10% each (not 80%)
    assert mfu_per_device(1e12, 800.0, 8, 1e15) == pytest.approx(0.1)
    assert mfu_per_device(1e12, 800.0, 8, None) is None


def test_variants_run_on_one_case_right_after_their_base_twin(gpu):
    """The default grid (2 presets x 2 profiles x AC off/on) gets the three variants on
    git-rsclip-base / zero2 / no AC only: 8 + 3 cases, each variant with the overrides of its feature."""
    todo = gpu.cases(["git-rsclip-base", "git-rsclip-large"], ["zero2", "zero3"], [False, True], None, ["tensor"],
                     ["base", "patch_dropout", "compile", "distill"])
    names = [c.name for c in todo]
    assert len(todo) == 11 and names[:4] == ["git-rsclip-base/zero2/no-ac/micro256",
                                             "git-rsclip-base/zero2/no-ac/micro256/+patch_dropout",
                                             "git-rsclip-base/zero2/no-ac/micro256/+compile",
                                             "git-rsclip-base/zero2/no-ac/micro256/+distill"]
    assert [c.variant for c in todo[4:]] == ["base"] * 7
    # a tiny smoke grid: the variants go on its first preset's zero2 case; loader cases stay base
    tiny = gpu.cases(["tiny"], ["zero2"], [False], None, ["tensor", "loader"], ["base", "patch_dropout"])
    assert [(c.data, c.variant) for c in tiny] == [("tensor", "base"), ("tensor", "patch_dropout"), ("loader", "base")]
    assert [c.name for c in gpu.cases(["tiny"], ["zero2"], [False], None, ["tensor"], ["patch_dropout"])] == \
        ["tiny/zero2/no-ac/micro8", "tiny/zero2/no-ac/micro8/+patch_dropout"]   # the twin it is read against


def test_variant_overrides_and_their_pairing_with_the_base_case():
    from benchmarks.gpu_variants import pair_with_base, variant_overrides

    assert variant_overrides("base") == [] and variant_overrides("patch_dropout") == ["model.patch_dropout=0.5"]
    assert variant_overrides("compile") == ["compile.enabled=true"]
    assert variant_overrides("distill", "/t") == ["distill.teacher=/t", "distill.weight=1.0"]
    with pytest.raises(ValueError, match="teacher folder"):
        variant_overrides("distill")
    base = {"preset": "p", "profile": "zero2", "checkpointing": False, "micro": 8, "ok": True, "data": "tensor"}
    rows = [{**base, "case": "b", "variant": "base", "samples_per_s": 100.0, "peak_memory_bytes": 10},
            {**base, "case": "b/+pd", "variant": "patch_dropout", "samples_per_s": 150.0, "peak_memory_bytes": 6},
            {**base, "case": "b/+c", "variant": "compile", "ok": False}]
    [pair] = pair_with_base(rows)
    assert (pair["case"], pair["variant"], pair["variant_over_base"], pair["peak_memory_ratio"]) == \
        ("b", "patch_dropout", 1.5, 0.6)


def test_each_presets_twins_follow_its_first_case_before_the_variants(gpu):
    """One eager and one compiled plain-loop case per preset (no profile, no checkpointing), right
    after the preset's first case: the floor measured next to the case first read against it."""
    todo = gpu.cases(["git-rsclip-base", "git-rsclip-large"], ["zero2", "zero3"], [False], None, ["tensor"],
                     ["base", "compile"], ["eager", "compiled"])
    assert [c.name for c in todo] == [
        "git-rsclip-base/zero2/no-ac/micro256", "git-rsclip-base/twin-eager/micro256",
        "git-rsclip-base/twin-compiled/micro256", "git-rsclip-base/zero2/no-ac/micro256/+compile",
        "git-rsclip-base/zero3/no-ac/micro256",
        "git-rsclip-large/zero2/no-ac/micro128", "git-rsclip-large/twin-eager/micro128",
        "git-rsclip-large/twin-compiled/micro128", "git-rsclip-large/zero3/no-ac/micro128"]
    assert {(c.profile, c.checkpointing, c.variant) for c in todo if c.twin} == {("plain", False, "base")}
    assert not any(c.twin for c in gpu.cases(["tiny"], ["zero2"], [True], None))   # none unless asked for


def test_ours_over_the_twin_is_our_rate_over_each_twins_and_renders(gpu):
    """Every case of ours doing the twin's work (any profile, the compile variant) is divided by the
    twins of its preset and micro-batch; patch dropout (other work), loader cases and a preset
    without twins are not; a failed twin gives no ratio. The table shows both ratios beside MFU."""
    from benchmarks.gpu_variants import pair_with_twins
    from benchmarks.results_tables.throughput import gpu as gpu_tables

    base = {"preset": "p", "micro": 8, "checkpointing": False, "ok": True, "data": "tensor", "variant": "base",
            "twin": "", "mfu": 0.10, "hfu": 0.10, "step_ms": 1.0, "achieved_tflops": 1.0, "peak_memory_bytes": None,
            "device": "NVIDIA H200", "data_wait_fraction": 0.0}
    rows = [{**base, "case": "p/zero2", "profile": "zero2", "samples_per_s": 900.0},
            {**base, "case": "p/twin-eager", "profile": "plain", "twin": "eager", "samples_per_s": 1800.0, "mfu": 0.2},
            {**base, "case": "p/twin-compiled", "profile": "plain", "twin": "compiled", "ok": False, "error": "x"},
            {**base, "case": "p/zero3/ac", "profile": "zero3", "checkpointing": True, "samples_per_s": 450.0},
            {**base, "case": "p/zero2/+compile", "profile": "zero2", "variant": "compile", "samples_per_s": 1200.0},
            {**base, "case": "p/zero2/+pd", "profile": "zero2", "variant": "patch_dropout", "samples_per_s": 2000.0},
            {**base, "case": "p/zero2/loader", "profile": "zero2", "data": "loader", "samples_per_s": 800.0},
            {**base, "case": "q/zero2", "preset": "q", "profile": "zero2", "samples_per_s": 5.0}]
    pairs = pair_with_twins(rows)
    assert [p["case"] for p in pairs] == ["p/zero2", "p/zero3/ac", "p/zero2/+compile"]
    assert [p["over_twin_eager"] for p in pairs] == [0.5, 0.25, pytest.approx(2 / 3)]
    assert all(p["over_twin_compiled"] is None and p["twin_compiled_samples_per_s"] is None for p in pairs)
    assert pairs[0]["twin_eager_mfu"] == 0.2 and pairs[0]["mfu"] == 0.10
    rows[2].pop("error")   # a compiled twin that ran
    rows[2].update(ok=True, samples_per_s=3600.0, mfu=0.4)
    assert [p["over_twin_compiled"] for p in pair_with_twins(rows)] == [0.25, 0.125, pytest.approx(1 / 3)]
    page = "\n".join(gpu_tables({"gpu_h200_base.json": {"config": {"precision": "bf16"}, "cases": rows,
                                                        "ours_vs_twin": pair_with_twins(rows)}}))
    assert "| p/zero2 | 900.0 | 10.0% | 1,800 | 20.0% | 0.500 | 3,600 | 40.0% | 0.250 |" in page
    assert "| p/twin-eager | 1,800 |" in page   # the twins are rows of the cases table too

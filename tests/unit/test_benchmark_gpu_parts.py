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

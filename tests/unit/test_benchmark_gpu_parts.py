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

"""benchmarks/throughput/compare.py --tiny on 2 CPU ranks, launched the way users launch it.

One launch (under a minute on 2 idle cores: four loops, each with its own engine, loader and
workers, then the loader alone, the checkpointed run, three profiled runs and two quality runs).
No timing assertions (the machine is shared); the assertions are on what the loops did, from
the instruments on them: the samples each model's forward saw, the per-step losses (the same
model, seed and data must give the same first loss in every loop with the same loss), the
time spent waiting for batches, and the code cProfile found.
"""

from __future__ import annotations

import math

import pytest

from tests.integration.benchmark_helpers import run_benchmark

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("bench")
    return run_benchmark("throughput.compare", "--tiny", "--data", str(tmp / "data"), out=tmp / "throughput.json",
                         timeout=420)


def _run(report: dict, loop: str, repeat: int = 0) -> dict:
    return next(r for r in report["runs"] if r["loop"] == loop and r["repeat"] == repeat)


def test_every_loop_ran_on_two_ranks(report):
    assert report["environment"]["world_size"] == 2
    loops = report["config"]["loops"]
    assert loops == ["ours", "bare", "trainer", "ours_local"]   # accelerate is a dependency: the Trainer runs
    assert [r["loop"] for r in report["runs"]] == loops * report["config"]["repeats"]


def test_every_forward_saw_steps_x_micro_x_world_samples(report):
    """Counted by a forward-pre-hook on each loop's model, summed over ranks: no loop skipped
    or repeated a batch, and the Trainer's hook reached the model the engine runs."""
    cfg = report["config"]
    expected = cfg["steps"] * cfg["micro"] * report["environment"]["world_size"]
    assert {r["loop"]: r["samples"] for r in report["runs"]} == {loop: expected for loop in cfg["loops"]}


def test_losses_are_finite_every_step(report):
    for r in report["runs"]:
        assert len(r["losses"]) == report["config"]["steps"], r
        assert all(math.isfinite(v) for v in r["losses"]), r


def test_same_model_seed_and_data_give_the_same_first_loss(report):
    """The Trainer's run and the hand-wired DeepSpeed loop build the same model (seed 0) and
    loader (same seed), so their first losses (before any update) agree to float precision;
    likewise ours_local and the HF Trainer, which both compute the per-rank loss."""
    ours, bare = _run(report, "ours"), _run(report, "bare")
    assert ours["losses"][0] == pytest.approx(bare["losses"][0], rel=1e-6), (ours["losses"], bare["losses"])
    if "trainer" in report["config"]["loops"]:
        local, hf = _run(report, "ours_local"), _run(report, "trainer")
        assert local["losses"][0] == pytest.approx(hf["losses"][0], rel=1e-6), (local["losses"], hf["losses"])


def test_global_negatives_add_to_the_loss(report):
    """SigLIP's loss adds a positive term per negative pair; on the same first batch the
    global form sees W x the local form's negatives, so its loss is strictly larger."""
    assert _run(report, "ours")["losses"][0] > _run(report, "ours_local")["losses"][0]


def test_loops_waited_for_data_and_the_profiler_found_our_code(report):
    """next(batch) is timed through the Trainer's wrap_loader seam in ours, directly in the
    others: every loop waited some time. cProfile's self time of ours lands in rsclip_ds's
    train loop, and every loop spends some in the loader's main-process code (rsclip_ds/data/)."""
    for r in report["runs"]:
        assert 0 < r["data_wait_s"] < r["elapsed_s"], r
    by = {p["loop"]: p for p in report["python_self_time"]}
    assert {"ours", "bare"} <= set(by)
    assert by["ours"]["self_ms_per_step"] > 0
    assert any(f["function"].startswith("rsclip_ds/train.py:") for f in by["ours"]["top"]), by["ours"]["top"]
    for p in by.values():
        assert p["loader_main_process_ms_per_step"] > 0, p


def test_loader_alone_and_the_checkpointed_run(report):
    assert report["loader"]["samples_per_s"] > 0
    c = report["summary_rate_with_final_checkpoint"]
    assert c["checkpoints"] == [f"step{report['config']['steps']:08d}"]   # the end-of-run save happened
    assert c["summary_samples_per_s"] > 0


def test_quality_runs_repeat_the_timed_runs(report):
    """--tiny trains the quality runs for as many steps as the timed runs, with the same
    settings: the runs are deterministic, so their final losses are the timed runs' own."""
    cfg = report["config"]
    assert cfg["quality_steps"] == cfg["steps"]
    rows = {r["negatives"]: r for r in report["quality"]}
    assert rows["global"]["final_train_loss"] == pytest.approx(_run(report, "ours")["final_loss"], rel=1e-6)
    assert rows["local"]["final_train_loss"] == pytest.approx(_run(report, "ours_local")["final_loss"], rel=1e-6)
    for r in rows.values():
        assert r["num_images"] == cfg["num_val"]
        for key in ("i2t_R@1", "t2i_R@1", "mean_recall"):
            assert 0.0 <= r[key] <= 1.0
        assert r["i2t_R@5"] >= r["i2t_R@1"] and r["t2i_R@5"] >= r["t2i_R@1"]

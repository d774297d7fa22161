"""The CPU-testable parts of benchmarks/gpu/run.py, without an engine: the step timer (warm-up, bounds,
the time spent waiting for batches), the case list (profile x precision less the refused pairs,
a loader case beside its tensor twin, the twins per compute dtype), the pairings (loader / tensor,
variant / base, ours / twin), the planner's pick of the open_clip comparison and the commands it
gives both tools, and the device tag that names the GPU script's JSON. The whole script runs on
CPU in tests/integration/test_benchmark_gpu.py, the GPU script's CPU form by hand
(docs/benchmarks/gpu.md)."""

from __future__ import annotations

import time

import pytest

from tests.unit.benchmark_modules import import_benchmark


@pytest.fixture(scope="module")
def gpu():
    yield from import_benchmark("gpu.run")


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
    assert todo[0].name == "git-rsclip-base/zero2/bf16/no-ac/micro256"
    assert todo[1].name == "git-rsclip-base/zero2/bf16/no-ac/micro256/loader"
    assert gpu.cases(["tiny"], ["zero2"], [True], None)[0].data == "tensor"   # the default is unchanged


def test_loader_rows_pair_with_their_tensor_twin(gpu):
    base = {"preset": "git-rsclip-base", "profile": "zero2", "checkpointing": False, "micro": 256, "ok": True}
    rows = [{**base, "case": "t", "data": "tensor", "samples_per_s": 2000.0},
            {**base, "case": "t-amp", "data": "tensor", "precision": "amp_bf16", "samples_per_s": 1.0},   # another
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
    from benchmarks.gpu.peaks import mfu_per_device, peak_flops

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
    assert len(todo) == 11 and names[:4] == ["git-rsclip-base/zero2/bf16/no-ac/micro256",
                                             "git-rsclip-base/zero2/bf16/no-ac/micro256/+patch_dropout",
                                             "git-rsclip-base/zero2/bf16/no-ac/micro256/+compile",
                                             "git-rsclip-base/zero2/bf16/no-ac/micro256/+distill"]
    assert [c.variant for c in todo[4:]] == ["base"] * 7
    # a tiny smoke grid: the variants go on its first preset's zero2 case; loader cases stay base
    tiny = gpu.cases(["tiny"], ["zero2"], [False], None, ["tensor", "loader"], ["base", "patch_dropout"])
    assert [(c.data, c.variant) for c in tiny] == [("tensor", "base"), ("tensor", "patch_dropout"), ("loader", "base")]
    assert [c.name for c in gpu.cases(["tiny"], ["zero2"], [False], None, ["tensor"], ["patch_dropout"])] == \
        ["tiny/zero2/bf16/no-ac/micro8", "tiny/zero2/bf16/no-ac/micro8/+patch_dropout"]   # the twin it is read against


def test_variant_overrides_and_their_pairing_with_the_base_case():
    from benchmarks.gpu.variants import pair_with_base, variant_overrides

    assert variant_overrides("base") == [] and variant_overrides("patch_dropout") == ["model.patch_dropout=0.5"]
    assert variant_overrides("compile") == ["compile.enabled=true"]
    assert variant_overrides("distill", "/t") == ["distill.teacher=/t", "distill.weight=1.0"]
    with pytest.raises(ValueError, match="teacher folder"):
        variant_overrides("distill")
    base = {"preset": "p", "profile": "zero2", "checkpointing": False, "micro": 8, "ok": True, "data": "tensor",
            "precision": "bf16"}
    rows = [{**base, "case": "b", "variant": "base", "samples_per_s": 100.0, "peak_memory_bytes": 10},
            {**base, "case": "b-amp", "variant": "base", "precision": "amp_bf16", "samples_per_s": 1.0},   # not base
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
        "git-rsclip-base/zero2/bf16/no-ac/micro256", "git-rsclip-base/twin-eager/bf16/micro256",
        "git-rsclip-base/twin-compiled/bf16/micro256", "git-rsclip-base/zero2/bf16/no-ac/micro256/+compile",
        "git-rsclip-base/zero3/bf16/no-ac/micro256",
        "git-rsclip-large/zero2/bf16/no-ac/micro128", "git-rsclip-large/twin-eager/bf16/micro128",
        "git-rsclip-large/twin-compiled/bf16/micro128", "git-rsclip-large/zero3/bf16/no-ac/micro128"]
    assert {(c.profile, c.checkpointing, c.variant) for c in todo if c.twin} == {("plain", False, "base")}
    assert not any(c.twin for c in gpu.cases(["tiny"], ["zero2"], [True], None))   # none unless asked for


def test_ours_over_the_twin_is_our_rate_over_each_twins_and_renders(gpu):
    """Every case of ours doing the twin's work (any profile, the compile variant) is divided by the
    twins of its preset and micro-batch; patch dropout (other work), loader cases and a preset
    without twins are not; a failed twin gives no ratio. The table shows both ratios beside MFU."""
    from benchmarks.gpu.variants import pair_with_twins
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


# --------------------------------------------------------------------------- profile x precision (issue 44)

def test_a_profile_runs_the_precisions_a_run_allows_with_auto_made_concrete(gpu):
    """ddp with bf16 weights is refused (DeepSpeed's FP16_UnfusedOptimizer at stage 0), amp under
    ZeRO too; auto is the run config's default for the stage: amp_bf16 on ddp, bf16 under ZeRO."""
    runs, refused = gpu.profile_precisions("ddp", ["amp_bf16", "bf16", "auto"])
    assert runs == ["amp_bf16"]                                  # auto on ddp is amp_bf16: once
    assert len(refused) == 1 and refused[0].startswith("ddp/bf16: precision=bf16 at stage 0")
    assert gpu.profile_precisions("zero2", ["auto", "amp_bf16", "bf16"]) == (["bf16", "amp_bf16"], [])
    assert gpu.profile_precisions("zero2", ["fp32"]) == (["fp32"], [])


def test_the_gpu_scripts_cases_each_profile_under_its_precisions_then_one_set_of_twins(gpu):
    """step.sh's large part: ddp under amp_bf16 only, zero2 under both (bf16 first, as asked),
    the eager and compiled twin once, after the first case: amp_bf16 and bf16 both compute in bf16,
    and the twin's recipe is one for both."""
    todo = gpu.cases(["git-rsclip-large"], ["ddp", "zero2"], [False], None, ["tensor"], ["base"], ["eager", "compiled"],
                     ["bf16", "amp_bf16"])
    assert [c.name for c in todo] == [
        "git-rsclip-large/ddp/amp_bf16/no-ac/micro128", "git-rsclip-large/twin-eager/bf16/micro128",
        "git-rsclip-large/twin-compiled/bf16/micro128", "git-rsclip-large/zero2/bf16/no-ac/micro128",
        "git-rsclip-large/zero2/amp_bf16/no-ac/micro128"]
    assert [(c.profile, c.precision) for c in todo if c.twin] == [("plain", "bf16")] * 2
    # fp32 computes in fp32: its own twins, after its first case; the variants on zero2's first precision only
    mixed = gpu.cases(["git-rsclip-base"], ["zero2"], [False], None, ["tensor"], ["base", "compile"], ["eager"],
                      ["fp32", "bf16"])
    assert [c.name for c in mixed] == [
        "git-rsclip-base/zero2/fp32/no-ac/micro256", "git-rsclip-base/twin-eager/fp32/micro256",
        "git-rsclip-base/zero2/fp32/no-ac/micro256/+compile",
        "git-rsclip-base/zero2/bf16/no-ac/micro256", "git-rsclip-base/twin-eager/bf16/micro256"]


def test_a_command_whose_pairs_are_all_refused_runs_nothing_and_says_why(gpu, capsys):
    assert gpu.main(["--profiles", "ddp", "--precisions", "bf16", "--out", "/nonexistent/x.json"]) == 2
    err = capsys.readouterr().err
    assert "left out: ddp/bf16: precision=bf16 at stage 0" in err and "every --profiles x --precisions pair" in err


def test_ours_is_read_against_the_twins_of_its_compute_dtype():
    """amp_bf16 and bf16 rows divide by the bf16 twin; an fp32 row by the fp32 twin, none here."""
    from benchmarks.gpu.variants import pair_with_twins, twin_precision

    assert [twin_precision(p) for p in ("amp_bf16", "bf16", "fp32")] == ["bf16", "bf16", "fp32"]
    base = {"preset": "p", "micro": 8, "checkpointing": False, "ok": True, "data": "tensor", "variant": "base",
            "twin": "", "mfu": None}
    rows = [{**base, "case": "twin", "profile": "plain", "twin": "eager", "precision": "bf16", "samples_per_s": 400.0},
            {**base, "case": "ddp/amp", "profile": "ddp", "precision": "amp_bf16", "samples_per_s": 300.0},
            {**base, "case": "zero2/bf16", "profile": "zero2", "precision": "bf16", "samples_per_s": 200.0},
            {**base, "case": "zero2/fp32", "profile": "zero2", "precision": "fp32", "samples_per_s": 100.0}]
    pairs = pair_with_twins(rows)
    assert [(p["case"], p["precision"], p["over_twin_eager"]) for p in pairs] == [("ddp/amp", "amp_bf16", 0.75),
                                                                                  ("zero2/bf16", "bf16", 0.5)]


def test_an_appended_report_pairs_its_cases_with_the_earlier_twins(gpu):
    """step.sh's zero part appends zero2 cases to the base part's report (ddp and the twins):
    one report, every case read against the same twins, both commands' seconds."""
    args = gpu.parse_args(["--model", "git-rsclip-base", "--profiles", "zero2", "--precisions", "bf16",
                           "--out", "/tmp/unused.json"])
    args.left_out = []
    row = {"preset": "git-rsclip-base", "micro": 256, "checkpointing": False, "ok": True, "data": "tensor",
           "variant": "base", "mfu": 0.1}
    earlier = {"config": {"profiles": ["ddp"], "precision": "amp_bf16"}, "seconds": 100.0, "cases": [
        {**row, "case": "ddp", "profile": "ddp", "twin": "", "precision": "amp_bf16", "samples_per_s": 900.0},
        {**row, "case": "eager", "profile": "plain", "twin": "eager", "precision": "bf16", "samples_per_s": 1800.0}]}
    new = [{**row, "case": "zero2", "profile": "zero2", "twin": "", "precision": "bf16", "samples_per_s": 600.0}]
    report = gpu.report_of(earlier["cases"] + new, args, earlier, 50.0)
    assert [c["case"] for c in report["cases"]] == ["ddp", "eager", "zero2"]
    assert [(p["case"], p["over_twin_eager"]) for p in report["ours_vs_twin"]] == [("ddp", 0.5), ("zero2", 1 / 3)]
    assert report["config"]["precision"] == "amp_bf16, bf16"   # the table's heading: every precision ours ran
    assert report["config"]["appended_to"] == earlier["config"] and report["seconds"] == 150.0


# --------------------------------------------------------------------------- the planner's pick against open_clip

@pytest.mark.parametrize("gib, pick", [
    (80, ("ddp", "amp_bf16", 256, 1, False)),    # an H100: the whole model and micro 256 fit, no ZeRO needed
    (30, ("zero1", "bf16", 256, 1, False)),      # ddp's fp32 weights need 30.6 GiB at 256; ZeRO-1 bf16 fits in 24.9
    (20, ("ddp", "amp_bf16", 256, 1, True)),     # 9.4 GiB with checkpointing
])
def test_the_planner_picks_profile_precision_micro_and_checkpointing_for_one_gpu(gpu, gib, pick):
    """The comparison's git-rsclip-base shape (224 px; the planner sees it through the meta
    model, nothing is built) at 256 samples a step on one GPU of the given memory."""
    got = gpu.planner_pick("git-rsclip-base", 256, gib * 2**30)
    row = got["row"]
    assert (row["profile"], row["precision"], row["micro"], row["accumulation"], row["checkpointing"]) == pick
    assert row["fits"] and row["gpu_gib"] <= gib and got["reason"].startswith(f"{pick[0]}: ")
    assert (got["budget_bytes"], got["batch"]) == (gib * 2**30, 256)


def test_a_pick_that_accumulates_or_nothing_that_fits_is_refused_with_the_fix(gpu):
    with pytest.raises(SystemExit, match=r"ddp at micro 32 x 8 micro-batches.*give --micro 32"):
        gpu.planner_pick("git-rsclip-base", 256, 8 * 2**30)
    with pytest.raises(SystemExit, match="nothing fits one GPU of 1.0 GiB at 8 samples a step for tiny"):
        gpu.planner_pick("tiny", 8, 2**30)


def test_the_pick_runs_on_both_sides_at_its_micro_batch_and_checkpointing(gpu, tmp_path):
    """--planner-pick: our case is rsclip-ds train at the pick's profile and precision, open_clip's
    the same micro-batch and checkpointing in amp_bf16 (its recipe: fp32 weights under autocast);
    without it the comparison is zero2 bf16, as before."""
    from benchmarks.throughput.openclip import Inputs
    from benchmarks.throughput.openclip_cases import openclip_cmd, rsclip_cmd

    flags = ["--open-clip", "kit", "--model", "git-rsclip-base", "--openclip-precisions", "amp_bf16",
             "--openclip-peers", "--out", str(tmp_path / "oc.json")]
    bench, todo, pick = gpu.comparison_setup(gpu.parse_args([*flags, "--planner-pick", "--pick-gpu-mem", "20GiB"]))
    assert (bench.micro, bench.checkpointing, bench.ranks) == (256, True, 1)
    assert [c.name for c in todo] == ["open_clip/amp_bf16", "rsclip_ds/ddp/amp_bf16"]
    assert pick["budget"] == "--pick-gpu-mem 20GiB" and pick["row"]["profile"] == "ddp"
    inputs = Inputs(tmp_path / "venv", "shards/train-{000000..000003}.tar", tmp_path / "tok", tmp_path / "hf",
                    tmp_path / "oc")
    ours = rsclip_cmd(bench, todo[1], inputs, 29500, tmp_path / "out")
    sets = [ours[k + 1] for k, word in enumerate(ours) if word == "--set"]
    assert {"profile=ddp", "precision=amp_bf16", "batch.micro_batch_size=256", "model.activation_checkpointing=true",
            "batch.gradient_accumulation_steps=1"} <= set(sets)
    theirs = " ".join(openclip_cmd(bench, todo[0], inputs, 29501, "run"))
    assert "--precision amp_bf16" in theirs and "--batch-size 256" in theirs and "--grad-checkpointing" in theirs
    bench, todo, pick = gpu.comparison_setup(gpu.parse_args(flags))
    assert (bench.micro, bench.checkpointing, pick) == (256, False, None)
    assert [c.name for c in todo] == ["open_clip/amp_bf16", "rsclip_ds/zero2/bf16"]
    assert "model.activation_checkpointing=true" not in rsclip_cmd(bench, todo[1], inputs, 29500, tmp_path / "out")


def test_the_pick_plans_for_a_stated_budget_without_a_gpu(gpu):
    assert gpu.pick_budget("16GiB") == (16 * 2**30, "--pick-gpu-mem 16GiB")
    assert gpu.pick_budget(None) == (80 * 10**9, "80GB, stated: no GPU here")   # this machine has none


def test_the_device_tag_names_the_gpu_scripts_json():
    from benchmarks.gpu.peaks import device_tag

    assert [device_tag(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H100 NVL", "NVIDIA A100-SXM4-80GB",
                                    "NVIDIA L40S", "NVIDIA GeForce RTX 4090", "cpu")] == \
        ["h100", "h200", "h100", "a100", "l40s", "gpu", "cpu"]

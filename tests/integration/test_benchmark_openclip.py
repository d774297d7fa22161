"""benchmarks/throughput/openclip.py --tiny in its smallest case: open_clip's own trainer against
`rsclip-ds train` at fp32 (ZeRO-2), one run each of 8 steps of a tiny SigLIP shape (~30 s on 2 idle
cores: 2 launches).

The launches need open_clip's environment, which this repository does not install (its trainer
pins webdataset<=0.2.86): `bash benchmarks/throughput/openclip_env.sh runs/openclip-venv` (or set
RSCLIP_OPENCLIP_VENV to one made elsewhere); that test is skipped without it. No timing
assertions (the machine is shared); the assertions are on what each run did, as each tool
logged it, and on what the driver derived from the logs. The first tests need no environment:
the log parsers on lines both tools wrote, the rate arithmetic on known step times, the cases and
their pairing, and each peer's command lines (benchmarks/gpu/run.py --open-clip drives the same code).
"""

from __future__ import annotations

import math
import os
import random

import pytest

from tests.integration.benchmark_helpers import run_benchmark
from tests.integration.helpers import ROOT
from tests.unit.benchmark_modules import import_benchmark

VENV = os.environ.get("RSCLIP_OPENCLIP_VENV", str(ROOT / "runs" / "openclip-venv"))
needs_venv = pytest.mark.skipif(
    not os.path.isfile(os.path.join(VENV, "bin", "python")),
    reason=f"no open_clip environment at {VENV}: create it with `bash benchmarks/throughput/openclip_env.sh {VENV}` "
           f"(or point RSCLIP_OPENCLIP_VENV at one)")


def launches(test):
    return pytest.mark.slow(needs_venv(test))


# --------------------------------------------------------------------------- no environment needed

@pytest.fixture(scope="module")
def driver():
    yield from import_benchmark("throughput.openclip")


OPENCLIP_LINE = ("2026-12-01,12:02:41 | INFO | Train Epoch: 0 [ 64/384 (17%)] Data (t): 0.002 Batch (t): 0.868, "
                 "36.8863/s, 18.4432/s/gpu LR: 0.000100 Logit Scale: 10.001 Contrastive_loss: 6.8450 (8.2421) "
                 "Loss: 6.8450 (8.2421)")
RSCLIP_LINES = ("[12:02:15 rank0] step 1/12  loss 10.54  lr 0  samples/s nan  (1.6s)",
                "[12:02:19 rank0] step 5/12  loss 7.658  lr 0.00015  samples/s 30.14  (5.9s)")


def test_log_lines_parse(driver):
    assert driver.parse_openclip(OPENCLIP_LINE, 32) == {"step": 2, "samples": 64, "samples_per_s": 36.8863,
                                                        "loss": 6.845}
    first, fifth = (driver.parse_rsclip(line, 32) for line in RSCLIP_LINES)
    assert fifth == {"step": 5, "loss": 7.658, "samples_per_s": 30.14}
    assert first["step"] == 1 and math.isnan(first["samples_per_s"])
    assert driver.parse_openclip(RSCLIP_LINES[1], 32) is None and driver.parse_rsclip(OPENCLIP_LINE, 32) is None


def test_both_rate_formulas_recover_the_window_from_what_each_tool_logs(driver):
    """Known step times -> the numbers each tool would log (open_clip: global batch / that step's
    time; rsclip_ds: global batch x (k - 1) / time since the end of step 1) -> the rate over
    steps 6..60 equals global batch x 55 / the window's time."""
    rng, batch, n, skip = random.Random(0), 32, 60, 5
    seconds = {k: rng.uniform(0.5, 1.5) for k in range(1, n + 1)}
    openclip = {k: {"samples_per_s": batch / seconds[k]} for k in seconds}
    since_step1 = {k: sum(seconds[j] for j in range(2, k + 1)) for k in seconds}
    rsclip = {k: {"samples_per_s": batch * (k - 1) / since_step1[k] if k > 1 else math.nan} for k in seconds}
    truth = batch * (n - skip) / sum(seconds[k] for k in range(skip + 1, n + 1))
    assert driver.openclip_rate(openclip, skip + 1, n, batch) == pytest.approx(truth, rel=1e-12)
    assert driver.rsclip_rate(rsclip, skip + 1, n, batch) == pytest.approx(truth, rel=1e-12)
    assert driver.rsclip_rate(rsclip, 2, n, batch) == pytest.approx(rsclip[n]["samples_per_s"], rel=1e-12)


def test_cases_put_each_pair_together_and_ratios_pair_within_a_repeat(driver):
    todo = driver.cases(["fp32", "amp_bf16", "pure_bf16"], ["zero2"], ["fp32", "bf16"])
    assert [c.name for c in todo] == ["open_clip/fp32", "rsclip_ds/zero2/fp32", "open_clip/amp_bf16",
                                      "open_clip/pure_bf16", "rsclip_ds/zero2/bf16"]
    rate = {("open_clip/fp32", 0): 40.0, ("rsclip_ds/zero2/fp32", 0): 30.0,
            ("open_clip/fp32", 1): 20.0, ("rsclip_ds/zero2/fp32", 1): 18.0}
    rows = [{"case": c, "repeat": k, "ok": True, "samples_per_s": v, "samples_per_s_wall": v, "startup_s": 1.0,
             "cpu_busy_before": 0.0, "steady": {"minflt_per_step_per_rank": 1.0, "sys_ms_per_step": 1.0,
                                                "user_ms_per_step": 1.0, "foreign_cpu_share": 0.0},
             "whole_run": {"minflt_per_step_per_rank": 1.0, "sys_ms_per_step": 1.0}} for (c, k), v in rate.items()]
    rows.append({"case": "open_clip/fp32", "repeat": 2, "ok": False})    # a failed run pairs with nothing
    rows.append({**rows[1], "repeat": 2})
    summary = driver.summarize(rows, todo[:2])
    ratio = summary["ratios"]["rsclip_ds/zero2/fp32 / open_clip/fp32"]
    assert ratio["per_repeat"] == [0.75, 0.9] and ratio["median"] == pytest.approx(0.825)
    assert summary["cases"]["open_clip/fp32"]["runs"] == 2


def test_peer_cases_pair_with_the_open_clip_case_of_the_same_peer(driver):
    todo = driver.cases(["fp32", "amp_bf16"], ["zero1", "zero2"], ["fp32", "bf16"], ["patch_dropout"],
                        peer_precisions=["bf16"])
    assert [c.name for c in todo][-2:] == ["open_clip/amp_bf16+patch_dropout", "rsclip_ds/zero2/bf16+patch_dropout"]
    assert todo[-1].partners() == ["open_clip/amp_bf16+patch_dropout", "open_clip/pure_bf16+patch_dropout"]
    only = driver.cases(["fp32"], ["zero2"], ["fp32"], ["patch_dropout", "compile"], base=False)
    assert [c.name for c in only] == ["open_clip/fp32+patch_dropout", "rsclip_ds/zero2/fp32+patch_dropout",
                                      "open_clip/fp32+compile", "rsclip_ds/zero2/fp32+compile"]
    rows = [{"case": c.name, "repeat": 0, "ok": True, "samples_per_s": v, "samples_per_s_wall": v, "startup_s": 1.0,
             "cpu_busy_before": 0.0, "peak_pss_bytes": pss,
             "steady": {"minflt_per_step_per_rank": 1.0, "sys_ms_per_step": 1.0, "user_ms_per_step": 1.0,
                        "foreign_cpu_share": 0.0},
             "whole_run": {"minflt_per_step_per_rank": 1.0, "sys_ms_per_step": 1.0}}
            for c, v, pss in zip(only[:2], (40.0, 50.0), (2e9, 3e9))]
    ratio = driver.summarize(rows, only[:2])["ratios"]["rsclip_ds/zero2/fp32+patch_dropout / open_clip/fp32+patch_dropout"]
    assert ratio["per_repeat"] == [1.25] and ratio["peak_pss_ratio"]["median"] == 1.5


def test_each_peer_is_its_flag_on_both_sides_and_the_users_style_sets_no_threads(driver, tmp_path, monkeypatch):
    bench, inputs = driver.TINY, driver.Inputs(tmp_path, "/d/train-{0..1}.tar", tmp_path, tmp_path / "hf", tmp_path)
    pd = driver.Case("open_clip", "fp32", peer="patch_dropout")
    assert driver.openclip_cmd(bench, pd, inputs, 1, "n")[-2:] == ["--force-patch-dropout", "0.5"]
    assert "--torchcompile" in driver.openclip_cmd(bench, driver.Case("open_clip", "fp32", peer="compile"), inputs, 1, "n")
    ours = driver.rsclip_cmd(bench, driver.Case("rsclip_ds", "fp32", "zero2", "patch_dropout"), inputs, 1, tmp_path)
    assert ours[-2:] == ["--set", "model.patch_dropout=0.5"] and "checkpoint.at_end=false" in ours
    users = driver.rsclip_cmd(bench, driver.Case("rsclip_ds", "fp32", "zero2"), inputs, 1, tmp_path, "users")
    assert "checkpoint.at_end=false" not in users   # the default end-of-run checkpoint stays
    assert "--save-frequency" not in driver.openclip_cmd(bench, pd, inputs, 1, "n", "users")
    monkeypatch.setenv("OMP_NUM_THREADS", "7")   # the driver's own: never passed on in the users style
    assert "OMP_NUM_THREADS" not in driver.tool_env("rsclip_ds", "cpu", None)
    assert driver.tool_env("open_clip", "cpu", 1)["OMP_NUM_THREADS"] == "1"
    # huge pages: no flag on either side, the variable in both launches and in no other case
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    assert driver.openclip_cmd(bench, driver.Case("open_clip", "fp32", peer="huge_pages"), inputs, 1, "n")[-2:] == ["--name", "n"]
    assert all(driver.tool_env(tool, "cpu", 1, "huge_pages")["THP_MEM_ALLOC_ENABLE"] == "1" for tool in ("open_clip", "rsclip_ds"))
    assert "THP_MEM_ALLOC_ENABLE" not in driver.tool_env("open_clip", "cpu", 1, "compile")


# --------------------------------------------------------------------------- the launches


def siglip_parameters(width: int, depth: int, mlp: int, patch: int, image: int, context: int, vocab: int) -> int:
    """A SigLIP dual encoder's parameters, counted from the architecture (no model built)."""
    linear = lambda i, o: i * o + o
    norm = 2 * width
    block = 2 * norm + 4 * linear(width, width) + linear(width, mlp) + linear(mlp, width)
    vision = (3 * patch * patch * width + width) + (image // patch) ** 2 * width + depth * block + norm \
        + width + 3 * linear(width, width) + linear(width, width) + norm + linear(width, mlp) + linear(mlp, width)
    #   patch embedding, positions, blocks, post-norm, MAP head: probe, q/k/v, out, norm, MLP
    text = vocab * width + context * width + depth * block + norm + linear(width, width)
    return vision + text + 2   # + logit scale and bias


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("openclip")
    return run_benchmark("throughput.openclip", "--open-clip", VENV, "--tiny", "--data", str(tmp / "data"),
                         "--work", str(tmp / "work"), "--profiles", "zero2", "--precisions", "fp32",
                         "--openclip-precisions", "fp32", out=tmp / "throughput_openclip.json", ranks=None, timeout=300)


@launches
def test_both_tools_trained_the_same_model_and_every_step(report):
    """Each run as its tool logged it and counted its samples (open_clip's last log line,
    rsclip_ds's summary.json); the parameters counted on the models each side builds (rsclip_ds's
    Hugging Face folder, open_clip's create_model in its own environment) against the
    architecture's count; the ratio paired within the repeat."""
    cfg, m, s = report["config"], report["models"], report["models"]["shape"]
    assert cfg["cases"] == ["open_clip/fp32", "rsclip_ds/zero2/fp32"]
    assert [r["case"] for r in report["runs"]] == cfg["cases"] * cfg["repeats"]
    for r in report["runs"]:
        assert r["ok"], r
        assert r["samples_trained"] == cfg["steps"] * cfg["micro"] * cfg["ranks"], r
        assert r["steps_logged"] == cfg["steps"] and r["samples_per_s"] > 0 and 0 < r["startup_s"] < r["wall_s"]
        # SigLIP at init (t = 10, b = -10): each positive pair costs ~10 (1 - cos), negatives ~0
        assert abs(r["first_loss"] - 10) < 3 and math.isfinite(r["final_loss"]), r
    expected = siglip_parameters(s["width"], s["depth"], s["mlp"], s["patch"], s["image"], s["context"], s["vocab"])
    assert m["rsclip_ds_parameters"] == expected
    assert abs(m["open_clip_parameters"] / m["rsclip_ds_parameters"] - 1) < 0.005, m
    assert m["open_clip_env"]["webdataset"].startswith("0.2.")   # its own environment, not ours (1.0.x)
    runs = {r["case"]: r["samples_per_s"] for r in report["runs"]}
    [(name, ratio)] = report["summary"]["ratios"].items()
    assert name == "rsclip_ds/zero2/fp32 / open_clip/fp32"
    assert ratio["per_repeat"] == [runs["rsclip_ds/zero2/fp32"] / runs["open_clip/fp32"]]


@launches
def test_the_rate_parsed_from_each_log_matches_the_line_arrivals(report):
    """The samples/s derived from each tool's log (open_clip: per-step rates; rsclip_ds: rates
    since step 1) against the same steps timed by the driver from the log lines' arrival. Compared
    as the seconds the timed steps took: 5 % of them plus 0.05 s for a line delayed on a busy core
    (--tiny times 5 steps, 0.4-1.2 s: quiet runs differ by under 0.01 s, one loaded run by more
    than 5 %). A rate over one step too many or too few is off by a fifth of the span, which
    still fails."""
    cfg = report["config"]
    samples = (cfg["steps"] - cfg["skip"]) * cfg["micro"] * cfg["ranks"]
    for r in report["runs"]:
        from_log, from_arrival = samples / r["samples_per_s"], samples / r["samples_per_s_wall"]
        assert abs(from_log - from_arrival) <= 0.05 * from_log + 0.05, r


@launches
def test_the_whole_process_tree_was_measured(report):
    """Launcher(s) + ranks + one loader worker per rank, all counted: torchrun's agent (open_clip)
    or the deepspeed runner and its launch process (rsclip_ds)."""
    cfg = report["config"]
    launchers = {"open_clip": 1, "rsclip_ds": 2}
    for r in report["runs"]:
        steady = r["steady"]
        assert steady["processes"] == launchers[r["tool"]] + cfg["ranks"] * (1 + cfg["workers"]), r
        assert steady["steps"] == cfg["steps"] - cfg["skip"]
        assert steady["minflt_per_step_per_rank"] > 0 and steady["user_ms_per_step"] > 0
        assert 0 <= steady["foreign_cpu_share"] <= 1 and 0 <= r["cpu_busy_before"] <= 1
        whole = r["whole_run"]
        assert whole["minflt"] >= steady["minflt"] and whole["user_s"] >= steady["user_s"]
        # host memory: the tree's PSS, sampled and at both marks; the ranks' program holds most of it
        rank_program = {"open_clip": "openclip_main.py", "rsclip_ds": "rsclip_ds"}[r["tool"]]
        assert r["peak_pss_bytes"] >= max(steady["pss_bytes_at_first"], steady["pss_bytes_at_last"]) > 0, r
        assert max(r["peak_pss_by_command"], key=r["peak_pss_by_command"].get) == rank_program, r
        assert sum(r["peak_pss_by_command"].values()) == r["peak_pss_bytes"]

"""Evaluation end to end: demo-length training at ZeRO-3 on 2 ranks with the evaluation hook,
then the same numbers from a single process on the exported folder (`rsclip-ds eval --model`).

Measured (2 CPU ranks, ZeRO-3, fp32, global batch 64, 128 held-out images x 4 captions,
8 classes; printed with -s): see STEPS and the report in the commit history.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from rsclip_ds.config import EvalConfig, ModelConfig
from rsclip_ds.evaluation import Embedder, EvalSets, evaluate
from rsclip_ds.model import build_model
from rsclip_ds.data.synthetic import make_synthetic
from rsclip_ds.data.tokenizer import iter_captions, train_tokenizer

from tests.integration.helpers import ROOT, deepspeed_cmd, free_port, run_checked

pytestmark = pytest.mark.slow
NUM_VAL = 128
CHANCE_ZERO_SHOT = 1 / 8          # 8 land-cover classes
CHANCE_R1 = 1 / NUM_VAL           # text->image R@1 of a random ranking
# The demo's 60 steps leave the tiny model at ~0.25 zero-shot top-1 and ~2.5 % R@1 (loss ~4.9);
# by 100-120 steps the land-cover classes are separated (top-1 ~1.0) and R@1 is ~5-10x chance.
STEPS = 120


@pytest.fixture(scope="module")
def eval_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_data")
    index = make_synthetic(out, num_train=2048, num_val=NUM_VAL, shard_size=256, image_size=64, seed=0,
                           progress=False, eval_layout=True)
    urls = [str(out / s["url"]) for s in index["train"]]
    train_tokenizer(iter_captions(urls), out / "tokenizer", vocab_size=500, max_length=64)
    return out


@pytest.fixture(scope="module")
def trained(eval_data, tmp_path_factory):
    """2-rank ZeRO-3 demo-length training with the eval hook (eval_worker.py)."""
    out = tmp_path_factory.mktemp("eval_run")
    cmd = deepspeed_cmd() + ["--num_gpus", "2", "--master_port", str(free_port()),
                             str(ROOT / "tests/integration/eval_worker.py"),
                             "--data", str(eval_data), "--out", str(out), "--set", f"steps={STEPS}", "--set", f"eval.every={STEPS // 2}"]
    run_checked(cmd, timeout=900)
    return out, json.loads((out / "result.json").read_text())


def _sets(data) -> EvalSets:
    return EvalSets.from_config(EvalConfig(zero_shot_dir=data / "eval/classes",
                                           retrieval_json=data / "eval/captions.json"))


def test_untrained_models_are_at_chance(eval_data):
    """Random towers give random rankings: averaged over 4 initialisations, zero-shot top-1 and
    R@1 sit at chance (one initialisation alone can land a few classes by luck)."""
    sets, top1, r1 = _sets(eval_data), [], []
    for seed in range(4):
        bundle = build_model(ModelConfig(tokenizer=eval_data / "tokenizer"), seed)
        res = evaluate(Embedder(bundle.model.eval(), bundle, 64, progress=False), sets)
        top1.append(res["zero_shot"]["top1"])
        r1.append(res["retrieval"]["t2i_R@1"])
    print(f"untrained: zero-shot top-1 {top1} (chance {CHANCE_ZERO_SHOT:.3f}); t2i R@1 {r1} "
          f"(chance {CHANCE_R1:.4f})")
    assert sum(top1) / 4 < 2.5 * CHANCE_ZERO_SHOT
    assert sum(r1) / 4 < 3 * CHANCE_R1


def test_trained_far_above_chance_and_untrained_at_chance(trained):
    _, result = trained
    before, after = result["before"], result["evals"][-1]
    assert result["stage"] == 3 and result["world"] == 2
    # the hook fired before the first step, mid-run (training then continued under ZeRO-3) and
    # at the last step
    assert [e["step"] for e in result["evals"]] == [0, STEPS // 2, STEPS]
    assert sum(result["losses"][-10:]) < sum(result["losses"][STEPS // 2 - 10:STEPS // 2])
    print(f"ZeRO-3 x 2 ranks, before -> after {STEPS} steps: zero-shot top-1 "
          f"{before['zero_shot/top1']:.3f} -> {after['zero_shot/top1']:.3f}, mean per class "
          f"{before['zero_shot/mean_per_class']:.3f} -> {after['zero_shot/mean_per_class']:.3f}; "
          f"t2i R@1 {before['retrieval/t2i_R@1']:.4f} -> {after['retrieval/t2i_R@1']:.4f}, i2t R@1 "
          f"{before['retrieval/i2t_R@1']:.4f} -> {after['retrieval/i2t_R@1']:.4f}, mean recall "
          f"{before['retrieval/mean_recall']:.3f} -> {after['retrieval/mean_recall']:.3f}")
    assert after["zero_shot/top1"] > 5 * CHANCE_ZERO_SHOT
    assert after["zero_shot/mean_per_class"] > 5 * CHANCE_ZERO_SHOT
    assert after["retrieval/t2i_R@1"] > 4 * CHANCE_R1
    assert after["retrieval/i2t_R@1"] > 4 * CHANCE_R1
    assert after["retrieval/t2i_R@10"] > 3 * 10 * CHANCE_R1
    assert before["retrieval/t2i_R@1"] < 4 * CHANCE_R1


def test_the_suite_hook_under_zero3_equals_the_eval_hook(trained):
    """The benchmark suite's hook (the same sets as one found set) at the same steps, through the
    ZeRO-3 engine on 2 ranks: its per-set numbers equal the eval hook's; they reach
    metrics.jsonl (the monitor's feed) and {output_dir}/suite_eval/step*.json."""
    out, result = trained
    suite = result["suite_evals"]
    assert [e["step"] for e in suite] == [e["step"] for e in result["evals"]] == [0, STEPS // 2, STEPS]
    for ours, theirs in zip(suite, result["evals"]):
        assert ours["suite/synthetic/top1"] == pytest.approx(theirs["zero_shot/top1"], abs=1e-6)
        assert ours["suite/synthetic/mean_recall"] == pytest.approx(theirs["retrieval/mean_recall"], abs=1e-6)
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if r.get("kind") == "eval" and "suite/synthetic/top1" in r["eval"]] == \
        [0, STEPS // 2, STEPS]
    last = json.loads((out / f"suite_eval/step{STEPS:08d}.json").read_text())["suite"]
    assert [(s["name"], s["protocol"]) for s in last["sets"]] == [("synthetic", "zero-shot classification"),
                                                                   ("synthetic", "retrieval")]
    assert last["sets"][0]["images"] == NUM_VAL and last["template_set"] == "ours"
    # rank 0 wrote each step's report: the suite's and the plain sets' per-sample rows and report.html
    for folder, name in ((out / f"suite_eval/step{STEPS:08d}", "synthetic"),
                         (out / f"eval/step{STEPS:08d}", "classes")):
        rows = [json.loads(line) for line in (folder / f"samples/{name}.zero-shot.jsonl").read_text().splitlines()]
        assert len(rows) == NUM_VAL and (folder / "report.html").stat().st_size > 10_000
        assert sum(r["rank"] == 1 for r in rows) / NUM_VAL == pytest.approx(result["evals"][-1]["zero_shot/top1"])
    assert last["sets"][0]["samples"] == f"step{STEPS:08d}/samples/synthetic.zero-shot.jsonl"


def test_zero3_two_ranks_equal_single_process(trained, eval_data):
    """The exported weights embedded by one plain process match the ZeRO-3 engine's embeddings
    from 2 ranks, and give the same metrics."""
    out, result = trained
    sets = _sets(eval_data)
    bundle = build_model(ModelConfig(pretrained=out / "export"), 0)
    embedder = Embedder(bundle.model.eval(), bundle, 64, progress=False)
    image, text = embedder.embed(sets.retrieval.image_paths, sets.retrieval.captions, "retrieval")
    ref = torch.load(out / "embeddings.pt")
    assert image.shape == ref["image"].shape == (NUM_VAL, 64)
    assert (image - ref["image"]).abs().max().item() < 1e-5
    assert (text - ref["text"]).abs().max().item() < 1e-5
    single = evaluate(embedder, sets)
    after = result["evals"][-1]
    for key in ("zero_shot/top1", "zero_shot/top5", "retrieval/t2i_R@1", "retrieval/i2t_R@5",
                "retrieval/mean_recall"):
        group, name = key.split("/")
        assert single[group][name] == pytest.approx(after[key], abs=1e-6), key


def test_eval_command_on_exported_folder(trained, eval_data, tmp_path):
    """`rsclip-ds eval --model` (one process, no launcher) reproduces the ZeRO-3 numbers and
    writes the CSV monitor events."""
    out, result = trained
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps({"csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"),
                                                     "job_name": "ev"}}))
    run_checked([sys.executable, "-m", "rsclip_ds", "eval", "--model", str(out / "export"),
                 "--zero-shot", str(eval_data / "eval/classes"),
                 "--retrieval", str(eval_data / "eval/captions.json"), "--out", str(tmp_path / "res.json"),
                 "--ds-config", str(ds_config)], timeout=300)
    res = json.loads((tmp_path / "res.json").read_text())
    after = result["evals"][-1]
    assert res["zero_shot"]["top1"] == pytest.approx(after["zero_shot/top1"], abs=1e-6)
    assert res["retrieval"]["mean_recall"] == pytest.approx(after["retrieval/mean_recall"], abs=1e-6)
    assert len(res["zero_shot"]["per_class"]) == 8
    rows = (tmp_path / "csv/ev/Eval_zero_shot_top1.csv").read_text().split()
    assert rows[0] == "step,top1" and float(rows[1].split(",")[1]) == pytest.approx(res["zero_shot"]["top1"])
    # the per-sample rows and the report beside res.json (res/), without a second pass over the images
    assert (res["zero_shot"]["samples"], res["retrieval"]["samples"]) == ("res/samples/classes.zero-shot.jsonl",
                                                                          "res/samples/captions.retrieval.jsonl")
    samples = [json.loads(line) for line in (tmp_path / res["zero_shot"]["samples"]).read_text().splitlines()]
    assert len(samples) == NUM_VAL and sum(r["rank"] == 1 for r in samples) / NUM_VAL == pytest.approx(
        res["zero_shot"]["top1"])
    queries = [json.loads(line) for line in (tmp_path / res["retrieval"]["samples"]).read_text().splitlines()]
    assert sum(r["query"] == "caption" for r in queries) == NUM_VAL * 4
    suite = json.loads((tmp_path / "res/suite.json").read_text())
    assert [s["name"] for s in suite["sets"]] == ["classes", "captions"] and (tmp_path / "res/report.html").is_file()

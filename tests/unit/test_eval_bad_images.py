"""Evaluation sets with unreadable and missing images: they are skipped (with their captions),
counted and named; the metrics equal those of the set without them; past
eval.max_bad_fraction every rank stops with the same DataError; the marks survive the
cross-rank gather (two forked gloo ranks)."""

import dataclasses

import pytest
import torch

from rsclip_ds.config import EvalConfig, ModelConfig
from rsclip_ds.data.bad import DataError
from rsclip_ds.data.synthetic import make_synthetic
from rsclip_ds.evaluation.datasets import CaptionSet, ClassFolderSet, EvalSets
from rsclip_ds.evaluation.embed import Embedder, evaluate
from rsclip_ds.evaluation.metrics import flat_metrics
from tests.unit.forked_ranks import run_ranks


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """The synthetic eval layout (24 images, 4 captions each), listed, then in both sets one image
    truncated to a few bytes and one deleted (as on a flaky mount after start-up); and a tiny
    model with its tokenizer."""
    from rsclip_ds.data.tokenizer import iter_captions, train_tokenizer
    from rsclip_ds.model import build_model

    out = tmp_path_factory.mktemp("evalbad")
    index = make_synthetic(out, num_train=16, num_val=24, shard_size=8, seed=3, progress=False, eval_layout=True)
    cfg = EvalConfig(zero_shot_dir=index["zero_shot_dir"], retrieval_json=index["retrieval_json"])
    listed = EvalSets.from_config(cfg)
    broken = {listed.retrieval.image_paths[3], listed.retrieval.image_paths[10],
              listed.zero_shot.paths[5], listed.zero_shot.paths[17]}
    for i, path in enumerate(sorted(broken)):
        if i % 2:
            path.unlink()
        else:
            path.write_bytes(path.read_bytes()[:20])   # a JPEG header, then nothing
    train_tokenizer(iter_captions([str(out / s["url"]) for s in index["train"]]), out / "tok", vocab_size=200)
    bundle = build_model(ModelConfig(tokenizer=out / "tok"), 0)
    return listed, broken, bundle


def _without(sets: EvalSets, broken: set) -> EvalSets:
    """The reference: the sets as if the broken images had never been listed."""
    zs, rs = sets.zero_shot, sets.retrieval
    keep = [i for i, p in enumerate(zs.paths) if p not in broken]
    zero_shot = ClassFolderSet([zs.paths[i] for i in keep], [zs.labels[i] for i in keep], zs.class_names, zs.folders)
    kept_images = [i for i, p in enumerate(rs.image_paths) if p not in broken]
    new = {old: n for n, old in enumerate(kept_images)}
    pairs = [(c, new[i]) for c, i in zip(rs.captions, rs.text_image_index) if i in new]
    retrieval = CaptionSet([rs.image_paths[i] for i in kept_images], [c for c, _ in pairs], [i for _, i in pairs])
    return EvalSets(zero_shot, sets.templates, retrieval, max_bad_fraction=0.0)


def _numbers(results: dict) -> dict:
    """The scalar metrics and the per-class accuracies (the skipped counts are ints: not here)."""
    return {**flat_metrics(results), **{f"class/{k}": v for k, v in results["zero_shot"]["per_class"].items()}}


def test_unreadable_images_are_skipped_counted_and_the_metrics_are_the_set_without_them(damaged, caplog):
    listed, broken, bundle = damaged
    sets = dataclasses.replace(listed, max_bad_fraction=0.1)
    embedder = Embedder(bundle.model.eval(), bundle, 7, progress=False)
    with caplog.at_level("WARNING", logger="rsclip_ds"):
        got = evaluate(embedder, sets)
    assert got["zero_shot"]["skipped_images"] == 2 and got["zero_shot"]["num_images"] == 22
    assert got["retrieval"]["skipped_images"] == 2 and got["retrieval"]["num_images"] == 22
    assert got["retrieval"]["skipped_captions"] == 2 * 4 and got["retrieval"]["num_texts"] == 22 * 4
    assert "2 of 24 images unreadable or missing" in caplog.text
    assert any(str(p) in caplog.text for p in broken)                     # named with the reason
    assert "FileNotFoundError" in caplog.text
    want = evaluate(Embedder(bundle.model.eval(), bundle, 7, progress=False), _without(listed, broken))
    assert _numbers(got) == pytest.approx(_numbers(want), abs=1e-6)


def test_the_per_sample_rows_list_the_unreadable_images_and_rank_the_rest(damaged):
    """samples=True: every listed image has its row; the broken ones say so (and why: this one process read
    them all), the others' ranks give the metrics of the set without the broken ones."""
    listed, broken, bundle = damaged
    sets = dataclasses.replace(listed, max_bad_fraction=0.1)
    got = evaluate(Embedder(bundle.model.eval(), bundle, 7, progress=False), sets, samples=True)
    rows = got["zero_shot"]["rows"]
    assert [r["image"] for r in rows] == [str(p) for p in listed.zero_shot.paths]
    bad = [r for r in rows if not r["readable"]]
    assert {r["image"] for r in bad} == {str(p) for p in broken if p in listed.zero_shot.paths}
    assert all(r["rank"] is None and r["top5"] == [] and r["error"] for r in bad)
    assert any("FileNotFoundError" in r["error"] for r in bad)
    good = [r for r in rows if r["readable"]]
    assert sum(r["rank"] == 1 for r in good) / len(good) == pytest.approx(got["zero_shot"]["top1"])
    queries = got["retrieval"]["rows"]
    captions = [r for r in queries if r["query"] == "caption"]
    assert len(captions) == len(listed.retrieval.captions) and sum(not r["readable"] for r in captions) == 2 * 4
    kept = [r for r in captions if r["readable"]]
    assert sum(r["rank"] == 1 for r in kept) / len(kept) == pytest.approx(got["retrieval"]["t2i_R@1"])
    assert all(not set(r["top5"]) & {listed.retrieval.image_paths.index(p) for p in broken
                                     if p in listed.retrieval.image_paths} for r in kept)   # never ranked


def test_past_the_threshold_every_set_stops_with_the_fix(damaged):
    listed, _, bundle = damaged
    assert listed.max_bad_fraction == EvalConfig().max_bad_fraction == 0.01   # 2 of 24 is too many
    with pytest.raises(DataError, match=r"2 of 24 images are unreadable.*eval.max_bad_fraction=0.01"):
        evaluate(Embedder(bundle.model.eval(), bundle, 64, progress=False), listed)


def _two_rank_eval(rank: int, world: int, listed: EvalSets, bundle, limit: float) -> dict:
    sets = dataclasses.replace(listed, max_bad_fraction=limit)
    embedder = Embedder(bundle.model.eval(), bundle, 4, rank=rank, world_size=world, progress=False)
    results = evaluate(embedder, sets)
    return {"results": _numbers(results), "skipped": results["retrieval"]["skipped_images"],
            "mine": len(embedder.unreadable)}


def test_two_ranks_agree_on_the_marks_and_the_stop(damaged, tmp_path):
    listed, _, bundle = damaged
    ranks = run_ranks(_two_rank_eval, 2, tmp_path / "ok", listed, bundle, 0.1)
    single = _two_rank_eval(0, 1, listed, bundle, 0.1)
    assert [r["value"]["skipped"] for r in ranks] == [2, 2]
    assert sum(r["value"]["mine"] for r in ranks) == 2                    # each rank met its own share
    for r in ranks:
        assert r["value"]["results"] == pytest.approx(single["results"], abs=1e-5)
    stopped = run_ranks(_two_rank_eval, 2, tmp_path / "stop", listed, bundle, 0.01)
    assert all(r["error"].startswith("DataError: eval zero-shot: 2 of 24") for r in stopped)

"""The three corpora as published train on 2 CPU ranks, with a load-time filter (issue 23's
"Done means"): shards made by `make-shards` from a Git-10M-shaped parquet dataset (--hf-dataset,
planted faults), a SkyScript-shaped CSV with two caption columns and a score (--table), and
13-band uint16 GeoTIFFs (--table --bands), joined by '::' in one run with data.where over columns
of all three. One launch stops after step 4 (mid-epoch), a second resumes it to step 6, a third
runs the 6 steps uninterrupted: the reference the resumed run's losses must equal.

What is known without the library: every shard holds 8 samples, of which the filter keeps those
at positions 0, 2, 4 and 7 (the last), so each rank's 3 shards per epoch keep 12 samples = 3
batches of 4 and an epoch reads every sample of every shard once, dropping 4 per shard. With no
shuffle buffer a rank's first batch of an epoch is the 4 kept samples of its first shard, read
to its end. Hence filtered_out = 24 after epoch 0 (step 3), 24 + 2 x 4 = 32 after step 4, 48 after
step 6 -- also across the resume, which replays its position without counting again."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from rsclip_ds.cli import main
from rsclip_ds.data.tokenizer import iter_captions, train_tokenizer
from tests.corpora import (CORRUPT_ROWS, EMPTY_CAPTION_ROWS, TRUNCATED_ROWS, git10m_rows, write_eurosat_ms,
                           write_git10m, write_skyscript_csv)
from tests.integration.helpers import launch_run, summary

pytestmark = pytest.mark.slow
SHARD, KEPT_AT = 8, (0, 2, 4, 7)      # samples per shard; the positions the filter keeps
WHERE = "not img_quality_score < 0.5 and not similarity_CLIP_openai < 0.3 and not cloud_cover > 50"
RUN = ["steps=6", "batch.micro_batch_size=4", "optim.warmup_steps=1", "logging.log_every=1",
       "data.num_workers=0", "data.shuffle_buffer=0", "checkpoint.every=0", f"data.where={WHERE}"]


def _kept(j: int) -> bool:
    return j % SHARD in KEPT_AT


def _make_shards(*args: str) -> dict:
    code = main(["make-shards", "--shard-size", str(SHARD), *args])
    assert code == 0
    return json.loads((Path(args[args.index("--out") + 1]) / "index.json").read_text())


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("corpora")
    # Git-10M: 19 rows, of which make-shards skips rows 3 and 17 (corrupt) and 8 (empty caption)
    n = 19
    rows = git10m_rows(n)
    written = [i for i in range(n) if i not in CORRUPT_ROWS + TRUNCATED_ROWS + EMPTY_CAPTION_ROWS]
    assert len(written) == 2 * SHARD
    for j, i in enumerate(written):
        rows["img_quality_score"][i] = 0.9 if _kept(j) else 0.1
    index = _make_shards("--hf-dataset", str(write_git10m(root / "git10m", n=n, files=2, rows=rows)),
                         "--out", str(root / "s_git"))
    assert index["splits"]["train"]["skipped"] == {"corrupt_image": 2, "empty_caption": 1}
    # SkyScript: 16 rows, two caption columns, the CLIP score filtered on
    sky = write_skyscript_csv(root / "sky", n=2 * SHARD, scores=[0.35 if _kept(j) else 0.25 for j in range(2 * SHARD)])
    _make_shards("--table", str(sky), "--path-column", "filepath", "--caption-column", "title,title_multi_objects",
                 "--out", str(root / "s_sky"))
    # EuroSAT-MS: 16 13-band uint16 TIFFs in a table with a caption and a cloud cover column
    ms = write_eurosat_ms(root / "ms", per_class=SHARD)
    table = root / "ms" / "eurosat_ms.csv"
    with table.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["filepath", "caption", "cloud_cover"])
        for j, tif in enumerate(sorted(ms.rglob("*.tif"))):
            w.writerow([str(tif.relative_to(ms)), f"a sentinel-2 image of {tif.parent.name.lower()}",
                        10 if _kept(j) else 80])
    _make_shards("--table", str(table), "--path-column", "filepath", "--caption-column", "caption",
                 "--bands", "4,3,2", "--band-scale", "range:0,3000", "--out", str(root / "s_ms"))
    folders = [root / "s_git", root / "s_sky", root / "s_ms"]
    urls = [str(p) for f in folders for p in sorted(f.glob("train-*.tar"))]
    assert len(urls) == 6 and all(json.loads((f / "index.json").read_text())["shards"][-1]["num_samples"] == SHARD
                                  for f in folders)
    train_tokenizer(iter_captions(urls), root / "tokenizer", vocab_size=300, max_length=32)
    return {"shards": "::".join(f"{f}/train-{{000000..000001}}.tar" for f in folders),
            "tokenizer": str(root / "tokenizer")}


def test_three_corpora_train_with_a_filter_and_resume_with_exact_counts(corpora, tmp_path):
    out = tmp_path / "run"
    first = launch_run(corpora, out, *RUN, "checkpoint.stop_after=4")
    assert first.returncode == 0, (first.stdout + first.stderr)[-5000:]
    s = summary(out)
    assert s["optimizer_steps"] == 4 and s["bad_data"]["filtered_out"] == 32
    # the kept counts were counted once and cached in the run's folder: 4 per shard
    cached = [json.loads(p.read_text()) for p in (out / "where-counts").glob("*.json")]
    assert len(cached) == 1 and sorted(cached[0]["kept"].values()) == [4] * 6
    second = launch_run(corpora, out, *RUN, extra=["--resume", "latest"])
    assert second.returncode == 0, (second.stdout + second.stderr)[-5000:]
    s = summary(out)
    assert s["resumed_from"] == [4] and s["optimizer_steps"] == 6
    assert {k: v for k, v in s["bad_data"].items() if v} == {"filtered_out": 48}   # no bad data besides
    losses = s["losses"]
    print("losses", [round(x, 4) for x in losses])
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0], losses
    reference = launch_run(corpora, tmp_path / "reference", *RUN)
    assert reference.returncode == 0, (reference.stdout + reference.stderr)[-5000:]
    ref = summary(tmp_path / "reference")
    assert ref["losses"] == losses and ref["bad_data"] == s["bad_data"]

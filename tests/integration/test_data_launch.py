"""Real 2-rank launches on uneven shards with bad data: the run finishes, every rank got the same
number of batches, and summary.json's bad-data counts equal the sum of what an in-process
loader of each rank counts over the same batches (its reference twin). A second launch shows
the bad-fraction threshold stopping a run with the error that names the key."""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import pytest
from webdataset import TarWriter

from rsclip_ds.config import DataConfig
from rsclip_ds.data import StreamCounter, build_train_loader, read_shard
from rsclip_ds.data.sources import expand_urls
from rsclip_ds.data.synthetic import make_synthetic
from rsclip_ds.model import load_tokenizer
from tests.integration.helpers import (BASE_OVERRIDES, DEMO_CONFIG, ROOT, deepspeed_cmd, free_port, launch_env,
                                       run_checked, train_args)

pytestmark = pytest.mark.slow
MICRO, STEPS = 16, 20


@pytest.fixture(scope="module")
def messy(tmp_path_factory, launch_data):
    """5 synthetic shards of 128,128,128,128,88 samples + bad.tar (3 corrupt images, 1 without
    caption), trunc.tar (a shard cut at 60%) and empty.tar: 8 shards for 2 ranks x 3 workers."""
    out = tmp_path_factory.mktemp("messy")
    make_synthetic(out, num_train=600, num_val=8, shard_size=128, image_size=32, seed=1, progress=False)
    samples = list(itertools.islice(read_shard(str(out / "train-000000.tar"), StreamCounter({})), 10))
    for s in samples[:3]:
        s["jpg"] = s["jpg"][:100]
    del samples[3]["txt"]
    with TarWriter(str(out / "bad.tar"), encoder=False, mtime=0) as sink:
        for s in samples:
            sink.write({k: v for k, v in s.items() if k != "__url__"})
    data = (out / "train-000001.tar").read_bytes()
    (out / "trunc.tar").write_bytes(data[: int(len(data) * 0.6)])
    with TarWriter(str(out / "empty.tar"), encoder=False, mtime=0):
        pass
    spec = f"{out}/train-{{000000..000004}}.tar::{out}/bad.tar::{out}/trunc.tar::{out}/empty.tar"
    return {"shards": spec, "tokenizer": launch_data["tokenizer"]}


def _overrides(*extra):
    return [f"steps={STEPS}", f"batch.micro_batch_size={MICRO}", "data.num_workers=3",
            "data.shuffle_buffer=64", "logging.log_every=5", *extra]


def test_two_ranks_finish_on_uneven_bad_shards_and_report_exact_counts(messy, tmp_path):
    out = tmp_path / "run"
    cmd = deepspeed_cmd() + ["--num_gpus", "2", "--master_port", str(free_port())]
    run_checked(cmd + train_args(messy, out, _overrides("data.max_bad_fraction=0.5")), timeout=400)
    import json
    summary = json.loads((out / "summary.json").read_text())
    assert summary["optimizer_steps"] == STEPS and summary["micro_steps"] == STEPS
    # the reference twin: each rank's loader built in-process, the same number of batches
    tok = load_tokenizer(Path(messy["tokenizer"]))
    cfg = DataConfig(train_shards=messy["shards"], num_workers=3, shuffle_buffer=64, max_bad_fraction=0.5)
    expected: dict[str, int] = {}
    for rank in range(2):
        loader = build_train_loader(cfg, tokenizer=tok, image_size=32, max_text_length=16, micro_batch_size=MICRO,
                                    rank=rank, world_size=2, seed=0)
        list(itertools.islice(iter(loader), STEPS))
        for k, v in loader.bad_data().items():
            expected[k] = expected.get(k, 0) + v
    assert summary["bad_data"] == expected
    assert sum(expected.values()) > 0


def test_too_much_bad_data_stops_the_run_with_the_fix(messy, tmp_path):
    cmd = deepspeed_cmd() + ["--num_gpus", "2", "--master_port", str(free_port())]
    args = train_args(messy, tmp_path / "run", _overrides("data.max_bad_fraction=0.001",
                                                          "data.bad_data_min_samples=16"))
    proc = subprocess.run(cmd + args, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=400)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert "DataError" in text and "data.max_bad_fraction=0.001" in text, text[-3000:]


def test_two_epochs_deliver_every_sample_once_less_one_global_batch(launch_data, tmp_path):
    """1,024 samples, 2 ranks x 4 workers, micro 24: a global batch of 48, so an epoch is 21 batches
    per rank = 1,008 samples. What each rank's loader handed out (its tap, not the schedule): in each
    of two epochs 1,008 distinct samples of the set; metrics.jsonl marks each epoch's end at its
    step, summary.json and the start-up line say the same."""
    import json

    from rsclip_ds.reporting.metrics import read_metrics

    out, keys = tmp_path / "run", tmp_path / "keys"
    keys.mkdir()
    sets = BASE_OVERRIDES + [f"output_dir={out}", f"data.train_shards={launch_data['shards']}",
                             f"model.tokenizer={launch_data['tokenizer']}", "steps=42", "batch.micro_batch_size=24",
                             "data.num_workers=4", "logging.log_every=7", "checkpoint.at_end=false"]
    cmd = deepspeed_cmd() + ["--num_gpus", "2", "--master_port", str(free_port()),
                             str(ROOT / "tests" / "integration" / "epoch_worker.py"), "--config", str(DEMO_CONFIG),
                             "--keys", str(keys), *[a for s in sets for a in ("--set", s)]]
    proc = run_checked(cmd, timeout=400)
    assert "data: epoch 0: 21 batches per rank = 1,008 of 1,024 samples (98.4 %)" in proc.stdout + proc.stderr
    every = {s["__key__"] for u in expand_urls(launch_data["shards"]) for s in read_shard(u, StreamCounter({}))}
    assert len(every) == 1024
    taps = [json.loads(line) for r in (0, 1) for line in (keys / f"rank{r}.jsonl").read_text().splitlines()]
    for rank in (0, 1):
        lines = (keys / f"rank{rank}.jsonl").read_text().splitlines()
        assert [json.loads(t)["index"] for t in lines] == list(range(42))           # 21 per epoch, each rank
    for epoch in (0, 1):
        got = [k for t in taps if t["epoch"] == epoch for k in t["keys"]]
        assert len(got) == 1008 and len(set(got)) == 1008 and set(got) <= every
    ends = [e for e in read_metrics(out / "metrics.jsonl")["events"] if e["event"] == "epoch_end"]
    assert [(e["epoch"], e["step"], e["samples"], e["batches_per_rank"]) for e in ends] == \
        [(0, 21, 1008, 21), (1, 42, 1008, 21)]
    epochs = json.loads((out / "summary.json").read_text())["epochs"]
    assert [(e["epoch"], e["delivered"], e["complete"], e["epoch_samples"]) for e in epochs] == \
        [(0, 1008, True, 1024), (1, 1008, True, 1024)]

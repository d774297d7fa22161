"""Bad data: every kind is skipped and counted (exactly), logged without flooding, resumable,
and too much of it stops the run with DataError."""

from __future__ import annotations

import io
import itertools
import json
import logging
import time

import numpy as np
import pytest
from PIL import Image
from webdataset import TarWriter

from rsclip_ds.config import DataConfig
from rsclip_ds.data import (BAD_KINDS, DataError, ImageTransform, SampleDecoder, StreamCounter, build_epoch_schedule,
                            build_train_loader, read_shard)
from tests.helpers import deadline

B = 2


def _jpeg(rng, size=16) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def _write(path, samples):
    with TarWriter(str(path), encoder=False, mtime=0) as sink:
        for s in samples:
            sink.write(s)


def _good(name, n, rng):
    return [{"__key__": f"{name}_{i}", "jpg": _jpeg(rng), "txt": f"{name} {i}".encode()} for i in range(n)]


# kinds each shard produces when read once
EXPECTED = {
    "good": {}, "mixed": {"corrupt_image": 2, "missing_caption": 1, "missing_image": 1},
    "truncated": {"truncated_tar": 1}, "empty": {"empty_shard": 1}, "gone": {"missing_shard": 1},
    "pipe": {"unreadable_shard": 1},
}


@pytest.fixture
def bad_shards(tmp_path):
    rng = np.random.default_rng(0)
    _write(tmp_path / "good.tar", _good("good", 6, rng))
    mixed = _good("mixed", 6, rng)
    mixed[0]["jpg"] = b"\xff\xd8\xff\xe0 not a jpeg at all"       # corrupt header
    mixed[1]["jpg"] = mixed[1]["jpg"][: len(mixed[1]["jpg"]) // 2]    # cut in the middle
    del mixed[2]["txt"]                                                # no caption
    del mixed[3]["jpg"]                                                # no image
    _write(tmp_path / "mixed.tar", mixed)
    _write(tmp_path / "truncated.tar", _good("trunc", 6, rng))
    data = (tmp_path / "truncated.tar").read_bytes()
    (tmp_path / "truncated.tar").write_bytes(data[: int(len(data) * 0.6)])
    _write(tmp_path / "empty.tar", [])
    _write(tmp_path / "gone.tar", _good("gone", 6, rng))
    listing = tmp_path / "shards.txt"
    # 'file:' urls are not checked when the loader starts: gone.tar may vanish afterwards
    listing.write_text("good.tar\nmixed.tar\ntruncated.tar\nempty.tar\n"
                       f"file:{tmp_path}/gone.tar\npipe:cat {tmp_path}/no-such.tar\n")
    (tmp_path / "counts.json").write_text(json.dumps({"shards": [{"url": "no-such.tar", "num_samples": 6},
                                                                 {"url": "gone.tar", "num_samples": 6}]}))
    return {"dir": tmp_path, "list": str(listing), "index": str(tmp_path / "counts.json")}


def _prep():
    return SampleDecoder(ImageTransform(8), ["jpg"], ["txt"])


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_shard_is_counted_by_kind(bad_shards, name):
    (bad_shards["dir"] / "gone.tar").unlink()
    url = f"pipe:cat {bad_shards['dir']}/no-such.tar" if name == "pipe" else str(bad_shards["dir"] / f"{name}.tar")
    counter = StreamCounter({})
    import random
    good = [s for s in read_shard(url, counter) if _prep()(s, random.Random(0), counter) is not None]
    assert {k: v for k, v in counter.bad.items() if v} == EXPECTED[name]
    assert len(good) == {"good": 6, "mixed": 2, "truncated": len(good)}.get(name, 0)
    if name == "truncated":
        assert 1 <= len(good) < 6   # what precedes the break is kept
    assert counter.shards == 1


def _loader(spec, tok, *, state=None, **data):
    cfg = DataConfig(**{"train_shards": spec, "num_workers": 0, "shuffle_buffer": 0, "max_bad_fraction": 1.0,
                        **data})
    return build_train_loader(cfg, tokenizer=tok, image_size=8, max_text_length=16, micro_batch_size=B, rank=0,
                              world_size=1, seed=0, return_keys=True, state=state)


def _expected(plan, opened_per_epoch: list[int]) -> dict:
    """Bad counts implied by the shards the stream opened in each epoch (plan order, passes
    repeating)."""
    total = dict.fromkeys(BAD_KINDS, 0)
    for epoch, opened in enumerate(opened_per_epoch):
        names = [u.rsplit("/", 1)[-1].removesuffix(".tar").replace("no-such", "pipe")
                 for u in plan.shards(epoch, 0, 0)]
        for i in range(opened):
            for k, v in EXPECTED[names[i % len(names)]].items():
                total[k] += v
    return total


def test_loader_skips_and_counts_every_kind_and_resumes_the_counts(bad_shards, tiny_tokenizer):
    spec, index = bad_shards["list"], bad_shards["index"]
    (bad_shards["dir"] / "gone.tar").unlink()
    loader = _loader(spec, tiny_tokenizer, shard_index=index)
    plan = build_epoch_schedule(DataConfig(train_shards=spec, shard_index=index, num_workers=0),
                            micro_batch_size=B, world_size=1, seed=0)
    assert plan.batches(0) == 14   # 29 samples counted (5 before the break): 3 passes of good ones
    it = iter(loader)
    with deadline(60):
        batches = list(itertools.islice(it, 14))
        opened0 = loader.state_dict()["streams"][0]["opened"]
        assert opened0 > 12 and loader.bad_data() == _expected(plan, [opened0])
        batches += list(itertools.islice(it, 4))   # into epoch 1
    keys = {k for b in batches for k in b["keys"]}
    assert all(k.startswith(("good_", "trunc_", "mixed_4", "mixed_5")) for k in keys)
    state = loader.state_dict()
    assert state["epoch"] == 1
    bad = loader.bad_data()
    assert bad == _expected(plan, [opened0, state["streams"][0]["opened"]])
    assert all(bad[k] > 0 for k in BAD_KINDS if k != "filtered_out")   # no data.where here
    assert bad["filtered_out"] == 0
    assert state["bad"] == bad and loader.samples_seen == state["samples_seen"] > 0
    # stopped and resumed at batch 5: same batches, same counts as the uninterrupted loader
    first = _loader(spec, tiny_tokenizer, shard_index=index)
    head = list(itertools.islice(iter(first), 5))
    second = _loader(spec, tiny_tokenizer, shard_index=index, state=first.state_dict())
    tail = list(itertools.islice(iter(second), 13))
    assert [b["keys"] for b in head + tail] == [b["keys"] for b in batches]
    assert second.bad_data() == bad and second.samples_seen == loader.samples_seen


def test_bad_fraction_stops_with_a_clear_error(bad_shards, tiny_tokenizer):
    (bad_shards["dir"] / "gone.tar").unlink()
    loader = _loader(bad_shards["list"], tiny_tokenizer, shard_index=bad_shards["index"],
                     max_bad_fraction=0.1, bad_data_min_samples=10)
    with pytest.raises(DataError) as err, deadline(60):
        list(itertools.islice(iter(loader), 50))
    msg = str(err.value)
    assert "data.max_bad_fraction=0.1" in msg and "--set data.max_bad_fraction" in msg
    assert "were bad" in msg and ".tar" in msg   # counts and an example path


def test_bad_fraction_error_reaches_the_main_process_from_a_worker(bad_shards, tiny_tokenizer, monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    loader = _loader(f"{bad_shards['dir']}/mixed.tar", tiny_tokenizer, num_workers=1,
                     max_bad_fraction=0.2, bad_data_min_samples=6)
    with pytest.raises(DataError, match=r"4 of 6 samples read were bad.*corrupt_image 2.*mixed.tar"), \
            deadline(60):
        next(iter(loader))


def test_many_bad_samples_are_fast_and_logged_without_flooding(tmp_path, tiny_tokenizer, caplog, monkeypatch):
    rng = np.random.default_rng(1)
    samples = _good("x", 240, rng)
    for s in samples[:200]:
        s["jpg"] = b"garbage"
    _write(tmp_path / "bad.tar", samples)
    loader = _loader(str(tmp_path / "bad.tar"), tiny_tokenizer)
    sleeps = []   # the loader runs in this process (num_workers=0): every sleep lands here
    monkeypatch.setattr(time, "sleep", sleeps.append)
    with caplog.at_level(logging.WARNING, logger="rsclip_ds.data"), deadline(60):
        list(itertools.islice(iter(loader), 20))            # the 40 good ones: one pass
    assert sleeps == []   # webdataset's warn_and_continue sleeps 0.5 s per bad sample: 100 s here
    assert loader.bad_data()["corrupt_image"] == 200
    lines = [r.getMessage() for r in caplog.records]
    assert sum("skipped bad data (corrupt_image)" in m for m in lines) == 3   # examples
    # one count line when a power of ten is passed (here 10 and 100 before the first batch)
    assert [m for m in lines if "so far" in m] == ["rank 0: 200 corrupt_image so far (202 samples read)"]
    assert len(lines) == 4

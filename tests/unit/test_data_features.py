"""Loader features: weighted sources, pipe: urls, RS5M / JSON member names, augmentations, and
shard counts from img2dataset stats, read by one rank for all."""

from __future__ import annotations

import io
import itertools
import json
import multiprocessing
import os
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from webdataset import TarWriter

from rsclip_ds.config import DataConfig
from rsclip_ds.data import (ImageTransform, SampleDecoder, build_epoch_schedule, build_train_loader, shard_counts,
                            shard_counts_from_rank0)
from tests.helpers import deadline, write_shards


def _loader(spec, tok, **data):
    cfg = DataConfig(**{"train_shards": spec, "num_workers": 0, "shuffle_buffer": 0, **data})
    return build_train_loader(cfg, tokenizer=tok, image_size=8, max_text_length=16, micro_batch_size=4, rank=0,
                              world_size=1, seed=0, return_keys=True)


def _keys(loader, n):
    with deadline(60):
        return [k for b in itertools.islice(iter(loader), n) for k in b["keys"]]


def test_resampled_weights_set_the_mix_of_sources(tmp_path, tiny_tokenizer):
    a = write_shards(tmp_path, [8, 8], prefix="a")
    b = write_shards(tmp_path, [8, 8], prefix="b")
    keys = _keys(_loader(f"{a}::{b}", tiny_tokenizer, policy="resampled", train_weights=[3, 1],
                         epoch_batches=10), 100)
    share_a = sum(k.startswith("a") for k in keys) / len(keys)
    assert 0.5 < share_a < 0.95           # 50 shard draws of p=0.75
    plan = build_epoch_schedule(DataConfig(train_shards=f"{a}::{b}", policy="resampled", train_weights=[3, 1],
                                       num_workers=0), micro_batch_size=4, world_size=1, seed=0)
    draws = list(itertools.islice(plan.draw(0, 0, 0), 4000))
    assert abs(sum("/a-" in u for u in draws) / 4000 - 0.75) < 0.025
    assert len(set(draws)) == 4
    assert plan.epoch_batches == 8        # 32 samples / (1 rank x 4): default from the counts


def test_exact_weights_repeat_sources_per_epoch(tmp_path, tiny_tokenizer):
    a = write_shards(tmp_path, [8], prefix="a")
    b = write_shards(tmp_path, [8], prefix="b")
    keys = _keys(_loader(f"{a}::{b}", tiny_tokenizer, train_weights=[2, 1]), 6)   # one epoch: 24 samples
    assert Counter(k[0] for k in keys) == {"a": 16, "b": 8}
    assert Counter(keys)["a0_000"] == 2
    with pytest.raises(ValueError, match="whole number"):
        _loader(f"{a}::{b}", tiny_tokenizer, train_weights=[1.5, 1])
    with pytest.raises(ValueError, match="one non-negative weight per"):
        _loader(f"{a}::{b}", tiny_tokenizer, train_weights=[1])


def test_pipe_urls_are_read(tmp_path, tiny_tokenizer):
    local = write_shards(tmp_path, [8, 8])
    (tmp_path / "index.json").write_text(json.dumps({"shards": [
        {"url": f"s-{i:02d}.tar", "num_samples": 8} for i in range(2)]}))
    spec = f"pipe:cat {tmp_path}/s-00.tar::pipe:cat {tmp_path}/s-01.tar"
    piped = _keys(_loader(spec, tiny_tokenizer, shard_index=str(tmp_path / "index.json")), 4)
    assert sorted(piped) == sorted(_keys(_loader(local, tiny_tokenizer), 4))
    with pytest.raises(ValueError, match="data.shard_index"):
        _loader(spec, tiny_tokenizer)   # exact epochs need counts; pipes are not counted


def test_rs5m_member_names_and_json_captions(tmp_path, tiny_tokenizer):
    rng = np.random.default_rng(0)
    with TarWriter(str(tmp_path / "rs5m.tar"), encoder=False, mtime=0) as sink:
        for i in range(8):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(buf, "PNG")
            sink.write({"__key__": f"r{i}", "img_content": buf.getvalue(), "img_name": b"x.png",
                        "caption": f"caption {i}".encode(),
                        "json": json.dumps({"captions": [f"json caption {i}", "other"]}).encode()})
    keys = _keys(_loader(str(tmp_path / "rs5m.tar"), tiny_tokenizer), 2)   # defaults find them
    assert sorted(keys) == [f"r{i}" for i in range(8)]
    prep = SampleDecoder(ImageTransform(8), ["img_content"], ["json"])
    from rsclip_ds.data import StreamCounter, read_shard
    sample = next(read_shard(str(tmp_path / "rs5m.tar"), StreamCounter({})))
    draws = {prep(sample, random.Random(s), StreamCounter({}))[1] for s in range(20)}
    assert draws == {"json caption 0", "other"}


def _flat_image(w=32, h=16):
    """Left half black, right half white, a red pixel block top-left."""
    img = np.zeros((h, w, 3), np.uint8)
    img[:, w // 2:] = 255
    img[:4, :4] = (255, 0, 0)
    return img


def _encode(arr) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def test_flips_and_rotations_are_exact_transforms():
    data = _encode(_flat_image(16, 16))
    base = ImageTransform(16)(data, random.Random(0))
    transforms = {"id": base, "h": base[:, ::-1], "v": base[::-1], "r90": np.rot90(base, 1),
                  "r180": np.rot90(base, 2), "r270": np.rot90(base, 3)}
    for flags in ({"hflip": True}, {"vflip": True}, {"rot90": True}):
        prep = ImageTransform(16, **flags)
        outs = [prep(data, random.Random(s)) for s in range(40)]
        names = {next(n for n, t in transforms.items() if np.array_equal(o, t)) for o in outs}
        want = {"hflip": {"id", "h"}, "vflip": {"id", "v"}, "rot90": {"id", "r90", "r180", "r270"}}
        assert names == want[next(iter(flags))]


def test_random_resized_crop_covers_the_asked_area():
    arr = np.arange(64 * 64 * 3, dtype=np.uint32).reshape(64, 64, 3) % 251
    data = _encode(arr.astype(np.uint8))
    prep = ImageTransform(16, crop=(0.25, 0.25))
    boxes = []
    orig = Image.Image.resize

    def spy(self, size, resample=None, box=None, **kw):
        boxes.append(box)
        return orig(self, size, resample, box, **kw)
    Image.Image.resize = spy
    try:
        outs = [prep(data, random.Random(s)) for s in range(10)]
    finally:
        Image.Image.resize = orig
    assert all(o.shape == (16, 16, 3) for o in outs)
    areas = [(x1 - x0) * (y1 - y0) / (64 * 64) for x0, y0, x1, y1 in boxes]
    assert all(0.2 < a < 0.3 for a in areas)
    assert len({b[:2] for b in boxes}) > 5      # random positions


def test_counts_from_img2dataset_stats_and_tar_headers(tmp_path):
    spec = write_shards(tmp_path, [5, 7])
    (tmp_path / "s-01_stats.json").write_text(json.dumps({"count": 9, "successes": 6}))
    counts = shard_counts([str(tmp_path / "s-00.tar"), str(tmp_path / "s-01.tar")])
    assert counts == {str(tmp_path / "s-00.tar"): 5, str(tmp_path / "s-01.tar"): 6}
    assert spec.endswith("s-{00..01}.tar")


def _rank_reading_counts(rank: int, world: int, store: str, spec: str, out: str) -> None:
    """One rank of a gloo group (a forked process): build its loader, counting the tar header
    reads, and ask for the count of a url nobody can count; write what happened to ``out``."""
    import torch.distributed as dist

    from rsclip_ds.data import sources

    code = 1
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        reads, real = [], sources.count_tar_samples
        sources.count_tar_samples = lambda path: reads.append(Path(path).name) or real(path)
        loader = build_train_loader(DataConfig(train_shards=spec, num_workers=0, shuffle_buffer=0), tokenizer=None,
                                    image_size=8, max_text_length=16, micro_batch_size=2, rank=rank,
                                    world_size=world, seed=0)
        try:
            shard_counts_from_rank0(["pipe:cat elsewhere.tar"])
            error = None
        except ValueError as err:
            error = str(err)
        Path(out).write_text(json.dumps({"reads": reads, "counts": loader.schedule.counts, "error": error}))
        dist.destroy_process_group()
        code = 0
    finally:
        os._exit(code)


def test_only_rank_0_reads_the_shard_counts_and_the_others_get_them(tmp_path):
    """Two ranks in a gloo group, shards without an index (every tar's headers must be read):
    rank 0 reads each tar once, rank 1 reads none and gets the same counts; rank 0's error
    reaches rank 1 with its message."""
    spec = write_shards(tmp_path, [3, 5, 2, 4])
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_rank_reading_counts, args=(r, 2, str(tmp_path / "store"), spec,
                                                            str(tmp_path / f"rank{r}.json"))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert sorted(got[0]["reads"]) == ["s-00.tar", "s-01.tar", "s-02.tar", "s-03.tar"] and got[1]["reads"] == []
    want = {str(tmp_path / f"s-0{i}.tar"): n for i, n in enumerate([3, 5, 2, 4])}
    assert got[0]["counts"] == got[1]["counts"] == want
    assert got[0]["error"] == got[1]["error"] and "no sample count for 'pipe:cat elsewhere.tar'" in got[1]["error"]


@pytest.mark.parametrize("fmt", ["pax", "gnu", "ustar"])
def test_tar_reader_matches_tarfile_for_every_format(tmp_path, fmt):
    import tarfile

    from rsclip_ds.data import StreamCounter, read_shard
    path = tmp_path / f"{fmt}.tar"
    fmts = {"pax": tarfile.PAX_FORMAT, "gnu": tarfile.GNU_FORMAT, "ustar": tarfile.USTAR_FORMAT}
    long_dir = "d" * 90 if fmt == "ustar" else "d" * 150   # ustar: a long name goes in the prefix field
    with tarfile.open(path, "w", format=fmts[fmt]) as tar:
        tar.addfile(tarfile.TarInfo("folder"), None)
        for i, (name, size) in enumerate([("a.jpg", 5), ("a.txt", 0), (f"{long_dir}/b.jpg", 1000),
                                          (f"{long_dir}/b.txt", 512)]):
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BytesIO(bytes([i]) * size))
    counter = StreamCounter({})
    got = list(read_shard(str(path), counter))
    assert [(s["__key__"], {k: len(v) for k, v in s.items() if not k.startswith("__")}) for s in got] == \
        [("a", {"jpg": 5, "txt": 0}), (f"{long_dir}/b", {"jpg": 1000, "txt": 512})]
    assert got[1]["jpg"] == bytes([2]) * 1000 and not any(counter.bad.values())
    (tmp_path / "not.tar").write_bytes(b"hello" * 300)
    assert list(read_shard(str(tmp_path / "not.tar"), counter)) == []
    assert counter.bad["unreadable_shard"] == 1

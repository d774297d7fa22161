"""data.where under the 'exact' policy: the kept samples per shard are counted at start-up
(filter_counts.py) and size the epochs, so every (rank, worker) stream fills its quota in one pass
over its shards, and filtered_out is exactly what the filter drops in what the streams read."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from rsclip_ds.config import ConfigError, DataConfig
from rsclip_ds.data import StreamCounter, build_epoch_schedule, build_train_loader, read_shard
from rsclip_ds.data import filter_counts as fc
from rsclip_ds.data import loader as loader_mod
from rsclip_ds.data.loader import StreamDataset
from rsclip_ds.data.where import Where, json_columns
from tests.corpora import jpeg
from tests.unit.forked_ranks import run_ranks

WHERE = "score >= 0.5"
MICRO = 2
SIZES = [9, 4, 12, 7, 10, 5, 8, 6]   # samples per shard


def _score(shard: int, i: int):
    """Uneven: shard 2 keeps 11 of 12, shard 1 none; and the JSON edge cases of json_columns."""
    if (shard, i) == (0, 3):
        return "no json"
    if (shard, i) == (0, 5):
        return "bad json"
    if (shard, i) == (3, 1):
        return None
    return 0.0 if shard == 1 else 0.9 if shard == 2 and i else ((shard * 7 + i * 3) % 10) / 10


def _write(folder: Path) -> list[str]:
    """8 shards of SIZES samples (jpg, txt, json {"score"}) and their index.json -> the urls."""
    folder.mkdir(parents=True, exist_ok=True)
    urls, entries, image = [], [], jpeg(0, 8)
    for s, n in enumerate(SIZES):
        path = folder / f"w-{s:06d}.tar"
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(n):
                score = _score(s, i)
                members = {"jpg": image, "txt": f"caption {s} {i}".encode()}
                if score == "bad json":
                    members["json"] = b"{not json"
                elif score != "no json":
                    members["json"] = json.dumps({"score": score}).encode()
                for ext, data in members.items():
                    info = tarfile.TarInfo(f"s{s}_{i:03d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        urls.append(str(path))
        entries.append({"url": path.name, "num_samples": n})
    (folder / "index.json").write_text(json.dumps({"shards": entries}))
    return urls


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    return _write(tmp_path_factory.mktemp("where"))


def _brute_force(url: str) -> tuple[int, list[bool]]:
    """Every sample of a shard read as the loader reads it, through data.where's own test."""
    where = Where.parse(WHERE)
    flags = [where(json_columns(s.get("json"))) for s in read_shard(url, StreamCounter({}))]
    return sum(flags), flags


def test_kept_counts_equal_a_brute_force_count(shards):
    kept = fc.kept_counts(shards, WHERE)
    assert kept == {u: _brute_force(u)[0] for u in shards}
    assert kept[shards[1]] == 0 and kept[shards[2]] == 11          # uneven, as meant
    assert not Where.parse(WHERE)(json_columns(b"[1]")) and json_columns(None) == {}


def _piece_flags(flags: list[bool], piece) -> list[bool]:
    """The filter's verdicts on the samples a stream reads of a piece of a shard: from the one after
    the shard's skip-th kept sample (the first when skip is 0) to its (skip + take)-th kept one (to
    the shard's end for its last piece)."""
    kept_at = [i for i, keep in enumerate(flags) if keep]
    begin = kept_at[piece.skip - 1] + 1 if piece.skip else 0
    end = len(flags) if piece.last else kept_at[piece.skip + piece.take - 1] + 1
    return flags[begin:end]


def _streams(urls, world: int, workers: int, epochs: int, monkeypatch, tokenizer, *, unfiltered=False):
    """Play every (rank, worker) stream of ``epochs`` epochs in this process (the DataLoader would
    give worker w its id; here _worker says so) -> {(epoch, rank, w): [batch metas]}, schedule."""
    cfg = DataConfig(train_shards="::".join(urls), where=WHERE, num_workers=workers, shuffle_buffer=0)
    got, schedule = {}, None
    for rank in range(world):
        ld = build_train_loader(cfg, tokenizer=tokenizer, image_size=8, max_text_length=16, micro_batch_size=MICRO,
                                rank=rank, world_size=world, seed=3, return_keys=True)
        schedule = ld.schedule
        if unfiltered:   # what sizing the epochs from all samples did before
            schedule.kept = None
        k = schedule.workers_of(rank)
        for w in range(k):
            monkeypatch.setattr(loader_mod, "_worker", lambda w=w, k=k: (w, k))
            stream = iter(StreamDataset(schedule, rank, ld.prep, ld.collate, cfg, [None] * k, offset=0))
            total = sum(schedule.worker_batches(e, rank, w) for e in range(epochs))
            for _ in range(total):
                batch = next(stream)
                got.setdefault((batch["_meta"]["epoch"], rank, w), []).append(batch)
    return got, schedule


@pytest.mark.parametrize("world,workers", [(1, 2), (2, 1), (2, 2), (3, 1)])
def test_every_stream_fills_its_quota_in_one_pass_and_counts_exactly(shards, world, workers, monkeypatch,
                                                                       tiny_tokenizer):
    flags = {u: _brute_force(u)[1] for u in shards}
    got, schedule = _streams(shards, world, workers, 2, monkeypatch, tiny_tokenizer)
    last = {}   # (rank, w) -> filtered_out after its previous epoch
    for epoch in range(2):
        delivered = [key for (e, _, _), batches in got.items() if e == epoch for b in batches for key in b["keys"]]
        assert len(delivered) == len(set(delivered)) == schedule.batches(epoch) * world * MICRO   # nothing twice
        for rank in range(world):
            for w in range(schedule.workers_of(rank)):
                if (epoch, rank, w) not in got:   # a stream with no batch in this epoch
                    continue
                mine, batches = schedule.pieces(epoch, rank, w), got[(epoch, rank, w)]
                meta = batches[-1]["_meta"]
                assert meta["opened"] <= len(mine)                   # no shard read a second time
                # brute force: this stream's samples in shard order (no shuffle buffer) up to the
                # quota's last kept one; what the filter dropped before it is filtered_out
                need, dropped = len(batches) * MICRO, 0
                for keep in (f for p in mine for f in _piece_flags(flags[p.url], p)):
                    if need == 0:
                        break
                    need, dropped = (need - 1, dropped) if keep else (need, dropped + 1)
                assert meta["bad"]["filtered_out"] - last.get((rank, w), 0) == dropped
                last[(rank, w)] = meta["bad"]["filtered_out"]


def test_sized_from_all_samples_a_stream_would_read_its_shards_again(shards, monkeypatch, tiny_tokenizer):
    """The test above means something: with the unfiltered counts some stream re-reads."""
    got, schedule = _streams(shards, 2, 2, 1, monkeypatch, tiny_tokenizer, unfiltered=True)
    assert any(batches[-1]["_meta"]["opened"] > len(schedule.pieces(0, r, w)) for (_, r, w), batches in got.items())


def test_counts_are_cached_by_shard_list_index_and_expression(shards, tmp_path, monkeypatch):
    first = fc.kept_counts(shards, WHERE, cache_dir=tmp_path)
    assert len(list((tmp_path / "where-counts").glob("*.json"))) == 1

    def no_walk(*_):
        raise AssertionError("walked the tars again")

    monkeypatch.setattr(fc, "_count", no_walk)
    assert fc.kept_counts(shards, WHERE, cache_dir=tmp_path) == first             # read back
    for other in (lambda: fc.kept_counts(shards, "score >= 0.6", cache_dir=tmp_path),
                  lambda: fc.kept_counts(shards[:4], WHERE, cache_dir=tmp_path)):
        with pytest.raises(AssertionError, match="again"):
            other()
    folder = tmp_path / "copy"
    urls = _write(folder)
    monkeypatch.undo()
    fc.kept_counts(urls, WHERE, cache_dir=tmp_path)
    (folder / "index.json").write_text((folder / "index.json").read_text() + "\n")   # the shards were rewritten
    monkeypatch.setattr(fc, "_count", no_walk)
    with pytest.raises(AssertionError, match="again"):
        fc.kept_counts(urls, WHERE, cache_dir=tmp_path)


def test_remote_shards_under_exact_and_where_are_refused_naming_resampled(shards, tmp_path):
    index = tmp_path / "remote.json"
    index.write_text(json.dumps([{"url": "w-000000.tar", "num_samples": 9}, {"url": "w-000001.tar", "num_samples": 4}]))
    spec = f"pipe:cat {shards[0]}::pipe:cat {shards[1]}"
    cfg = DataConfig(train_shards=spec, where=WHERE, shard_index=str(index))
    with pytest.raises(ConfigError, match=r"2 of 2 are remote.*data.policy=resampled"):
        build_epoch_schedule(cfg, micro_batch_size=MICRO, world_size=1, seed=0, num_workers=1)
    resampled = cfg.model_copy(update={"policy": "resampled"})
    assert build_epoch_schedule(resampled, micro_batch_size=MICRO, world_size=1, seed=0, num_workers=1).kept is None
    nothing = DataConfig(train_shards="::".join(shards), where="score > 5")
    with pytest.raises(ConfigError, match=r"data.where='score > 5' keeps none of the 61 samples"):
        build_epoch_schedule(nothing, micro_batch_size=MICRO, world_size=1, seed=0, num_workers=1)


def test_a_saved_position_with_another_filter_is_refused(shards, tiny_tokenizer):
    def loader(where, state=None):
        cfg = DataConfig(train_shards="::".join(shards), where=where, num_workers=0, shuffle_buffer=4)
        return build_train_loader(cfg, tokenizer=tiny_tokenizer, image_size=8, max_text_length=16,
                                  micro_batch_size=MICRO, rank=0, world_size=1, seed=0, state=state)

    first = loader(WHERE)
    next(iter(first))
    with pytest.raises(ConfigError, match="data.where"):
        loader("score >= 0.6", state=first.state_dict())


def _over_ranks(rank, world, urls, where, cache):
    return fc.kept_counts_over_ranks(urls, where, cache_dir=Path(cache))


def test_counting_split_over_ranks_gives_every_rank_the_counts(shards, tmp_path):
    ranks = run_ranks(_over_ranks, 3, tmp_path / "group", shards, WHERE, str(tmp_path / "run"))
    assert [r.get("value") for r in ranks] == [fc.kept_counts(shards, WHERE)] * 3
    assert len(list((tmp_path / "run" / "where-counts").glob("*.json"))) == 1
    ranks = run_ranks(_over_ranks, 2, tmp_path / "group2", shards, "score > 'x'", str(tmp_path / "run"))
    assert all("WhereError" in r["error"] and "cannot compare" in r["error"] for r in ranks)

"""Resume a data position saved on W ranks on W' ranks (other worker counts and micro batch too).

``build_train_loader(..., state={"remap_from": [s_0, ..., s_{W-1}]})``, ``s_r`` old rank r's
``TrainLoader.state_dict()``. The old ranks have all handed B batches to the trainer; e is the
epoch of the next batch in the old schedule.

At an epoch boundary (B is the first batch of epoch e): nothing of epoch e was delivered, and the
new ranks play epoch e and the following ones exactly as a fresh run on W' ranks does.

Mid-epoch, policy 'exact'. Old stream (r, w) reads its pieces of epoch e (schedule.py: ranges
of shards) through its shuffle buffer in a fixed order and has delivered the first ``taken``
samples of that order. What is left of it (the samples in its buffer, the unread part of its
open piece, the pieces it has not opened) is positions taken..n-1 of the same order, n the
samples of its pieces (under data.where the kept ones: the streams filter as they read). Those
remainders, concatenated in (old rank, old stream) order, are R samples. Every new rank delivers
N_t = R // (W' x micro') batches in epoch e (the transition epoch); new stream (r', w'), in that
order, takes the next (its batches x micro' + its slack) samples of the concatenation --
contiguous ranges of one or a few old orders -- through its own shuffle buffer (seeded by (seed,
"buffer", e, r', w')). It replays an old order up to its range without decoding (tar reads, as
an exact resume does). The surplus R - N_t x W' x micro' is the slack, spread over the new
streams with batches: each leaves the samples its buffer did not hand out. Kept, without bad data:
  * no sample of epoch e's shard list is delivered twice in epoch e, old and new ranks together
    (a shard listed twice by a whole-number weight is two shards, as in any exact epoch);
  * none is left out except ``dropped`` = R - N_t x W' x micro' < W' x micro' samples (one
    micro-batch per new rank), logged and kept in the state (``remap.kept``). The old run's own
    end-of-epoch surplus is not dropped: it is part of R;
  * epochs e+1, ... are those of a fresh W' run: same pieces per stream, same batches in the same
    order (the transition's first batch index is chosen so that epoch e+1 starts at the fresh
    run's index modulo the workers).
With bad data: a bad sample in a range uses up slack, so ``dropped`` is the planned count and
fewer good samples go unseen. A stream whose ranges hold more bad samples than slack reads its
ranges again, as the exact policy does: it repeats that many samples (and counts the bad ones it
meets again) rather than stall the other ranks.

Mid-epoch, policy 'resampled'. The old ranks owed (epoch_batches - delivered) x W x micro
samples of epoch e; the new ranks deliver N_t = that // (W' x micro') batches each, drawn by
fresh streams seeded by (seed, e, rank', w', "remap", W'), then epochs follow W''s
``data.epoch_batches``. Sampling is with replacement: nothing is kept per sample.

Counts. Bad-data counts, samples read and shards opened of all old ranks (their totals,
including what they carried themselves) are carried by new rank 0 and included in its
``bad_data()`` and ``samples_seen``. Shard errors found while replaying an old order are counted
once, by the new stream holding the last range of that old order, and only for pieces the old
stream had not read to their end (the one piece it had open counts twice as opened, in the
denominator of the bad-shard fraction). Under data.where the filtered samples before a position
are counted with it, by whoever takes it from a buffer: once.

Second resume. The new loader's state carries ``remap`` (epoch, first index, batches, the old
positions): it resumes exactly on W' ranks, also inside the transition epoch. A remap to yet
another world size works from a state saved after the transition epoch; inside it, it is refused.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

from rsclip_ds.config import ConfigError
from rsclip_ds.data.bad import BAD_KINDS, DataError, StreamCounter
from rsclip_ds.data.schedule import EpochSchedule, _share, derive_seed
from rsclip_ds.data.tar import read_piece

STATE_VERSION = 3          # 2: + remap, carried, shuffle_buffer; 3: streams read sample ranges (issue 37)
READABLE_VERSIONS = (3,)    # 1 and 2 split whole shards: their positions mean other samples

FIXES = {"version": "resume with an rsclip_ds that reads it; before version 3 the streams split whole shards",
         "seed": "run with the seed of the saved run",
         "policy": "keep data.policy", "shards": "keep data.train_shards / data.train_weights and the shard "
         "sample counts (index JSON)"}


@dataclass
class Remap:
    """Where a remapped run starts: epoch ``epoch`` at batch index ``start``; ``batches`` per new
    rank in that (transition) epoch, None at an epoch boundary (the epoch is played as usual)."""

    epoch: int
    start: int
    batches: int | None
    source: dict | None    # exact, mid-epoch: the old layout and positions the transition reads
    kept: dict             # what the remap kept, for the log line and the state

    def to_state(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> "Remap":
        return cls(**{k: state[k] for k in ("epoch", "start", "batches", "source", "kept")})

    def apply(self, schedule: EpochSchedule) -> None:
        """Anchor ``schedule`` (the new world size's) here and give it the transition's plan."""
        schedule.anchor(self.epoch, self.start, self.batches, self.kept.get("remaining"))
        if self.batches is not None:
            schedule.transition = Transition.build(schedule, self)

    def describe(self) -> str:
        k = self.kept
        head = f"data remap: {k['from_world_size']} -> {k['to_world_size']} rank(s) at epoch {self.epoch}: "
        counts = (f"old ranks' counts carried by rank 0: {k['samples_read']} samples read, "
                  f"{k['bad']} bad")
        if self.batches is None:
            return head + f"at its start: the new ranks play it as a fresh run on {k['to_world_size']} rank(s) does; " + counts
        return head + (f"{k['seen']} samples of the epoch already seen, {k['remaining']} remaining, "
                       f"{k['used']} delivered by the new ranks in {self.batches} batch(es) each, "
                       f"{k['dropped']} dropped for evenness (< {k['to_world_size']} x micro "
                       f"{k['micro']}); " + counts)


@dataclass(frozen=True)
class Segment:
    """Positions [begin, end) of old stream (rank, stream)'s epoch order; its shard errors from
    shard index ``count_from`` on go to the reading stream's counter (None: to none)."""

    rank: int
    stream: int
    begin: int
    end: int
    count_from: int | None


@dataclass
class Transition:
    """How the new streams read the transition epoch: 'exact' ranges of the old streams' orders
    (``segments`` by (rank, stream)), 'resampled' draws salted with ``salt``."""

    epoch: int
    old: EpochSchedule | None
    bufsize: int
    segments: dict[tuple[int, int], list[Segment]]
    salt: tuple = ()

    @classmethod
    def build(cls, schedule: EpochSchedule, remap: Remap) -> "Transition":
        if schedule.policy == "resampled":
            return cls(remap.epoch, None, 0, {}, ("remap", schedule.world_size))
        src = remap.source
        old = schedule.rescaled(src["world_size"], max(src["streams"]), src["micro"])
        units = _units(old, remap.epoch, src)
        return cls(remap.epoch, old, src["shuffle_buffer"], _cut(schedule, remap.epoch, units))

    def samples(self, rank: int, stream: int, counter: StreamCounter, rng: random.Random, bufsize: int,
                shuffle: Callable, keep: Callable | None = None) -> Iterator[dict]:
        """'exact': this stream's raw samples of the transition epoch, through its own buffer;
        read again when bad data left them short (as the exact policy does). ``keep``: data.where
        as the streams apply it while reading (their orders count kept samples)."""
        segments = self.segments.get((rank, stream), [])
        while True:
            got = 0
            for sample in shuffle(self._chain(segments, counter, shuffle, keep), bufsize, rng):
                got += 1
                yield sample
            if not got:
                raise DataError(f"rank {rank} stream {stream}: the old streams' samples it continues in "
                                f"epoch {self.epoch} held no readable sample; check data.train_shards")

    def _chain(self, segments: list[Segment], counter: StreamCounter, shuffle: Callable,
               keep: Callable | None) -> Iterator[dict]:
        for seg in segments:
            yield from self._segment(seg, counter, shuffle, keep)

    def _segment(self, seg: Segment, counter: StreamCounter, shuffle: Callable,
                 keep: Callable | None) -> Iterator[dict]:
        """Replay old stream (seg.rank, seg.stream)'s first pass of the epoch as it read it (same
        pieces, same buffer seed) and yield positions [begin, end), undecoded."""
        pieces, scratch, carry = self.old.pieces(self.epoch, seg.rank, seg.stream), StreamCounter({}), [0]

        def read() -> Iterator[dict]:
            for i, p in enumerate(pieces):
                counts = seg.count_from is not None and i >= seg.count_from
                yield from read_piece(p.url, counter if counts else scratch, p.skip, p.take, p.last, keep, carry)

        rng = random.Random(derive_seed(self.old.seed, "buffer", self.epoch, seg.rank, seg.stream))
        order = shuffle(read(), self.bufsize, rng)
        try:
            for n, sample in enumerate(order):
                if n >= seg.end:
                    return
                if n >= seg.begin:
                    yield sample
        finally:
            order.close()


def _units(old: EpochSchedule, epoch: int, src: dict) -> list[tuple[int, int, int, int, int]]:
    """(old rank, old stream, samples taken, samples left, shards read to the end) per old stream."""
    units = []
    for r, (taken_r, closed_r) in enumerate(zip(src["taken"], src["closed"])):
        for s, (taken, closed) in enumerate(zip(taken_r, closed_r)):
            size = sum(p.take for p in old.pieces(epoch, r, s))
            units.append((r, s, taken, max(0, size - taken), closed))
    return units


def _cut(schedule: EpochSchedule, epoch: int, units: list) -> dict[tuple[int, int], list[Segment]]:
    """New stream (r', w') after new stream: the next quota x micro samples of the concatenated
    remainders, plus its part of the surplus (slack: a bad sample uses it up instead of making the
    stream read its ranges again). The last range of each old stream counts its shard errors."""
    needs = {(r, w): schedule.worker_batches(epoch, r, w) * schedule.micro
             for r in range(schedule.world_size) for w in range(schedule.workers_of(r))}
    busy = [key for key, need in needs.items() if need]
    surplus = sum(u[3] for u in units) - sum(needs.values())
    for i, key in enumerate(busy):
        needs[key] += surplus // len(busy) + (i < surplus % len(busy))
    cuts: dict[tuple[int, int], list[list]] = {}
    last: dict[int, list] = {}
    u = off = 0                      # unit and offset in its remainder of the next free sample
    for key, need in needs.items():
        cuts[key] = []
        while need:
            orank, ostream, taken, left, _ = units[u]
            n = min(need, left - off)
            if n:
                piece = [orank, ostream, taken + off, taken + off + n, None]
                cuts[key].append(piece)
                last[u] = piece
                off, need = off + n, need - n
            if off == left:
                u, off = u + 1, 0
    for i, piece in last.items():
        piece[4] = units[i][4]
    return {key: [Segment(*p) for p in pieces] for key, pieces in cuts.items()}


# --------------------------------------------------------------------------- from saved states

def _check_saved(saved: list, schedule: EpochSchedule) -> None:
    if not isinstance(saved, list) or not saved:
        raise ValueError("remap_from must list every old rank's saved data state, ordered by old rank")
    mine = {"version": STATE_VERSION, "seed": schedule.seed, "policy": schedule.policy, "shards": schedule.digest()}
    diffs, world = [], len(saved)
    for r, st in enumerate(saved):
        if (st.get("rank"), st.get("world_size")) != (r, world):
            diffs.append(f"entry {r} is rank {st.get('rank')} of {st.get('world_size')} (pass all {world} old "
                         f"ranks' states in rank order, each as saved)")
        for key, fix in FIXES.items():
            got = STATE_VERSION if key == "version" and st.get(key) in READABLE_VERSIONS else st.get(key)
            if got != mine[key]:
                diffs.append(f"{key}: saved {got!r} (rank {r}), now {mine[key]!r} ({fix})")
    if len({st.get("batches") for st in saved}) > 1:
        diffs.append(f"the old ranks were at different batches {[st.get('batches') for st in saved]} (pass the "
                     "states of one checkpoint)")
    if diffs:
        raise ConfigError("cannot remap the data position: " + "; ".join(dict.fromkeys(diffs)) +
                         ". Or start the data from scratch without the saved data state.")


def _old_schedule(saved: list, schedule: EpochSchedule) -> EpochSchedule:
    streams = [len(st["streams"]) for st in saved]
    old = schedule.rescaled(len(saved), max(streams), int(saved[0]["micro_batch_size"]))
    if old.policy == "resampled":
        old.epoch_batches = int(saved[0]["epoch_batches"])
    wrong = [r for r in range(len(saved)) if old.workers_of(r) != streams[r]]
    if wrong:
        raise ConfigError(f"cannot remap the data position: old ranks {wrong} saved {[streams[r] for r in wrong]} "
                         "stream(s), which their shards cannot give; pass the states as saved")
    if saved[0].get("remap"):      # the old run was itself remapped: its batch indices are anchored
        Remap.from_state(saved[0]["remap"]).apply(old)
    return old


def _carried(saved: list) -> dict:
    """The old ranks' totals (each rank's own state totals include what it carried)."""
    return {"bad": {k: sum(int(st["bad"].get(k, 0)) for st in saved) for k in BAD_KINDS},
            "samples": sum(int(st["samples_seen"]) for st in saved),
            "shards": sum(sum(int(s["shards"]) for s in st["streams"] if s) + int(st.get("carried", {}).get("shards", 0))
                          for st in saved)}


def remap_state(saved: list[dict], schedule: EpochSchedule, rank: int, shuffle_buffer: int) -> tuple[Remap, dict]:
    """Old ranks' states (by old rank) -> (the Remap to apply to ``schedule``, the new world
    size's, and what this rank carries of the old counts: all on rank 0, zeros elsewhere).
    ``shuffle_buffer``: the old streams' buffer when their states do not say it."""
    _check_saved(saved, schedule)
    old, batches = _old_schedule(saved, schedule), int(saved[0]["batches"])
    e = old.first
    while old.start(e + 1) <= batches:
        e += 1
    if old.transition is not None and e == old.transition.epoch:
        raise ConfigError(f"cannot remap the data position: the saved states are inside epoch {e}, the transition "
                         f"epoch of an earlier remap (batch {batches} of {old.start(e)}..{old.start(e + 1) - 1}); "
                         f"resume on {old.world_size} rank(s) until epoch {e} ends, then remap")
    done = batches - old.start(e)    # batches each old rank delivered in epoch e
    carried = _carried(saved)
    fresh = schedule.rescaled(schedule.world_size, schedule.num_workers, schedule.micro)
    kept = {"from_world_size": old.world_size, "to_world_size": schedule.world_size, "micro": schedule.micro,
            "samples_read": carried["samples"], "bad": sum(carried["bad"].values())}
    if done == 0:
        remap = Remap(e, fresh.start(e), None, None, kept)
    else:
        source, seen, remaining = _positions(saved, old, e, done, shuffle_buffer)
        n = remaining // (schedule.world_size * schedule.micro)
        used = n * schedule.world_size * schedule.micro
        period = math.lcm(*(schedule.workers_of(r) for r in range(schedule.world_size)))
        start = fresh.start(e + 1) - n      # epoch e+1 then starts where a fresh run's does (mod workers)
        kept.update(seen=seen, remaining=remaining, used=used, dropped=remaining - used)
        remap = Remap(e, start if start >= 0 else start % period, n, source, kept)
    zero = {"bad": dict.fromkeys(BAD_KINDS, 0), "samples": 0, "shards": 0}
    return remap, (carried if rank == 0 else zero)


def _positions(saved: list, old: EpochSchedule, e: int, done: int, shuffle_buffer: int) -> tuple[dict | None, int, int]:
    """(source, samples of epoch e the old ranks delivered, samples of it left)."""
    if old.policy == "resampled":
        per_batch = old.world_size * old.micro
        return None, done * per_batch, (old.batches(e) - done) * per_batch
    taken, closed = [], []
    for r, st in enumerate(saved):
        k = old.workers_of(r)
        row_t, row_c = [], []
        for s, pos in enumerate(st["streams"]):
            share = _share(old.start(e), done, k, s)
            here = pos is not None and int(pos["epoch"]) == e
            if (int(pos["done"]) if here else 0) != share or (pos is not None and int(pos["epoch"]) > e):
                raise ConfigError(f"cannot remap the data position: old rank {r} stream {s} saved {pos and pos['done']} "
                                 f"batch(es) of epoch {pos and pos['epoch']}, its schedule says {share} of epoch "
                                 f"{e}; pass the states as saved, of one checkpoint")
            row_t.append(int(pos["taken"]) if here else 0)
            row_c.append(int(pos["closed"]) if here else 0)
        taken.append(row_t)
        closed.append(row_c)
    bufsize = saved[0].get("shuffle_buffer", shuffle_buffer)
    source = {"world_size": old.world_size, "streams": [len(st["streams"]) for st in saved], "micro": old.micro,
              "shuffle_buffer": bufsize, "taken": taken, "closed": closed}
    units = _units(old, e, source)
    return source, sum(u[2] for u in units), sum(u[3] for u in units)


"""The epoch schedule: which samples each (rank, worker) stream reads, and how many batches it
delivers, in every epoch. Pure and rank-independent: every rank computes the same schedule.

Policy 'exact': epoch e shuffles the shard list with seed (seed, e), the same on every rank, and
reads it as one sequence of N samples (N: the shards' counts; under data.where the samples the
filter keeps, ``kept``, counted at start-up by filter_counts.py). Every rank delivers

    n = N // (W x micro)                       batches per rank, every epoch

so an epoch covers all but N mod (W x micro) < one global batch of its samples, whatever the
worker count and shard sizes. Batch i of a rank (counted from the run's start) comes from worker
i % K (the DataLoader's round robin), so stream (r, w) owes share(start_e, n, K, w) batches; the
streams, in (rank, worker) order, take consecutive ranges of the sequence of exactly that many
samples, plus an even part of the remainder (slack: a bad sample uses it up, and the shuffle
buffer decides which samples the epoch leaves out). A range is a list of ``Piece``s (shard, skip,
take): a shard may be split between streams, each reading its part (tar.read_piece seeks over
the samples before it). A worker may have no batch in an epoch with fewer batches than workers.
Policy 'resampled': every worker draws shards with replacement from its own seeded generator, and
an epoch is ``data.epoch_batches`` batches per rank. Both never run a rank dry, so no collective
hangs.

Batch indices. The epochs' first indices (``start``) decide which worker fills which batch. A run
resumed on another world size (remap.py) anchors its schedule: it starts in epoch ``first`` at a
given index, that transition epoch has a fixed batch count, and later epochs follow from there.
``coverage(e)`` says what an epoch delivers, without reading a sample.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import random
from dataclasses import dataclass, field, replace
from typing import Iterator, NamedTuple

from rsclip_ds.config import ConfigError, DataConfig
from rsclip_ds.data.bad import DataError
from rsclip_ds.data.filter_counts import kept_counts
from rsclip_ds.data.sources import expand_sources, shard_counts


def derive_seed(*parts) -> int:
    """Stable 63-bit seed from ints/strings (Python's hash() of str is salted per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _share(start: int, n: int, k: int, w: int) -> int:
    """How many of the batch indices start..start+n-1 fall to worker w of k (i % k == w)."""
    def below(x: int) -> int:
        return max(0, (x - w + k - 1) // k)
    return below(start + n) - below(start)


class Piece(NamedTuple):
    """Samples skip..skip+take-1 of a shard (counted among those data.where keeps, when set);
    ``last``: the piece ends at the shard's end (it reads on to the end: a break there, more
    samples than counted)."""
    url: str
    skip: int
    take: int
    last: bool


def cut(order: list[str], counts: dict[str, int], needs: list[int]) -> list[list[Piece]]:
    """Consecutive ranges of the samples of ``order`` (shards of ``counts`` samples), ``needs[j]``
    samples for range j (sum(needs) <= the samples), as pieces. A shard of no sample goes with the
    range being filled where it comes (its reader reports an empty tar)."""
    ranges: list[list[Piece]] = [[] for _ in needs]
    j, left, filled = -1, 0, -1     # the range being filled, what it still needs, the last one given samples
    for url in order:
        count, skip = counts[url], 0
        while skip < count or (count == 0 and skip == 0):
            while left == 0 and j + 1 < len(needs):
                j, left = j + 1, needs[j + 1]
            if count == 0:              # with the range being filled, or the last one when all are full
                ranges[j if left else filled].append(Piece(url, 0, 0, True))
                break
            if left == 0:
                return ranges           # the rest of the epoch is left out (sum(needs) < samples)
            take = min(left, count - skip)
            ranges[j].append(Piece(url, skip, take, skip + take == count))
            skip, left, filled = skip + take, left - take, j
    return ranges


@dataclass
class EpochSchedule:
    """Which samples each (rank, worker) stream reads and how many batches it delivers, per epoch.
    Pure and rank-independent: every rank computes the same schedule."""

    sources: list[list[str]]
    weights: list[float]
    policy: str
    seed: int
    world_size: int
    num_workers: int            # per rank; 0: the rank loads in its main process (one stream)
    micro: int
    counts: dict[str, int] | None = None
    kept: dict[str, int] | None = None     # 'exact' + data.where: samples the filter keeps per shard
    where: str = ""                        # ... and the filter
    epoch_batches: int | None = None
    first: int = 0              # first epoch played (a remapped run starts in its transition epoch)
    fixed: dict[int, int] = field(default_factory=dict)      # epoch -> batches per rank, set by a remap
    remaining: int | None = None   # samples of the transition epoch left to the new ranks (coverage)
    transition: object = None   # remap.Transition: how the streams read the remap's transition epoch
    _starts: list[int] = field(default_factory=lambda: [0])   # first batch index of epoch first, first+1, ...
    _orders: dict[int, list[str]] = field(default_factory=dict)  # epoch -> shuffled shard list
    _pieces: dict[int, list[list[Piece]]] = field(default_factory=dict)  # epoch -> ranges in (rank, worker) order

    def __post_init__(self):
        if self.policy == "exact":   # whole-number weights repeat a source's shards
            self.urls = [u for src, wt in zip(self.sources, self.weights) for _ in range(int(wt)) for u in src]
        else:
            self.urls = [u for src in self.sources for u in src]

    @property
    def sizes(self) -> dict[str, int]:
        """Samples per shard that size the epochs: the kept ones under data.where."""
        return self.counts if self.kept is None else self.kept

    @property
    def total(self) -> int:
        """Samples in one epoch's data (a shard listed twice by a weight counts twice)."""
        sizes = self.sizes
        return sum(sizes[u] for u in self.urls)

    def workers_of(self, rank: int) -> int:
        """Worker streams of ``rank`` (1 when the rank loads in its main process); the same on
        every rank, whatever the shard count."""
        return max(1, self.num_workers)

    def order(self, epoch: int) -> list[str]:
        """'exact': the epoch's shuffle of the whole shard list, seeded by (seed, epoch), the same
        on every rank (computed once, the last three kept)."""
        if epoch not in self._orders:
            if len(self._orders) > 2:
                self._orders.pop(min(self._orders))
            order = list(self.urls)
            random.Random(derive_seed(self.seed, "shards", epoch)).shuffle(order)
            self._orders[epoch] = order
        return self._orders[epoch]

    def pieces(self, epoch: int, rank: int, worker: int) -> list[Piece]:
        """'exact' only: the samples stream (rank, worker) reads in ``epoch`` (see the module doc)."""
        if epoch not in self._pieces:
            if len(self._pieces) > 2:
                self._pieces.pop(min(self._pieces))
            self._pieces[epoch] = cut(self.order(epoch), self.sizes, self._needs(epoch))
        return self._pieces[epoch][rank * self.workers_of(rank) + worker]

    def _needs(self, epoch: int) -> list[int]:
        """Samples per stream, (rank, worker) order: its batches x micro, plus its part of the slack."""
        k, start, n = self.workers_of(0), self.start(epoch), self.batches(epoch)
        needs = [_share(start, n, k, w) * self.micro for _ in range(self.world_size) for w in range(k)]
        busy = [j for j, need in enumerate(needs) if need]
        slack = max(0, self.total - sum(needs))
        for i, j in enumerate(busy):
            needs[j] += slack // len(busy) + (i < slack % len(busy))
        return needs

    def shards(self, epoch: int, rank: int, worker: int) -> list[str]:
        """'exact' only: the shards stream (rank, worker) reads (a part of) in ``epoch``, in order."""
        return [p.url for p in self.pieces(epoch, rank, worker)]

    def draw(self, epoch: int, rank: int, worker: int, salt: tuple = ()) -> Iterator[str]:
        """'resampled' only: endless shard draws, source by weight, then uniform within it.
        ``salt`` tells a remap's transition epoch apart from the old ranks' draws."""
        rng = random.Random(derive_seed(self.seed, "resample", epoch, rank, worker, *salt))
        cum = list(itertools.accumulate(self.weights))
        while True:
            src = self.sources[bisect.bisect_right(cum, rng.random() * cum[-1])]
            yield src[rng.randrange(len(src))]

    def batches(self, epoch: int) -> int:
        """Batches every rank delivers in ``epoch``."""
        return self.start(epoch + 1) - self.start(epoch)

    def start(self, epoch: int) -> int:
        """Index (within the rank) of the first batch of ``epoch``."""
        if epoch < self.first:
            raise ValueError(f"epoch {epoch} comes before epoch {self.first}, where this (remapped) schedule starts")
        while len(self._starts) <= epoch - self.first:
            e = self.first + len(self._starts) - 1
            if e in self.fixed:    # a remap's transition epoch: 0 batches is allowed there
                n = self.fixed[e]
            elif self.policy == "resampled":
                n = self.epoch_batches
            else:
                n = self.total // (self.world_size * self.micro)
                if n == 0:
                    raise DataError(self.too_small())
            self._starts.append(self._starts[-1] + n)
        return self._starts[epoch - self.first]

    def epoch_of(self, index: int) -> int:
        """The epoch that batch ``index`` of a rank (counted from the run's start) belongs to."""
        epoch = self.first
        while self.start(epoch + 1) <= index:
            epoch += 1
        return epoch

    def too_small(self) -> str:
        """'exact': why an epoch makes no batch, with the numbers and the fixes."""
        n, w, m = self.total, self.world_size, self.micro
        kept = f" that data.where={self.where!r} keeps" if self.kept is not None else ""
        fixes = [f"set batch.micro_batch_size to {n // w} or less ({n:,} // {w} rank(s))" if n >= w else None,
                 f"launch {n // m} rank(s) or fewer ({n:,} // micro {m})" if n >= m else None, "add data",
                 "use data.policy=resampled with data.epoch_batches (samples drawn with replacement)"]
        return (f"the {n:,} training samples{kept} hold no global batch of {w} rank(s) x micro batch {m} = "
                f"{w * m:,} samples, and data.policy=exact draws every epoch's batches from its samples once. "
                f"Fix: {', or '.join(f for f in fixes if f)}")

    def anchor(self, epoch: int, start: int, batches: int | None = None, remaining: int | None = None) -> None:
        """Start the schedule in ``epoch`` at batch index ``start``; ``batches``: that epoch's
        fixed batch count per rank (a remap's transition epoch, ``remaining`` samples left to it),
        None: computed as usual."""
        self.first, self._starts, self._pieces = epoch, [start], {}
        self.fixed = {} if batches is None else {epoch: batches}
        self.remaining = remaining if batches is not None else None

    def rescaled(self, world_size: int, num_workers: int, micro: int) -> "EpochSchedule":
        """The same data and seed on another world size / workers / micro batch, from epoch 0."""
        return replace(self, world_size=world_size, num_workers=num_workers, micro=micro, first=0, fixed={},
                       remaining=None, transition=None, _starts=[0], _orders={}, _pieces={})

    def worker_batches(self, epoch: int, rank: int, worker: int) -> int:
        n = self.start(epoch + 1) - self.start(epoch)
        return _share(self.start(epoch), n, self.workers_of(rank), worker)

    def coverage(self, epoch: int) -> dict:
        """What ``epoch`` delivers, from the counts alone: batches per rank, the samples they hold
        over all ranks, the samples of the epoch's data (kept by data.where; for a remap's
        transition epoch those left to the new ranks) and the fraction delivered ('resampled'
        draws with replacement: samples drawn / samples in the data, which may pass 1).
        ``refused``: why 'exact' makes no batch of this data (the DataError a run stops with), or None."""
        per_batch = self.world_size * self.micro
        try:
            n, refused = self.batches(epoch), None
        except DataError as err:
            n, refused = 0, str(err)
        transition = epoch in self.fixed
        data = self.remaining if transition else (self.total if self.counts is not None else None)
        delivered = n * per_batch
        return {"epoch": epoch, "policy": self.policy, "batches_per_rank": n, "global_batch": per_batch,
                "samples": delivered, "epoch_samples": data, "transition": transition,
                "coverage": delivered / data if data else None, "refused": refused}

    def describe(self, epoch: int) -> str:
        """One line for the start-up log: 'epoch 0: 34 batches per rank = 8,704 of 8,734 samples (99.7 %)'."""
        c = self.coverage(epoch)
        if c["refused"]:
            return f"epoch {epoch}: no batch: {c['refused']}"
        head = f"epoch {epoch}: {c['batches_per_rank']:,} batches per rank = {c['samples']:,}"
        if c["epoch_samples"] is None:
            return f"{head} samples drawn with replacement (data.policy=resampled)"
        pct = f"{100 * c['coverage']:.1f} %"
        if self.policy == "resampled":
            return f"{head} samples drawn with replacement from {c['epoch_samples']:,} ({pct}, data.policy=resampled)"
        if c["transition"]:
            return f"{head} of the {c['epoch_samples']:,} samples left at the remap ({pct})"
        kept = " kept by data.where" if self.kept is not None else ""
        return f"{head} of {c['epoch_samples']:,} samples{kept} ({pct})"

    def digest(self) -> str:
        counts = [self.counts.get(u) for u in self.urls] if self.counts else None
        what = [self.sources, self.weights, counts]
        if self.kept is not None:   # (appended: a run without data.where keeps its digest)
            what += [self.where, [self.kept.get(u) for u in self.urls]]
        return hashlib.blake2b(json.dumps(what).encode(), digest_size=8).hexdigest()


def build_epoch_schedule(cfg: DataConfig, *, micro_batch_size: int, world_size: int, seed: int,
                         num_workers: int | None = None, read_counts=shard_counts,
                         read_kept=kept_counts) -> EpochSchedule:
    """Shard list, weights and counts -> the schedule every rank shares (validates the combination).
    ``num_workers``: workers per rank, resolved (build_train_loader sizes data.num_workers=auto);
    default cfg.num_workers, which must then be a number. ``read_counts(urls, shard_index)``:
    shard_counts, or shard_counts_from_rank0 in a multi-rank run. ``read_kept(urls, where,
    shard_index)``: 'exact' + data.where, the samples the filter keeps per shard (filter_counts.py:
    kept_counts, or kept_counts_over_ranks in a multi-rank run). Under 'exact', data that holds no
    global batch is a DataError naming the numbers and the fixes when an epoch's size is first
    asked for (``start``; the loader asks before its first batch, ``coverage`` says it)."""
    workers = cfg.num_workers if num_workers is None else num_workers
    if not isinstance(workers, int):
        raise ValueError(f"data.num_workers={workers!r}: pass the resolved worker count as num_workers "
                         "(build_train_loader sizes 'auto')")
    if cfg.train_shards is None:
        raise ConfigError("data.train_shards is not set; point it at tar shards "
                         "(e.g. --set data.train_shards='data/train-{000000..000007}.tar')")
    sources = expand_sources(cfg.train_shards)
    weights = list(cfg.train_weights) if cfg.train_weights is not None else [1.0] * len(sources)
    if len(weights) != len(sources) or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"data.train_weights {cfg.train_weights} needs one non-negative weight per "
                         f"'::'-separated source of data.train_shards ({len(sources)}), not all zero")
    if cfg.policy == "exact" and any(w != int(w) for w in weights):
        raise ConfigError(f"data.train_weights {weights}: with data.policy=exact a weight is how often a "
                         "source's shards appear per epoch, a whole number; use data.policy=resampled "
                         "for fractional weights")
    schedule = EpochSchedule(sources, weights, cfg.policy, seed, world_size, workers, micro_batch_size)
    if cfg.policy == "exact" or cfg.epoch_batches is None:
        schedule.counts = read_counts(schedule.urls, cfg.shard_index)
    if cfg.policy == "exact" and cfg.where:
        schedule.kept, schedule.where = read_kept(schedule.urls, cfg.where, cfg.shard_index), cfg.where
        if not sum(schedule.kept.values()):
            raise ConfigError(f"data.where={cfg.where!r} keeps none of the {sum(schedule.counts.values())} "
                              f"samples of the {len(schedule.kept)} shard(s) (their JSON members); check the "
                              "filter against a sample's JSON (`tar -xOf SHARD KEY.json`)")
    if cfg.policy == "resampled":
        schedule.epoch_batches = cfg.epoch_batches or sum(schedule.counts.values()) // (world_size * micro_batch_size)
        if schedule.epoch_batches < 1:
            raise ConfigError(f"{sum(schedule.counts.values())} samples make no batch of {micro_batch_size} per "
                             f"rank on {world_size} ranks; set data.epoch_batches")
    return schedule

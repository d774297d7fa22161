"""The epoch schedule: which shards each (rank, worker) stream reads, and how many batches it
delivers, in every epoch. Pure and rank-independent: every rank computes the same schedule.

Policy 'exact': epoch e shuffles the shard list with seed (seed, e), the same on every rank;
rank r takes shards[r::W], worker w takes [w::K]. Every rank delivers the same number N_e of
batches in epoch e: the largest N that every stream can fill, given that the DataLoader takes
batch i of the rank from worker i % K. What a fuller stream holds beyond its share is dropped for
that epoch (less than about one shard per stream); the next epoch's reshuffle drops other
samples. Under data.where the counts that size the epoch are the samples the filter keeps
(``kept``, counted at start-up by filter_counts.py), so a filtered stream fills its quota in one
pass over its shards. Policy 'resampled': every worker draws shards with replacement from its own seeded
generator, and an epoch is ``data.epoch_batches`` batches per rank. Both never run a rank dry, so
no collective hangs.

Batch indices. Batch i of a rank (counted from the run's start) comes from worker i % K, so the
epochs' first indices (``start``) decide which worker fills which batch. A run resumed on another
world size (remap.py) anchors its schedule: it starts in epoch ``first`` at a given index, that
transition epoch has a fixed batch count, and later epochs follow from there as usual.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import random
from dataclasses import dataclass, field, replace
from typing import Iterator

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


@dataclass
class EpochSchedule:
    """Which shards each (rank, worker) stream reads and how many batches it delivers, per epoch.
    Pure and rank-independent: every rank computes the same schedule."""

    sources: list[list[str]]
    weights: list[float]
    policy: str
    seed: int
    world_size: int
    num_workers: int            # requested per rank; 'exact' clamps it per rank (workers_of)
    micro: int
    counts: dict[str, int] | None = None
    kept: dict[str, int] | None = None     # 'exact' + data.where: samples the filter keeps per shard
    where: str = ""                        # ... and the filter
    epoch_batches: int | None = None
    first: int = 0              # first epoch played (a remapped run starts in its transition epoch)
    fixed: dict[int, int] = field(default_factory=dict)      # epoch -> batches per rank, set by a remap
    transition: object = None   # remap.Transition: how the streams read the remap's transition epoch
    _starts: list[int] = field(default_factory=lambda: [0])   # first batch index of epoch first, first+1, ...
    _orders: dict[int, list[str]] = field(default_factory=dict)  # epoch -> shuffled shard list

    def __post_init__(self):
        if self.policy == "exact":   # whole-number weights repeat a source's shards
            self.urls = [u for src, wt in zip(self.sources, self.weights) for _ in range(int(wt)) for u in src]
        else:
            self.urls = [u for src in self.sources for u in src]

    def workers_of(self, rank: int) -> int:
        """Worker streams of ``rank`` (1 when the rank loads in its main process)."""
        k = max(1, self.num_workers)
        if self.policy == "exact":
            return max(1, min(k, len(range(rank, len(self.urls), self.world_size))))
        return k

    def shards(self, epoch: int, rank: int, worker: int) -> list[str]:
        """'exact' only: the shards of this stream in this epoch: the epoch's shuffle of the whole
        list (seeded by (seed, epoch), the same on every rank, computed once), rank r's share
        [r::W], then worker w's share of that [w::K]."""
        if epoch not in self._orders:
            if len(self._orders) > 2:
                self._orders.pop(min(self._orders))
            order = list(self.urls)
            random.Random(derive_seed(self.seed, "shards", epoch)).shuffle(order)
            self._orders[epoch] = order
        return self._orders[epoch][rank::self.world_size][worker::self.workers_of(rank)]

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

    def _rank_batches(self, epoch: int, rank: int, start: int) -> int:
        k, counts = self.workers_of(rank), self.counts if self.kept is None else self.kept
        caps = [sum(counts[u] for u in self.shards(epoch, rank, w)) // self.micro for w in range(k)]
        lo, hi = 0, sum(caps)        # largest n such that every worker can fill its share
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if all(_share(start, mid, k, w) <= caps[w] for w in range(k)):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def start(self, epoch: int) -> int:
        """Index (within the rank) of the first batch of ``epoch``."""
        if epoch < self.first:
            raise ValueError(f"epoch {epoch} comes before epoch {self.first}, where this (remapped) schedule starts")
        while len(self._starts) <= epoch - self.first:
            e = self.first + len(self._starts) - 1
            at = self._starts[-1]
            if e in self.fixed:    # a remap's transition epoch: 0 batches is allowed there
                n = self.fixed[e]
            else:
                n = self.epoch_batches if self.policy == "resampled" else \
                    min(self._rank_batches(e, r, at) for r in range(self.world_size))
                if n == 0:
                    kept = f" that data.where={self.where!r} keeps" if self.kept is not None else ""
                    raise DataError(f"epoch {e}: some rank/worker stream holds fewer than micro_batch_size="
                                    f"{self.micro} samples{kept}; write more or smaller shards, lower "
                                    "data.num_workers or the micro batch")
            self._starts.append(at + n)
        return self._starts[epoch - self.first]

    def anchor(self, epoch: int, start: int, batches: int | None = None) -> None:
        """Start the schedule in ``epoch`` at batch index ``start``; ``batches``: that epoch's
        fixed batch count per rank (a remap's transition epoch), None: computed as usual."""
        self.first, self._starts = epoch, [start]
        self.fixed = {} if batches is None else {epoch: batches}

    def rescaled(self, world_size: int, num_workers: int, micro: int) -> "EpochSchedule":
        """The same data and seed on another world size / workers / micro batch, from epoch 0."""
        return replace(self, world_size=world_size, num_workers=num_workers, micro=micro, first=0, fixed={},
                       transition=None, _starts=[0], _orders={})

    def worker_batches(self, epoch: int, rank: int, worker: int) -> int:
        n = self.start(epoch + 1) - self.start(epoch)
        return _share(self.start(epoch), n, self.workers_of(rank), worker)

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
    kept_counts, or kept_counts_over_ranks in a multi-rank run)."""
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
    elif len(schedule.urls) < world_size:
        raise ConfigError(f"{len(schedule.urls)} training shard(s) cannot feed {world_size} ranks: each rank "
                         "needs at least one. Write more, smaller shards (`rsclip-ds make-shards "
                         "--shard-size` / `make-synthetic --shard-size` smaller), use data.policy=resampled, "
                         "or launch fewer ranks.")
    return schedule


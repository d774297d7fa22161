"""Perceptual hashes of images and an exact index over them: near-duplicates between training
data and evaluation sets (``rsclip-ds check-leakage``, ``make-shards --exclude-near``).

Two pHashes per image (imagehash's DCT hash of the grey image), from one decode:

    coarse   64 bits (8 x 8 DCT of a 32 px thumbnail): the index key, ``max_distance`` bits apart at most
    fine    256 bits (16 x 16 DCT of a 64 px thumbnail): the check, ``max_fine_distance`` at most

A pair is a match when both hold. The coarse hash alone catches re-encoded and resized copies
but also pairs of distinct images whose low frequencies agree -- flat scenes (water, desert,
snow) with a feature in the same place; the fine hash sees the texture that tells them apart.
On synthetic scenes the 64-bit hash alone paired about 100 times more distinct scenes than both
together, which still find 95-100% of re-encoded, resized and brightened copies
(docs/results/data.md#leakage). JPEGs are decoded at a reduced
DCT scale, at least 128 px a side (PIL's draft: about 2x faster at 256 px; the fine hash needs
64 px): the hash then differs from a full decode's by about as much as a PNG copy's does.

The index is multi-index hashing (Norouzi, Punjani and Fleet, CVPR 2012), exact: the 64 bits are
cut into m = ``max_distance // 2 + 1`` bands; two hashes at most d = ``max_distance`` bits apart
differ in at most floor(d / m) <= 1 bit of some band (pigeonhole: otherwise every band holds
2 or more of their differing bits, 2m > d in all), so looking up each band of a query, and its
one-bit neighbours, in a sorted array of the indexed hashes' bands yields every match -- no
misses. At d = 10 that is 6 bands of 10-11 bits, 12 probes each: ~1,300 candidates per query
against 30,000 uniform hashes instead of 30,000 (the pigeonhole form with d + 1 exact bands
compared ~6,000). It is numpy throughout (sorted arrays, searchsorted, a popcount per candidate),
a batch of queries at a time. A BK-tree is the other exact choice; its queries walk a tree node
by node in Python, and at a radius of 10 in 64 bits they visit a large part of it.
``brute_force_pairs`` is the reference twin the tests hold the index to.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

DRAFT_SIDE = 128             # JPEGs decode at a DCT scale that keeps at least this many pixels a side
MAX_DISTANCE = 10            # coarse (64-bit) bits, the index radius
MAX_FINE_DISTANCE = 40       # fine (256-bit) bits
FINE_WORDS = 4               # the fine hash as 4 uint64
HASH_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


def _bits(hash_) -> np.ndarray:
    """imagehash's boolean (n, n) array -> its bits as big-endian uint64 words."""
    return np.frombuffer(np.packbits(hash_.hash.reshape(-1)).tobytes(), dtype=">u8").astype(np.uint64)


def image_hashes(data: bytes) -> tuple[int, np.ndarray]:
    """Encoded image bytes -> (coarse 64-bit pHash, fine 256-bit pHash as 4 uint64).
    Raises what PIL raises for bytes that are not a readable image (HASH_ERRORS)."""
    import imagehash

    with Image.open(io.BytesIO(data)) as img:
        img.draft("L", (DRAFT_SIDE, DRAFT_SIDE))    # JPEG only: the grey channel at a DCT scale
        grey = img.convert("L")
    coarse = _bits(imagehash.phash(grey, hash_size=8))
    fine = _bits(imagehash.phash(grey, hash_size=16))
    return int(coarse[0]), fine


def hash_version() -> str:
    import imagehash

    return (f"imagehash {imagehash.__version__} phash: 64 bits (index) + 256 bits (check) of the grey "
            f"image, JPEGs drafted to >= {DRAFT_SIDE} px")


# --------------------------------------------------------------------------- the index

def band_layout(max_distance: int, bits: int = 64) -> tuple[list[tuple[int, int]], int]:
    """-> ([(shift, width)] of max_distance // 2 + 1 contiguous bit ranges covering ``bits``, widths
    differing by 1 at most; the radius each band is probed within: max_distance // bands, 0 or 1)."""
    if not 0 <= max_distance < bits:
        raise ValueError(f"max distance {max_distance}: the index needs 0 <= max distance < {bits}")
    bands = max_distance // 2 + 1
    widths = [bits // bands + (i < bits % bands) for i in range(bands)]
    shifts = np.cumsum([0] + widths[:-1])
    return [(int(s), w) for s, w in zip(shifts, widths)], max_distance // bands


def _band(values: np.ndarray, shift: int, width: int) -> np.ndarray:
    return (values >> np.uint64(shift)) & np.uint64((1 << width) - 1)


def _expand(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per query q the range [lo[q], hi[q]) of a sorted array -> (query index, position) per entry."""
    counts = hi - lo
    query = np.repeat(np.arange(len(lo)), counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return query, np.arange(len(query)) - starts + np.repeat(lo, counts)


@dataclass(frozen=True)
class Matches:
    """Pairs (query i, indexed j) within both distances, sorted by (i, j)."""
    query: np.ndarray       # (P,) int64
    index: np.ndarray       # (P,) int64
    distance: np.ndarray    # (P,) coarse bits apart
    fine: np.ndarray        # (P,) fine bits apart


class HashIndex:
    """Exact radius search over ``coarse`` (N,) uint64 hashes, checked with ``fine`` (N, 4)."""

    def __init__(self, coarse: np.ndarray, fine: np.ndarray, max_distance: int = MAX_DISTANCE,
                 max_fine_distance: int = MAX_FINE_DISTANCE):
        if not 0 <= max_fine_distance <= 64 * FINE_WORDS:
            raise ValueError(f"max fine distance {max_fine_distance}: needs 0..{64 * FINE_WORDS}")
        self.coarse = np.asarray(coarse, np.uint64).reshape(-1)
        self.fine = np.asarray(fine, np.uint64).reshape(-1, FINE_WORDS)
        self.max_distance, self.max_fine_distance = max_distance, max_fine_distance
        self.layout, self.radius = band_layout(max_distance)
        self.order, self.sorted, self.flips = [], [], []
        for shift, width in self.layout:                  # per band: the hashes sorted by that band
            keys = _band(self.coarse, shift, width)
            order = np.argsort(keys, kind="stable")
            self.order.append(order)
            self.sorted.append(keys[order])
            ones = [np.uint64(1) << np.uint64(k) for k in range(width)] if self.radius else []
            self.flips.append(np.array([0, *ones], np.uint64))   # the band itself and its 1-bit neighbours

    def __len__(self) -> int:
        return len(self.coarse)

    def query(self, coarse: np.ndarray, fine: np.ndarray, batch: int = 2048) -> Matches:
        """Every (query, indexed) pair within both distances."""
        coarse = np.asarray(coarse, np.uint64).reshape(-1)
        fine = np.asarray(fine, np.uint64).reshape(-1, FINE_WORDS)
        parts = [self._query_batch(coarse[s:s + batch], fine[s:s + batch], s)
                 for s in range(0, len(coarse), batch)]
        if not parts:
            empty = np.zeros(0, np.int64)
            return Matches(empty, empty, empty, empty)
        return Matches(*(np.concatenate([p[k] for p in parts]) for k in range(4)))

    def _query_batch(self, coarse: np.ndarray, fine: np.ndarray, offset: int) -> tuple[np.ndarray, ...]:
        found_q, found_j = [], []
        for b, ((shift, width), order, keys, flips) in enumerate(zip(self.layout, self.order, self.sorted, self.flips)):
            probes = (_band(coarse, shift, width)[:, None] ^ flips[None, :]).reshape(-1)   # (Q * F,)
            p, pos = _expand(np.searchsorted(keys, probes, "left"), np.searchsorted(keys, probes, "right"))
            q, j = p // len(flips), order[pos]      # each candidate once per band: the probes differ
            diff = coarse[q] ^ self.coarse[j]
            near = np.bitwise_count(diff) <= self.max_distance
            # a pair found in several bands is kept at the first of them only
            for s, w in self.layout[:b]:
                near &= np.bitwise_count(_band(diff, s, w)) > self.radius
            found_q.append(q[near])
            found_j.append(j[near])
        q, j = np.concatenate(found_q), np.concatenate(found_j)
        order = np.lexsort((j, q))      # sorted by (query, indexed)
        q, j = q[order], j[order]
        fine_d = np.bitwise_count(fine[q] ^ self.fine[j]).sum(axis=1)
        keep = fine_d <= self.max_fine_distance
        coarse_d = np.bitwise_count(coarse[q[keep]] ^ self.coarse[j[keep]])
        return (q[keep] + offset, j[keep], coarse_d.astype(np.int64), fine_d[keep].astype(np.int64))


def brute_force_pairs(query_coarse: np.ndarray, query_fine: np.ndarray, coarse: np.ndarray, fine: np.ndarray,
                      max_distance: int, max_fine_distance: int) -> set[tuple[int, int, int, int]]:
    """HashIndex.query's reference twin: every pair compared, (i, j, distance, fine distance)."""
    d = np.bitwise_count(np.asarray(query_coarse, np.uint64)[:, None] ^ np.asarray(coarse, np.uint64)[None, :])
    f = np.bitwise_count(np.asarray(query_fine, np.uint64)[:, None, :] ^ np.asarray(fine, np.uint64)[None]).sum(-1)
    i, j = np.nonzero((d <= max_distance) & (f <= max_fine_distance))
    return {(int(a), int(b), int(d[a, b]), int(f[a, b])) for a, b in zip(i, j)}


# --------------------------------------------------------------------------- evaluation images

@dataclass
class NearIndex:
    """The evaluation images' hashes in an index, with where each image came from."""
    index: HashIndex
    sets: list[str]              # per indexed image: its evaluation set
    paths: list[str]             # ... and its path
    sources: list[str]           # the --against paths, as given

    def pairs(self, coarse: np.ndarray, fine: np.ndarray) -> list[list[dict]]:
        """Per query: the evaluation images it matches, as report entries."""
        found = self.index.query(coarse, fine)
        out: list[list[dict]] = [[] for _ in range(len(np.atleast_1d(coarse)))]
        for i, j, d, f in zip(found.query.tolist(), found.index.tolist(), found.distance.tolist(), found.fine.tolist()):
            out[i].append({"set": self.sets[j], "image": self.paths[j], "distance": d, "fine_distance": f})
        return out

    def fingerprint(self) -> dict:
        """What a resumed make-shards compares: the same evaluation images and distances."""
        import hashlib

        digest = hashlib.sha256(self.index.coarse.tobytes() + self.index.fine.tobytes()).hexdigest()[:16]
        return {"against": self.sources, "images": len(self.paths), "hashes_sha256": digest,
                "max_distance": self.index.max_distance, "max_fine_distance": self.index.max_fine_distance}

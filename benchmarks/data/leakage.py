"""check-leakage per core: hashing (decode + two pHashes), the index query, the whole per-image
path of a worker, what the hashes catch and confuse, and the projection for Git-10M.

    python -m benchmarks.data.leakage --out benchmarks/results/leakage.json    # ~2 min on 2 busy cores
    python -m benchmarks.data.leakage --tiny --out /tmp/leakage.json           # seconds (a test)

Images: synthetic land-cover scenes (rsclip_ds/data/synthetic.py) as JPEG q90, at 256 px (Git-10M's
tiles, UCM, NWPU) and 600 px (AID). All rates are per CPU-second of one process, one thread
(``time.process_time``: one core's rate, steadier than wall time on a shared machine), median
over --repeats rounds, the steps in turn within each round (a busy machine slows all alike):

- hash: ``near_duplicates.image_hashes`` on encoded bytes in memory (decode at the draft scale,
  grey, the 64- and 256-bit pHashes);
- query: ``HashIndex.query`` of the 256 px scenes' hashes against --eval-hashes indexed hashes,
  two kinds: uniform random hashes (buckets evenly filled: the least work) and hashes of
  synthetic scenes at 64 px (flat backgrounds with shapes at five places: far more alike than
  real imagery, many candidates per query: a pessimistic case); candidates compared per query
  are counted;
- shard: ``evaluation.leakage.check_shard`` on a tar of the 256 px scenes against the synthetic
  index: what a worker of check-leakage does per image (tar read, decode, hash, query).

Discrimination: --scenes scenes at 256 px, each also re-encoded five ways (JPEG quality 20/40,
PNG, resized to 160 px, brightness x1.05); the share of copies found at the default distances,
and how many pairs of distinct scenes match with the 64-bit hash alone and with both.

Git-10M projection: 10.5M images / (32 cores x the shard rate): the workers are independent
processes and the main process only gathers matches, so the rate scales with the cores until the
disk does not keep up (not measured here).
"""

from __future__ import annotations

import io
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance

from benchmarks.harness import base_parser, environment, write_report

GIT10M_IMAGES = 10_500_000
PROJECTION_CORES = 32


def parse_args(argv: list[str] | None = None):
    parser = base_parser(__doc__, tiny=True)
    parser.add_argument("--images", type=int, default=400, help="scenes per size for the hash/shard rates")
    parser.add_argument("--eval-hashes", type=int, default=30_000, help="indexed evaluation hashes (RSICD + "
                        "RSITMD + UCM + the zero-shot sets are about 30k images)")
    parser.add_argument("--scenes", type=int, default=400, help="scenes for the discrimination counts")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of the steps in turn")
    return parser.parse_args(argv)


def _jpeg(image: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, **({"format": "JPEG", "quality": 90} | kw))
    return buf.getvalue()


def _scenes(n: int, px: int, seed: int) -> list[Image.Image]:
    from rsclip_ds.data.synthetic import render_sample

    return [render_sample(np.random.default_rng([seed, i]), px)[0] for i in range(n)]


def _cpu_seconds(fn) -> float:
    c0 = time.process_time()
    fn()
    return max(time.process_time() - c0, 1e-9)


def _alternating(steps: dict, repeats: int) -> dict[str, dict]:
    """{step: (fn, items per call)} -> {step: {median, min, max} items per CPU-second}: every step
    once as a warm-up (first-use imports: imagehash, scipy.fftpack), then the steps in turn,
    ``repeats`` rounds, so that the load of a shared machine falls on all of them alike."""
    for fn, _ in steps.values():
        fn()
    rates = {name: [] for name in steps}
    for _ in range(repeats):
        for name, (fn, items) in steps.items():
            rates[name].append(items / _cpu_seconds(fn))
    return {name: {"median": statistics.median(r), "min": min(r), "max": max(r)} for name, r in rates.items()}


def _hash_arrays(hashes: list) -> tuple[np.ndarray, np.ndarray]:
    return np.array([h[0] for h in hashes], np.uint64), np.stack([h[1] for h in hashes])


def _candidates(index, coarse: np.ndarray) -> float:
    """Mean indexed hashes compared per query (the bucket sizes of its bands' probes)."""
    from rsclip_ds.data.near_duplicates import _band

    total = 0
    for (shift, width), keys, flips in zip(index.layout, index.sorted, index.flips):
        probes = (_band(coarse, shift, width)[:, None] ^ flips[None, :]).reshape(-1)
        total += int((np.searchsorted(keys, probes, "right") - np.searchsorted(keys, probes, "left")).sum())
    return total / len(coarse)


def measure_rates(args, tiny: bool) -> dict:
    from rsclip_ds.data.near_duplicates import HashIndex, NearIndex, image_hashes
    from rsclip_ds.evaluation.leakage import DEFAULT_IMAGE_KEYS, check_shard
    from webdataset import TarWriter

    n, repeats, m = (16, 1, 500) if tiny else (args.images, args.repeats, args.eval_hashes)
    jpegs = {256: [_jpeg(im) for im in _scenes(n, 256, seed=5)], 600: [_jpeg(im) for im in _scenes(max(n // 4, 4), 600, seed=5)]}
    coarse, fine = _hash_arrays([image_hashes(d) for d in jpegs[256]])
    rng = np.random.default_rng(0)
    indexed = {"uniform": (rng.integers(0, 2**63, m, dtype=np.int64).astype(np.uint64) * np.uint64(2) + np.uint64(1),
                           rng.integers(0, 2**63, (m, 4), dtype=np.int64).astype(np.uint64)),
               "synthetic scenes": _hash_arrays([image_hashes(_jpeg(im)) for im in _scenes(m, 64, seed=9)])}
    indexes = {kind: HashIndex(*hashes) for kind, hashes in indexed.items()}
    copies = max(1, 4000 // len(coarse))                       # enough queries for a steady rate
    queries, queries_fine = np.repeat(coarse, copies), np.repeat(fine, copies, axis=0)
    near = NearIndex(indexes["synthetic scenes"], ["synthetic"] * m, [f"e{i}" for i in range(m)], ["synthetic"])
    keys = tuple(DEFAULT_IMAGE_KEYS.split(";"))
    with tempfile.TemporaryDirectory() as tmp:
        shard = str(Path(tmp) / "train-000000.tar")
        with TarWriter(shard, encoder=False) as sink:
            for i, data in enumerate(jpegs[256]):
                sink.write({"__key__": f"s{i:06d}", "jpg": data, "txt": b"a caption"})
        steps = {f"hash {px}": ((lambda d=data: [image_hashes(x) for x in d]), len(data)) for px, data in jpegs.items()}
        steps.update({f"query {kind}": ((lambda i=index: i.query(queries, queries_fine)), len(queries))
                      for kind, index in indexes.items()})
        steps["shard"] = (lambda: check_shard(shard, near, keys), len(jpegs[256]))
        rates = _alternating(steps, repeats)
    return {"hash": {str(px): {"images": len(data), "kb_per_image": sum(map(len, data)) / len(data) / 1e3,
                               "images_per_cpu_s": rates[f"hash {px}"]} for px, data in jpegs.items()},
            "query": {kind: {"indexed": m, "queries": len(queries), "candidates_per_query": _candidates(index, queries),
                             "queries_per_cpu_s": rates[f"query {kind}"]} for kind, index in indexes.items()},
            "shard": {"images": len(jpegs[256]), "indexed": m, "images_per_cpu_s": rates["shard"]}}


VARIANTS = {
    "jpeg q20": lambda im: _jpeg(im, quality=20),
    "jpeg q40": lambda im: _jpeg(im, quality=40),
    "png": lambda im: _jpeg(im, format="PNG"),
    "resized to 160 px": lambda im: _jpeg(im.resize((160, 160), Image.Resampling.BICUBIC), quality=85),
    "brightness x1.05": lambda im: _jpeg(ImageEnhance.Brightness(im).enhance(1.05)),
}


def discrimination(n: int) -> dict:
    from rsclip_ds.data.near_duplicates import MAX_DISTANCE, MAX_FINE_DISTANCE, image_hashes

    scenes = _scenes(n, 256, seed=1)
    coarse, fine = _hash_arrays([image_hashes(_jpeg(im, quality=95)) for im in scenes])
    d = np.bitwise_count(coarse[:, None] ^ coarse[None, :])                      # (n, n)
    f = np.bitwise_count(fine[:, None, :] ^ fine[None, :, :]).sum(-1)            # (n, n)
    upper = np.triu(np.ones((n, n), bool), 1)
    found = {}
    for name, make in VARIANTS.items():
        vc, vf = _hash_arrays([image_hashes(make(im)) for im in scenes])
        dc, df = np.bitwise_count(vc ^ coarse), np.bitwise_count(vf ^ fine).sum(-1)
        found[name] = {"found": float(((dc <= MAX_DISTANCE) & (df <= MAX_FINE_DISTANCE)).mean()),
                       "found_coarse_only": float((dc <= MAX_DISTANCE).mean()),
                       "median_distance": float(np.median(dc)), "median_fine_distance": float(np.median(df))}
    return {"scenes": n, "px": 256, "distinct_pairs": int(upper.sum()), "max_distance": MAX_DISTANCE,
            "max_fine_distance": MAX_FINE_DISTANCE,
            "distinct_matched_coarse_only": int((upper & (d <= MAX_DISTANCE)).sum()),
            "distinct_matched": int((upper & (d <= MAX_DISTANCE) & (f <= MAX_FINE_DISTANCE)).sum()),
            "copies": found}


def projection(rates: dict) -> dict:
    per_core = rates["shard"]["images_per_cpu_s"]["median"]
    return {"images": GIT10M_IMAGES, "cores": PROJECTION_CORES, "images_per_cpu_s": per_core,
            "minutes": GIT10M_IMAGES / (PROJECTION_CORES * per_core) / 60}


def main(argv: list[str] | None = None) -> int:
    from rsclip_ds.data.near_duplicates import hash_version

    args = parse_args(argv)
    rates = measure_rates(args, args.tiny)
    report = {"benchmark": "leakage", "tiny": args.tiny, "repeats": 1 if args.tiny else args.repeats,
              "hash_method": hash_version(), "unit": "per CPU-second of one process, one thread", **rates,
              "discrimination": discrimination(24 if args.tiny else args.scenes),
              "git10m_projection": projection(rates), "environment": environment(1)}

    def tables(r: dict) -> None:
        for px, h in r["hash"].items():
            print(f"hash {px} px: {h['images_per_cpu_s']['median']:8.0f} images per CPU-second")
        for kind, q in r["query"].items():
            print(f"query vs {q['indexed']:,} {kind}: {q['queries_per_cpu_s']['median']:9.0f} per CPU-second, "
                  f"{q['candidates_per_query']:.0f} candidates per query")
        print(f"check_shard: {r['shard']['images_per_cpu_s']['median']:.0f} images per CPU-second")
        p = r["git10m_projection"]
        print(f"Git-10M on {p['cores']} cores: {p['minutes']:.1f} min")

    write_report(report, args.out, tables)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

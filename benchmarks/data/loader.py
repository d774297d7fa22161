"""Loader throughput per core against bare decode loops, the cores a GPU needs, and where the time goes.

    python -m benchmarks.data.loader --out benchmarks/results/loader.json      # ~6 min on 2 busy cores
    -> per image size (224: git-rsclip-base, 256: -large) and worker count (1, 2): loader samples
       per CPU-second (one core's rate), the same for two bare loops, the ratios within each
       repeat, the cores per GPU that feed base (2,000 samples/s) and large (700), and a split of
       a worker's time by stage.
    python -m benchmarks.data.loader --out /tmp/loader.json --num-images 64 --shard-size 16 --micro 8 \
        --samples 64 --repeats 2 --image-sizes 224 --workers 1   # the tiny form tests/integration/test_benchmark_loader.py runs

The images: --num-images synthetic land-cover scenes at --source-px (256: Git-10M's size) px,
JPEG q90, in webdataset shards written by `rsclip_ds.data.shard_writer.make_shards`. Measured,
in alternation, --repeats times, on the same JPEGs:

- **loader**: `build_train_loader` with the default config and its real path: DataLoader worker
  processes, tar reading, the shuffle buffer, per-sample generators, the training transform
  (rsclip_ds.data.transforms: simplejpeg + torch's uint8 bicubic), tokenisation, Collate and the
  hand-over through shared memory. The main process copies every batch once into a buffer it
  keeps, as pin_memory does before the copy to a GPU (--no-consume leaves batches untouched).
- **loader_pil**: the same with `data.jpeg_draft=false`: PIL's decode and resize, which is what
  the loader ran before issue 17 for these 256 px sources (the draft scale needs 2x the size).
- **bare_pil**: the same JPEG bytes in memory, `Image.open` + convert + bicubic resize in k plain
  processes for k workers: the practical limit of a PIL loader (the evaluation transform).
- **bare_fast**: the same with the training transform (`ImageTransform.from_config`): the limit
  of our decoder, so loader / bare_fast is the loader's own overhead.
- **bare_tensor**: bare_pil plus making the normalised float32 (3, S, S) array (what Collate did
  in the worker before batches went uint8).

Rates: samples per CPU-second (user + system of the loader's main process and workers, of the
bare processes): a core's rate, steadier on a shared machine than wall time and counting the
main process's share; the JSON also has wall-clock samples/s per worker. Ratios are taken per
repeat (median, min..max reported). Cores per GPU = the preset's samples/s per GPU / the
loader's samples per CPU-second at its input size (base: 224, large: 256).

The breakdown (--breakdown, on by default) runs one stream's stages in this process over the
same shards and reports CPU microseconds per sample: tar reading (whole shards, and the second
half of each as a stream whose range starts mid-shard reads it, schedule.py), shuffle buffer,
per-sample generator, SampleDecoder (decode, augment, resize), Collate (tokenisation apart), a fresh
shared-memory segment per batch written once (what a worker's Collate does with every batch
tensor) against writing a segment kept mapped; the loader's measured CPU per sample minus these
is the hand-over to the main process and its work (pickling, the fd passing, mapping, the copy).
"""

from __future__ import annotations

import argparse
import io
import itertools
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import PIL
import torch
from PIL import Image

from benchmarks.harness import ROOT, base_parser, environment, page_tables, pyplot, save_figure, write_report
from benchmarks.results_tables.data import loader as loader_tables

TARGET = 1.0                                                 # loader / bare_pil, per CPU-second
GPU_RATES = {"git-rsclip-base": (224, 2000), "git-rsclip-large": (256, 700)}   # (input px, samples/s per H200)
LOOPS = ("bare_pil", "bare_fast", "loader", "loader_pil", "bare_tensor")


def write_dataset(out: Path, num: int, px: int, shard_size: int) -> tuple[str, list[bytes], list[str]]:
    """Synthetic scenes -> shards (via make-shards) -> (brace pattern, jpeg bytes, captions)."""
    from rsclip_ds.data.shard_writer import Record, make_shards
    from rsclip_ds.data.synthetic import render_sample

    src = out / "images"
    src.mkdir(parents=True, exist_ok=True)
    records, jpegs = [], []
    for i in range(num):
        image, caption, _ = render_sample(np.random.default_rng([7, i]), px)
        path = src / f"img{i:06d}.jpg"
        image.save(path, format="JPEG", quality=90)
        jpegs.append(path.read_bytes())
        records.append(Record(path, [caption]))
    info = make_shards(records, out / "shards", prefix="bench", shard_size=shard_size, root=src, progress=False)
    return str(out / "shards" / info["pattern"]), jpegs, [r.captions[0] for r in records]


# --------------------------------------------------------------------------- bare loops

def _bare(args: tuple[list[bytes], int, float, str]) -> tuple[int, float, float]:
    """One process of a bare loop over in-memory JPEGs; -> (count, wall seconds, CPU seconds).
    mode: "pil" (decode + bicubic), "tensor" (and the normalised float32 (3, S, S) array),
    "fast" (the training transform)."""
    jpegs, size, start_at, mode = args
    torch.set_num_threads(1)
    scale = np.full((3, 1, 1), 2 / 255, np.float32)
    out = np.empty((3, size, size), np.float32)
    if mode == "fast":
        from rsclip_ds.config import DataConfig
        from rsclip_ds.data.transforms import ImageTransform

        transform = ImageTransform.from_config(size, DataConfig())
        transform(jpegs[0])   # warm-up (first torch op)
    while time.time() < start_at:      # all processes start together
        time.sleep(0.001)
    t0, c0 = time.perf_counter(), time.process_time()
    for data in jpegs:
        if mode == "fast":
            transform(data)
            continue
        img = Image.open(io.BytesIO(data)).convert("RGB").resize((size, size), Image.Resampling.BICUBIC)
        if mode == "tensor":   # the fast path: contiguous uint8 (3,S,S) first (a strided read is ~3x slower)
            np.multiply(np.ascontiguousarray(np.asarray(img).transpose(2, 0, 1)), scale, out=out,
                        casting="unsafe")
            out -= 1.0
    return len(jpegs), time.perf_counter() - t0, time.process_time() - c0


def bare_rate(pool, jpegs: list[bytes], size: int, procs: int, samples: int, mode: str) -> dict:
    """{"wall": samples/s per process, "cpu": samples per CPU-second} of `procs` processes, each
    decoding samples/procs images."""
    per = samples // procs
    work = [list(itertools.islice(itertools.cycle(jpegs[p::procs]), per)) for p in range(procs)]
    start_at = time.time() + 0.2
    results = pool.map(_bare, [(w, size, start_at, mode) for w in work])
    return {"wall": statistics.mean(n / s for n, s, _ in results),
            "cpu": sum(n for n, _, _ in results) / sum(c for *_, c in results)}


# --------------------------------------------------------------------------- the loader

def _cpu_seconds(exclude: set[int]) -> tuple[float, float]:
    """CPU time (user + system) of this process, and of its children except ``exclude``.
    This process's own time comes from the clock (nanoseconds): /proc counts whole 10 ms ticks,
    and the main process's part of a short loop can round to none of them."""
    import psutil

    me = psutil.Process()
    children = 0.0
    for proc in me.children(recursive=True):
        if proc.pid in exclude:
            continue
        try:
            c = proc.cpu_times()
            children += c.user + c.system
        except psutil.NoSuchProcess:
            pass
    return time.process_time(), children


def build_loader(pattern: str, tokenizer, size: int, workers: int, micro: int, **data):
    """The run's loader on the benchmark shards (data.* overrides in ``data``)."""
    from rsclip_ds.config import DataConfig
    from rsclip_ds.data import build_train_loader

    cfg = DataConfig(train_shards=pattern, num_workers=workers, **data)
    return build_train_loader(cfg, tokenizer=tokenizer, image_size=size, max_text_length=64, micro_batch_size=micro,
                              rank=0, world_size=1, seed=0)


def _consume(batch: dict, keep: dict) -> None:
    """Copy the batch's tensors once into buffers the main process keeps (pin_memory's copy)."""
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            if key not in keep or keep[key].shape != value.shape:
                keep[key] = torch.empty(value.shape, dtype=value.dtype)
            keep[key].copy_(value)


def loader_rate(pattern: str, tokenizer, size: int, workers: int, micro: int, samples: int,
                exclude: set[int] = frozenset(), consume: bool = True, **data) -> dict:
    """{"wall": loader samples/s per worker, "cpu": samples per CPU-second of the main process and
    its workers, "main_cpu_share": the main process's part, "fast_transform": whether its image
    transform took the fast path (draft-scale decode, torch resize)}, after each worker delivered
    its first batch."""
    loader = build_loader(pattern, tokenizer, size, workers, micro, **data)
    it, keep = iter(loader), {}
    for _ in range(2 * max(1, workers)):   # start-up: process start, buffer fill
        next(it)
    batches = max(1, samples // micro)
    t0, (m0, w0) = time.perf_counter(), _cpu_seconds(exclude)
    for _ in range(batches):
        batch = next(it)
        if consume:
            _consume(batch, keep)
    elapsed, (m1, w1) = time.perf_counter() - t0, _cpu_seconds(exclude)
    assert tuple(batch["pixel_values"].shape) == (micro, 3, size, size)
    del it
    main, work = m1 - m0, w1 - w0
    return {"wall": batches * micro / elapsed / max(1, workers), "cpu": batches * micro / (main + work),
            "main_cpu_share": main / (main + work), "fast_transform": loader.prep.transform.fast}


# --------------------------------------------------------------------------- where the time goes

def _per_sample(fn, n: int, passes: int = 3) -> float:
    """Median CPU microseconds per sample of fn() (which handles n samples) over `passes`."""
    times = []
    for _ in range(passes):
        c0 = time.process_time()
        fn()
        times.append((time.process_time() - c0) / n * 1e6)
    return statistics.median(times)


def _fresh_shared(batches: list[dict]) -> None:
    """What a worker's Collate does with each batch tensor: a new shared-memory segment, written once."""
    for batch in batches:
        for value in batch.values():
            if isinstance(value, torch.Tensor):
                storage = value._typed_storage()._new_shared(value.numel(), device="cpu")
                torch.empty(0, dtype=value.dtype).set_(storage, 0, value.shape).copy_(value)


def breakdown(pattern: str, tokenizer, size: int, micro: int) -> dict:
    """CPU microseconds per sample of one stream's stages, in this process (see the module doc)."""
    from braceexpand import braceexpand

    from rsclip_ds.data.bad import StreamCounter
    from rsclip_ds.data.loader import _shuffled
    from rsclip_ds.data.schedule import derive_seed
    from rsclip_ds.data.tar import read_piece, read_shard
    from rsclip_ds.data.tokenizer import tokenize

    loader = build_loader(pattern, tokenizer, size, 0, micro)
    counter, urls = StreamCounter({}), list(braceexpand(pattern))
    samples = [s for u in urls for s in read_shard(u, counter)]
    n = len(samples)
    gens = [random.Random(derive_seed(0, "sample", 0, i, s["__key__"])) for i, s in enumerate(samples)]
    items = [loader.prep(s, random.Random(0), counter) for s in samples]
    groups = [items[i:i + micro] for i in range(0, n - micro + 1, micro)]
    nb = len(groups) * micro
    batches = [loader.collate(g) for g in groups]
    kept = [{k: v.clone() for k, v in b.items() if isinstance(v, torch.Tensor)} for b in batches[:1]]

    def rewrite_kept():   # the floor of a hand-over: segments kept mapped, written once per batch
        for b in batches:
            for k, v in kept[0].items():
                v.copy_(b[k])
    halves = [(u, c // 2, c - c // 2) for u, c in loader.schedule.counts.items()]   # a shard split between two streams
    stages = {
        "tar read + grouping": _per_sample(lambda: [s for u in urls for s in read_shard(u, StreamCounter({}))], n),
        "tar read of a shard's second half (seeking over the first)": _per_sample(
            lambda: [s for u, skip, take in halves for s in read_piece(u, StreamCounter({}), skip, take, True)],
            sum(take for *_, take in halves)),
        "shuffle buffer": _per_sample(lambda: list(_shuffled(iter(samples), loader.cfg.shuffle_buffer,
                                                             random.Random(0))), n),
        "per-sample generator": _per_sample(lambda: [random.Random(derive_seed(0, "sample", 0, i, s["__key__"]))
                                                     for i, s in enumerate(samples)], n),
        "decode + resize (SampleDecoder)": _per_sample(lambda: [loader.prep(s, g, counter)
                                                                for s, g in zip(samples, gens)], n),
        "tokenise (per batch)": _per_sample(lambda: [tokenize(tokenizer, [it[1] for it in g], 64)
                                                     for g in groups], nb),
        "collate (whole, in-process)": _per_sample(lambda: [loader.collate(g) for g in groups], nb),
        "fresh shared memory per batch, written once": _per_sample(lambda: _fresh_shared(batches), nb),
        "kept shared memory, written once (floor)": _per_sample(rewrite_kept, nb),
    }
    it = iter(loader)
    next(it)
    stages["stream in-process (all of the above, no workers)"] = _per_sample(
        lambda: [next(it) for _ in range(max(1, n // micro))], max(1, n // micro) * micro)
    pixels = batches[0]["pixel_values"]
    return {"us_per_sample": stages, "pixel_dtype": str(pixels.dtype), "pixel_bytes_per_sample":
            pixels[0].numel() * pixels.element_size()}


# --------------------------------------------------------------------------- the run

def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(args, pattern, jpegs, tokenizer, size: int, workers: int) -> dict:
    """Every loop in alternation for one (size, workers), --repeats times."""
    ctx = get_context("fork")
    data = {"loader": {}, "loader_pil": {"jpeg_draft": False}}
    rows = {name: [] for name in LOOPS}
    with ctx.Pool(workers) as pool:
        pool_pids = {p.pid for p in pool._pool}
        for rep in range(args.repeats):   # alternate: load on the machine hits all alike
            for name in LOOPS:
                if name.startswith("loader"):
                    r = loader_rate(pattern, tokenizer, size, workers, args.micro, args.samples, pool_pids,
                                    consume=not args.no_consume, **data[name])
                else:
                    r = bare_rate(pool, jpegs, size, workers, args.samples, name.removeprefix("bare_"))
                rows[name].append(r)
            last = {k: v[-1] for k, v in rows.items()}
            print(f"{size} px, workers {workers}, repeat {rep}: per CPU-second " +
                  ", ".join(f"{k} {v['cpu']:.0f}" for k, v in last.items()) +
                  f"; loader / bare_pil {last['loader']['cpu'] / last['bare_pil']['cpu']:.2f}, "
                  f"/ bare_fast {last['loader']['cpu'] / last['bare_fast']['cpu']:.2f}", flush=True)
    out = {"image_size": size, "workers": workers}
    for name, values in rows.items():
        out[name] = {"per_cpu_second": [v["cpu"] for v in values], "per_worker_wall": [v["wall"] for v in values]}
        if name.startswith("loader"):
            out[name]["main_cpu_share"] = [v["main_cpu_share"] for v in values]
            out[name]["fast_transform"] = values[0]["fast_transform"]
        out[name]["per_cpu_second_summary"] = _summary(out[name]["per_cpu_second"])
    ratios = {}
    for num, den in (("loader", "bare_pil"), ("loader", "bare_fast"), ("loader", "bare_tensor"),
                     ("loader_pil", "bare_pil"), ("loader", "loader_pil"), ("bare_fast", "bare_pil")):
        for unit in ("per_cpu_second", "per_worker_wall"):
            paired = [a / b for a, b in zip(out[num][unit], out[den][unit])]
            key = f"{num}/{den}" + ("" if unit == "per_cpu_second" else " (wall)")
            ratios[key] = {"per_repeat": paired, **_summary(paired)}
    out["ratios"] = ratios
    out["pass"] = ratios["loader/bare_pil"]["median"] >= TARGET
    return out


def cores_per_gpu(rows: list[dict]) -> dict:
    """Cores (at the loader's measured samples per CPU-second, the median over worker counts and
    repeats) a GPU of each preset needs."""
    out = {}
    for preset, (size, per_gpu) in GPU_RATES.items():
        rates = [r for row in rows if row["image_size"] == size for r in row["loader"]["per_cpu_second"]]
        if not rates:
            continue
        pil = [r for row in rows if row["image_size"] == size for r in row["loader_pil"]["per_cpu_second"]]
        per_core = statistics.median(rates)
        out[preset] = {"image_size": size, "samples_per_s_per_gpu": per_gpu, "loader_per_core": per_core,
                       "cores_per_gpu": per_gpu / per_core,
                       "cores_per_gpu_range": [per_gpu / max(rates), per_gpu / min(rates)],
                       "cores_per_gpu_pil_loader": per_gpu / statistics.median(pil)}
    return out


def run(args) -> dict:
    from rsclip_ds.data.tokenizer import train_tokenizer

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        pattern, jpegs, captions = write_dataset(tmp, args.num_images, args.source_px, args.shard_size)
        tokenizer = train_tokenizer(iter(captions), tmp / "tok", vocab_size=300, max_length=64)
        print(f"dataset: {len(jpegs)} x {args.source_px}px JPEG "
              f"({sum(map(len, jpegs)) / len(jpegs) / 1024:.1f} KiB mean) in {time.perf_counter() - t0:.1f} s",
              flush=True)
        rows = [measure(args, pattern, jpegs, tokenizer, size, workers)
                for size in args.image_sizes for workers in args.workers]
        split = {size: breakdown(pattern, tokenizer, size, args.micro) for size in args.image_sizes} \
            if args.breakdown else {}
    for size, b in split.items():   # what the stages leave unexplained: hand-over + main process
        loader_us = 1e6 / statistics.median(r for row in rows if row["image_size"] == size and row["workers"] == 1
                                            for r in row["loader"]["per_cpu_second"]) if 1 in args.workers else None
        b["loader_us_per_sample_1_worker"] = loader_us
        if loader_us:
            b["hand-over + main process (loader minus stream)"] = \
                loader_us - b["us_per_sample"]["stream in-process (all of the above, no workers)"]
    return {"benchmark": "loader", "target_ratio": TARGET,
            "setup": {"num_images": args.num_images, "source_px": args.source_px, "image_sizes": args.image_sizes,
                      "micro_batch_size": args.micro, "shard_size": args.shard_size, "workers": args.workers,
                      "samples_per_measure": args.samples, "repeats": args.repeats, "jpeg_quality": 90,
                      "consume": not args.no_consume},
            "environment": environment(args.threads, pillow=PIL.__version__, platform=platform.platform()),
            "results": rows, "cores_per_gpu": cores_per_gpu(rows), "breakdown": split}


def plot(report: dict, path: Path) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    rows = report["results"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(LOOPS)
    for i, name in enumerate(LOOPS):
        ax.bar([j + i * width for j in range(len(rows))],
               [r[name]["per_cpu_second_summary"]["median"] for r in rows], width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))],
                  [f"{r['image_size']} px, {r['workers']} worker(s)" for r in rows])
    ax.set_ylabel("samples per CPU-second")
    ax.set_title(f"loader vs bare loops ({report['setup']['source_px']} px JPEG), median of repeats")
    for preset, c in report["cores_per_gpu"].items():
        ax.axhline(c["samples_per_s_per_gpu"], ls=":", lw=1, color="grey")
        ax.text(len(rows) - 0.5, c["samples_per_s_per_gpu"], f"{preset}: 1 GPU", fontsize=7, ha="right", va="bottom")
    ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__, out=ROOT / "benchmarks" / "results" / "loader.json")
    p.add_argument("--num-images", type=int, default=1024)
    p.add_argument("--source-px", type=int, default=256)
    p.add_argument("--image-sizes", type=int, nargs="+", default=[224, 256],
                   help="model input sides (224: git-rsclip-base, 256: -large)")
    p.add_argument("--shard-size", type=int, default=128)
    p.add_argument("--micro", type=int, default=32)
    p.add_argument("--samples", type=int, default=1536, help="samples per measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--no-consume", action="store_true", help="the main process does not copy the batches")
    p.add_argument("--no-breakdown", dest="breakdown", action="store_false", help="skip the stage split")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    write_report(run(args), args.out, page_tables(loader_tables, "loader.json"), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

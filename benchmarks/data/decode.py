"""JPEG decode + bicubic squash to S x S on one core: which decoder and which resize feed the GPUs.

    python -m benchmarks.data.decode --out benchmarks/results/decode.json \
        --simd-python /tmp/simd/bin/python          # ~5 min on 2 busy cores (a venv: numpy + pillow-simd)
    python -m benchmarks.data.decode --out /tmp/decode.json --num-images 8 --sources 256 --sizes 224 \
        --repeats 2 --min-seconds 0.05                    # seconds: the form tests run

The images: `rsclip_ds.data.synthetic.make_synthetic` shards (what `rsclip-ds make-synthetic`
writes: land-cover scenes, JPEG q90) at --sources px: 64 (the command's default), 256 (Git-10M,
UCM, NWPU tiles) and 600 (AID). Each is decoded to RGB and squashed to --sizes (224:
git-rsclip-base, 256: git-rsclip-large) by every method:

| method | decode | resize |
|---|---|---|
| pil | PIL, full size | PIL bicubic: the evaluation transform, the reference pixels |
| pil-draft | PIL at the draft scale (1/2^k while >= S) | PIL bicubic: training until issue 17 |
| simplejpeg | simplejpeg at PIL's draft scale | PIL bicubic |
| turbojpeg | PyTurboJPEG at PIL's draft scale | PIL bicubic |
| pillow-simd, pillow-simd-draft | pil, pil-draft under pillow-simd (--simd-python) | its SIMD bicubic |
| pil-draft+torch | PIL at the draft scale | torch's uint8 antialiased bicubic |
| simplejpeg+torch | simplejpeg at PIL's draft scale | torch's uint8 bicubic |
| simplejpeg-dct+torch | simplejpeg at the smallest m/8 DCT scale >= S (e.g. 7/8 for 256 -> 224) | torch's |
| rsclip-train | `ImageTransform.from_config(S, DataConfig())`: what training runs | |

Per method: samples per CPU-second of the timing loop (one process, one thread: one core's
rate; steadier than wall time on a shared machine, which is recorded too), and the pixels'
difference from `pil` (max and mean absolute, fraction off by more than 2 and 8 grey levels).
The methods run in alternation, --repeats times, the order rotating each repeat; ratios to `pil`
and `pil-draft` are taken within each repeat (median, min..max reported). pillow-simd replaces
Pillow and cannot share an environment with it: give --simd-python, the interpreter of a venv
holding only numpy and pillow-simd; its methods run there (this file imports nothing else at
the top for that reason).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

BICUBIC = Image.Resampling.BICUBIC
SIMD = {"pillow-simd": "pil", "pillow-simd-draft": "pil-draft"}   # run the same code under pillow-simd


# --------------------------------------------------------------------------- the methods

def _draft_scale(width: int, height: int, need: int) -> int:
    """PIL's Image.draft rule (as rsclip_ds.data.transforms.draft_scale; this file must import
    without rsclip_ds under --simd-python)."""
    fits = min(width // need, height // need)
    return next((s for s in (8, 4, 2) if fits >= s), 1)


def _squash_pil(pixels, size: int) -> np.ndarray:
    img = pixels if isinstance(pixels, Image.Image) else Image.fromarray(pixels)
    return np.asarray(img if img.size == (size, size) else img.resize((size, size), BICUBIC))


def _squash_torch(pixels: np.ndarray, size: int) -> np.ndarray:
    from rsclip_ds.data.transforms import resize_bicubic_fast

    return pixels if pixels.shape[:2] == (size, size) else resize_bicubic_fast(pixels, size)


def _pil(data: bytes, size: int, draft: bool = False) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    if draft:
        img.draft("RGB", (size, size))
    return img.convert("RGB")


def _simplejpeg(data: bytes, size: int, any_scale: bool = False) -> np.ndarray:
    import simplejpeg

    if any_scale:   # libjpeg-turbo's m/8 scales: the smallest output with both sides >= size
        return simplejpeg.decode_jpeg(data, "RGB", min_height=size, min_width=size)
    h, w, _, _ = simplejpeg.decode_jpeg_header(data)
    s = _draft_scale(w, h, size)
    return simplejpeg.decode_jpeg(data, "RGB", min_height=-(-h // s), min_width=-(-w // s), min_factor=s)


def _turbojpeg():
    from turbojpeg import TJPF_RGB, TurboJPEG

    jpeg = TurboJPEG()   # finds libturbojpeg.so (Debian: libturbojpeg0) or raises RuntimeError

    def decode(data: bytes, size: int) -> np.ndarray:
        w, h, _, _ = jpeg.decode_header(data)
        return jpeg.decode(data, pixel_format=TJPF_RGB, scaling_factor=(1, _draft_scale(w, h, size)))
    return decode


def _rsclip_train(size: int):
    from rsclip_ds.config import DataConfig
    from rsclip_ds.data.transforms import ImageTransform

    return ImageTransform.from_config(size, DataConfig())


def build_method(name: str):
    """name -> fn(jpeg bytes, size) -> uint8 (size, size, 3); ImportError/RuntimeError when the
    package (or its library) is missing."""
    name = SIMD.get(name, name)
    if name == "pil":
        return lambda d, s: _squash_pil(_pil(d, s), s)
    if name == "pil-draft":
        return lambda d, s: _squash_pil(_pil(d, s, draft=True), s)
    if name == "simplejpeg":
        import simplejpeg  # noqa: F401  (fail here, not in the timing loop)
        return lambda d, s: _squash_pil(_simplejpeg(d, s), s)
    if name == "turbojpeg":
        decode = _turbojpeg()
        return lambda d, s: _squash_pil(decode(d, s), s)
    if name == "pil-draft+torch":
        return lambda d, s: _squash_torch(np.array(_pil(d, s, draft=True)), s)
    if name == "simplejpeg+torch":
        import simplejpeg  # noqa: F401
        return lambda d, s: _squash_torch(_simplejpeg(d, s), s)
    if name == "simplejpeg-dct+torch":
        import simplejpeg  # noqa: F401
        return lambda d, s: _squash_torch(_simplejpeg(d, s, any_scale=True), s)
    if name == "rsclip-train":
        transforms = {}
        return lambda d, s: (transforms.get(s) or transforms.setdefault(s, _rsclip_train(s)))(d)
    raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)}")


METHODS = ["pil", "pil-draft", "simplejpeg", "turbojpeg", "pillow-simd", "pillow-simd-draft", "pil-draft+torch",
           "simplejpeg+torch", "simplejpeg-dct+torch", "rsclip-train"]


# --------------------------------------------------------------------------- measuring

def time_method(fn, jpegs: list[bytes], size: int, min_seconds: float) -> tuple[float, float]:
    """(samples per CPU-second, samples per wall second) over whole passes until min_seconds."""
    fn(jpegs[0], size)   # warm-up: lazy imports, first torch op
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while True:
        for data in jpegs:
            fn(data, size)
        n += len(jpegs)
        if time.perf_counter() - t0 >= min_seconds:
            break
    return n / (time.process_time() - c0), n / (time.perf_counter() - t0)


def pixel_difference(fn, jpegs: list[bytes], size: int, reference: np.ndarray) -> dict:
    """Grey levels (0-255) against the reference pixels (N, S, S, 3)."""
    diff = np.abs(np.stack([fn(d, size) for d in jpegs]).astype(np.int16) - reference)
    return {"max": int(diff.max()), "mean": float(diff.mean()), "frac_over_2": float((diff > 2).mean()),
            "frac_over_8": float((diff > 8).mean())}


def _worker(args) -> int:
    """--simd-python side: time one method on the saved images, compare with the saved reference."""
    import PIL
    from PIL import features

    jpegs = [p.read_bytes() for p in sorted(args.images.glob("*.jpg"))]
    fn = build_method(args.methods[0])
    cpu, wall = time_method(fn, jpegs, args.sizes[0], args.min_seconds)
    row = {"cpu": cpu, "wall": wall, "pillow": PIL.__version__, "libjpeg_turbo": features.version("libjpeg_turbo")}
    if args.reference:
        row["pixels"] = pixel_difference(fn, jpegs, args.sizes[0], np.load(args.reference))
    print(json.dumps(row))
    return 0


def _simd_run(python: str, images: Path, method: str, size: int, min_seconds: float,
              reference: Path | None) -> dict:
    cmd = [python, str(Path(__file__).resolve()), "--worker", "--images", str(images), "--methods", method,
           "--sizes", str(size), "--min-seconds", str(min_seconds)]
    if reference:
        cmd += ["--reference", str(reference)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def synthetic_jpegs(root: Path, px: int, num: int) -> list[bytes]:
    """The JPEG members of one make_synthetic train shard of `num` px-sized scenes."""
    from rsclip_ds.data.synthetic import make_synthetic

    make_synthetic(root, num_train=num, num_val=1, shard_size=num, image_size=px, seed=0, progress=False)
    with tarfile.open(root / "train-000000.tar") as tar:
        return [tar.extractfile(m).read() for m in tar.getmembers() if m.name.endswith(".jpg")]


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_combo(args, jpegs: list[bytes], px: int, size: int, folder: Path) -> dict:
    """Every method on one (source px, size), interleaved over the repeats."""
    available, skipped = {}, {}
    for name in args.methods:
        if name in SIMD:
            if args.simd_python:
                available[name] = None
            else:
                skipped[name] = "no --simd-python (pillow-simd replaces Pillow: it needs its own venv)"
            continue
        try:
            available[name] = build_method(name)
        except (ImportError, RuntimeError) as err:
            skipped[name] = f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"
    reference = np.stack([available["pil"](d, size) for d in jpegs])          # (N, S, S, 3)
    ref_path = folder / f"reference_{px}_{size}.npy"
    np.save(ref_path, reference)
    rows = {name: {"per_core": [], "per_core_wall": []} for name in available}
    for name, fn in available.items():
        if fn is not None:
            rows[name]["pixels"] = pixel_difference(fn, jpegs, size, reference)
    names = list(available)
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]          # rotate: no method always first
        for name in order:
            if available[name] is None:
                out = _simd_run(args.simd_python, folder, name, size, args.min_seconds,
                                ref_path if rep == 0 else None)
                cpu, wall = out["cpu"], out["wall"]
                rows[name].setdefault("pixels", out.get("pixels"))
                rows[name]["pillow"], rows[name]["libjpeg_turbo"] = out["pillow"], out["libjpeg_turbo"]
            else:
                cpu, wall = time_method(available[name], jpegs, size, args.min_seconds)
            rows[name]["per_core"].append(cpu)
            rows[name]["per_core_wall"].append(wall)
        print(f"{px} px -> {size}: repeat {rep}: " + ", ".join(
            f"{n} {rows[n]['per_core'][-1]:.0f}" for n in names), flush=True)
    for name, row in rows.items():
        for base in ("pil", "pil-draft"):
            if base in rows:
                row[f"ratio_to_{base}"] = [a / b for a, b in zip(row["per_core"], rows[base]["per_core"])]
                row[f"ratio_to_{base}_summary"] = _summary(row[f"ratio_to_{base}"])
        row["per_core_summary"] = _summary(row["per_core"])
    return {"source_px": px, "size": size, "num_images": len(jpegs),
            "kib_mean": sum(map(len, jpegs)) / len(jpegs) / 1024, "methods": rows, "skipped": skipped}


def versions() -> dict:
    import PIL
    import torch
    from PIL import features

    out = {"pillow": PIL.__version__, "pillow_libjpeg_turbo": features.version("libjpeg_turbo"),
           "torch": torch.__version__}
    for module, key in (("simplejpeg", "simplejpeg"), ("turbojpeg", "pyturbojpeg")):
        try:
            out[key] = __import__(module).__version__
        except ImportError:
            out[key] = None
    return out


def run(args) -> dict:
    import torch

    from benchmarks.harness import environment

    torch.set_num_threads(1)   # a DataLoader worker's setting: one core
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for px in args.sources:
            folder = Path(tmp) / f"s{px}"
            jpegs = synthetic_jpegs(folder / "shards", px, args.num_images)
            for i, data in enumerate(jpegs):   # for the --simd-python side
                (folder / f"{i:05d}.jpg").write_bytes(data)
            for size in args.sizes:
                results.append(run_combo(args, jpegs, px, size, folder))
    return {"benchmark": "decode",
            "setup": {"sources": args.sources, "sizes": args.sizes, "num_images": args.num_images,
                      "jpeg_quality": 90, "repeats": args.repeats, "min_seconds": args.min_seconds,
                      "methods": args.methods, "simd_python": args.simd_python},
            "environment": environment(1, **versions()), "results": results}


# --------------------------------------------------------------------------- report

def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    for combo in report["results"]:
        table = Table(title=f"{combo['source_px']} px JPEG ({combo['kib_mean']:.0f} KiB) -> {combo['size']} px, "
                            "one core")
        for col in ("method", "samples/s/core", "x pil (min..max)", "x pil-draft", "max diff", "mean diff",
                    "> 8 levels"):
            table.add_column(col, justify="right")
        for name, r in combo["methods"].items():
            ratio, draft = r.get("ratio_to_pil_summary"), r.get("ratio_to_pil-draft_summary")
            px = r.get("pixels") or {}
            table.add_row(name, f"{r['per_core_summary']['median']:.0f}",
                          f"{ratio['median']:.2f} ({ratio['min']:.2f}..{ratio['max']:.2f})" if ratio else "-",
                          f"{draft['median']:.2f}" if draft else "-", str(px.get("max", "-")),
                          f"{px['mean']:.3f}" if px else "-", f"{100 * px['frac_over_8']:.2f}%" if px else "-")
        for name, why in combo["skipped"].items():
            table.add_row(name, "-", "-", "-", "-", "-", why[:40])
        console.print(table)


def plot(report: dict, path: Path) -> str | None:
    from benchmarks.harness import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return None
    combos = report["results"]
    names = [n for n in report["setup"]["methods"] if any(n in c["methods"] for c in combos)]
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(combos)), 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        rates = [c["methods"][name]["per_core_summary"]["median"] if name in c["methods"] else 0 for c in combos]
        ax.bar([j + i * width for j in range(len(combos))], rates, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(combos))],
                  [f"{c['source_px']} -> {c['size']}" for c in combos])
    ax.set_ylabel("samples per CPU-second (one core)")
    ax.set_title("JPEG decode + bicubic squash, per core (median of the repeats)")
    ax.legend(fontsize=7, ncol=2)
    return save_figure(plt, fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "decode.json")
    p.add_argument("--sources", type=int, nargs="+", default=[64, 256, 600], help="JPEG sides, px")
    p.add_argument("--sizes", type=int, nargs="+", default=[224, 256], help="model input sides, px")
    p.add_argument("--num-images", type=int, default=48)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--min-seconds", type=float, default=0.6, help="timing loop length per measurement")
    p.add_argument("--methods", nargs="+", default=METHODS)
    p.add_argument("--simd-python", default=None, help="python of a venv with numpy + pillow-simd only")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--images", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--reference", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return _worker(args)
    from benchmarks.harness import write_report

    write_report(run(args), args.out, print_table, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

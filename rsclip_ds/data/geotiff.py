"""Multispectral GeoTIFF -> 8-bit RGB: ``--bands 4,3,2`` and a scaling rule.

Sentinel-2 imagery as EuroSAT's all-bands release ships it is a 13-band (B01..B12 with B8A)
16-bit GeoTIFF, which PIL cannot open. ``tifffile`` (a well-kept pure-Python TIFF reader, a
dependency) reads any band count and bit depth; ``BandChoice`` picks three bands, 1-based as GDAL
numbers them (Sentinel-2 true colour: 4,3,2 = B04 red, B03 green, B02 blue), and scales each to
0..255:

  percentile:LO,HI   per band and image: clip at its LO-th and HI-th percentile, stretch between
                     (default percentile:2,98, what QGIS and rasterio's examples show)
  range:MIN,MAX      one fixed range for every band and image (Sentinel-2 L1C reflectance x 10000:
                     range:0,3000 is a common true-colour stretch); the same pixel value always
                     maps to the same grey level, which per-image percentiles do not give

    v8 = round(255 * clip((v - lo) / (hi - lo), 0, 1))

make-shards (--bands) writes the result as PNG (lossless; --format jpg for JPEG), evaluation
(``eval.bands`` / ``rsclip-ds eval --bands``) feeds it to the one image transform. A TIFF with
more than 3 bands and no band choice raises BandsError, naming --bands.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

TIFF_MAGIC = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")   # classic and BigTIFF


class BandsError(RuntimeError):
    """A multi-band TIFF without a band choice, or a band choice the file cannot satisfy. Not an
    OSError/ValueError on purpose: it must stop a conversion or an evaluation, not be counted as
    one unreadable image among many."""


def is_tiff(data: bytes) -> bool:
    return data[:4] in TIFF_MAGIC


@dataclass(frozen=True)
class BandChoice:
    """Three 1-based band numbers and a scaling rule (see the module doc)."""
    bands: tuple[int, ...] = (4, 3, 2)
    scale: str = "percentile"            # percentile | range
    low: float = 2.0
    high: float = 98.0

    @classmethod
    def parse(cls, bands: str | None, scale: str | None = None) -> "BandChoice | None":
        """'4,3,2' and 'percentile:2,98' | 'range:0,3000' -> BandChoice; bands None -> None."""
        if bands is None or not str(bands).strip():
            return None
        try:
            numbers = tuple(int(b) for b in str(bands).split(","))
        except ValueError:
            raise ValueError(f"--bands {bands!r}: 1-based band numbers, comma-separated (Sentinel-2 RGB: "
                             "4,3,2)") from None
        if len(numbers) not in (1, 3) or min(numbers) < 1:
            raise ValueError(f"--bands {bands!r}: one band (grey) or three (R,G,B), numbered from 1 as GDAL does")
        kind, _, args = (scale or "percentile:2,98").partition(":")
        try:
            low, high = (float(x) for x in args.split(",")) if args else ((2.0, 98.0) if kind == "percentile" else (None, None))
        except (ValueError, TypeError):
            low = high = None
        if kind not in ("percentile", "range") or low is None or not low < high or \
                (kind == "percentile" and not 0 <= low < high <= 100):
            raise ValueError(f"--band-scale {scale!r}: 'percentile:LO,HI' (0 <= LO < HI <= 100, e.g. "
                             "percentile:2,98) or 'range:MIN,MAX' (e.g. range:0,3000 for Sentinel-2 L1C)")
        return cls(numbers, kind, low, high)

    def describe(self) -> str:
        return f"bands {','.join(map(str, self.bands))}, {self.scale}:{self.low:g},{self.high:g}"


def read_tiff(data: bytes) -> np.ndarray:
    """Any TIFF -> (H, W, C) array in its own dtype (C = 1 for one band)."""
    import tifffile

    try:
        with tifffile.TiffFile(io.BytesIO(data)) as tif:
            series = tif.series[0]
            arr, axes = series.asarray(), series.axes
    except (tifffile.TiffFileError, ValueError, KeyError, IndexError) as err:
        raise OSError(f"unreadable TIFF: {type(err).__name__}: {err}") from None
    if arr.ndim == 2:
        return arr[:, :, None]
    if arr.ndim != 3:
        raise OSError(f"TIFF of shape {arr.shape} (axes {axes}): expected (H, W) or bands x (H, W)")
    if axes[-1] not in "YX":     # YXS: bands last (pixel-interleaved, EuroSAT's)
        return arr
    return np.moveaxis(arr, 0, -1)   # SYX / CYX / IYX: planar


def band_count(data: bytes) -> int:
    return read_tiff(data).shape[-1]


def to_rgb(data: bytes, choice: BandChoice | None, where: str = "image") -> np.ndarray:
    """TIFF bytes -> uint8 (H, W, 3). Without a choice only 1-3 band 8-bit files pass through."""
    arr = read_tiff(data)
    n = arr.shape[-1]
    if choice is None:
        if n not in (1, 3) or arr.dtype != np.uint8:
            raise BandsError(f"{where}: a {n}-band {arr.dtype} TIFF; choose three bands and a scaling with "
                             "--bands 4,3,2 (1-based, Sentinel-2 true colour) [--band-scale percentile:2,98 | "
                             "range:0,3000] (eval: --bands / eval.bands)")
        return np.repeat(arr, 3, axis=-1) if n == 1 else arr
    if max(choice.bands) > n:
        raise BandsError(f"{where}: --bands {','.join(map(str, choice.bands))} asks for band {max(choice.bands)}, "
                         f"the file has {n} (numbered 1..{n})")
    picked = arr[..., [b - 1 for b in choice.bands]].astype(np.float32)          # (H, W, 1|3)
    if choice.scale == "percentile":
        flat = picked.reshape(-1, picked.shape[-1])
        lo, hi = np.percentile(flat, [choice.low, choice.high], axis=0)          # (C,), (C,)
    else:
        lo = np.full(picked.shape[-1], choice.low, np.float32)
        hi = np.full(picked.shape[-1], choice.high, np.float32)
    span = np.where(hi > lo, hi - lo, 1.0)                                        # flat band: black
    out = np.rint(255.0 * np.clip((picked - lo) / span, 0.0, 1.0)).astype(np.uint8)
    return np.repeat(out, 3, axis=-1) if out.shape[-1] == 1 else out              # (H, W, 3)

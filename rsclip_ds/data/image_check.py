"""Encoded image bytes in ``make-shards --hf-dataset``: checked from their header, or re-encoded.

``--verify header`` (the default) on a JPEG, PNG or WebP that is copied as it is (no --max-side,
--format keep or the same format) needs no decoder: ``header_format`` reads the signature (and a
JPEG's marker segments up to its frame header), ``check_ends`` the end marker a cut-off file
lacks. That check is cheap (microseconds) and runs in the conversion's main process
(``precheck``), which holds the bytes anyway: such images are never shipped to a worker process
and back. Everything else -- other formats, ``--verify decode``, resizing, re-encoding, TIFF bands
-- goes through PIL in a worker (``encode_image``), as the bytes must be read there.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

from rsclip_ds.data.geotiff import is_tiff, to_rgb

EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "TIFF": "tif", "GIF": "gif", "BMP": "bmp"}
_COPIED = ("jpg", "png", "webp")    # formats written as they are unless resized or re-encoded


@dataclass(frozen=True)
class Checked:
    """An image the main process checked in place of its bytes: its extension and size (the
    main process writes the bytes it kept), or why it is skipped (``problem``: (reason, detail))."""
    ext: str | None
    size: int = 0
    problem: tuple[str, str] | None = None


def image_bytes(value) -> bytes | None:
    """A column value (datasets' {"bytes", "path"} or raw bytes) -> the encoded bytes."""
    if isinstance(value, dict):
        return value.get("bytes") or (Path(value["path"]).read_bytes() if value.get("path") else None)
    return bytes(value) if value else None


def check_ends(data: bytes, fmt: str) -> None:
    """A truncated JPEG/PNG lacks its end marker: the cheap check that catches cut-off files."""
    tail = data[-16:].rstrip(b"\x00")
    if fmt == "JPEG" and not tail.endswith(b"\xff\xd9"):
        raise OSError("truncated JPEG (no end-of-image marker)")
    if fmt == "PNG" and b"IEND" not in tail:
        raise OSError("truncated PNG (no IEND chunk)")


def _jpeg_frame(data: bytes) -> None:
    """Walk a JPEG's marker segments from SOI to its frame header (SOFn); OSError if they do
    not hold together (what PIL's header parse rejects: a byte that is no marker, a segment
    running past the data, a scan before any frame header)."""
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            raise OSError(f"broken JPEG: no marker at byte {i}")
        marker = data[i + 1]
        if marker == 0xFF:                                   # fill byte
            i += 1
            continue
        if marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:  # markers without a length
            i += 2
            continue
        length = int.from_bytes(data[i + 2:i + 4], "big")
        if length < 2 or i + 2 + length > n:
            raise OSError(f"broken JPEG: segment {marker:#04x} at byte {i} runs past the data")
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):   # SOFn: the frame header
            if length < 8 or not int.from_bytes(data[i + 5:i + 7], "big") or not int.from_bytes(data[i + 7:i + 9], "big"):
                raise OSError("broken JPEG: a frame header without a size")
            return
        if marker in (0xD9, 0xDA):
            raise OSError("broken JPEG: image data before any frame header")
        i += 2 + length
    raise OSError("truncated JPEG header (no frame header)")


def header_format(data: bytes) -> str | None:
    """'JPEG' / 'PNG' / 'WEBP' when the header says so and holds together (OSError when it
    starts like one and does not); None for any other bytes (PIL decides)."""
    if data[:3] == b"\xff\xd8\xff":
        _jpeg_frame(data)
        return "JPEG"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        if data[12:16] != b"IHDR" or len(data) < 33:
            raise OSError("broken PNG: no IHDR chunk after the signature")
        return "PNG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        if data[12:15] != b"VP8":
            raise OSError("broken WebP: no VP8 chunk")
        return "WEBP"
    return None


def precheck(data: bytes | None, fmt_wanted: str, verify: str, max_side: int, column: str) -> Checked | None:
    """The main process's check of one row's image: a Checked (kept, or why skipped) when the
    header check settles it; None when a worker must read the bytes (encode_image)."""
    if not data:
        return Checked(None, problem=("missing_image", f"no bytes in column {column!r}"))
    if verify != "header" or max_side:
        return None
    try:
        fmt = header_format(data)
        if fmt is None or fmt_wanted not in ("keep", EXT[fmt]):
            return None
        check_ends(data, fmt)
    except OSError as err:
        return Checked(None, problem=("corrupt_image", f"{type(err).__name__}: {err}"))
    return Checked(EXT[fmt], len(data))


def encode_image(data: bytes, fmt_wanted: str, verify: str, max_side: int, quality: int,
                 bands) -> tuple[bytes, str]:
    """-> (bytes, ext): the bytes as they are, or re-encoded. OSError/ValueError when unreadable."""
    from PIL import Image

    if is_tiff(data):
        if bands is None and fmt_wanted == "keep" and not max_side:
            to_rgb(data, None)   # a multi-band or 16-bit TIFF without --bands: BandsError
            return data, "tif"
        img, fmt, too_big = Image.fromarray(to_rgb(data, bands)), "TIFF", False
    else:
        img = Image.open(io.BytesIO(data))
        fmt = img.format
        if verify == "decode":
            img.load()
        else:
            check_ends(data, fmt)
        too_big = bool(max_side) and max(img.size) > max_side
        ext = EXT.get(fmt, (fmt or "bin").lower())
        if not too_big and fmt_wanted in ("keep", ext) and ext in _COPIED:
            return data, ext
    ext = EXT.get(fmt, "png")
    out = fmt_wanted if fmt_wanted != "keep" else ("png" if fmt in ("TIFF", "BMP", "GIF") else ext)
    img = img.convert("RGB") if img.mode not in ("RGB", "L") or out == "jpg" else img
    if too_big:
        s = max_side / max(img.size)
        img = img.resize((max(1, round(img.width * s)), max(1, round(img.height * s))), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    img.save(buf, format={"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}[out],
             **({"quality": quality} if out in ("jpg", "webp") else {}))
    return buf.getvalue(), out

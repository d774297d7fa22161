"""Number formats and the markdown table every results section uses: deterministic strings, so the
rendered page is byte-stable for the same JSON."""

from __future__ import annotations

import math
from collections.abc import Callable

MiB, GiB = 2**20, 2**30


def _unsigned_zero(text: str) -> str:
    """'-0.00' -> '0.00': a value that rounds to zero prints the same whatever its sign."""
    return text[1:] if text.startswith("-") and not text.strip("-0.,%") else text


def sig(x: float | None, n: int = 3) -> str:
    """n significant digits, never an exponent; the integer part keeps all its digits (40,103)."""
    if x is None:
        return "-"
    if x == 0:
        return "0"
    decimals = max(0, n - 1 - math.floor(math.log10(abs(x))))
    return _unsigned_zero(f"{x:,.{decimals}f}")


def fix(x: float | None, d: int = 2) -> str:
    return "-" if x is None else _unsigned_zero(f"{x:.{d}f}")


def pct(x: float | None, d: int = 0) -> str:
    return "-" if x is None else _unsigned_zero(f"{100 * x:.{d}f}%")


def spread(s: dict, fmt: Callable[[float], str]) -> str:
    """'median (min..max)' of a {median, min, max} record."""
    return f"{fmt(s['median'])} ({fmt(s['min'])}..{fmt(s['max'])})"


def pvm(rec: dict, unit: int, n: int = 4) -> str:
    """'predicted / measured (ratio)' of a {predicted, measured, ratio} record, in `unit` bytes."""
    both = f"{sig(rec['predicted'] / unit, n)} / {sig(rec['measured'] / unit, n)}"
    return both if rec["predicted"] == rec["measured"] == 0 else f"{both} ({fix(rec['ratio'])})"


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list]) -> list[str]:
    """A markdown table and the blank line after it; a row of another width is a bug here, not data."""
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a row of {len(row)} cells under {len(header)} columns: {row}")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines + [""]

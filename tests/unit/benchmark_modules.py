"""Import a script of benchmarks/ as a module, for unit tests of its parts. Import from here."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def import_benchmark(name: str) -> Iterator[ModuleType]:
    """Yields benchmarks/<name>.py as a module (for a pytest fixture); the scripts import
    `harness` and each other as siblings, so benchmarks/ is on sys.path meanwhile."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))

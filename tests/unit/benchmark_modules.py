"""Import a script of benchmarks/ as a module, for unit tests of its parts. Import from here."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Iterator


def import_benchmark(name: str) -> Iterator[ModuleType]:
    """Yields benchmarks.<name> (e.g. "comms.scaling") as a module, for a pytest fixture. The
    scripts are a package run from the repository root, where pytest runs too."""
    yield importlib.import_module(f"benchmarks.{name}")

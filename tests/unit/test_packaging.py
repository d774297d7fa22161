"""A non-editable install carries every subpackage: setup.cfg's `packages = find:` finds only folders
with an __init__.py, and rsclip_ds/reporting/ once had none, so `pip install .` left it out and the
installed package failed at import while every editable (test) install worked."""

from __future__ import annotations

from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]


def test_every_folder_of_modules_is_a_package_setuptools_finds():
    with_modules = {".".join(d.relative_to(ROOT).parts) for d in (ROOT / "rsclip_ds").rglob("*")
                    if d.is_dir() and any(d.glob("*.py"))} | {"rsclip_ds"}
    found = set(find_packages(where=str(ROOT), include=["rsclip_ds*"]))
    assert with_modules - found == set(), f"left out of a `pip install .`: {sorted(with_modules - found)} " \
                                          "(add an __init__.py)"

"""The field's standard evaluation sets as released: where each one is under a suite root, its
classes with the prompt phrase of each, its published test split, and the published numbers.

    find_sets(root)        -> the standard sets found under root, and the folders not recognised
    published_results()    -> the published zero-shot / retrieval numbers, each with its source

Interface shared by the suite runner (rsclip_ds/evaluation/suite.py) and the leakage check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rsclip_ds.evaluation.datasets import CaptionSet, ClassFolderSet


@dataclass(frozen=True)
class SetSpec:
    """One standard set, from its data file (rsclip_ds/evaluation/sets/<name>.json)."""
    name: str                          # the name the field's tables use: "AID", "NWPU-RESISC45", "RSICD"
    task: str                          # "classification" | "retrieval"
    classes: dict[str, str]            # classification: folder name as released -> prompt phrase
    source: str                        # where the layout, class list and split come from (URL)


@dataclass
class FoundSet:
    """A set found under a suite root, loaded with its split applied."""
    name: str                          # SetSpec.name, or the folder name of an unknown class-folder set
    root: Path                         # the folder it was found in
    split: str                         # what is scored: "test (published split list <file>)" / "all images"
    spec: SetSpec | None = None        # None: an unknown set, phrases from the folder-name rule
    classification: ClassFolderSet | None = None   # class_names are the prompt phrases
    retrieval: CaptionSet | None = None
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PublishedResult:
    """One number of a published table."""
    model: str                         # "Git-RSCLIP", "RemoteCLIP ViT-L-14", "GeoRSCLIP", "SkyCLIP50", "CLIP"
    set: str                           # SetSpec.name
    metric: str                        # "top1" (a fraction) | "mean_recall" (percent, as published)
    value: float
    source: str                        # URL of the table, and which table


def find_sets(root: str | Path, overrides: str | Path | None = None) -> tuple[list[FoundSet], list[Path]]:
    """Every standard set under ``root`` (by its published layouts) and the folders not recognised.
    ``overrides``: a JSON file of {set name: {folder name: prompt phrase}}."""
    raise NotImplementedError


def published_results() -> list[PublishedResult]:
    raise NotImplementedError

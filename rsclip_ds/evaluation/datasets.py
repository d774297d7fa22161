"""Evaluation sets as users have them: class folders (AID, NWPU-RESISC45, EuroSAT, UCMerced)
for zero-shot classification, Karpathy-style caption JSON (RSICD, RSITMD, UCM, Sydney) for
retrieval, and the prompt templates."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from rsclip_ds.config import ConfigError, EvalConfig

log = logging.getLogger("rsclip_ds")

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".tif", ".tiff", ".bmp", ".webp")


def class_name_from_folder(folder: str) -> str:
    """'denseResidential' / 'DenseResidential' / 'dense_residential' -> 'dense residential';
    'AnnualCrop' -> 'annual crop' (EuroSAT), 'baseball_diamond' -> 'baseball diamond' (NWPU)."""
    name = re.sub(r"[_\-\s]+", " ", folder)
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", name)        # camelCase / CamelCase boundary
    name = re.sub(r"(?<=[A-Z])(?=[A-Z][a-z])", " ", name)      # acronym then word: 'RSImage'
    return " ".join(name.split()).lower()


def default_templates_path() -> Path:
    return Path(str(resources.files("rsclip_ds") / "templates" / "remote_sensing.txt"))


def load_templates(path: str | Path | None = None) -> list[str]:
    """Prompt templates, one per line with a single '{}'; '#' lines and blank lines skipped."""
    path = Path(path) if path is not None else default_templates_path()
    if not path.is_file():
        raise ConfigError(f"templates file not found: {path} (one template per line, '{{}}' marks the "
                          f"class name; leave eval.templates unset for the shipped remote-sensing set)")
    templates = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.count("{}") != 1:
            raise ConfigError(f"{path}:{number}: a template needs exactly one '{{}}' for the class name, "
                              f"got {line!r}")
        templates.append(line)
    if not templates:
        raise ConfigError(f"{path} holds no templates")
    return templates


@dataclass
class ClassFolderSet:
    """A zero-shot set: image paths, their class ids, and the readable class names."""
    paths: list[Path]
    labels: list[int]
    class_names: list[str]
    folders: list[str]


def load_class_folders(root: str | Path) -> ClassFolderSet:
    """root/<ClassFolder>/<image> (AID, NWPU-RESISC45, EuroSAT, UCMerced's Images/)."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"zero-shot folder not found: {root} (expected one sub-folder per class)")
    folders = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if len(folders) < 2:
        raise ConfigError(f"{root} has {len(folders)} class folder(s); zero-shot needs >= 2 "
                          f"(point it at the folder that holds one folder per class)")
    images = []
    for folder in folders:
        found = list_images(root / folder)
        if not found:
            log.warning("class folder %s has no images (%s); it still competes as a class",
                        root / folder, ", ".join(IMAGE_EXTENSIONS))
        images.append(found)
    if not any(images):
        raise ConfigError(f"no images under {root}/*/ (extensions {', '.join(IMAGE_EXTENSIONS)})")
    return class_folder_set(folders, [class_name_from_folder(f) for f in folders], images)


def list_images(folder: Path) -> list[Path]:
    """The image files directly in ``folder`` (IMAGE_EXTENSIONS, any case), sorted."""
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())


def class_folder_set(folders: list[str], class_names: list[str], images: list[list[Path]]) -> ClassFolderSet:
    """A zero-shot set from explicit image lists, one list per class; label i is folders[i] / class_names[i]
    (the catalog's sets: nested class folders, a published split applied, phrases from the set's data file)."""
    if not len(folders) == len(class_names) == len(images):
        raise ValueError(f"{len(folders)} folders, {len(class_names)} class names, {len(images)} image lists")
    paths = [path for found in images for path in found]
    labels = [label for label, found in enumerate(images) for _ in found]
    return ClassFolderSet(paths, labels, list(class_names), list(folders))


@dataclass
class CaptionSet:
    """A retrieval set: N images, M captions, and the image index of every caption."""
    image_paths: list[Path]
    captions: list[str]
    text_image_index: list[int]


def _images_folder(json_path: Path, first: str, images_dir: Path | None) -> Path:
    candidates = [images_dir] if images_dir else [json_path.parent / "images", json_path.parent / "imgs",
                                                  json_path.parent / "RSICD_images", json_path.parent]
    for folder in candidates:
        if (Path(folder) / first).is_file():
            return Path(folder)
    raise ConfigError(f"{json_path}: image {first!r} not found in {', '.join(map(str, candidates))}; "
                      f"pass the image folder (eval.retrieval_images / --retrieval-images)")


def load_caption_json(path: str | Path, images_dir: str | Path | None = None,
                      split: str = "test") -> CaptionSet:
    """Karpathy-style JSON: {"images": [{"filename", "split", "sentences": [{"raw"}]}]}."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"caption JSON not found: {path}")
    entries = [e for e in json.loads(path.read_text())["images"] if e.get("split") == split]
    if not entries:
        raise ConfigError(f"{path} has no images with split {split!r} (set eval.retrieval_split / --split)")
    folder = _images_folder(path, entries[0]["filename"], Path(images_dir) if images_dir else None)
    images, captions, index = [], [], []
    for entry in entries:
        raws = [s["raw"].strip() for s in entry.get("sentences", []) if s.get("raw", "").strip()]
        if not raws:
            log.warning("%s: %s has no captions; left out", path, entry["filename"])
            continue
        index += [len(images)] * len(raws)
        images.append(folder / entry["filename"])
        captions += raws
    return CaptionSet(images, captions, index)


@dataclass
class EvalSets:
    """What one evaluation reads; loaded (and checked) once, before any training."""
    zero_shot: ClassFolderSet | None = None
    templates: list[str] | None = None
    retrieval: CaptionSet | None = None
    max_bad_fraction: float = 0.01    # unreadable images tolerated per set (skipped and counted)

    @classmethod
    def from_config(cls, cfg: EvalConfig) -> "EvalSets":
        zero_shot = load_class_folders(cfg.zero_shot_dir) if cfg.zero_shot_dir else None
        retrieval = (load_caption_json(cfg.retrieval_json, cfg.retrieval_images, cfg.retrieval_split)
                     if cfg.retrieval_json else None)
        if zero_shot is None and retrieval is None:
            raise ConfigError("nothing to evaluate: give a zero-shot class-folder set "
                              "(--zero-shot / eval.zero_shot_dir) and/or a caption JSON "
                              "(--retrieval / eval.retrieval_json)")
        from rsclip_ds.evaluation.prompts import zero_shot_templates

        templates = zero_shot_templates(cfg.templates, cfg.templates_set) if zero_shot else None
        return cls(zero_shot, templates, retrieval,
                   cfg.max_bad_fraction)


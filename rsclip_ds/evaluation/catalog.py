"""The field's standard evaluation sets as released: where each one is under a suite root, its
classes with the prompt phrase of each, its published test split, and the published numbers.

    find_sets(root)        -> the standard sets found under root, and the folders not recognised
    published_results()    -> the published zero-shot / retrieval numbers, each with its source

Interface shared by the suite runner (rsclip_ds/evaluation/suite.py) and the leakage check. The sets
are data: one JSON per set in rsclip_ds/evaluation/sets/ (its names, layouts, class folders as
released -> prompt phrase, split, sources and what was checked); docs/reference/eval-sets.md is
rendered from them (rsclip_ds/evaluation/catalog_page.py).

How a folder is recognised: its class folders (the folders holding images, up to LEAF_DEPTH levels
down, so RSI-CB256's category/class and Million-AID's three levels are found) are compared with
each set's release folder names, ignoring case, spaces, '_', '-' and '&' ('BareLand' = 'Bare Land'
= 'bare_land'). It is that set when >= MATCH of the set's classes are there and >= MATCH of its
class folders are the set's (the best overlap wins: RSI-CB128 and RSI-CB256 share 34 classes);
under one of the set's own folder names NAMED_MATCH of the set's classes are enough.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

from rsclip_ds.config import ConfigError
from rsclip_ds.evaluation.datasets import CaptionSet, ClassFolderSet, class_folder_set, load_caption_json
from rsclip_ds.evaluation.datasets import IMAGE_EXTENSIONS
from rsclip_ds.evaluation.phrases import phrase_for_folder, vocabulary

MATCH = 0.8          # share of a set's classes (and of a folder's class folders) that makes it that set
NAMED_MATCH = 0.5    # the same, for a folder carrying one of the set's names
LEAF_DEPTH = 3       # class folders are looked for this many levels below a set's folder
WALK_DEPTH = 8       # sets are looked for this deep under the root (EuroSAT all-bands nests 6 deep)
SPLIT_FOLDERS = ("train", "val", "valid", "validation", "test")
OVERRIDES_FORMAT = '{"<set name>": {"<class folder>": "<prompt phrase>"}}'


@dataclass(frozen=True)
class SetSpec:
    """One standard set, from its data file (rsclip_ds/evaluation/sets/<name>.json)."""
    name: str                          # the name the field's tables use: "AID", "NWPU-RESISC45", "RSICD"
    task: str                          # "classification" | "retrieval"
    classes: dict[str, str]            # classification: folder name as released -> prompt phrase
    source: str                        # where the layout, class list and split come from (URL)
    aliases: tuple[str, ...] = ()      # folder names users have for it ("NWPU_RESISC45", "RESISC45")
    layouts: tuple[str, ...] = ()      # the published layouts, as text ("UCMerced_LandUse/Images/<class>/...")
    extensions: tuple[str, ...] = ()   # the release's image file types (any of IMAGE_EXTENSIONS is read)
    split: dict | None = None          # {"files": [...]} split lists / {"folders": [...]} / {"field": "split"}
    protocol: str = ""                 # what is scored and how the published numbers scored it
    checked: str = ""                  # what of this file was checked against what, and what was not
    notes: tuple[str, ...] = ()
    caption_json: tuple[str, ...] = ()  # retrieval: the caption JSON's file names
    image_dirs: tuple[str, ...] = ()   # retrieval: the image folder beside it
    image_count: int | None = None     # retrieval: images in the JSON (tells UCM- from Sydney-captions)
    hierarchy: dict | None = None      # Million-AID: its level-1 / level-2 nodes and the path of each leaf
    groups: dict | None = None         # RSI-CB256: category folder -> class folders
    tiff_note: str = ""                # said when the set's images are TIFFs (EuroSAT's 13-band release)
    file: str = ""                     # the data file

    @property
    def keys(self) -> dict[str, str]:
        """normalised folder name -> folder name as released."""
        return {folder_key(f): f for f in self.classes}


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
    notes: list[str] = field(default_factory=list)   # how it was read (levels, layout), not problems


@dataclass(frozen=True)
class PublishedResult:
    """One number of a published table."""
    model: str                         # "Git-RSCLIP", "RemoteCLIP ViT-L-14", "GeoRSCLIP", "SkyCLIP50", "CLIP"
    set: str                           # SetSpec.name
    metric: str                        # "top1" (a fraction) | "mean_recall" (percent, as published)
    value: float
    source: str                        # URL of the table, and which table
    verified: bool = True              # read from the source's text here; False: quoted, not confirmed
    note: str = ""                     # protocol caveats ("fine-tuned on ...", "column RS2800/RSSCN7")


CLASSIFICATION, RETRIEVAL = "zero-shot classification", "retrieval"   # the protocols a set is scored by


def folder_key(name: str) -> str:
    """'BareLand' / 'Bare Land' / 'bare_land' / 'bare-land' -> 'bareland'."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _sets_folder():
    return resources.files("rsclip_ds") / "evaluation" / "sets"


def _spec(data: dict, file: str) -> SetSpec:
    allowed = {f.name for f in SetSpec.__dataclass_fields__.values()} - {"file"}
    if unknown := set(data) - allowed:
        raise ValueError(f"rsclip_ds/evaluation/sets/{file}: unknown keys {sorted(unknown)} (allowed: {sorted(allowed)})")
    tuples = {k: tuple(v) for k, v in data.items() if isinstance(v, list)}
    return SetSpec(**{**data, **tuples, "file": file})


@lru_cache(maxsize=1)
def catalog() -> tuple[SetSpec, ...]:
    """Every set of rsclip_ds/evaluation/sets/, in file order."""
    entries = sorted(_sets_folder().iterdir(), key=lambda e: e.name)
    return tuple(_spec(json.loads(e.read_text()), e.name) for e in entries
                 if e.name.endswith(".json") and e.name != "published.json")


def spec_named(name: str) -> SetSpec | None:
    """The set called ``name`` or one of its aliases (case and separators ignored)."""
    key = folder_key(name)
    for spec in catalog():
        if key in {folder_key(n) for n in (spec.name, *spec.aliases)}:
            return spec
    return None


def published_results(set_name: str | None = None) -> list[PublishedResult]:
    """The numbers of rsclip_ds/evaluation/sets/published.json (of one set, by SetSpec.name)."""
    data = json.loads((_sets_folder() / "published.json").read_text())
    results = [PublishedResult(**row) for row in data["results"]]
    return [r for r in results if set_name is None or r.set == set_name]


def load_overrides(path: str | Path | None) -> dict[str, dict[str, str]]:
    """{set name: {class folder: prompt phrase}}; the set key is a catalog name/alias or an unknown set's
    folder name; the folder key is the folder as on disk or as released (case and separators ignored)."""
    if path is None:
        return {}
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"class-name overrides file not found: {path} (JSON {OVERRIDES_FORMAT})")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: not JSON ({error}); expected {OVERRIDES_FORMAT}") from error
    if not isinstance(data, dict) or not all(
            isinstance(v, dict) and all(isinstance(p, str) and p.strip() for p in v.values()) for v in data.values()):
        raise ConfigError(f"{path}: expected {OVERRIDES_FORMAT} (non-empty phrases)")
    return data


def find_sets(root: str | Path, overrides: str | Path | None = None) -> tuple[list[FoundSet], list[Path]]:
    """Every standard set under ``root`` (by its published layouts) and the folders not recognised.
    ``overrides``: a JSON file of {set name: {folder name: prompt phrase}}."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"suite root not found: {root} (a folder holding evaluation sets, or one set's folder)")
    finder = _Finder(root, load_overrides(overrides))
    _, unrecognised = finder.walk(root, 0)
    if not finder.found and not unrecognised and finder.listing(root)[1]:
        unrecognised = [root]   # loose images, no class folders
    named = {folder_key(f.name) for f in finder.found}
    if stray := [k for k in finder.overrides if spec_named(k) is None and folder_key(k) not in named]:
        raise ConfigError(f"class-name overrides name no set: {stray}; the sets under {root}: "
                          f"{', '.join(f.name for f in finder.found) or 'none'} (keys are set names or the "
                          f"folder name of a set the catalog does not know)")
    return finder.found, unrecognised


class _Finder:
    """One walk of a suite root; directory listings are read once."""

    def __init__(self, root: Path, overrides: dict[str, dict[str, str]]):
        self.root, self.overrides = root, overrides
        self.classifiers = [s for s in catalog() if s.task == "classification"]
        self.captioners = [s for s in catalog() if s.task == "retrieval"]
        self.vocab = vocabulary([p for s in self.classifiers for p in s.classes.values()])
        self.found: list[FoundSet] = []
        self._listings: dict[Path, tuple[list[Path], list[Path], list[Path]]] = {}

    def listing(self, folder: Path) -> tuple[list[Path], list[Path], list[Path]]:
        """(sub-folders, images, other files) of ``folder``, sorted; hidden entries and __MACOSX left out."""
        if folder not in self._listings:
            dirs, images, files = [], [], []
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.name.startswith(".") or entry.name == "__MACOSX":
                        continue
                    if entry.is_dir():
                        dirs.append(Path(entry.path))
                    elif Path(entry.name).suffix.lower() in IMAGE_EXTENSIONS:
                        images.append(Path(entry.path))
                    else:
                        files.append(Path(entry.path))
            self._listings[folder] = (sorted(dirs), sorted(images), sorted(files))
        return self._listings[folder]

    def leaves(self, folder: Path, skip: frozenset[Path] = frozenset(), depth: int = LEAF_DEPTH) -> list[Path]:
        """The folders holding images, up to ``depth`` levels below ``folder``."""
        out = []
        for sub in self.listing(folder)[0]:
            if sub in skip:
                continue
            if self.listing(sub)[1]:
                out.append(sub)
            if depth > 1:
                out += self.leaves(sub, depth=depth - 1)
        return out

    def walk(self, folder: Path, depth: int) -> tuple[bool, list[Path]]:
        """(anything found at or under folder, the top-most folders under it holding images where nothing was
        found; folders without images, like MLRSNet's Labels/, are not evaluation data and not listed)."""
        before = len(self.found)
        consumed = self._caption_sets(folder)
        if self._split_set(folder, consumed) or self._class_set(folder, consumed):
            return True, []
        unrecognised = []
        for child in self.listing(folder)[0]:
            if child in consumed:
                continue
            found, inner = self.walk(child, depth + 1) if depth < WALK_DEPTH else (False, [])
            if found:
                unrecognised += inner
            elif inner or self.listing(child)[1]:
                unrecognised.append(child)
        return len(self.found) > before, unrecognised

    # ---------------------------------------------------------------- retrieval
    def _caption_sets(self, folder: Path) -> frozenset[Path]:
        files = {f.name: f for f in self.listing(folder)[2] if f.suffix.lower() == ".json"}
        consumed = set()
        for name, path in files.items():
            specs = [s for s in self.captioners if name in s.caption_json]
            spec = specs[0] if len(specs) == 1 else self._pick_caption_spec(folder, path, specs)
            if spec is None:
                continue
            try:
                captions = load_caption_json(path)
            except ConfigError as error:
                raise ConfigError(f"{spec.name} ({path}): {error}") from error
            image_dir = captions.image_paths[0].parent
            if image_dir != folder:
                consumed.add(image_dir)
            self.found.append(FoundSet(
                spec.name, folder, f"test (the 'split' field of {name}: {len(captions.image_paths)} images, "
                f"{len(captions.captions)} captions)", spec, retrieval=captions))
        return frozenset(consumed)

    def _pick_caption_spec(self, folder: Path, path: Path, specs: list[SetSpec]) -> SetSpec | None:
        """UCM- and Sydney-captions both ship dataset.json: by folder name, else by image count."""
        if not specs:
            return None
        names = {folder_key(p.name) for p in (folder, folder.parent)}
        for spec in specs:
            if names & {folder_key(a) for a in (spec.name, *spec.aliases)}:
                return spec
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        count = len(data.get("images", [])) if isinstance(data, dict) else -1
        return next((s for s in specs if s.image_count == count), None)

    # ---------------------------------------------------------------- classification
    def _named(self, folder: Path) -> SetSpec | None:
        """The set one of whose names ``folder`` (or one of its two parents) carries."""
        for candidate in (folder, *list(folder.parents)[:2]):
            spec = spec_named(candidate.name) if candidate.name else None
            if spec is not None and spec.task == "classification":
                return spec
        return None

    def _match(self, folder: Path, leaves: list[Path]) -> SetSpec | None:
        """The set these class folders are, or None. Two sets side by side are not one: a class name
        twice, or a sub-folder of groups (a set's folder, unlike RSI-CB's categories) mostly not the set's."""
        found = [folder_key(leaf.name) for leaf in leaves]
        names = set(found)
        if len(names) < len(found):
            return None
        groups: dict[str, set[str]] = {}
        for leaf, key in zip(leaves, found):
            parts = leaf.relative_to(folder).parts
            if len(parts) > 1:
                groups.setdefault(parts[0], set()).add(key)
        named, best, best_score = self._named(folder), None, 0.0
        for spec in self.classifiers:
            keys = set(spec.keys)
            hit = len(names & keys)
            need = NAMED_MATCH if spec is named else MATCH
            if hit / len(keys) < need or hit / len(names) < MATCH:
                continue
            if any(len(group & keys) < MATCH * len(group) for group in groups.values()):
                continue
            score = hit / len(names | keys) + (1.0 if spec is named else 0.0)
            if score > best_score:
                best, best_score = spec, score
        return best

    def _identify(self, folder: Path, skip: frozenset[Path] = frozenset()):
        """('known', spec, leaves) / ('unknown', None, class folders) / None for a folder's class folders."""
        leaves = self.leaves(folder, skip)
        if len(leaves) >= 2 and len({leaf.relative_to(folder).parts[0] for leaf in leaves}) >= 2:
            spec = self._match(folder, leaves)
            if spec is not None:
                return "known", spec, leaves
        subs = [s for s in self.listing(folder)[0] if s not in skip]
        direct = [s for s in subs if self.listing(s)[1]]
        if len(direct) >= 2 and not any(self.leaves(s) for s in subs if s not in direct):
            return "unknown", None, direct
        return None

    def _class_set(self, folder: Path, consumed: frozenset[Path]) -> bool:
        identified = self._identify(folder, consumed)
        if identified is None:
            return False
        kind, spec, leaves = identified
        self.found.append(self._load_known(folder, spec, leaves, folder) if kind == "known"
                          else self._load_unknown(folder, leaves, folder))
        return True

    def _split_set(self, folder: Path, consumed: frozenset[Path]) -> bool:
        """A set kept as <set>/train/... and <set>/test/... (Million-AID, or a user's own split): test/ is scored."""
        kids = {s.name.lower(): s for s in self.listing(folder)[0]
                if s not in consumed and s.name.lower() in SPLIT_FOLDERS}
        if not {"test", "train"} & set(kids):
            return False
        for name in ("test", "train"):
            identified = self._identify(kids[name]) if name in kids else None
            if identified is None:
                continue
            kind, spec, leaves = identified
            loaded = (self._load_known(kids[name], spec, leaves, folder) if kind == "known"
                      else self._load_unknown(kids[name], leaves, folder))
            loaded.split = (f"test (the set's own test/ folder: {len(loaded.classification.paths)} images)"
                            if name == "test" else
                            f"all images of train/ ({len(loaded.classification.paths)}; no test/ folder with "
                            f"class folders)")
            self.found.append(loaded)
            return True
        return False

    def _load_known(self, folder: Path, spec: SetSpec, leaves: list[Path], set_root: Path) -> FoundSet:
        by_key: dict[str, list[Path]] = {}
        extra = []
        for leaf in leaves:
            key = folder_key(leaf.name)
            (by_key.setdefault(key, []) if key in spec.keys else extra).append(leaf)
        released = [f for f in spec.classes if folder_key(f) in by_key]
        on_disk = [by_key[folder_key(f)][0].name for f in released]
        images = [sorted(i for leaf in by_key[folder_key(f)] for i in self.listing(leaf)[1]) for f in released]
        overrides = self._overrides_for(spec.name, spec.aliases, on_disk + released)
        phrases = [overrides.get(folder_key(d), overrides.get(folder_key(r), spec.classes[r]))
                   for d, r in zip(on_disk, released)]
        split, images, warnings = self._apply_split(spec, folder, set_root, images)
        if missing := [f for f in spec.classes if folder_key(f) not in by_key]:
            warnings.append(f"{spec.name}: {len(missing)} of its {len(spec.classes)} classes are not under {folder} "
                            f"({', '.join(missing)}); they do not compete, so the score is not the published protocol's")
        if extra:
            warnings.append(f"{spec.name}: folders that are not its classes left out: "
                            f"{', '.join(str(e.relative_to(folder)) for e in extra)}")
        if spec.tiff_note and any(p.suffix.lower() in (".tif", ".tiff") for found in images for p in found):
            warnings.append(f"{spec.name}: {spec.tiff_note}")
        return FoundSet(spec.name, set_root, split, spec, class_folder_set(on_disk, phrases, images),
                        warnings=warnings, notes=self._level_notes(spec, folder, by_key))

    def _level_notes(self, spec: SetSpec, folder: Path, by_key: dict[str, list[Path]]) -> list[str]:
        depths = [len(leaf.relative_to(folder).parts) for leaves in by_key.values() for leaf in leaves]
        if max(depths) <= 1:
            return []
        counts = ", ".join(f"{depths.count(d)} at level {d}" for d in sorted(set(depths), reverse=True))
        return [f"{spec.name}: scored at the finest level that has images, the folder holding each image: "
                f"{len(by_key)} classes ({counts} below {folder.name}/)"]

    def _load_unknown(self, folder: Path, class_folders: list[Path], set_root: Path) -> FoundSet:
        name = set_root.name
        overrides = self._overrides_for(name, (), [c.name for c in class_folders])
        phrases, warnings = [], []
        for sub in class_folders:
            phrase, warning = phrase_for_folder(name, sub.name, self.vocab)
            if folder_key(sub.name) in overrides:
                phrase, warning = overrides[folder_key(sub.name)], None
            phrases.append(phrase)
            warnings += [warning] if warning else []
        if (named := self._named(set_root)) is not None:
            warnings.insert(0, f"{name}: named like {named.name} but its class folders are not {named.name}'s "
                               f"(see docs/reference/eval-sets.md); scored as an unknown set")
        images = [self.listing(sub)[1] for sub in class_folders]
        return FoundSet(name, set_root, "all images (not a catalog set: no published split)", None,
                        class_folder_set([c.name for c in class_folders], phrases, images), warnings=warnings)

    def _overrides_for(self, name: str, aliases: tuple[str, ...], folders: list[str]) -> dict[str, str]:
        """normalised folder -> phrase for this set; an entry naming no folder of it stops the run."""
        names = {folder_key(n) for n in (name, *aliases)}
        chosen = {}
        for set_name, table in self.overrides.items():
            if folder_key(set_name) in names:
                chosen.update({folder_key(f): p.strip() for f, p in table.items()})
        valid = {folder_key(f) for f in folders}
        if stray := sorted(set(chosen) - valid):
            raise ConfigError(f"class-name overrides for {name} name folders it does not have: {stray}; "
                              f"its class folders: {', '.join(sorted(set(folders)))}")
        return chosen

    def _apply_split(self, spec: SetSpec, folder: Path, set_root: Path, images: list[list[Path]]):
        """(split description, images kept, warnings): the published split list beside the data, if any."""
        files = (spec.split or {}).get("files", [])
        if not files:
            return "all images (no published test split)", images, []
        listed = self._split_file(set_root, files)
        if listed is None:
            return (f"all images (the published test split {' / '.join(files)} is not beside the data)",
                    images, [])
        names = {line.strip() for line in listed.read_text().splitlines() if line.strip()}
        stems = {Path(n).stem: n for n in names}
        kept = [[p for p in found if p.name in names or p.stem in stems] for found in images]
        n_kept, n_all = sum(map(len, kept)), sum(map(len, images))
        if n_kept == 0:
            return (f"all images ({listed.name} lists none of them)", images,
                    [f"{spec.name}: {listed} names none of the images under {folder}; the whole set is scored"])
        warnings = []
        if (absent := len(names) - n_kept) > 0:
            warnings.append(f"{spec.name}: {absent} of the {len(names)} images {listed.name} lists are not "
                            f"under {folder}")
        return f"test (published split list {listed.name}: {n_kept} of {n_all} images)", kept, warnings

    def _split_file(self, set_root: Path, files: list[str]) -> Path | None:
        """A split list in the set's folder or above it, up to two levels above the suite root."""
        stop = list(self.root.parents)[:2]
        candidates = [set_root, *[p for p in set_root.parents if p == self.root or self.root in p.parents]]
        for folder in [*candidates, *stop]:
            for name in files:
                if (folder / name).is_file():
                    return folder / name
        return None

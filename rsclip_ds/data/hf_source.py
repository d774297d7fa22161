"""``make-shards --hf-dataset``: a Hugging Face dataset as the hub publishes it -> ordered rows.

What FOLDER_OR_ID may be:
  a folder laid out as the hub lays a dataset repo   data/train-00000-of-00010.parquet (or .arrow),
                                                     a README with `configs:`; resolved by the
                                                     `datasets` library's own data-file rules
  a ``save_to_disk`` folder                          state.json + data-*.arrow (a DatasetDict:
                                                     one such folder per split)
  one .parquet / .arrow file
  a hub id (lcybuaa/Git-10M)                         fetched with huggingface_hub into the standard
                                                     cache (datasets--lcybuaa--Git-10M/snapshots/
                                                     <commit>/...); under HF_HUB_OFFLINE=1 read
                                                     from the cache only, as model.pretrained is

Rows are read through ``datasets`` in streaming mode (``load_dataset(..., streaming=True)``), a
record batch at a time, so 10.5M rows never sit in memory; the ``Image`` column is cast to
``decode=False``: its encoded bytes pass through untouched. The files of a split are kept in the
order the library resolves them and their row counts are read from the file metadata, so a
resumed conversion starts at file f, row r (skipping whole files without reading them) and sees
exactly the rows an uninterrupted one saw after that point.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from rsclip_ds.hub import is_hub_id

_MODULES = {".parquet": "parquet", ".arrow": "arrow"}


@dataclass
class HFSource:
    """The ordered data files of one split, their row counts and features."""
    label: str                       # what the user named (folder, file or hub id)
    module: str                      # 'parquet' | 'arrow' (the datasets packaged builder)
    files: list[str]
    rows: list[int]
    features: dict = field(default_factory=dict)    # column -> datasets feature (its repr)
    commit: str | None = None        # a hub snapshot's commit

    @property
    def total(self) -> int:
        return sum(self.rows)

    @property
    def columns(self) -> list[str]:
        return list(self.features)

    @property
    def float32_columns(self) -> tuple[str, ...]:
        """Columns of float32 numbers (Git-10M's img_quality_score): arrow hands them over as the
        float64 of the float32 (0.9800000190734863), ingest writes their shortest float32 form."""
        return tuple(c for c, f in self.features.items() if getattr(f, "dtype", None) == "float32")

    def fingerprint(self) -> dict:
        """What a resumed conversion must find again (file names, row counts, the commit)."""
        return {"files": [Path(f).name for f in self.files], "rows": self.rows, "commit": self.commit}

    def iter_batches(self, start: int = 0, batch_rows: int = 256, image_column: str | None = None
                     ) -> Iterator[dict[str, list]]:
        """Columnar batches ({column: [values]}) of rows ``start`` .. end, in order."""
        import datasets

        first, offset = _locate(self.rows, start)
        if first >= len(self.files):
            return
        # parquet: record batches of batch_rows, not whole row groups (the reader's default): the
        # memory held is a chunk's rows, whatever row-group size the publisher chose
        extra = {"batch_size": batch_rows} if self.module == "parquet" else {}
        ds = datasets.load_dataset(self.module, data_files={"rows": self.files[first:]}, split="rows",
                                   streaming=True, **extra)
        feats = ds.features or {}
        if image_column and isinstance(feats.get(image_column), datasets.Image):
            ds = ds.cast_column(image_column, datasets.Image(decode=False))   # bytes as they are
        if offset:
            ds = ds.skip(offset)
        yield from ds.iter(batch_size=batch_rows)


def _locate(rows: list[int], start: int) -> tuple[int, int]:
    """Global row ``start`` -> (file index, row within it)."""
    for i, n in enumerate(rows):
        if start < n:
            return i, start
        start -= n
    return len(rows), 0


def _count_rows(path: str, module: str) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if module == "parquet":
        return pq.ParquetFile(path).metadata.num_rows
    with pa.memory_map(path) as src:   # save_to_disk writes the IPC stream format, others the file one
        try:
            return pa.ipc.open_stream(src).read_all().num_rows
        except pa.ArrowInvalid:
            src.seek(0)
            return pa.ipc.open_file(src).num_rows


def _features(path: str, module: str) -> dict:
    """Column -> feature, from the schema's 'huggingface' metadata (or the arrow types)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    if module == "parquet":
        schema = pq.read_schema(path)
    else:
        with pa.memory_map(path) as src:
            try:
                schema = pa.ipc.open_stream(src).schema
            except pa.ArrowInvalid:
                src.seek(0)
                schema = pa.ipc.open_file(src).schema
    return dict(datasets.Features.from_arrow_schema(schema))


def _from_files(label: str, files: list[str], commit: str | None = None) -> HFSource:
    modules = {_MODULES.get(Path(f).suffix.lower()) for f in files}
    if len(modules) != 1 or None in modules:
        raise ValueError(f"--hf-dataset {label}: data files of one kind (.parquet or .arrow) expected, got "
                         f"{sorted({Path(f).suffix for f in files})}")
    module = modules.pop()
    return HFSource(label, module, files, [_count_rows(f, module) for f in files], _features(files[0], module),
                    commit)


def _saved(folder: Path, split: str) -> list[str] | None:
    """save_to_disk's data files (a Dataset folder, or the split's folder of a DatasetDict)."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits:
            raise ValueError(f"--hf-dataset {folder}: a saved DatasetDict without split {split!r}; its "
                             f"splits: {splits} (choose one with --split)")
        folder = folder / split
    if not (folder / "state.json").is_file():
        return None
    state = json.loads((folder / "state.json").read_text())
    return [str(folder / f["filename"]) for f in state["_data_files"]]


def _from_folder(folder: Path, label: str, split: str, config: str | None, commit: str | None) -> HFSource:
    saved = _saved(folder, split)
    if saved is not None:
        return _from_files(label, saved, commit)
    import datasets
    from datasets.exceptions import DataFilesNotFoundError

    try:
        builder = datasets.load_dataset_builder(str(folder), name=config)
    except (DataFilesNotFoundError, FileNotFoundError) as err:
        raise ValueError(f"--hf-dataset {label}: no data files found in {folder} ({err}); expected a dataset "
                         "repo layout (data/train-*.parquet or *.arrow), a save_to_disk folder (state.json) "
                         "or a .parquet/.arrow file") from None
    except ValueError as err:   # an unknown config name
        raise ValueError(f"--hf-dataset {label}: {err} (choose one with --hf-config)") from None
    files = (builder.config.data_files or {}).get(split)
    if not files:
        raise ValueError(f"--hf-dataset {label}: no split {split!r}; it has "
                         f"{sorted(builder.config.data_files or {})} (choose one with --split)")
    return _from_files(label, [str(f) for f in files], commit)


def resolve_hf_dataset(spec: str, *, split: str = "train", config: str | None = None,
                       revision: str | None = None) -> HFSource:
    """FOLDER_OR_ID (see the module doc) -> the split's HFSource. Errors are ValueErrors that name
    the fix (the CLI turns them into ConfigError)."""
    path = Path(spec)
    if path.is_file():
        return _from_files(spec, [str(path)])
    if path.is_dir():
        return _from_folder(path, spec, split, config, None)
    if not is_hub_id(spec):
        raise ValueError(f"--hf-dataset {spec}: no such file or folder, and not a hub id (owner/name)")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    rev = f" --revision {revision}" if revision else ""
    try:
        folder = Path(snapshot_download(spec, repo_type="dataset", revision=revision))
    except LocalEntryNotFoundError:
        raise ValueError(f"--hf-dataset {spec}{rev}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                         "and it could not be fetched (HF_HUB_OFFLINE=1 reads the cache only; or no network). "
                         f"Fetch it where there is a network with `hf download {spec} --repo-type dataset{rev}` "
                         "(same HF_HOME / HF_HUB_CACHE), or pass the downloaded folder") from None
    except RepositoryNotFoundError:
        raise ValueError(f"--hf-dataset {spec}: the hub has no such dataset (or it is gated: `hf auth login`)") from None
    except RevisionNotFoundError:
        raise ValueError(f"--revision {revision} does not exist for dataset {spec}") from None
    return _from_folder(folder, spec, split, config, folder.name)


# --------------------------------------------------------------------------- metadata

def tile_centre(location: str) -> tuple[float, float] | None:
    """Git-10M's Google_location 'Z_X_Y' (slippy-map tile indices) -> the tile centre's
    (latitude, longitude) in degrees (Web Mercator: lon = x/2^Z*360-180, lat = atan(sinh(pi(1-2y/2^Z))),
    at x+0.5, y+0.5); None for anything else (public-dataset rows carry no location)."""
    try:
        z, x, y = (int(p) for p in str(location).split("_"))
    except (TypeError, ValueError):
        return None
    n = 2.0 ** z
    if z < 0 or not (0 <= x < n and 0 <= y < n):
        return None
    lon = (x + 0.5) / n * 360.0 - 180.0
    lat = math.degrees(math.atan(math.sinh(math.pi * (1 - 2 * (y + 0.5) / n))))
    return round(lat, 6), round(lon, 6)

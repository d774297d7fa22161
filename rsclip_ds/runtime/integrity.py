"""Checkpoint integrity: what a save wrote, a full disk during it, the manifest, verification.

A save (checkpoint.Checkpointer.save) writes every file through one `SaveWrites` per rank:
DeepSpeed's shards too, by handing DeepSpeed's checkpoint engine a wrapper for that save
(`deepspeed_writes`). Each file is written through a sink that hashes the bytes on their way
(xxh3_128: no read-back), then flushed and fsynced (NFS reports a full disk or quota at
close/fsync). A write that finds no room (ENOSPC, EDQUOT) is recorded, not raised: this rank
writes nothing more but still reaches every collective of DeepSpeed's save and of ours, so that
the ranks can agree on the outcome (`storage.gather_on_every_rank`) instead of one rank raising
while the others wait in a barrier. (torch.save given a path turns a full disk into
"RuntimeError: basic_ios::clear: iostream error"; through a file object it keeps the errno.)

The manifest, {tag}/rsclip_manifest.json, lists every file of the tag (path relative to the tag
folder, size, xxh3_128, the rank that wrote it); rank 0 writes it from what every rank sent,
before rsclip_meta.json and before the pointer moves. `verify_files` checks sizes (a stat per
file) and, unless asked not to, checksums; on resume each rank checks the files its own rank
number wrote (`share`), so no rank reads the whole checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import xxhash

from rsclip_ds.runtime.storage import free_bytes, is_no_space, mount_of

MANIFEST = "rsclip_manifest.json"
ALGORITHM = "xxh3_128"       # ~0.06 s/GiB on one core (docs/results/faults.md#checksum): the disk is slower
CHUNK = 8 << 20
# not listed: the meta and the manifest themselves (written after), temp files, the universal
# conversion (made later, by a resume on another number of ranks; it has its own marker)
UNLISTED_DIRS = ("universal", "universal.partial")


def digest(path: Path) -> tuple[int, str]:
    """(bytes, xxh3_128 hex) of a file, read in 8 MiB chunks into one buffer."""
    h, size, view = xxhash.xxh3_128(), 0, memoryview(bytearray(CHUNK))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


# --------------------------------------------------------------------------- writing

@dataclass(frozen=True)
class WriteFailure:
    """A rank's write that found no room: what every rank's DiskFull message is made of."""
    rank: int
    path: str
    errno: int
    free: int      # bytes free on that file system when it failed
    mount: str     # 'DEVICE mounted at MOUNTPOINT'

    @property
    def reason(self) -> str:
        name = errno.errorcode.get(self.errno, str(self.errno))
        return {"ENOSPC": "no space left on device", "EDQUOT": "disk quota exceeded"}.get(name, name) + f" ({name})"


class _Sink:
    """The file object torch.save writes to: counts and hashes the bytes; records the OSError of a
    failed write (torch re-raises it as a RuntimeError); ``limit`` bytes, then ENOSPC (fault injection)."""

    def __init__(self, raw: BinaryIO, path: Path, limit: int | None):
        self.raw, self.path, self.limit = raw, path, limit
        self.size, self.hash, self.error = 0, xxhash.xxh3_128(), None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            if self.limit is not None and self.size + len(view) > self.limit:
                self.raw.write(view[:self.limit - self.size])   # a torn file, as a full disk leaves one
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (faults.inject_enospc_in_save_at_step)",
                              str(self.path))
            self.raw.write(view)
        except OSError as err:
            self.error = err
            raise
        self.hash.update(view)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self.raw.flush()


class SaveWrites:
    """One rank's writes of one save into ``folder``: the manifest entries of the files written,
    and the first write that found no room (`failure`), after which the rest are skipped.
    ``fail_after``: fault injection, the first file written fails like a full disk after that many bytes."""

    def __init__(self, folder: Path, rank: int, fail_after: int | None = None):
        self.folder, self.rank, self.fail_after = Path(folder), rank, fail_after
        self.entries: dict[str, dict[str, Any]] = {}
        self.failure: WriteFailure | None = None

    def write(self, path: Path | str, fill: Callable[[Any], None]) -> None:
        """``fill(file)`` writes ``path``; then flush and fsync. A full disk becomes `failure`."""
        if self.failure is not None:
            return
        path = Path(path)
        limit, self.fail_after = self.fail_after, None
        with self.no_space(path):
            with open(path, "wb") as raw:
                sink = _Sink(raw, path, limit)
                try:
                    fill(sink)
                except Exception:
                    if sink.error is not None:
                        raise sink.error from None
                    raise
                raw.flush()
                os.fsync(raw.fileno())
            self._add(path, sink.size, sink.hash.hexdigest())

    def write_bytes(self, path: Path, data: bytes) -> None:
        self.write(path, lambda f: f.write(data))

    @contextlib.contextmanager
    def no_space(self, path: Path) -> Iterator[None]:
        """Around writes made by others (DeepSpeed's other checkpoint engines, save_pretrained): a
        full disk or quota is recorded as `failure` and the block ends; other errors pass."""
        try:
            yield
        except OSError as err:
            if not is_no_space(err):
                raise
            self.record(err, path)

    def record(self, err: OSError, path: Path) -> None:
        """A full disk or quota (the first one counts): this rank writes nothing more in this save."""
        if self.failure is None:
            self.failure = WriteFailure(self.rank, str(err.filename or path), err.errno, free_bytes(self.folder),
                                        mount_of(self.folder))

    def add_written(self, path: Path) -> None:
        """A file (or every file under a folder) that another writer made: hashed by reading it back."""
        if self.failure is not None:
            return
        path = Path(path)
        for p in ([path] if path.is_file() else sorted(q for q in path.rglob("*") if q.is_file())):
            self._add(p, *digest(p))

    def _add(self, path: Path, size: int, hexdigest: str) -> None:
        self.entries[path.relative_to(self.folder).as_posix()] = {"size": size, ALGORITHM: hexdigest,
                                                                   "rank": self.rank}

    def report(self) -> dict[str, Any]:
        """What this rank sends to the others after its writes (small: a few entries)."""
        return {"failure": asdict(self.failure) if self.failure else None, "entries": self.entries}


class _DeepSpeedWriter:
    """DeepSpeed's checkpoint engine for one save, its `save` through SaveWrites; the rest delegated."""

    def __init__(self, inner, writes: SaveWrites):
        self._inner, self._writes = inner, writes

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def save(self, state_dict, path: str) -> None:
        import torch
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        if type(self._inner) is TorchCheckpointEngine:   # what it does, to a file object we hold
            zipped = self._inner.zipfile_serialization
            self._writes.write(path, lambda f: torch.save(state_dict, f, _use_new_zipfile_serialization=zipped))
            return
        if self._writes.failure is None:   # another engine (fast, nebula, decoupled): its own writes
            with self._writes.no_space(Path(path)):
                self._inner.save(state_dict, path)
                self._writes.add_written(Path(path))


@contextlib.contextmanager
def deepspeed_writes(engine, writes: SaveWrites) -> Iterator[None]:
    """DeepSpeed's save_checkpoint writes through ``writes`` inside this block (engine.checkpoint_engine
    is DeepSpeed's pluggable writer; it is put back after). Engines without one pass untouched."""
    inner = getattr(engine, "checkpoint_engine", None)
    if inner is None:
        yield
        return
    engine.checkpoint_engine = _DeepSpeedWriter(inner, writes)
    try:
        yield
    finally:
        engine.checkpoint_engine = inner


# --------------------------------------------------------------------------- the manifest

def listed_files(folder: Path, skip: tuple[str, ...] = ()) -> list[str]:
    """The files of a tag folder a manifest lists (relative paths, sorted): all but the manifest,
    the names in ``skip``, hidden (temporary) files and the universal conversion."""
    out = []
    for p in Path(folder).rglob("*"):
        rel = p.relative_to(folder)
        if p.is_file() and rel.parts[0] not in UNLISTED_DIRS and p.name not in (MANIFEST, *skip) \
                and not p.name.startswith("."):
            out.append(rel.as_posix())
    return sorted(out)


def build_manifest(folder: Path, tag: str, reports: list[dict[str, Any]], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every rank's entries, plus any file of the folder no rank claimed (hashed here)."""
    files: dict[str, dict[str, Any]] = {}
    for report in reports:
        files.update(report["entries"])
    for rel in listed_files(folder, skip):
        if rel not in files:
            size, h = digest(Path(folder) / rel)
            files[rel] = {"size": size, ALGORITHM: h, "rank": 0}
    return {"version": 1, "tag": tag, "algorithm": ALGORITHM, "bytes": sum(f["size"] for f in files.values()),
            "files": dict(sorted(files.items()))}


def read_manifest(folder: Path) -> dict[str, Any] | None:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def verify_files(folder: Path, manifest: dict[str, Any], checksums: bool = True,
                 share: tuple[int, int] = (0, 1)) -> list[str]:
    """Problems of the files of ``manifest`` in ``folder``, one line each naming the file ([] when
    intact). ``share`` (rank, world): only the files whose writer rank % world is this rank."""
    rank, world = share
    problems = []
    for rel, entry in manifest["files"].items():
        if entry.get("rank", 0) % world != rank:
            continue
        path = Path(folder) / rel
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if size != entry["size"]:
            cut = " (truncated)" if size < entry["size"] else ""
            problems.append(f"{path}: {size:,} bytes, the manifest says {entry['size']:,}{cut}")
        elif checksums and digest(path)[1] != entry[manifest.get("algorithm", ALGORITHM)]:
            problems.append(f"{path}: {ALGORITHM} checksum differs from the manifest (the bytes changed)")
    return problems


def verify_tag(folder: Path, checksums: bool = True, share: tuple[int, int] = (0, 1)) -> list[str] | None:
    """verify_files against the folder's manifest; None when it has none (an older rsclip_ds wrote it)."""
    try:
        manifest = read_manifest(folder)
    except (OSError, ValueError) as err:
        return [f"{Path(folder) / MANIFEST}: unreadable ({err})"] if share[0] == 0 else []
    if manifest is None:
        return None
    return verify_files(folder, manifest, checksums, share)


# --------------------------------------------------------------------------- disk space

class DiskFullError(RuntimeError):
    """A save found no room on some rank; raised on every rank with the same message (the trainer
    turns it into train.DiskFull, exit code 6)."""


def human(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError


def param_counts(model) -> tuple[int, int]:
    """(parameters, trainable parameters) of a module; ZeRO-3's partitioned ones by their ds_numel."""
    total = trainable = 0
    for p in model.parameters():
        n = getattr(p, "ds_numel", p.numel())
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


def checkpoint_bytes(params: int, trainable: int, precision: str, master: str = "fp32", stage: int = 2) -> int:
    """Bytes of one checkpoint, every rank's files together, from the memory model's bytes per
    parameter (planning.memory.state_bytes: p for the weights, k for the optimizer's fp32 master
    and Adam moments): stages 0/1/2 write the module once (p per parameter, DeepSpeed's model-state
    file), ZeRO-2/3 the frozen parameters again as p-byte fragments, every stage the optimizer
    state of the trainable ones (k each, split over the ranks under ZeRO). Stage 0 (the ddp profile)
    writes it once, into rank 0's model-state file: torch's AdamW m and v (k = 8: fp32, amp_bf16, amp,
    no master copy), or DeepSpeed's FP16_UnfusedOptimizer state with its fp32 copy of the weights (k = 12:
    bf16, fp16). The small files (hf/, each rank's RNG file, the history, DeepSpeed's bookkeeping) are
    left out: tens of KB to a few MB."""
    from rsclip_ds.planning.memory import state_bytes

    p, _, k = state_bytes(precision, master, stage)
    weights = p * params if stage < 3 else 0
    fragments = p * (params - trainable) if stage >= 2 else 0
    return weights + fragments + k * trainable


def saves_in_run(every: int, at_end: bool, steps: int, start: int = 0) -> int:
    """How many checkpoints a run from step ``start`` to ``steps`` writes."""
    regular = steps // every - start // every if every else 0
    end = at_end and not (every and steps % every == 0)
    return regular + int(end and steps > start)


def space_shortfall(folder: Path, per_checkpoint: int, keep_last: int, saves: int, existing: int) -> str | None:
    """None when the file system of ``folder`` holds what this run's checkpoints add at their peak
    (checkpoint.keep_last kept + the one being written, less the ``existing`` ones already there);
    else a warning with the numbers and the ways out."""
    count = min(keep_last + 1, existing + saves) - existing
    if count <= 0 or per_checkpoint <= 0:
        return None
    need, free = count * per_checkpoint, free_bytes(folder)
    if free >= need:
        return None
    there = f", less the {existing} already there" if existing else ""
    return (f"disk space: output_dir {folder} ({mount_of(folder)}) has {human(free)} free, but this run's checkpoints "
            f"need about {human(need)} more: {count} x {human(per_checkpoint)} (checkpoint.keep_last={keep_last} kept "
            f"+ the one being written{there}). A save that runs out of room stops the run (exit code 6, the torn "
            f"checkpoint removed); free space, lower checkpoint.keep_last or put output_dir on a larger file system")


def disk_full_message(tag: str, failures: list[WriteFailure], needed: int | None, intact: str | None,
                      keep_last: int) -> str:
    """The one message every rank raises after a save that found no room."""
    first = failures[0]
    ranks = ("rank " if len(failures) == 1 else "ranks ") + ", ".join(str(f.rank) for f in failures)
    size = (f"; one checkpoint takes about {human(needed)}, checkpoint.keep_last={keep_last} needs about "
            f"{human(needed * (keep_last + 1))} with the one being written" if needed else "")
    resume = (f"the newest intact checkpoint is {intact}: free space there (or lower checkpoint.keep_last, or move "
              f"output_dir with its checkpoints folder), then continue with `--resume auto`" if intact else
              "no intact checkpoint is left: free space, then start again (`--resume auto` starts fresh)")
    return (f"checkpoint {tag} not saved: {ranks} found {first.reason} writing {first.path} "
            f"({first.mount}: {human(first.free)} free{size}). The incomplete {tag} was removed; {resume}")

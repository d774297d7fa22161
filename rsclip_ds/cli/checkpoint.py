"""`rsclip-ds verify-checkpoint PATH`: check checkpoints against their manifests by hand.

PATH is a tag folder (step########), a checkpoints folder or a run's output_dir (every tag).
One line per tag: intact, broken (each bad file named), incomplete (no rsclip_meta.json: a save
that did not finish, never loaded) or unverified (no manifest: an older rsclip_ds wrote it);
then the tag `--resume latest` would load. Exit 0 when every complete tag checked is intact or
unverified, 1 when one is broken (or the named tag folder is incomplete), 2 when PATH holds no
checkpoint (docs/reference/exit-codes.md).
"""

from __future__ import annotations

from pathlib import Path

from rsclip_ds.config import ConfigError


def register(sub) -> None:
    p = sub.add_parser("verify-checkpoint", help="check checkpoints against their manifests (sizes, checksums)")
    p.add_argument("path", type=Path, help="a step######## folder, a checkpoints/ folder or a run's output_dir")
    p.add_argument("--size-only", action="store_true", help="compare sizes only (a stat per file), no checksums")
    p.set_defaults(handler=run)


def _tags(path: Path) -> tuple[Path, list[str], bool]:
    """(checkpoint root, tags to check, whether PATH named one tag)."""
    from rsclip_ds.checkpoint import CHECKPOINT_DIR, META, _TAG

    if _TAG.match(path.name) and path.is_dir():
        return path.parent, [path.name], True
    root = path / CHECKPOINT_DIR if (path / CHECKPOINT_DIR).is_dir() else path
    tags = sorted(p.name for p in root.iterdir() if _TAG.match(p.name) and p.is_dir()) if root.is_dir() else []
    if not tags:
        raise ConfigError(f"verify-checkpoint {path}: no checkpoint there (no step######## folder, nor a "
                          f"'{CHECKPOINT_DIR}' folder holding one); pass a run's output_dir, its checkpoints "
                          f"folder or a tag folder (a complete tag has {META})")
    return root, tags, False


def check_tag(folder: Path, checksums: bool) -> tuple[str, str]:
    """(status, detail) of one tag folder."""
    from rsclip_ds.checkpoint import META
    from rsclip_ds.runtime.integrity import MANIFEST, human, read_manifest, verify_tag

    if not (folder / META).is_file():
        return "incomplete", f"no {META}: a save that did not finish; never loaded"
    problems = verify_tag(folder, checksums)
    if problems is None:
        return "unverified", f"no {MANIFEST}: written by an older rsclip_ds, loaded unchecked"
    if problems:
        return "broken", "; ".join(problems)
    manifest = read_manifest(folder)
    what = "sizes and checksums" if checksums else "sizes"
    return "intact", f"{len(manifest['files'])} files, {human(manifest['bytes'])}, {what} match the manifest"


def run(args) -> int:
    from rsclip_ds.checkpoint import POINTER, _candidates, read_pointer

    root, tags, named = _tags(args.path)
    status = {}
    for tag in tags:
        status[tag], detail = check_tag(root / tag, not args.size_only)
        print(f"{tag}  {status[tag]:<10}  {detail}")
    broken = [t for t in tags if status[t] == "broken" or (named and status[t] == "incomplete")]
    if not named:
        pointer = read_pointer(root)
        ok = [t for t in _candidates(root, "auto") if status.get(t) in ("intact", "unverified")]
        print(f"{POINTER} names {pointer or '(none)'}; --resume latest would load "
              f"{ok[0] if ok else 'nothing (no intact checkpoint)'}")
    print(f"{len(tags)} tag(s): " + ", ".join(f"{sum(s == k for s in status.values())} {k}"
                                             for k in ("intact", "broken", "incomplete", "unverified")
                                             if k in status.values()))
    return 1 if broken else 0

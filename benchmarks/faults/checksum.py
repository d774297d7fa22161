"""What the checkpoint manifest's checksum costs: seconds per GiB of xxh3_64, xxh3_128 (what
rsclip_ds uses), blake2b and crc32 (zlib) on one core, and the share of a save it adds.

    python -m benchmarks.faults.checksum --out benchmarks/results/checksum.json                # 1 GiB, ~1 min
    python -m benchmarks.faults.checksum --mib 32 --repeats 1 --out /tmp/checksum.json        # seconds

Hashing: from memory (a buffer of random bytes), from a file in the page cache (warm: what a rank
that just wrote its shard would read back) and from the same file with its pages dropped
(posix_fadvise DONTNEED: what a resume's verification reads), beside a plain cold read. Saving: a
state dict of --mib MiB of fp32 tensors, torch.save to the path + fsync (DeepSpeed's way, plus the
fsync), to a file object + fsync, and rsclip_ds's write (integrity.SaveWrites: a file object whose
bytes are hashed on the way, then fsync); the hashed write over the file object is the share a
manifest adds (the repeats rotate the order of the three); the same into /dev/shm (memory) shows
the serialization and the hash without the disk's noise.
The same for one checkpoint of the tiny preset (its bytes from integrity.checkpoint_bytes, fp32,
ZeRO-2), measured; git-rsclip-base's checkpoint (GBs) is worked out from the per-GiB numbers.
Best of --repeats, wall time on a shared machine.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
import xxhash

from benchmarks.harness import base_parser, environment, write_report
from rsclip_ds.runtime.integrity import SaveWrites, checkpoint_bytes, verify_files

GiB, MiB = 2**30, 2**20
CHUNK = 8 * MiB
SHM = "/dev/shm"


def _hashers() -> dict:
    """name -> (new state, update, digest); crc32 carries its running value."""
    def stateful(make):
        return make, lambda h, b: (h.update(b), h)[1], lambda h: h.hexdigest()
    return {"xxh3_64": stateful(xxhash.xxh3_64), "xxh3_128": stateful(xxhash.xxh3_128),
            "blake2b": stateful(hashlib.blake2b),
            "crc32": (lambda: 0, lambda h, b: zlib.crc32(b, h), lambda h: f"{h:08x}")}


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _hash_file(path: Path, new, update, digest) -> str:
    """Read into one 8 MiB buffer (as integrity.digest does) and hash."""
    h, view = new(), memoryview(bytearray(CHUNK))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h = update(h, view[:n])
    return digest(h)


def hash_rates(folder: Path, mib: int, repeats: int) -> tuple[list[dict], float]:
    """Per algorithm s/GiB from memory, a warm file, a cold file; and a plain cold read's s/GiB."""
    buf = os.urandom(min(mib, 256) * MiB)
    passes = max(1, mib * MiB // len(buf))
    path = folder / "random.bin"
    with open(path, "wb") as f:
        for _ in range(passes):
            f.write(buf)
    size = path.stat().st_size
    view = memoryview(buf)

    def from_memory(new, update, digest):
        h = new()
        for _ in range(passes):
            for i in range(0, len(buf), CHUNK):
                h = update(h, view[i:i + CHUNK])
        digest(h)

    def cold(fn):
        def run():
            _drop_cache(path)
            fn()
        return run

    def read_only():
        view = memoryview(bytearray(CHUNK))
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass

    rows = []
    for name, (new, update, digest) in _hashers().items():
        one = (new, update, digest)
        warm_fn = lambda: _hash_file(path, *one)   # noqa: E731
        warm_fn()   # into the page cache
        rows.append({"algorithm": name,
                     "memory_s_per_gib": _best(lambda: from_memory(*one), repeats) * GiB / size,
                     "warm_file_s_per_gib": _best(warm_fn, repeats) * GiB / size,
                     "cold_file_s_per_gib": _best(cold(warm_fn), repeats) * GiB / size})
    read_cold = _best(cold(read_only), repeats) * GiB / size
    path.unlink()
    return rows, read_cold


def _state(nbytes: int) -> dict[str, torch.Tensor]:
    """fp32 tensors of ``nbytes`` in all, in 8 parameters (random: a checksum sees real entropy)."""
    n = max(1, nbytes // 4 // 8)
    g = torch.Generator().manual_seed(0)
    return {f"p{i}": torch.randn(n, generator=g) for i in range(8)}


def save_costs(folder: Path, nbytes: int, repeats: int) -> dict:
    """Seconds to save a state of ``nbytes``: torch.save to the path + fsync (DeepSpeed's way), to a
    file object + fsync, and through SaveWrites (a file object whose bytes are hashed on the way)."""
    state = _state(nbytes)
    path = folder / "state.pt"

    def fsynced(write):
        def run():
            write()
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        return run

    def to_file_object():
        with open(path, "wb") as f:
            torch.save(state, f)

    writes = SaveWrites(folder, rank=0)
    variants = {"path": fsynced(lambda: torch.save(state, path)), "file_object": fsynced(to_file_object),
                "hashed": lambda: writes.write(path, lambda f: torch.save(state, f))}
    names, best = list(variants), {}
    for i in range(repeats):   # the order rotates: writeback of the previous file hits each alike
        for name in names[i % 3:] + names[:i % 3]:
            path.unlink(missing_ok=True)
            best[name] = min(best.get(name, float("inf")), _best(variants[name], 1))
    path.unlink()
    variants["hashed"]()   # the file the entries describe, then read back cold
    _drop_cache(path)
    t0 = time.perf_counter()
    assert verify_files(folder, {"algorithm": "xxh3_128", "files": writes.entries}) == []
    verify_s = time.perf_counter() - t0
    size = path.stat().st_size
    path.unlink()
    return {"bytes": size, "plain_s": best["path"], "file_object_s": best["file_object"], "hashed_s": best["hashed"],
            "added_fraction": (best["hashed"] - best["file_object"]) / best["file_object"],
            "against_deepspeed_fraction": (best["hashed"] - best["path"]) / best["path"], "verify_cold_s": verify_s}


def model_rows(folder: Path, repeats: int, large: dict, hash_rows: list[dict], read_cold: float) -> list[dict]:
    """One checkpoint of the tiny preset and of git-rsclip-base (fp32, ZeRO-2; bytes from
    integrity.checkpoint_bytes): its save (measured for tiny, scaled from the --mib save for base),
    the hash's CPU time on it (xxh3_128's in-memory s/GiB: the difference of two timed saves is
    within the disk's noise here) and a resume's verification (a cold read and the hash)."""
    from rsclip_ds.planning.memory import preset_spec

    xxh = next(r for r in hash_rows if r["algorithm"] == "xxh3_128")
    rows = []
    for preset in ("tiny", "git-rsclip-base"):
        spec = preset_spec(preset)
        nbytes = checkpoint_bytes(spec.params, spec.trainable, "fp32", "fp32", 2)
        row = {"model": preset, "params": spec.params, "checkpoint_bytes": nbytes, "measured": nbytes <= large["bytes"]}
        if row["measured"]:
            m = save_costs(folder, nbytes, repeats * 3)
            row.update(save_s=m["file_object_s"], verify_s=m["verify_cold_s"])
        else:
            row.update(save_s=large["file_object_s"] * nbytes / large["bytes"],
                       verify_s=(read_cold + xxh["memory_s_per_gib"]) * nbytes / GiB)
        row["hash_cpu_s"] = xxh["memory_s_per_gib"] * nbytes / GiB
        row["hash_cpu_fraction"] = row["hash_cpu_s"] / row["save_s"]
        rows.append(row)
    return rows


def print_tables(report: dict) -> None:
    print(f"{'algorithm':<10} {'memory s/GiB':>13} {'warm file':>10} {'cold file':>10}")
    for r in report["hash"]:
        print(f"{r['algorithm']:<10} {r['memory_s_per_gib']:>13.3f} {r['warm_file_s_per_gib']:>10.3f} "
              f"{r['cold_file_s_per_gib']:>10.3f}")
    print(f"plain cold read: {report['read_cold_s_per_gib']:.3f} s/GiB")
    s = report["save"]
    print(f"save of {s['bytes'] / MiB:,.0f} MiB + fsync: torch.save(path) {s['plain_s']:.3f} s, to a file object "
          f"{s['file_object_s']:.3f} s, hashed on the way {s['hashed_s']:.3f} s ({100 * s['added_fraction']:+.1f}% "
          f"over the file object, {100 * s['against_deepspeed_fraction']:+.1f}% over the path); cold verify "
          f"{s['verify_cold_s']:.3f} s")
    m = report["save_in_memory"]
    if m:
        print(f"the same into {SHM}: torch.save(path) {m['plain_s']:.3f} s, to a file object {m['file_object_s']:.3f} s, "
              f"hashed {m['hashed_s']:.3f} s ({100 * m['added_fraction']:+.1f}%)")
    for r in report["models"]:
        how = "measured" if r["measured"] else "from s/GiB"
        print(f"{r['model']}: checkpoint {r['checkpoint_bytes'] / MiB:,.1f} MiB, save {r['save_s']:.3f} s ({how}), "
              f"the checksum's CPU time {r['hash_cpu_s']:.3f} s ({100 * r['hash_cpu_fraction']:.1f}% of the save), "
              f"verify {r['verify_s']:.3f} s")


def parse_args(argv=None):
    parser = base_parser(__doc__)
    parser.add_argument("--mib", type=int, default=1024, help="MiB hashed and saved (keep it <= 1024 here)")
    parser.add_argument("--repeats", type=int, default=5, help="best of this many runs")
    parser.add_argument("--dir", type=Path, default=None, help="folder for the files (default: a temp folder)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        hashes, read_cold = hash_rates(folder, args.mib, args.repeats)
        large = save_costs(folder, args.mib * MiB, args.repeats)
        models = model_rows(folder, args.repeats, large, hashes, read_cold)
    memory = None
    if Path(SHM).is_dir():   # the same saves into memory: serialization and hashing without the disk's noise
        with tempfile.TemporaryDirectory(dir=SHM) as tmp:
            memory = save_costs(Path(tmp), args.mib * MiB, args.repeats)
    report = {"config": {"mib": args.mib, "repeats": args.repeats, "dir": str(args.dir or tempfile.gettempdir())},
              "environment": environment(args.threads), "hash": hashes, "read_cold_s_per_gib": read_cold,
              "save": large, "save_in_memory": memory, "models": models, "seconds": time.perf_counter() - t0}
    write_report(report, args.out, print_tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())

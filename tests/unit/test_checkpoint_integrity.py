"""Checkpoint integrity and a full disk (rsclip_ds/runtime/integrity.py, Checkpointer.save, select_resume_tag,
`rsclip-ds verify-checkpoint`), in one process or forked gloo ranks: the manifest of a save, a
truncated file and a flipped byte named, the fallback to the newest intact tag, the command's exit
codes, the start-up space warning, and a disk that fills during a save on one rank of two (by the
injection hook, and on a real 8 MiB tmpfs where this machine lets us mount one). The same paths
under the real `deepspeed` launcher: tests/integration/test_faults.py."""

from __future__ import annotations

import json
import logging
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import xxhash

from rsclip_ds.checkpoint import META, POINTER, Checkpointer, read_pointer, select_resume_tag, tag_for
from rsclip_ds.cli import main
from rsclip_ds.config import CheckpointConfig, ConfigError
from rsclip_ds.runtime.integrity import MANIFEST, human, saves_in_run, space_shortfall, verify_tag
from rsclip_ds.loop import TrainResult
from tests.unit.forked_ranks import run_ranks

OPTIM = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"


class DeepSpeedLike:
    """What Checkpointer.save uses of a DeepSpeed engine, with DeepSpeed's own TorchCheckpointEngine
    (zip serialization, its default) and save_checkpoint's collectives: a barrier before the writes,
    rank 0's model states and each rank's optimizer shard through checkpoint_engine.save, a barrier
    after (deepspeed/runtime/engine.py, 0.19.8)."""

    def __init__(self, rank: int, numel: int = 40_000):
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        self.checkpoint_engine = TorchCheckpointEngine(SimpleNamespace(checkpoint_config={"checkpoint_serialization": True}))
        self.rank, self.numel = rank, numel
        # what the save checks before writing (finite.check_weights): the module's weights; no optimizer
        self.module, self.optimizer = torch.nn.Module(), None
        self.module.w = torch.nn.Parameter(torch.arange(numel, dtype=torch.float32) + rank)

    def save_checkpoint(self, root, tag, save_latest, client_state):
        import torch.distributed as dist

        dist.barrier()
        folder = Path(root) / tag
        folder.mkdir(parents=True, exist_ok=True)
        shard = self.module.w.detach()
        if self.rank == 0:
            self.checkpoint_engine.save({"module": {"w": shard}, **client_state}, str(folder / "mp_rank_00_model_states.pt"))
        self.checkpoint_engine.save({"optimizer_state_dict": {"exp_avg": shard}}, str(folder / OPTIM.format(self.rank)))
        dist.barrier()


def _client(step: int) -> dict:
    return {"result": TrainResult(losses=[1.0] * step).to_dict(), "step": step, "data": None, "rng": None}


def _save_steps(root: Path, rank: int, world: int, steps, **faults) -> list[str]:
    ck = Checkpointer(CheckpointConfig(keep_last=3), root, rank=rank, world_size=world, run_config={}, **faults)
    engine = DeepSpeedLike(rank)
    return [ck.save(engine, s, _client(s)) for s in steps]


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _run_two_ranks(rank: int, world: int, root: str, steps: list[int], faults: dict) -> dict:
    """Save ``steps`` on each rank; a DiskFullError comes back as the rank's error (run_ranks)."""
    root = Path(root)
    _save_steps(root, rank, world, steps, **faults)
    return {"pointer": read_pointer(root)}


def _flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_save_lists_every_file_with_its_size_and_checksum_before_the_meta(tmp_path, one_rank):
    root = tmp_path / "checkpoints"
    _save_steps(root, 0, 1, [2])
    folder = root / tag_for(2)
    manifest = json.loads((folder / MANIFEST).read_text())
    on_disk = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()
                     and p.name not in (MANIFEST, META))
    assert sorted(manifest["files"]) == on_disk == ["mp_rank_00_model_states.pt", "rsclip_history.json",
                                                    "rsclip_rank00000.pt", OPTIM.format(0)]
    for rel, entry in manifest["files"].items():   # hashed on the way to disk: equal to a read-back
        data = (folder / rel).read_bytes()
        assert entry == {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest(), "rank": 0}
    assert manifest["bytes"] == sum(e["size"] for e in manifest["files"].values())
    assert torch.load(folder / OPTIM.format(0), weights_only=True)["optimizer_state_dict"]["exp_avg"][5] == 5.0
    # written in order: manifest, then meta, then the pointer
    times = [(folder / MANIFEST).stat().st_mtime_ns, (folder / META).stat().st_mtime_ns,
             (root / POINTER).stat().st_mtime_ns]
    assert times == sorted(times) and verify_tag(folder) == []


def test_a_truncated_file_and_a_flipped_byte_are_named(tmp_path, one_rank):
    root = tmp_path / "checkpoints"
    _save_steps(root, 0, 1, [2])
    folder = root / tag_for(2)
    shard = folder / OPTIM.format(0)
    size = shard.stat().st_size
    _flip_byte(shard, size // 2)
    assert verify_tag(folder) == [f"{shard}: xxh3_128 checksum differs from the manifest (the bytes changed)"]
    assert verify_tag(folder, checksums=False) == []   # checkpoint.verify=size does not read the bytes
    with open(shard, "r+b") as f:
        f.truncate(1000)
    want = f"{shard}: 1,000 bytes, the manifest says {size:,} (truncated)"
    assert verify_tag(folder) == verify_tag(folder, checksums=False) == [want]
    (folder / "rsclip_history.json").unlink()
    assert f"{folder / 'rsclip_history.json'}: missing" in verify_tag(folder)


def test_resume_falls_back_to_the_newest_intact_tag_naming_the_file(tmp_path, one_rank, caplog):
    root = tmp_path / "checkpoints"
    _save_steps(root, 0, 1, [2, 4, 6])
    newest = root / tag_for(6) / OPTIM.format(0)
    with open(newest, "r+b") as f:
        f.truncate(10)
    with caplog.at_level(logging.WARNING, logger="rsclip_ds"):
        assert select_resume_tag(root, "auto") == select_resume_tag(root, "latest") == tag_for(4)
    assert f"checkpoint step00000006 is broken: {newest}: 10 bytes" in caplog.text
    assert "resuming from step00000004, the newest intact checkpoint" in caplog.text
    with pytest.raises(ConfigError, match=r"--resume step00000006: checkpoint step00000006 is broken: .*"
                                          r"zero_pp_rank_0_mp_rank_00_optim_states.pt: 10 bytes"):
        select_resume_tag(root, tag_for(6))
    assert select_resume_tag(root, tag_for(2)) == tag_for(2)
    _flip_byte(root / tag_for(4) / "rsclip_rank00000.pt", 100)
    (root / tag_for(2) / "rsclip_history.json").unlink()
    with pytest.raises(ConfigError, match=r"no intact checkpoint left in .*step00000006: .*\| step00000004: .*"
                                          r"rsclip_rank00000.pt: xxh3_128 checksum differs.*\| step00000002: .*missing"):
        select_resume_tag(root, "auto")
    assert select_resume_tag(root, "auto", checksums=False) == tag_for(4)   # size-only misses the flipped byte
    # a tag an older rsclip_ds wrote (no manifest) loads, with a line saying it is unchecked
    (root / tag_for(4) / MANIFEST).unlink()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rsclip_ds"):
        assert select_resume_tag(root, "auto") == tag_for(4)
    assert "step00000004 has no rsclip_manifest.json (an older rsclip_ds wrote it)" in caplog.text


def test_verify_checkpoint_says_per_tag_and_exits_by_the_worst(tmp_path, one_rank, capsys):
    out = tmp_path / "run"
    root = out / "checkpoints"
    _save_steps(root, 0, 1, [2, 4])
    (root / tag_for(6)).mkdir()   # a save that did not finish
    assert main(["verify-checkpoint", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step00000002  intact      4 files, ") and "sizes and checksums match" in lines[0]
    assert lines[2].startswith("step00000006  incomplete  no rsclip_meta.json")
    assert lines[3] == "rsclip_latest names step00000004; --resume latest would load step00000004"
    assert lines[4] == "3 tag(s): 2 intact, 1 incomplete"
    shard = root / tag_for(4) / OPTIM.format(0)
    _flip_byte(shard, 64)
    assert main(["verify-checkpoint", str(root)]) == 1
    text = capsys.readouterr().out
    assert f"step00000004  broken      {shard}: xxh3_128 checksum differs" in text
    assert "--resume latest would load step00000002" in text
    assert main(["verify-checkpoint", str(root / tag_for(4)), "--size-only"]) == 0
    assert main(["verify-checkpoint", str(root / tag_for(6))]) == 1    # a named incomplete tag
    capsys.readouterr()
    assert main(["verify-checkpoint", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.startswith(f"rsclip-ds: error: verify-checkpoint {tmp_path / 'nothing'}: no "
                                              f"checkpoint there")


def test_the_start_up_space_check_counts_keep_last_plus_one(tmp_path):
    assert [saves_in_run(4, True, 8), saves_in_run(4, True, 10), saves_in_run(0, True, 10),
            saves_in_run(4, True, 10, start=4), saves_in_run(0, False, 10)] == [2, 3, 1, 2, 0]
    assert space_shortfall(tmp_path, 2**20, keep_last=3, saves=10, existing=0) is None
    huge = 2**60
    msg = space_shortfall(tmp_path / "not" / "made", huge, keep_last=3, saves=10, existing=1)
    assert msg.startswith(f"disk space: output_dir {tmp_path / 'not' / 'made'} (") and " mounted at " in msg
    assert f"need about {human(3 * huge)} more: 3 x {human(huge)} (checkpoint.keep_last=3 kept + the one being " \
           f"written, less the 1 already there)" in msg and "exit code 6" in msg
    assert space_shortfall(tmp_path, huge, keep_last=3, saves=0, existing=0) is None   # never saves


def _disk_full(tmp_path: Path, root: Path, faults: dict, ranks: str = "rank 1") -> str:
    """Steps 2 and 4 saved by 2 ranks, step 4 failing on ``ranks``: every rank raises the same
    DiskFullError, the torn tag is gone, the pointer still names step 2 and a resume takes it."""
    results = run_ranks(_run_two_ranks, 2, tmp_path / "group", str(root), [2, 4], faults)
    errors = [r.get("error") for r in results]
    assert errors[0] == errors[1], results
    assert re.match(rf"DiskFullError: checkpoint step00000004 not saved: {ranks} found no space left on device "
                    rf"\(ENOSPC\) writing ", errors[0]), errors[0]
    assert "The incomplete step00000004 was removed; the newest intact checkpoint is step00000002" in errors[0]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step")) == [tag_for(2)]
    assert read_pointer(root) == tag_for(2) and select_resume_tag(root, "auto") == tag_for(2)
    assert not [p for p in root.rglob(".*")]   # no temporary file left
    return errors[0]


def test_a_full_disk_on_one_rank_stops_every_rank_with_one_message(tmp_path):
    root = tmp_path / "checkpoints"
    msg = _disk_full(tmp_path, root, {"enospc_in_save_at": 4})
    step2 = json.loads((root / tag_for(2) / MANIFEST).read_text())["bytes"]
    assert f"writing {root / tag_for(4) / OPTIM.format(1)} (" in msg   # the first file rank 1 writes
    assert f" free; one checkpoint takes about {human(step2)}, checkpoint.keep_last=3 needs about " \
           f"{human(4 * step2)} with the one being written)" in msg and msg.endswith("then continue with `--resume auto`")


@pytest.fixture
def small_tmpfs(tmp_path):
    """An 8 MiB tmpfs (root with CAP_SYS_ADMIN); skipped where mounting is not allowed."""
    point = tmp_path / "tmpfs"
    point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(point)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield point
    subprocess.run(["umount", "-l", str(point)], check=True)


def test_a_real_full_disk_during_a_save(tmp_path, small_tmpfs):
    """A filler leaves room for one save and a half: step 2 fits, step 4 does not, on whichever
    rank(s) the disk runs out (both write at once)."""
    import os

    one_save = 3 * 4 * 40_000 + 64 * 1024   # three 160 kB shards, the small files and zip headers
    st = os.statvfs(small_tmpfs)
    with open(small_tmpfs / "filler", "wb") as f:
        f.write(b"\0" * (st.f_bavail * st.f_frsize - one_save * 3 // 2))
    msg = _disk_full(tmp_path, small_tmpfs / "checkpoints", {}, ranks="(rank 0|rank 1|ranks 0, 1)")
    assert f"(tmpfs mounted at {small_tmpfs}: " in msg

"""Storage the ranks must agree on (rsclip_ds/runtime/storage.py): the shared-output check names the
ranks that cannot see rank 0's files, the resume decision is rank 0's on every rank (errors
included), and a file system that cannot fsync a folder does not stop a save."""

import errno
import os
import socket

import pytest

from rsclip_ds.runtime import storage
from rsclip_ds.checkpoint import POINTER, _atomic_write, resume_tag
from rsclip_ds.config import ConfigError
from tests.unit.forked_ranks import run_ranks


def _check(rank: int, world: int, folders: list[str]) -> list[str]:
    from pathlib import Path

    import torch.distributed as dist

    storage.check_shared_dir(Path(folders[rank]), wait_s=1.0)
    dist.barrier()   # rank 0 removed its probe
    return sorted(os.listdir(folders[rank]))


def test_a_shared_folder_passes_and_leaves_nothing_behind(tmp_path):
    out = tmp_path / "run"
    ranks = run_ranks(_check, 3, tmp_path / "group", [str(out)] * 3)
    assert [r["value"] for r in ranks] == [[], [], []]                   # the probe is gone


def test_a_rank_on_another_disk_stops_every_rank_naming_it(tmp_path):
    """Rank 2 looks at a folder of the same name on "its own disk" (a node-local output_dir)."""
    shared, local = tmp_path / "run", tmp_path / "node2" / "run"
    ranks = run_ranks(_check, 3, tmp_path / "group", [str(shared), str(shared), str(local)])
    for r in ranks:
        msg = r["error"]
        assert msg.startswith("ConfigError: output_dir") and "rank(s) 2 on " + socket.gethostname() in msg
        assert "shared file system" in msg and "--set output_dir=" in msg


def _resume(rank: int, world: int, roots: list[str], resume: str) -> str:
    from pathlib import Path

    return storage.decide_on_rank0(lambda: resume_tag(Path(roots[rank]), resume))


def _complete(root, tag: str) -> None:
    (root / tag).mkdir(parents=True)
    (root / tag / "rsclip_meta.json").write_text("{}")


def test_the_resume_tag_is_rank_0s_on_every_rank(tmp_path):
    """Rank 1's view is older (an NFS client that has not seen the newest save yet): it still
    resumes rank 0's tag; rank 0's error reaches every rank."""
    new, old = tmp_path / "new", tmp_path / "old"
    for tag in ("step00000004", "step00000008"):
        _complete(new, tag)
    _complete(old, "step00000004")
    (new / POINTER).write_text("step00000008\n")
    (old / POINTER).write_text("step00000004\n")
    ranks = run_ranks(_resume, 2, tmp_path / "g1", [str(new), str(old)], "latest")
    assert [r["value"] for r in ranks] == ["step00000008", "step00000008"]
    empty = tmp_path / "empty"
    ranks = run_ranks(_resume, 2, tmp_path / "g2", [str(empty), str(new)], "latest")
    assert all(r["error"].startswith("ConfigError: --resume latest: no complete checkpoint") for r in ranks)


def test_without_a_group_the_decision_is_local():
    assert storage.decide_on_rank0(lambda: 7) == 7
    with pytest.raises(ConfigError, match="x"):
        storage.decide_on_rank0(lambda: (_ for _ in ()).throw(ConfigError("x")))


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOTSUP])
def test_a_folder_that_cannot_be_synced_is_tolerated(tmp_path, monkeypatch, caplog, code):
    """Some FUSE / object-store mounts answer fsync on a folder with EINVAL or ENOTSUP; the
    pointer is still replaced. A real I/O error still raises."""
    real = os.fsync

    def fsync(fd):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(code, os.strerror(code))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with caplog.at_level("INFO", logger="rsclip_ds"):
        _atomic_write(tmp_path / POINTER, "step00000004\n")
        _atomic_write(tmp_path / POINTER, "step00000008\n")
    assert (tmp_path / POINTER).read_text() == "step00000008\n"
    assert caplog.text.count("cannot fsync a folder") == 1              # said once per folder
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(OSError, match="I/O error"):
        _atomic_write(tmp_path / POINTER, "step00000012\n")

"""Process-group set-up; with cli.py the only module that reads the environment."""

from __future__ import annotations

import glob
import os
import socket
from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    on_gpu: bool


def world_size_from_env() -> int:
    """The world size the launcher announced (1 without a launcher); known before init."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerator_is_gpu() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() not in ("cpu",)


def init_distributed(timeout_minutes: float | None = None) -> DistInfo:
    """Start the process group (gloo on CPU ranks, nccl on GPUs). Without a launcher, a
    one-rank group on localhost, so `rsclip-ds train` also runs as a plain command."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = accelerator_is_gpu()
    if on_gpu:
        get_accelerator().set_device(local_rank)
    minutes = timeout_minutes or float(os.environ.get("DEEPSPEED_TIMEOUT", "10"))
    deepspeed.init_distributed(timeout=timedelta(minutes=minutes))
    import torch.distributed as dist

    if not on_gpu:
        _unlink_shm_buffer(dist.get_rank())
    return DistInfo(dist.get_rank(), local_rank, dist.get_world_size(), on_gpu)


def _unlink_shm_buffer(rank: int) -> None:
    """DeepSpeed's CPU shared-memory all-reduce (0.19.8) creates
    /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank> (64 MiB) and never unlinks
    it: every CPU run, finished or killed, leaks 64 MiB of RAM per rank until reboot. Every rank
    maps all buffers while the group starts, so once all ranks passed a barrier the names can
    go; the mappings stay valid until the processes exit."""
    import torch.distributed as dist

    dist.barrier()
    port = os.environ.get("MASTER_PORT", "*")
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_{rank}"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def destroy_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

"""Process-group facts and side effects: start and stop the group, rank-aware logging, the
SIGTERM flag (the heartbeat is in heartbeat.py); and the run config's `distributed` section. With the
command line the only code that reads the environment."""

from __future__ import annotations

import glob
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from datetime import timedelta
from typing import Annotated, Callable, Literal, Union

from pydantic import Field

from rsclip_ds.runtime.settings import ConfigError, Strict

log = logging.getLogger("rsclip_ds")


class DistributedConfig(Strict):
    threads_per_rank: Union[Literal["auto"], Annotated[int, Field(ge=1)]] = Field(
        "auto", description="torch / OpenMP threads of each rank (its compute on CPU ranks, DeepSpeed's "
        "CPU Adam under optimizer offload). auto: the node's cores shared by its ranks, less the rank's "
        "loader workers, at least 1 (an OMP_NUM_THREADS set in the environment wins); shown at start-up.")
    communication_data_type: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="The gradients' dtype in DeepSpeed's reduction (its communication_data_type). "
        "auto: the training precision (DeepSpeed's default: bf16 sums are rounded to bf16 on the wire), "
        "except fp16 under ZeRO++ qgZ, whose quantizer kernel reads only fp16 (zero3_zeropp). fp32 "
        "doubles the gradient bytes of a bf16 run (rsclip-ds plan follows it).")
    host_memory: Literal["keep", "release"] = Field(
        "keep", description="CPU ranks' host allocator (runtime/host_memory.py). keep: glibc malloc keeps "
        "freed memory for reuse, so DeepSpeed's per-step buffers are not page-faulted in anew each step "
        "(measured on a 20M-parameter ZeRO-2 fp32 run, 2 ranks: 23% less CPU per step) at the price of a "
        "resident set that holds every step's transient peak and grows with fragmentation (that run: "
        "0.6 GB per rank with release, 1.0-1.8 GB with keep). release: glibc's defaults. GPU runs: no effect.")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    on_gpu: bool
    local_world_size: int = 1   # ranks on this node (they share its cores and /dev/shm)


def local_world_size_from_env() -> int:
    """Ranks on this node as the launcher announced them: LOCAL_SIZE (deepspeed), LOCAL_WORLD_SIZE
    (torchrun); 1 without either."""
    return launcher_local_world_size() or 1


def launcher_local_world_size() -> int | None:
    """LOCAL_SIZE (deepspeed) or LOCAL_WORLD_SIZE (torchrun); None where no launcher set either
    (a plain process, or `rsclip-ds plan` on a login node: the GPUs per node are not known)."""
    value = os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else None


# Variables by which a process started by srun / mpirun / a PMI launcher knows it is one of many
# tasks (name of the task count, its launcher), checked when no RANK says where it stands.
# SLURM_STEP_NUM_TASKS, not SLURM_NTASKS: srun sets it for the tasks of a step, while SLURM_NTASKS is
# also in an sbatch script's own shell, where one plain process (an eval, a plan) is fine.
TASK_COUNT_VARS = (("SLURM_STEP_NUM_TASKS", "srun"), ("OMPI_COMM_WORLD_SIZE", "mpirun (Open MPI)"),
                   ("PMI_SIZE", "mpirun / PMI"), ("PMIX_SIZE", "a PMIx launcher"))


def check_launch_env(env=None) -> None:
    """Refuse a process that is one of several tasks while no launcher set RANK: each would invent a
    world of one (init_distributed) and train alone on device 0 -- N independent runs, no error.
    That is `srun python -m rsclip_ds train` under --ntasks N. Raises LaunchError naming the fix."""
    env = os.environ if env is None else env
    if "RANK" in env:
        return
    for var, launcher in TASK_COUNT_VARS:
        value = env.get(var, "")
        if value.isdigit() and int(value) > 1:
            raise LaunchError(
                f"this process is one of {value} tasks started by {launcher} ({var}={value}), but no launcher "
                f"set RANK / LOCAL_RANK / WORLD_SIZE: each task would train alone on device 0. Start one launcher "
                f"per node, which starts the node's ranks: srun --ntasks-per-node=1 launch/cluster.sh ... (see "
                f"launch/slurm.sbatch), or `deepspeed --num_gpus N -m rsclip_ds train ...` / `torchrun "
                f"--nproc_per_node N -m rsclip_ds train ...` on each node")


class LaunchError(ConfigError):
    """The processes were started in a way that cannot form the intended process group; the message
    names the launch that works (the CLI's exit code 2, like any ConfigError)."""


def device_index(local_rank: int, device_count: int, visible: str | None) -> int:
    """The GPU of this rank: LOCAL_RANK among the GPUs the process sees. A per-rank binding
    (srun --gpus-per-task=1, --gpu-bind=single:1; a CUDA_VISIBLE_DEVICES set per task) shows each
    rank one GPU, so LOCAL_RANK 3 has no device 3: refused, naming the fix, rather than guessed."""
    if 0 <= local_rank < device_count:
        return local_rank
    raise LaunchError(
        f"LOCAL_RANK={local_rank} but this rank sees {device_count} GPU(s) (CUDA_VISIBLE_DEVICES="
        f"{visible if visible is not None else '(unset)'}): a per-rank GPU binding hides the node's other GPUs. "
        f"Let every rank of a node see all of its GPUs (srun --gpu-bind=none, no --gpus-per-task; no "
        f"CUDA_VISIBLE_DEVICES per task) and let the launcher number them by LOCAL_RANK")


def world_size_from_env() -> int:
    """The world size the launcher announced (1 without a launcher); known before init."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def set_threads(threads: int, env=None) -> None:
    """This rank's torch / OpenMP threads (resolve.threads_per_rank decides how many): torch.set_num_threads,
    which DeepSpeed's CPU Adam's OpenMP loop follows too, and OMP_NUM_THREADS for processes started later.
    Without it every rank's intra-op pool and CPU Adam run on every core: 8 ranks oversubscribe the node 8
    times."""
    import torch

    env = os.environ if env is None else env
    torch.set_num_threads(threads)
    env["OMP_NUM_THREADS"] = str(threads)


def seconds_since_process_start() -> float | None:
    """Seconds since this process was started (interpreter start-up and imports included), from
    /proc; None where there is no /proc."""
    try:
        start_ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])   # field 22
        uptime = float(open("/proc/uptime").read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def configure_logging(rank: int) -> None:
    """INFO on rank 0, warnings only elsewhere, every line tagged with its rank."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s rank{rank}] %(message)s", datefmt="%H:%M:%S", force=True)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def configure_wandb_offline(monitor_dir: Path, env=None) -> str:
    """logging.wandb: W&B's own variables decide where the run goes (WANDB_MODE, WANDB_PROJECT,
    WANDB_ENTITY, WANDB_RUN_GROUP, WANDB_DIR, read by wandb.init); this only fills in the defaults.
    Offline when nothing says otherwise -- no WANDB_MODE and no WANDB_API_KEY -- so a node without
    network never waits on W&B's servers (`wandb sync` uploads later; reporting.wandb_log says the
    command at start-up); files under {monitor_dir}/wandb unless WANDB_DIR is set; project rsclip_ds
    unless WANDB_PROJECT is set (logging.wandb_project wins over both). Returns the mode line,
    logged here (INFO: rank 0's)."""
    env = os.environ if env is None else env
    if env.get("WANDB_MODE"):
        said = f"W&B mode {env['WANDB_MODE']} (WANDB_MODE)"
    elif env.get("WANDB_API_KEY"):
        said = "W&B online (WANDB_API_KEY is set; WANDB_MODE=offline to keep the run on disk)"
    else:
        env["WANDB_MODE"] = "offline"
        said = "W&B offline: neither WANDB_MODE nor WANDB_API_KEY is set (WANDB_MODE=online to stream)"
    if not env.get("WANDB_DIR"):
        env["WANDB_DIR"] = str(monitor_dir / "wandb")
    Path(env["WANDB_DIR"]).mkdir(parents=True, exist_ok=True)
    env.setdefault("WANDB_PROJECT", "rsclip_ds")
    said += f", files under {env['WANDB_DIR']}"
    log.info(said)
    return said


def process_group_exists() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerator_is_gpu() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() not in ("cpu",)


def accelerator_has_bf16() -> bool:
    """Whether the accelerator computes in bf16 (NVIDIA from Ampere on; DeepSpeed's CPU accelerator: yes):
    what `precision: auto` asks (precision.resolve_precision)."""
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_bf16_supported())


def init_distributed(timeout_minutes: float | None = None) -> DistInfo:
    """Start the process group (gloo on CPU ranks, nccl on GPUs). Without a launcher, a
    one-rank group on localhost, so `rsclip-ds train` also runs as a plain command."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    check_launch_env()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = accelerator_is_gpu()
    if on_gpu:
        acc = get_accelerator()
        acc.set_device(device_index(local_rank, acc.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES")))
    minutes = timeout_minutes or float(os.environ.get("DEEPSPEED_TIMEOUT", "10"))
    deepspeed.init_distributed(timeout=timedelta(minutes=minutes))
    import torch.distributed as dist

    if not on_gpu:
        _unlink_shm_buffer(dist.get_rank())
    return DistInfo(dist.get_rank(), local_rank, dist.get_world_size(), on_gpu, local_world_size_from_env())


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

    if process_group_exists():
        dist.destroy_process_group()


# --------------------------------------------------------------------------- faults

class StopFlag:
    """Set by SIGTERM (what schedulers send before pre-emption, and what the deepspeed launcher
    forwards to each rank when it is itself terminated); the train loop polls it and the ranks
    agree on it with a collective, then save and exit with code 75."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._lock, self._announced = threading.Lock(), False
        # true while this process reports a failure (rank_errors.py): a SIGTERM then is the launcher
        # stopping the survivors of a dead rank, and no checkpoint follows -- nothing to announce
        self.failing: Callable[[], bool] = lambda: False

    def __call__(self) -> bool:
        if self.signal is not None:
            self._announce()   # the loop polls at sync points: said by then at the latest
        return self.signal is not None

    def _announce(self) -> None:
        with self._lock:
            if self._announced or self.failing():
                return
            self._announced = True
        log.warning("received %s: saving a checkpoint at the next step boundary, then exiting with code 75",
                    signal.Signals(self.signal).name)

    def install(self) -> "StopFlag":
        def handler(signum, frame):
            if self.signal is None:
                # said a moment later, from a thread: the handler runs as soon as a collective broken
                # by a dead peer returns, before this rank's error path has claimed the report
                timer = threading.Timer(1.0, self._announce)
                timer.daemon = True
                timer.start()
            self.signal = signum

        signal.signal(signal.SIGTERM, handler)
        return self

    def watch_launcher(self, interval: float = 1.0) -> "StopFlag":
        """Under the deepspeed launcher, also stop when the `deepspeed` command itself is gone.
        That command (DeepSpeed's runner) does not pass SIGTERM or SIGINT on to its child,
        `deepspeed.launcher.launch`, which started the ranks: `timeout`, a plain `kill` or a
        container stop would leave launch and the ranks training on as orphans, with no
        checkpoint. A daemon thread watches launch's parent; once launch has been re-parented
        (the runner died) the flag is set as by SIGTERM: save, exit 75. Outside the launcher:
        nothing."""
        import threading

        launch = os.getppid()
        runner = _parent_pid(launch)
        if runner is None or "deepspeed.launcher.launch" not in _cmdline(launch):
            return self

        def watch():
            while self.signal is None:
                time.sleep(interval)
                if os.getppid() != launch or _parent_pid(launch) != runner:
                    log.warning("the deepspeed command that started this node's ranks (pid %d) is gone: saving a "
                                "checkpoint at the next step boundary, then exiting with code 75", runner)
                    self._announced = True   # said just now
                    self.signal = signal.SIGTERM
        threading.Thread(target=watch, name="rsclip-launcher-watch", daemon=True).start()
        return self


def _parent_pid(pid: int) -> int | None:
    """The parent of `pid` from /proc (None without /proc or once `pid` is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""

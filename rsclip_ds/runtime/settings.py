"""The run-config sections of the process runtime: faults (dead ranks, SIGTERM, non-finite losses)
and distributed (threads per rank, the gradients' dtype on the wire). Part of the one config tree
(rsclip_ds.config.RunConfig holds them); kept here because config.py is at its size limit, and
importing nothing from the package so that config.py can import it."""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    """Every section of the run config: unknown keys rejected, values frozen (rsclip_ds.config uses it too)."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


class FaultConfig(Strict):
    peer_timeout_s: float = Field(
        60.0, gt=0, description="A rank whose heartbeat is older than this is taken as dead: the "
        "other ranks exit (code 4) instead of waiting for the collective timeout. Keep it above the "
        "longest stall of a healthy rank's Python thread (a checkpoint write does not stall it).")
    heartbeat_s: float = Field(2.0, gt=0, description="Seconds between heartbeats (a background thread per rank).")
    stop_check_every: int = Field(
        10, ge=1, description="Optimizer steps between the sync points where the ranks agree to stop "
        "after SIGTERM. A sync point is one small all-reduce and a host sync; the log steps are sync "
        "points anyway, so a divisor of logging.log_every adds nothing, 1 adds one sync per step.")
    max_nonfinite_steps: int = Field(
        3, ge=1, description="bf16/fp32: stop the run (exit code 3) after this many consecutive "
        "optimizer steps with a non-finite loss; no checkpoint is written from non-finite weights.")
    inject_nan_at_step: Optional[int] = Field(
        None, description="FAULT INJECTION for tests, never set in real runs: from this optimizer "
        "step on, rank 0's loss is multiplied by NaN.")
    inject_kill_at_step: Optional[int] = Field(
        None, description="FAULT INJECTION for tests, never set in real runs: the last rank SIGKILLs "
        "itself at the start of this optimizer step.")
    inject_freeze_at_step: Optional[int] = Field(
        None, description="FAULT INJECTION for tests, never set in real runs: the last rank SIGSTOPs "
        "itself at the start of this optimizer step (a hung host: its sockets stay open).")
    inject_data_delay_s: Optional[float] = Field(
        None, gt=0, description="FAULT INJECTION for tests, never set in real runs: rank "
        "`inject_data_delay_rank` sleeps this many seconds before handing over each micro-batch (a "
        "slow loader on one rank).")
    inject_data_delay_rank: Optional[int] = Field(
        None, ge=0, description="FAULT INJECTION for tests: the rank `inject_data_delay_s` slows down "
        "(default: the last rank, like the other injections).")
    inject_kill_in_save_at_step: Optional[int] = Field(
        None, description="FAULT INJECTION for tests, never set in real runs: the last rank SIGKILLs "
        "itself inside the checkpoint save of this step, after writing its shards and before the "
        "latest pointer moves.")
    inject_enospc_in_save_at_step: Optional[int] = Field(
        None, description="FAULT INJECTION for tests, never set in real runs: in the checkpoint save of "
        "this step, rank `inject_enospc_rank`'s first file write fails with a real OSError(ENOSPC) after "
        "4 KiB (a disk that fills during a save: exit code 6, DiskFull).")
    inject_enospc_rank: Optional[int] = Field(
        None, ge=0, description="FAULT INJECTION for tests: the rank `inject_enospc_in_save_at_step` "
        "fails (default: the last rank, like the other injections).")
    inject_error_at_step: Optional[int] = Field(
        None, ge=1, description="FAULT INJECTION for tests, never set in real runs: rank `inject_rank` raises "
        "a Python error of no known kind at the start of this optimizer step (its traceback on that rank, "
        "'rank R failed' and exit code 1 on every other).")
    inject_worker_kill_at_step: Optional[int] = Field(
        None, ge=2, description="FAULT INJECTION for tests, never set in real runs: rank `inject_rank` "
        "SIGKILLs one of its DataLoader workers at the start of this optimizer step (what the OOM killer "
        "does; the workers start at step 1, so from step 2); needs data.num_workers >= 1.")
    inject_rank: Optional[int] = Field(
        None, ge=0, description="FAULT INJECTION for tests: the rank of inject_error_at_step and "
        "inject_worker_kill_at_step (default: the last rank, like the other injections).")

    @model_validator(mode="after")
    def _check(self) -> "FaultConfig":
        if self.inject_data_delay_rank is not None and self.inject_data_delay_s is None:
            raise ValueError("faults.inject_data_delay_rank is set without faults.inject_data_delay_s: "
                             "give the delay too, e.g. --set faults.inject_data_delay_s=0.2")
        if self.inject_enospc_rank is not None and self.inject_enospc_in_save_at_step is None:
            raise ValueError("faults.inject_enospc_rank is set without faults.inject_enospc_in_save_at_step: "
                             "give the step too, e.g. --set faults.inject_enospc_in_save_at_step=8")
        return self


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

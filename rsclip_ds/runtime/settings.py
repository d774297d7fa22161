"""The run-config sections of the process runtime: faults (dead ranks, SIGTERM, non-finite losses),
distributed (threads per rank, the gradients' dtype on the wire) and the precisions' own settings
(fp16's loss scaler; bf16's masters, gradient accumulation and overflow check). Part of the one config tree
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
        3, ge=1, description="bf16/fp32: stop the run (exit code 3) after this many consecutive optimizer steps "
        "skipped because their gradient norm was not finite (a skipped step changes no weight, moment or "
        "learning rate). fp16: the loss scaler skips steps while it finds its scale; they are counted, not stopped on.")
    inject_nan_at_step: Optional[int] = Field(
        None, ge=1, description="FAULT INJECTION for tests, never set in real runs: from this optimizer step on, "
        "rank `inject_rank`'s gradient of the token embedding's last row becomes `inject_nan_value`.")
    inject_nan_steps: Optional[int] = Field(
        None, ge=1, description="FAULT INJECTION for tests: how many steps inject_nan_at_step lasts (default: all).")
    inject_nan_value: Literal["nan", "inf"] = Field("nan", description="FAULT INJECTION for tests: NaN or inf.")
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
        None, ge=0, description="FAULT INJECTION for tests: the rank of inject_error_at_step, "
        "inject_worker_kill_at_step and inject_nan_at_step (default: the last rank, like the other injections).")

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


class Fp16Config(Strict):
    initial_scale_power: int = Field(16, ge=0, le=32, description="fp16 only: initial loss scale is 2**this.")
    loss_scale_window: int = Field(1000, ge=1, description="fp16 only: overflow-free steps before the scale grows.")
    hysteresis: int = Field(2, ge=1, description="fp16 only: overflows tolerated before the scale shrinks.")
    min_loss_scale: float = Field(1.0, gt=0, description="fp16 only: the scale never goes below this.")


class Bf16Config(Strict):
    master_weights: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16 only: the dtype of the optimizer's master weights and of AdamW's m and v. "
        "'fp32': DeepSpeed's mixed precision (an fp32 master copy and fp32 states, 16 bytes per trainable "
        "parameter with the bf16 weight and gradient). 'bf16': open_clip's pure_bf16, DeepSpeed's "
        "bf16_master_weights_and_grads + bf16_optimizer_states: no fp32 copy, 10 bytes per trainable "
        "parameter (DeepSpeed keeps a bf16 master beside the bf16 weight), but an update below half a bf16 "
        "step of its weight is lost (docs/guides/precision.md: profiles, bytes, measured quality). ZeRO-1/2/3; the "
        "offload profiles need optim.impl=deepspeed on CPU ranks.")
    grad_accum_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="bf16 only: the dtype DeepSpeed accumulates gradients in across micro-batches "
        "(its `data_types.grad_accum_dtype`). 'fp32' keeps the sum in fp32 (ZeRO-1 then runs DeepSpeed's "
        "BF16_Optimizer, with a whole fp32 gradient copy per GPU; ZeRO-2/3 an fp32 gradient partition); "
        "'bf16' sums in bf16. 'auto': fp32 for ZeRO-2 and ZeRO-3, bf16 for ZeRO-1 and ZeRO-2 with optimizer "
        "offload, where fp32 costs GPU memory the others do not pay (docs/guides/precision.md: the measurement, "
        "the rule and the bytes); bf16 with master_weights=bf16.")
    check_grad_overflow: bool = Field(
        False, description="bf16 only: DeepSpeed's per-gradient overflow check (amax, amin and isfinite on every "
        "gradient tensor and a host sync, each step: docs/results/throughput.md#census). A step whose gradient norm "
        "is not finite is skipped either way (docs/guides/precision.md#non-finite-steps): off, at ZeRO-1/2 by "
        "rsclip_ds's step guard, from the norm DeepSpeed computed; on, by DeepSpeed.")

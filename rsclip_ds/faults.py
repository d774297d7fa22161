"""Faults a run survives, and the faults tests inject, behind one seam.

The run config's `faults` section (`FaultConfig`) holds the rules every run has -- when a silent peer
counts as dead, how often the ranks agree on a SIGTERM stop, how many non-finite steps in a row end the
run -- and the FAULT INJECTION keys the tests set. resolve.py turns them into a `FaultPlan` (which rank
each fault strikes, checked against the world). `Faults(plan, rank)` is the one object that injects them:
the Trainer arms it on the model before the engine exists (a NaN gradient), the loop hands it its batches
once (a slow loader) and calls `before_step` at the top of every step (an error, a killed loader worker,
a SIGKILL or SIGSTOP of the rank); the Checkpointer takes its save-time faults from the plan. A run
without injections gets `NO_FAULTS`, whose methods do nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Iterator, Literal, Optional

from pydantic import Field, model_validator

from rsclip_ds.runtime.settings import Strict

log = logging.getLogger("rsclip_ds")


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

@dataclass(frozen=True)
class FaultPlan:
    """The loop's stop rules and, for tests, where each injected fault strikes: resolve.fault_plan makes it from
    the run and its world, `Faults` below strikes with it."""
    stop_check_every: int
    max_nonfinite_steps: int
    count_nonfinite: bool            # not under fp16, whose loss scaler skips steps by design
    last_rank: int                   # kill, freeze, kill-in-save: always the last rank
    rank: int                        # inject_rank resolved: error, worker kill, NaN gradient
    data_delay_rank: int
    enospc_rank: int
    nan_at_step: int | None = None
    nan_steps: int | None = None
    nan_value: str = "nan"
    kill_at_step: int | None = None
    freeze_at_step: int | None = None
    data_delay_s: float | None = None
    error_at_step: int | None = None
    worker_kill_at_step: int | None = None
    kill_in_save_at_step: int | None = None
    enospc_in_save_at_step: int | None = None

    @property
    def injects(self) -> bool:
        return any(getattr(self, k) is not None for k in (
            "nan_at_step", "kill_at_step", "freeze_at_step", "data_delay_s", "error_at_step",
            "worker_kill_at_step", "kill_in_save_at_step", "enospc_in_save_at_step"))


class InjectedError(RuntimeError):
    """faults.inject_error_at_step: an error of no known kind (its traceback is shown, exit 1)."""


class Faults:
    """The injected faults of one rank (the module docstring); `step` is the optimizer step under way."""

    def __init__(self, plan: FaultPlan | None = None, rank: int = 0):
        self.plan, self.rank, self.step = plan, rank, 0

    def batches(self, batches: Iterator[dict]) -> Iterator[dict]:
        """The batches, each handed over `data_delay_s` late on the chosen rank (a slow loader)."""
        p = self.plan
        if p is None or not p.data_delay_s or self.rank != p.data_delay_rank:
            return batches
        log.warning("fault injection: rank %d sleeps %.3g s before each batch", self.rank, p.data_delay_s)

        def slow():
            for batch in batches:
                time.sleep(p.data_delay_s)
                yield batch
        return slow()

    def arm(self, model) -> None:
        """faults.inject_nan_at_step: on the chosen rank, the gradient of one row of the text tower's token
        embedding (the last token's; where it is frozen, of the first trained parameter) becomes NaN or inf in
        every backward of the chosen steps -- a real non-finite gradient, through the reduction and the
        optimizer's norm; the loss stays finite. Call before the engine exists."""
        p = self.plan
        if p is None or p.nan_at_step is None or self.rank != p.rank:
            return
        trained = [(n, t) for n, t in model.named_parameters() if t.requires_grad]
        name, param = next(((n, t) for n, t in trained if n.endswith("token_embedding.weight")), trained[0])
        value, first = float(p.nan_value), p.nan_at_step
        last = first + (p.nan_steps or 10**12) - 1

        def poison(grad):
            if not first <= self.step <= last:
                return grad
            grad = grad.clone()
            grad.view(grad.shape[0], -1)[-1] = value   # (rows, ...): the last row
            return grad
        param.register_hook(poison)
        log.warning("fault injection: rank %d sets the last row of %s's gradient to %s at steps %d..%s", self.rank,
                    name, p.nan_value, first, "" if p.nan_steps is None else last)

    def before_step(self, step: int, loader=None) -> None:
        """The top of optimizer step ``step``: an error or a killed loader worker on the chosen rank, a SIGKILL
        or SIGSTOP of the last rank."""
        self.step, p, rank = step, self.plan, self.rank
        if p is None:
            return
        if rank == p.rank and step == p.error_at_step:
            log.warning("fault injection: rank %d raises InjectedError at step %d", rank, step)
            raise InjectedError(f"fault injection: rank {rank} raises at step {step} (faults.inject_error_at_step)")
        if rank == p.rank and step == p.worker_kill_at_step:
            pids = loader.worker_pids() if hasattr(loader, "worker_pids") else []
            if not pids:
                raise InjectedError(f"faults.inject_worker_kill_at_step={step}: rank {rank} has no DataLoader worker")
            log.warning("fault injection: rank %d SIGKILLs its DataLoader worker (pid %d) at step %d", rank, pids[0],
                        step)
            os.kill(pids[0], signal.SIGKILL)
        if rank != p.last_rank:
            return
        for at, sig in ((p.kill_at_step, signal.SIGKILL), (p.freeze_at_step, signal.SIGSTOP)):
            if at == step:
                log.warning("fault injection: rank %d sends itself %s at step %d", rank, sig.name, step)
                os.kill(os.getpid(), sig)


NO_FAULTS = Faults()

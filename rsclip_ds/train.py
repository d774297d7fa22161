"""The train step and loop. Read top to bottom; nothing here reads the environment."""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from rsclip_ds.checkpoint import tag_for
from rsclip_ds.data.workers import LoaderWorkerDied  # noqa: F401 -- exit code 7, raised by the loader and the Trainer
from rsclip_ds.engine import engine_dtype, loss_scale
from rsclip_ds.profiles import BatchSizes
from rsclip_ds.reporting.epochs import EpochWatch
from rsclip_ds.reporting.load import DataWaitWatch, LoadWindow, TimedBatches, add_to_totals, peak_memory, rank_record
from rsclip_ds.reporting.metrics import MetricsLog
from rsclip_ds.reporting.progress import ProgressReporter
from rsclip_ds.runtime.rank_errors import PeerFailed, RunStopped  # noqa: F401 -- the run's stop classes, here

log = logging.getLogger("rsclip_ds")


def _inputs(engine, batch: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch on the engine's device. uint8 pixels (the loader's) travel as uint8 -- a
    quarter of float32's bytes -- and the model normalises them there; float pixels (callers
    that normalise themselves) are cast to the engine's dtype. The loader pins its batches when
    CUDA is there, so the copies are asynchronous."""
    pixels = batch["pixel_values"]                                                      # (B,3,H,W)
    if pixels.dtype == torch.uint8:
        pixel_values = pixels.to(engine.device, non_blocking=True)
    else:
        pixel_values = pixels.to(engine.device, dtype, non_blocking=True)
    input_ids = batch["input_ids"].to(engine.device, non_blocking=True)                # (B,L)
    return pixel_values, input_ids


def train_step(engine, batch: dict, loss_fn: Callable, dtype: torch.dtype, distiller=None) -> torch.Tensor:
    """One micro-batch ('plain' accumulation): forward, loss, backward; engine.step() updates
    only at the accumulation boundary (engine.backward divides the loss by the accumulation
    steps). The loss sees micro x world samples. ``distiller`` (rsclip_ds.distill): the
    teacher's embeddings first (no graph: its activations are gone before the student's
    forward), its weighted term added to the loss."""
    targets = distiller.targets(batch, engine.device) if distiller is not None else None
    image, text, logit_scale, logit_bias = engine(*_inputs(engine, batch, dtype))     # (B,D) x2
    loss = loss_fn(image, text, logit_scale, logit_bias)
    if distiller is not None:
        loss = loss + distiller.loss(image, text, logit_scale, targets)
    engine.backward(loss)
    engine.step()
    return loss.detach()


def device_rng(accelerator=None):
    """The accelerator whose generator a rank saves and restores beside the CPU's (DeepSpeed's
    get_accelerator(), or the stand-in given): None on CPU ranks. The accelerator decides, not
    torch.cuda.is_available(): CPU ranks on a GPU host would otherwise open a CUDA context on
    GPU 0 at every RNG call. Its get_rng_state() is the current device's only -- the same state
    the checkpoint's client_state keeps."""
    if accelerator is None:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
    return None if accelerator.device_name() == "cpu" else accelerator


def _rng_state(accelerator=None):
    device = device_rng(accelerator)
    return torch.get_rng_state(), device.get_rng_state() if device is not None else None


def _set_rng_state(state, accelerator=None) -> None:
    torch.set_rng_state(state[0])
    device = device_rng(accelerator)
    if state[1] is not None and device is not None:
        device.set_rng_state(state[1])


def train_step_global(engine, batches: list[dict], loss_fn: Callable, dtype: torch.dtype,
                      distiller=None) -> torch.Tensor:
    """k micro-batches as one batch of k x micro x world samples ('global' accumulation, the
    GradCache scheme of Gao et al. 2021):
      1. embed every micro-batch without a graph (saving the RNG state before each);
      2. loss over all cached embeddings, backward to get d loss / d embedding (and d scale/bias);
      3. re-run each micro-batch with a graph under the same RNG state and back-propagate
         embedding . gradient through engine.backward, stepping at the boundary.
    Peak activation memory stays that of one micro-batch; the cost is one extra forward. Each
    pass moves a micro-batch to the device when it uses it: one micro-batch of inputs on the
    device at a time (the CPU batches are kept), for a second host-to-device copy of the pixels
    (uint8: 24 MiB for 128 x 256 px). A ``distiller``'s teacher embeds each micro-batch once,
    in pass 1 (no graph, eval mode: it draws no random numbers), and its term joins the loss of
    step 2; pass 3 needs no teacher."""
    states, images, texts, targets = [], [], [], []
    with torch.no_grad():
        for batch in batches:
            if distiller is not None:
                targets.append(distiller.targets(batch, engine.device))              # (B, D_t) x2
            states.append(_rng_state())
            image, text, logit_scale, logit_bias = engine(*_inputs(engine, batch, dtype))
            images.append(image.float())
            texts.append(text.float())
    all_image = torch.cat(images).requires_grad_()                              # (k*B, D)
    all_text = torch.cat(texts).requires_grad_()
    # Trainability from the module: under ZeRO-3 the outputs of a no-grad forward are
    # detached copies that say requires_grad=False even for trainable parameters.
    module = engine.module
    scale = logit_scale.detach().float().requires_grad_(module.logit_scale.requires_grad)
    bias = logit_bias.detach().float().requires_grad_(module.logit_bias.requires_grad)
    loss = loss_fn(all_image, all_text, scale, bias)
    if distiller is not None:   # the teacher's (k*B, D_t) embeddings, in the order of all_image
        loss = loss + distiller.loss(all_image, all_text, scale, [torch.cat(t) for t in zip(*targets)])
    loss.backward()   # includes the cross-rank exchange: features of all ranks get their gradient
    sizes = [len(i) for i in images]
    grad_image, grad_text = all_image.grad.split(sizes), all_text.grad.split(sizes)
    for i, batch in enumerate(batches):
        _set_rng_state(states[i])   # same dropout masks as in the cached pass
        image_i, text_i, logit_scale, logit_bias = engine(*_inputs(engine, batch, dtype))
        surrogate = (image_i.float() * grad_image[i]).sum() + (text_i.float() * grad_text[i]).sum()
        if i == len(batches) - 1:
            # the scale/bias gradient is the whole batch's: add it once, in the last micro-batch
            # (DeepSpeed 0.19.8's optimizer-offload paths drop a gradient a parameter got only in
            # an earlier micro-batch of the step: tests/unit/test_global_accumulation.py)
            for param, leaf in ((logit_scale, scale), (logit_bias, bias)):
                if leaf.grad is not None:
                    surrogate = surrogate + (param.float() * leaf.grad).sum()
        # the surrogate's gradient already is the full batch's: no division by the k steps
        engine.backward(surrogate, scale_wrt_gas=False)
        engine.step()
    return loss.detach()


@dataclass
class TrainResult:
    # per optimizer step, mean over ranks; with 'global' accumulation the loss of the whole
    # k x micro x world batch, with 'plain' the mean of the k micro-batch losses. A resumed run
    # continues the saved history, so these cover the whole run.
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)      # learning rate used by each step
    evals: list[dict] = field(default_factory=list)     # {"step": s, **metrics} from the hooks
    optimizer_steps: int = 0
    micro_steps: int = 0
    skipped_steps: int = 0                              # steps the optimizer skipped (DeepSpeed's count: fp16 too)
    skipped: list[int] = field(default_factory=list)    # the steps skipped for a non-finite gradient norm (not fp16)
    loss_scale: float | None = None
    seconds: float = 0.0                                # this process's training time (all segments)
    first_step_s: float = 0.0                           # this segment's first optimizer step (loader workers start, lazy init)
    samples_per_s: float = 0.0                          # global samples/s after the first step of this segment, saves and hooks excluded
    bad_data: dict[str, int] = field(default_factory=dict)   # bad samples skipped, sum over ranks
    checkpoints: list[str] = field(default_factory=list)     # tags saved by this segment
    rank_load: dict = field(default_factory=dict)       # per-rank totals of the log windows (reporting.load)
    resumed_from: list[int] = field(default_factory=list)    # steps this run was resumed at
    stopped: str | None = None                          # 'sigterm' when pre-empted

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainResult":
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


# RunStopped (runtime/rank_errors.py) and its kin: each carries its exit code (docs/reference/exit-codes.md).
# `shared`: every rank raises it at the same sync point; `said_by_rank0`: with the same text, said once.
class NonFiniteLoss(RunStopped):
    exit_code = 3
    shared = said_by_rank0 = True    # the losses are all-reduced: every rank sees the same run


class Preempted(RunStopped):
    exit_code = 75   # EX_TEMPFAIL: try again (with --resume latest)
    shared = said_by_rank0 = True    # agreed at a sync point


class InjectedError(RuntimeError):
    """faults.inject_error_at_step: an error of no known kind (its traceback is shown, exit 1)."""


class DiskFull(RunStopped):
    exit_code = 6    # a checkpoint save found no room (ENOSPC/EDQUOT): the message names the intact tag
    shared = said_by_rank0 = True    # every rank raises rank 0's message after the save's all-gather


@dataclass
class Guard:
    """The loop's fault handling: SIGTERM agreement, the stop after consecutive skipped steps, fault injection.

    `stop_requested` is a flag set by the SIGTERM handler (distributed.StopFlag, installed by the Trainer); every
    `stop_check_every` steps the ranks agree on it with the log-window all-reduce. A step whose gradient norm is
    not finite is skipped by the optimizer (rsclip_ds.finite: the weights, moments and learning rate stay); the
    loop counts it (`count_nonfinite`: not under fp16, whose loss scaler skips steps while it finds its scale)
    and stops the run after `max_nonfinite_steps` of them in a row."""
    stop_requested: Callable[[], bool] = lambda: False
    stop_check_every: int = 10
    max_nonfinite_steps: int = 3
    count_nonfinite: bool = True                        # off under fp16: the loss scaler skips steps by design
    inject_nan_at_step: int | None = None
    inject_nan_steps: int | None = None                 # None: every step from inject_nan_at_step on
    inject_nan_value: str = "nan"
    inject_kill_at_step: int | None = None
    inject_freeze_at_step: int | None = None
    inject_data_delay_s: float | None = None
    inject_data_delay_rank: int | None = None           # None: the last rank
    inject_error_at_step: int | None = None
    inject_worker_kill_at_step: int | None = None
    inject_rank: int | None = None                      # of the three above; None: the last rank
    skip_run: int = 0                                   # skipped steps in a row, up to the last step
    step: int = 0                                       # the optimizer step under way (before_step)

    def delayed(self, batches: Iterator[dict], rank: int, world_size: int) -> Iterator[dict]:
        """The batches, each handed over `inject_data_delay_s` late on the chosen rank (a slow loader)."""
        target = world_size - 1 if self.inject_data_delay_rank is None else self.inject_data_delay_rank
        if not self.inject_data_delay_s or rank != target:
            return batches
        log.warning("fault injection: rank %d sleeps %.3g s before each batch", rank, self.inject_data_delay_s)

        def slow():
            for batch in batches:
                time.sleep(self.inject_data_delay_s)
                yield batch
        return slow()

    def arm(self, model: torch.nn.Module, rank: int, world_size: int) -> None:
        """faults.inject_nan_at_step: on the chosen rank, the gradient of one row of the text tower's
        token embedding (the last token's; where it is frozen, of the first trained parameter) becomes
        NaN or inf in every backward of the chosen steps -- a real non-finite gradient, through the
        reduction and the optimizer's norm; the loss stays finite. Call before the engine exists."""
        target = world_size - 1 if self.inject_rank is None else self.inject_rank
        if self.inject_nan_at_step is None or rank != target:
            return
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        name, param = next(((n, p) for n, p in trained if n.endswith("token_embedding.weight")), trained[0])
        value = float(self.inject_nan_value)
        last = self.inject_nan_at_step + (self.inject_nan_steps or 10**12) - 1

        def poison(grad: torch.Tensor) -> torch.Tensor:
            if not self.inject_nan_at_step <= self.step <= last:
                return grad
            grad = grad.clone()
            grad.view(grad.shape[0], -1)[-1] = value   # (rows, ...): the last row
            return grad
        param.register_hook(poison)
        log.warning("fault injection: rank %d sets the last row of %s's gradient to %s at steps %d..%s", rank, name,
                    self.inject_nan_value, self.inject_nan_at_step, "" if self.inject_nan_steps is None else last)

    def before_step(self, step: int, rank: int, world_size: int, loader=None) -> None:
        self.step = step
        target = world_size - 1 if self.inject_rank is None else self.inject_rank
        if rank == target and step == self.inject_error_at_step:
            log.warning("fault injection: rank %d raises InjectedError at step %d", rank, step)
            raise InjectedError(f"fault injection: rank {rank} raises at step {step} (faults.inject_error_at_step)")
        if rank == target and step == self.inject_worker_kill_at_step:
            pids = loader.worker_pids() if hasattr(loader, "worker_pids") else []
            if not pids:
                raise InjectedError(f"faults.inject_worker_kill_at_step={step}: rank {rank} has no DataLoader worker")
            log.warning("fault injection: rank %d SIGKILLs its DataLoader worker (pid %d) at step %d", rank, pids[0], step)
            os.kill(pids[0], signal.SIGKILL)
        if rank != world_size - 1:
            return
        for at, sig in ((self.inject_kill_at_step, signal.SIGKILL), (self.inject_freeze_at_step, signal.SIGSTOP)):
            if at == step:
                log.warning("fault injection: rank %d sends itself %s at step %d", rank, sig.name, step)
                os.kill(os.getpid(), sig)

    def after_step(self, step: int, skipped: bool) -> bool:
        """Count a skipped step; True when `max_nonfinite_steps` in a row end at this one (stop)."""
        self.skip_run = self.skip_run + 1 if skipped else 0
        return self.count_nonfinite and self.skip_run >= self.max_nonfinite_steps

    def stop_error(self, step: int) -> "NonFiniteLoss":
        first = step - self.skip_run + 1
        return NonFiniteLoss(
            f"the gradient norm was not finite for {self.skip_run} consecutive steps ({first}..{step}); each was "
            f"skipped (the weights are those after step {first - 1}) and the run stops without saving. The last good "
            f"checkpoint is untouched: lower optim.lr or raise optim.warmup_steps, check the data, then resume with "
            f"--resume latest")


def _sync(pending: list[torch.Tensor], bad: dict[str, int], stop: bool, load: Sequence[float] = ()
          ) -> tuple[list[float], dict[str, int], bool, list[list[float]]]:
    """One all-reduce per sync point: the pending losses (mean over ranks), the bad-data
    counts (sum), the stop flag (any rank) and each rank's `load` numbers (gathered: rank r
    fills its own slots of a world x len(load) block, zeros elsewhere, so the sum is the
    gather). No host sync between sync points."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    # On the losses' device: a GPU run's process group is NCCL only, which rejects CPU tensors.
    losses_t = torch.stack(pending).double()   # float64: counts and byte counts stay exact past 2**24
    k = len(load)
    slots = [0.0] * (world * k)                                                        # (world * k,)
    slots[rank * k:(rank + 1) * k] = [float(v) for v in load]
    values = torch.cat([losses_t, torch.tensor([float(v) for v in bad.values()] + slots + [float(stop)],
                                               dtype=torch.float64, device=losses_t.device)])
    if world > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    values = values.cpu()   # the one host sync of this sync point
    n, b = len(pending), len(bad)
    losses = (values[:n] / world).tolist()
    counts = dict(zip(bad, (int(v) for v in values[n:n + b].tolist())))
    gathered = values[n + b:-1].view(world, k).tolist() if k else []                   # (world, k)
    return losses, counts, bool(values[-1] > 0), gathered


def optimizer_step(engine, batches: Iterator[dict], loss_fn: Callable, sizes: BatchSizes,
                   accumulation: str, dtype: torch.dtype, distiller=None) -> torch.Tensor:
    """One optimizer step over `sizes.accumulation` micro-batches -> the step's loss."""
    micro = [next(batches) for _ in range(sizes.accumulation)]
    if accumulation == "global" and sizes.accumulation > 1:
        return train_step_global(engine, micro, loss_fn, dtype, distiller)
    return torch.stack([train_step(engine, b, loss_fn, dtype, distiller) for b in micro]).mean()


def client_state(step: int, result: TrainResult, data: dict | None) -> dict[str, Any]:
    """What exact continuation needs besides DeepSpeed's own state: this rank's RNG (the CUDA
    generator of its own device only: a resume may see fewer devices per process) and data
    position, and the run's history (`result`, the same on every rank: the Checkpointer stores
    it once)."""
    cpu, cuda = _rng_state()
    return {"step": step, "data": data, "rng": {"torch": cpu, "cuda": cuda},
            "result": result.to_dict()}


def restore_client_state(state: dict[str, Any]) -> tuple[int, TrainResult]:
    """-> (step, history). The RNG is either this rank's saved state, or, after a resume on
    another number of ranks, a seed for CPU and every CUDA device (reshard.derived_seed)."""
    rng = state["rng"]
    if "seed" in rng:
        torch.manual_seed(rng["seed"])
    else:
        _set_saved_rng(rng)
    result = TrainResult.from_dict(state["result"])
    result.resumed_from.append(state["step"])
    return state["step"], result


def _set_saved_rng(rng: dict[str, Any], accelerator=None) -> None:
    cuda, device = rng["cuda"], device_rng(accelerator)
    if isinstance(cuda, (list, tuple)):   # checkpoints of rsclip_ds 0.1: every visible device's
        index = device.current_device() if device is not None else -1
        cuda = cuda[index] if 0 <= index < len(cuda) else None
    _set_rng_state((rng["torch"], cuda), accelerator)


def train(engine, batches: Iterator[dict], loss_fn: Callable, sizes: BatchSizes, steps: int,
          log_every: int, reporter: ProgressReporter, accumulation: str = "plain", *,
          hooks: Sequence[Callable[[int, Any], dict | None]] = (), checkpointer=None,
          guard: Guard | None = None, loader=None, resume: dict | None = None,
          stop_after: int | None = None, metrics: MetricsLog | None = None,
          data_wait: DataWaitWatch | None = None, distiller=None) -> TrainResult:
    """Steps `start+1 .. steps`. `hooks(step, engine)` run on every rank after each optimizer
    step; the dicts they return are logged and kept in result.evals. `loader` (optional)
    gives `state_dict()` for checkpoints and `bad_data()` for the counts; `resume` is this
    rank's saved client state; `stop_after` ends the loop after that step (checkpoint saved).
    `metrics` gets a line per log step and evaluation (rank 0's writes; no-op elsewhere);
    `data_wait` warns about a rank waiting for data far more than the others; `distiller` adds
    a teacher's term to every step's loss (rsclip_ds.distill).
    Host syncs happen only at sync points (log, save, stop check)."""
    guard = guard or Guard()
    metrics = metrics or MetricsLog("", enabled=False)
    data_wait = data_wait or DataWaitWatch()
    start, result = restore_client_state(resume) if resume else (0, TrainResult())
    bad_local = (lambda: loader.bad_data()) if hasattr(loader, "bad_data") else dict
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    dtype, pending, seconds_before = engine_dtype(engine), [], result.seconds
    t_start = t_first = time.perf_counter()
    paused = 0.0   # seconds in checkpoint saves and hooks (evaluation): left out of samples/s
    last = min(steps, stop_after or steps)   # stop_after ends this process early, same schedule
    if start == 0:   # a fresh run: hooks see the initial model too (evaluation from chance)
        _run_hooks(hooks, 0, engine, result, reporter, metrics)
    epochs = EpochWatch(loader)   # the epochs the loader finishes: metrics.jsonl's epoch_end lines
    batches = TimedBatches(guard.delayed(batches, rank, world))   # counts the seconds blocked in next()
    window, window_from = LoadWindow(batches, engine.device), start   # this rank's load after step window_from
    last_line = start
    t_loop = time.perf_counter()
    for step in range(start + 1, last + 1):
        guard.before_step(step, rank, world, loader)
        result.lrs.append(float(engine.get_lr()[0]))
        skipped_before = getattr(engine, "skipped_steps", 0)
        loss = optimizer_step(engine, batches, loss_fn, sizes, accumulation, dtype, distiller)
        pending.append(loss)
        skipped = getattr(engine, "skipped_steps", 0) != skipped_before   # the optimizer's decision (finite.py)
        if skipped and guard.count_nonfinite:
            result.skipped.append(step)
            norm = engine.get_global_grad_norm()
            norm = None if norm is None else float(norm)
            metrics.skipped(step, norm)
            if rank == 0:
                log.warning("step %d skipped: its gradient norm is not finite (%s); the weights, optimizer moments "
                            "and learning rate stay as after step %d", step, norm, step - 1)
        failing = guard.after_step(step, skipped)
        for record in epochs.ended():
            metrics.epoch_end(step, record)
        if step == start + 1:
            t_first = time.perf_counter()   # excludes lazy init / first-call overheads
            result.first_step_s = t_first - t_loop
            if step % log_every and step != last:   # the load numbers leave it out too (start-up)
                window.reset(paused)
                window_from = step
        if hooks:
            t_hooks = time.perf_counter()
            _run_hooks(hooks, step, engine, result, reporter, metrics)
            paused += time.perf_counter() - t_hooks   # t_first is set before the hooks run
        save_due = checkpointer is not None and checkpointer.due(step, last)
        if not (save_due or failing or step % log_every == 0 or step % guard.stop_check_every == 0 or step == last):
            continue
        losses, result.bad_data, stop, load = _sync(pending, bad_local(), guard.stop_requested(),
                                                    window.values(paused))
        result.losses += losses
        pending = []
        # a run about to stop for skipped steps logs that step first (metrics.jsonl keeps it)
        if step % log_every == 0 or step == last or stop or failing:
            elapsed = time.perf_counter() - t_first - paused
            rate = sizes.global_batch * (step - start - 1) / elapsed if step > start + 1 else float("nan")
            reporter.update(step, {"loss": result.losses[-1], "lr": result.lrs[-1], "samples/s": rate,
                                   "loss_scale": loss_scale(engine), **_counts(engine, result)})
            _log_metrics(metrics, data_wait, engine, result, step, last_line, (load, step - window_from), rate)
            window.reset(paused)
            window_from = last_line = step
        if failing:
            raise guard.stop_error(step)
        if checkpointer is not None and (save_due or stop):   # refuses non-finite weights (finite.NonFiniteWeights)
            data = loader.state_dict() if hasattr(loader, "state_dict") else None
            result.optimizer_steps, result.micro_steps = engine.global_steps, engine.micro_steps
            result.seconds = seconds_before + time.perf_counter() - t_start
            result.checkpoints.append(tag_for(step))
            t_save = time.perf_counter()
            checkpointer.save(engine, step, client_state(step, result, data))
            paused += time.perf_counter() - t_save
        if stop:
            result.stopped = "sigterm"
            break
    end = time.perf_counter()
    result.seconds = seconds_before + end - t_start
    done = len(result.losses) - start
    result.samples_per_s = sizes.global_batch * (done - 1) / (end - t_first - paused) if done > 1 else 0.0
    result.optimizer_steps = engine.global_steps
    result.micro_steps = engine.micro_steps
    result.skipped_steps = int(getattr(engine, "skipped_steps", 0))
    result.loss_scale = loss_scale(engine)
    return result


def _run_hooks(hooks, step: int, engine, result: TrainResult, reporter: ProgressReporter,
               metrics_log: MetricsLog) -> None:
    for hook in hooks:
        metrics = hook(step, engine)
        if metrics:
            result.evals.append({"step": step, **metrics})
            reporter.update(step, {k: v for k, v in metrics.items() if isinstance(v, (int, float))})
            metrics_log.eval(step, metrics)


def _log_metrics(metrics: MetricsLog, data_wait: DataWaitWatch, engine, result: TrainResult, step: int,
                 last_line: int, gathered: tuple[list[list[float]], int], rate: float) -> None:
    """One log step: every rank adds the gathered load to the run totals (the same on all ranks:
    they travel in every rank's checkpoint); rank 0 applies the data-wait rule and writes the line.
    `gathered`: every rank's [seconds, wait, peak] and the steps they cover (the segment's first
    step is left out, as from samples/s, unless it is itself a log step)."""
    load, steps = gathered
    kind = peak_memory(engine.device)[1]
    ranks = rank_record(load, steps, kind) if steps else None   # none: a SIGTERM stop right after step 1
    if ranks:
        result.rank_load = add_to_totals(result.rank_load, load, steps, kind)
    if not metrics.enabled:
        return
    if ranks:
        data_wait.update(step, ranks["data_wait"])
    window = result.losses[last_line:step]                                  # the steps since the last line
    norm = engine.get_global_grad_norm()   # cached by the last step, no collective; the step guard's: a number
    norm = None if norm is None else float(norm)
    norm = norm if norm is None or math.isfinite(norm) else None   # a skipped step: its event says
    metrics.train(step, {"loss": result.losses[-1], "loss_mean": sum(window) / len(window),
                         "lr": result.lrs[-1], "grad_norm": norm,
                         "samples_per_s": None if math.isnan(rate) else rate, "loss_scale": loss_scale(engine),
                         "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
                         "bad_data": result.bad_data, "ranks": ranks})


def _counts(engine, result: TrainResult) -> dict[str, int]:
    """Skipped steps and bad samples, shown only when there are any."""
    out = {f"bad {k}": v for k, v in result.bad_data.items() if v}
    skipped = int(getattr(engine, "skipped_steps", 0))
    if skipped:
        out["skipped"] = skipped
    return out

"""The training loop, read top to bottom: the loop, an optimizer step, a micro-batch step.

    result = train(resolved.loop, engine, loader, Objective(loss_fn), Observers(reporter, metrics, checkpointer))

`train` takes the numbers it runs by (`LoopPlan`: resolve.py's record of the run, read nowhere else), the
engine, the batches, the loss and its observers (progress, metrics.jsonl, checkpoints, evaluation hooks);
`stop` is the SIGTERM flag and `faults` the seam tests inject faults through (faults.py). Nothing here reads
the environment or decides a setting: the Trainer (assembly.py) built every part from the resolved run.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from rsclip_ds.checkpoint import tag_for
from rsclip_ds.engine import engine_dtype, loss_scale
from rsclip_ds.faults import NO_FAULTS, Faults
from rsclip_ds.reporting.epochs import EpochWatch
from rsclip_ds.reporting.load import DataWaitWatch, LoadWindow, TimedBatches, add_to_totals, peak_memory, rank_record
from rsclip_ds.reporting.metrics import MetricsLog
from rsclip_ds.reporting.progress import ProgressReporter
from rsclip_ds.resolve import BatchSizes, LoopPlan
from rsclip_ds.runtime.rank_errors import RunStopped

log = logging.getLogger("rsclip_ds")
Hook = Callable[[int, Any], "dict | None"]


@dataclass
class Objective:
    """What a step minimises: the contrastive ``loss`` (losses.build_loss) over the (B, D) embeddings, plus a
    ``distiller``'s teacher term (rsclip_ds.distill) when there is one."""
    loss: Callable
    distiller: Any = None


@dataclass
class Observers:
    """What watches the loop: progress on the terminal, metrics.jsonl (rank 0's writes; no-op elsewhere), the
    checkpoints, the hooks run on every rank after each optimizer step (evaluation; the dicts they return are
    logged and kept in result.evals), and the warning about a rank waiting for data far more than the others."""
    reporter: ProgressReporter | None = None
    metrics: MetricsLog | None = None
    checkpointer: Any = None
    hooks: Sequence[Hook] = ()
    data_wait: DataWaitWatch | None = None


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


def _never() -> bool:
    return False


def train(plan: LoopPlan, engine, loader, objective: Objective, observers: Observers = Observers(), *,
          resume: dict | None = None, stop: Callable[[], bool] = _never, faults: Faults = NO_FAULTS) -> TrainResult:
    """Optimizer steps `start+1 .. plan.steps` (`plan.stop_after` ends the loop after that step, checkpoint
    saved, the schedule unchanged). ``loader``: an iterable of batches; its `state_dict()` goes into each
    checkpoint and its `bad_data()` counts are summed over the ranks, where it has them. ``resume``: this
    rank's saved client state. ``stop()``: this rank was asked to stop (SIGTERM); every
    `plan.stop_check_every` steps the ranks agree on it with the log window's all-reduce. A step whose
    gradient norm is not finite is skipped by the optimizer (finite.py: the weights, moments and learning
    rate stay); the loop counts it (not under fp16, whose loss scaler skips steps while it finds its scale)
    and stops the run after `plan.max_nonfinite_steps` of them in a row (NonFiniteLoss, exit 3).
    Host syncs happen only at sync points (log, save, stop check)."""
    o = observers
    reporter = o.reporter or ProgressReporter(plan.steps, enabled=False)
    metrics = o.metrics or MetricsLog("", enabled=False)
    data_wait = o.data_wait or DataWaitWatch()
    checkpointer, hooks, sizes = o.checkpointer, o.hooks, plan.batch
    start, result = restore_client_state(resume) if resume else (0, TrainResult())
    bad_local = (lambda: loader.bad_data()) if hasattr(loader, "bad_data") else dict
    rank = dist.get_rank() if dist.is_initialized() else 0
    dtype, pending, seconds_before = engine_dtype(engine), [], result.seconds
    t_start = t_first = time.perf_counter()
    paused = 0.0   # seconds in checkpoint saves and hooks (evaluation): left out of samples/s
    last = min(plan.steps, plan.stop_after or plan.steps)   # stop_after ends this process early, same schedule
    if start == 0:   # a fresh run: hooks see the initial model too (evaluation from chance)
        _run_hooks(hooks, 0, engine, result, reporter, metrics)
    epochs = EpochWatch(loader)   # the epochs the loader finishes: metrics.jsonl's epoch_end lines
    stream = iter(loader)
    batches = TimedBatches(faults.batches(stream))   # counts the seconds blocked in next()
    window, window_from = LoadWindow(batches, engine.device), start   # this rank's load after step window_from
    last_line, skip_run = start, 0   # skip_run: steps skipped in a row, up to this one
    t_loop = time.perf_counter()
    try:
        for step in range(start + 1, last + 1):
            faults.before_step(step, loader)
            result.lrs.append(float(engine.get_lr()[0]))
            skipped_before = getattr(engine, "skipped_steps", 0)
            loss = optimizer_step(engine, batches, objective.loss, sizes, plan.accumulation, dtype, objective.distiller)
            pending.append(loss)
            skipped = getattr(engine, "skipped_steps", 0) != skipped_before   # the optimizer's decision (finite.py)
            if skipped and plan.count_nonfinite:
                result.skipped.append(step)
                norm = engine.get_global_grad_norm()
                norm = None if norm is None else float(norm)
                metrics.skipped(step, norm)
                if rank == 0:
                    log.warning("step %d skipped: its gradient norm is not finite (%s); the weights, optimizer "
                                "moments and learning rate stay as after step %d", step, norm, step - 1)
            skip_run = skip_run + 1 if skipped else 0
            failing = plan.count_nonfinite and skip_run >= plan.max_nonfinite_steps
            for record in epochs.ended():
                metrics.epoch_end(step, record)
            if step == start + 1:
                t_first = time.perf_counter()   # excludes lazy init / first-call overheads
                result.first_step_s = t_first - t_loop
                if step % plan.log_every and step != last:   # the load numbers leave it out too (start-up)
                    window.reset(paused)
                    window_from = step
            if hooks:
                t_hooks = time.perf_counter()
                _run_hooks(hooks, step, engine, result, reporter, metrics)
                paused += time.perf_counter() - t_hooks   # t_first is set before the hooks run
            save_due = checkpointer is not None and checkpointer.due(step, last)
            if not (save_due or failing or step % plan.log_every == 0 or step % plan.stop_check_every == 0
                    or step == last):
                continue
            losses, result.bad_data, stopping, load = _sync(pending, bad_local(), stop(), window.values(paused))
            result.losses += losses
            pending = []
            # a run about to stop for skipped steps logs that step first (metrics.jsonl keeps it)
            if step % plan.log_every == 0 or step == last or stopping or failing:
                elapsed = time.perf_counter() - t_first - paused
                rate = sizes.global_batch * (step - start - 1) / elapsed if step > start + 1 else float("nan")
                reporter.update(step, {"loss": result.losses[-1], "lr": result.lrs[-1], "samples/s": rate,
                                       "loss_scale": loss_scale(engine), **_counts(engine, result)})
                _log_metrics(metrics, data_wait, engine, result, step, last_line, (load, step - window_from), rate)
                window.reset(paused)
                window_from = last_line = step
            if failing:
                raise _nonfinite_stop(step, skip_run)
            if checkpointer is not None and (save_due or stopping):   # refuses non-finite weights (finite.py)
                data = loader.state_dict() if hasattr(loader, "state_dict") else None
                result.optimizer_steps, result.micro_steps = engine.global_steps, engine.micro_steps
                result.seconds = seconds_before + time.perf_counter() - t_start
                result.checkpoints.append(tag_for(step))
                t_save = time.perf_counter()
                checkpointer.save(engine, step, client_state(step, result, data))
                paused += time.perf_counter() - t_save
            if stopping:
                result.stopped = "sigterm"
                break
    finally:
        # the loader's workers end here, also on an error: left to interpreter exit (an error's
        # traceback keeps the iterator alive), multiprocessing's one SIGTERM is the one they absorb
        # (loader.py) and its join waits forever
        getattr(stream, "close", lambda: None)()
    end = time.perf_counter()
    result.seconds = seconds_before + end - t_start
    done = len(result.losses) - start
    result.samples_per_s = sizes.global_batch * (done - 1) / (end - t_first - paused) if done > 1 else 0.0
    result.optimizer_steps = engine.global_steps
    result.micro_steps = engine.micro_steps
    result.skipped_steps = int(getattr(engine, "skipped_steps", 0))
    result.loss_scale = loss_scale(engine)
    return result


def _nonfinite_stop(step: int, skip_run: int) -> NonFiniteLoss:
    first = step - skip_run + 1
    return NonFiniteLoss(
        f"the gradient norm was not finite for {skip_run} consecutive steps ({first}..{step}); each was "
        f"skipped (the weights are those after step {first - 1}) and the run stops without saving. The last good "
        f"checkpoint is untouched: lower optim.lr or raise optim.warmup_steps, check the data, then resume with "
        f"--resume latest")


def optimizer_step(engine, batches: Iterator[dict], loss_fn: Callable, sizes: BatchSizes,
                   accumulation: str, dtype: torch.dtype, distiller=None) -> torch.Tensor:
    """One optimizer step over `sizes.accumulation` micro-batches -> the step's loss."""
    micro = [next(batches) for _ in range(sizes.accumulation)]
    if accumulation == "global" and sizes.accumulation > 1:
        return global_optimizer_step(engine, micro, loss_fn, dtype, distiller)
    return torch.stack([micro_batch_step(engine, b, loss_fn, dtype, distiller) for b in micro]).mean()


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


def micro_batch_step(engine, batch: dict, loss_fn: Callable, dtype: torch.dtype, distiller=None) -> torch.Tensor:
    """One micro-batch ('plain' accumulation): forward, loss, backward; engine.step() updates the weights
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


def global_optimizer_step(engine, batches: list[dict], loss_fn: Callable, dtype: torch.dtype,
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

"""A step whose gradient norm is not finite never reaches the weights, and non-finite weights are
never written.

**Skipping.** An optimizer step whose global gradient norm is inf or NaN leaves the weights, the
optimizer's moments, its step count and the learning-rate schedule as they were, and counts as a
skipped step (DeepSpeed's `engine.skipped_steps`). Who tests the norm depends on the optimizer
DeepSpeed 0.19.8 builds (read from its source; every cell is run by tests/unit/test_nonfinite_steps.py):

- stage 0 (`ddp`; fp32, amp_bf16, amp -- bf16 and fp16 are refused there): rsclip (DeepSpeed steps
  torch's AdamW as it is; under amp torch's GradScaler skips on the device without telling the engine);
- ZeRO-1/2 without offload, every precision but fp16: rsclip, with its own norm (DeepSpeed's
  compute_grad_norm off); DeepSpeed where bf16.check_grad_overflow is on or ZeRO-1 bf16 accumulates
  in fp32 (its BF16_Optimizer tests the norm);
- ZeRO-1/2 with offload: rsclip under bf16, DeepSpeed (the norm) under fp32 and amp_bf16 -- rsclip clips;
- ZeRO-3, and fp16 everywhere: DeepSpeed (the norm; fp16's loss scaler tests every gradient).

DeepSpeed skips such a step by returning before its inner optimizer runs, then its engine counts
it and leaves the schedule alone (`engine._take_model_step` reads `optimizer.overflow`). Where it
does not test (bf16 at ZeRO-1/2 treats an invalid norm as an overflow only under its per-tensor
check: `stage_1_and_2.py`, `step`; stage 0 steps torch's AdamW as it is), `StepGuard` does the
same from the inner optimizer's step hooks: it reads the step's norm (one host read per optimizer
step, no kernel), and for a non-finite one hides every gradient from the inner optimizer (torch's
AdamW and DeepSpeed's skip a parameter without one: no moment, step count or weight decay moves)
and tells the engine the step overflowed, which is what DeepSpeed's own skip does. At ZeRO-1/2 it
also clips, in every precision but fp16, in place of DeepSpeed's clipping, which reads the norm on
the host once per parameter group (resolve.py then gives DeepSpeed gradient_clipping
0): one host sync a step instead of one per group, or none where DeepSpeed tests the norm itself.

**Writing.** `nonfinite_tensors(engine)` tests what a rank would write -- the module's weights as
it holds them (ZeRO-3: its partition) and its optimizer's master partitions and states -- and
`check_weights` agrees on it across ranks with one gather. A checkpoint save and a resume refuse
non-finite weights (`NonFiniteWeights`, exit code 8), and so does an export (`check_state_dict`).
"""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import TYPE_CHECKING, Callable, Iterable

import torch
import torch.distributed as dist

from rsclip_ds.runtime.rank_errors import RunStopped

if TYPE_CHECKING:
    from rsclip_ds.resolve import GuardPlan

log = logging.getLogger("rsclip_ds")

# elements per isfinite() call: its bool temporary stays 16 MiB on a full GPU at save time
CHUNK = 1 << 24


class NonFiniteWeights(RunStopped):
    """A checkpoint save, a resume or an export found inf/NaN in the weights or optimizer states
    it would write or load; nothing was written (docs/reference/exit-codes.md)."""
    exit_code = 8
    shared = said_by_rank0 = True   # agreed through one gather: every rank raises the same message


# --------------------------------------------------------------------------- skipping

class StepGuard:
    """Skips a step whose gradient norm is not finite (``skips``) and clips the others (``clip`` > 0),
    from the step hooks of the optimizer that applies the update (`install_step_guard`).

    DeepSpeed's ZeRO-1/2 `step` computes the global norm (`_global_grad_norm`, set before the update)
    and then calls its inner optimizer once per parameter group, narrowed to that group. Where the
    guard skips, the first call of a step reads the norm on the host -- the step's one sync -- and a
    non-finite one hides every gradient from the inner optimizer until the call returns; where
    DeepSpeed skips (it tested the norm before calling), nothing is read. Every applied call clips the
    group's gradient on the device with DeepSpeed's formula (`unscale_and_clip_grads`, loss scale 1:
    the weights are bit-equal to DeepSpeed's own clipping). At stage 0 the inner optimizer is the
    engine's torch AdamW: the guard computes the norm itself, as torch's clip_grad_norm_ does (one
    foreach norm, then its clipping: the plain loop's ops), and hands it to the engine as
    `_global_grad_norm`."""

    def __init__(self, outer, inner, clip: float, norm_of: Callable[[], torch.Tensor | None], *, skips: bool,
                 torch_clipping: bool = False):
        self.outer, self.inner, self.clip, self._norm_of = outer, inner, clip, norm_of
        self.skips, self.torch_clipping = skips, torch_clipping
        self.skipped = 0                      # steps this guard skipped (DeepSpeed counts them too)
        self._norm: torch.Tensor | None = None
        self._bad = False
        self._scale: torch.Tensor | None = None
        self._hidden: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._handles = [inner.register_step_pre_hook(self._before), inner.register_step_post_hook(self._after)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _before(self, optimizer, args, kwargs) -> None:
        norm = self._norm_of()
        if norm is None:   # resolve.plan_guard refuses the configurations without a norm; never guard blind
            raise RuntimeError("the non-finite guard found no gradient norm for this step (DeepSpeed computed none): "
                               "the run would apply inf/NaN gradients. Remove "
                               "zero_optimization.compute_grad_norm=false")
        if norm is not self._norm:   # the first parameter group of a new step
            self._norm, self._bad, self._scale = norm, False, None
            if self.clip > 0:
                self._scale = self._clip_scale(norm)
            if self.skips:   # the step's one host read
                value = float(norm)
                self._bad = not math.isfinite(value) or value < 0   # DeepSpeed's invalid-norm rule
                # the engine copies it for get_global_grad_norm(): a log step then reads a number, not the device
                self.outer._global_grad_norm = self._norm = value
            if self._bad:
                self.skipped += 1
                self.outer.overflow = True   # what DeepSpeed's own skip sets: the engine counts it, no lr step
        groups = optimizer.param_groups
        if self._bad:
            self._hidden = [(p, p.grad) for g in groups for p in g["params"]]
            for p, _ in self._hidden:
                p.grad = None   # the optimizer skips a parameter without a gradient: nothing of it moves
        elif self._scale is not None:
            grads = [p.grad for g in groups for p in g["params"] if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, self._scale.to(grads[0].device))

    def _clip_scale(self, norm: torch.Tensor) -> torch.Tensor:
        """The factor the gradients are multiplied by (a 0-dim tensor on the norm's device)."""
        if self.torch_clipping:   # torch.nn.utils.clip_grads_with_norm_
            return torch.clamp(self.clip / (norm + 1e-6), max=1.0)
        # stage_1_and_2.unscale_and_clip_grads with a loss scale of 1: the same float32 ops, the same bits
        return 1. / (torch.clamp(((norm / 1.0) + 1e-6) / self.clip, min=1.0) * 1.0)

    def _after(self, optimizer, args, kwargs) -> None:
        for p, grad in self._hidden:   # DeepSpeed's offload path keeps its gradient buffer across steps
            p.grad = grad
        self._hidden = []


def partition_norm(zero) -> torch.Tensor:
    """The step's global gradient norm at DeepSpeed's ZeRO-1/2 with compute_grad_norm off, computed at the
    inner optimizer's first call of the step and kept in `_global_grad_norm` (which DeepSpeed reset to None
    at the start of the step and reads afterwards): every rank's partition of the gradients -- the first
    group's already flattened to fp32 (`single_partition_of_fp32_groups[0].grad`), the others still the
    per-parameter pieces of `averaged_gradients` (under fp32 accumulation one flat fp32 partition each) --
    in one foreach norm accumulated in fp32, the squares summed over the data-parallel group. DeepSpeed's own casts each tensor to fp64 and takes its norm one
    by one; the two agree to fp32 rounding."""
    if zero._global_grad_norm is not None:   # a later group of this step: the norm is made
        return zero._global_grad_norm
    tensors = []
    for i in range(len(zero.bit16_groups)):
        flat = zero.single_partition_of_fp32_groups[i].grad
        pieces = zero.averaged_gradients.get(i) if flat is None else [flat]
        if hasattr(pieces, "flat_partition"):   # fp32 accumulation: one flat fp32 partition (zeros for padding)
            pieces = [pieces.flat_partition]
        if not isinstance(pieces, (list, tuple)):
            raise RuntimeError(f"the non-finite guard cannot read ZeRO's gradient partition of group {i} "
                               f"({type(pieces).__name__}): run with bf16.check_grad_overflow=true")
        tensors += [t for t in pieces if t is not None and t.numel()]
    squares = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square().sum() if tensors else \
        torch.zeros((), device=zero.device)
    if dist.is_initialized():
        dist.all_reduce(squares, group=zero.dp_process_group)
    zero._global_grad_norm = squares.sqrt()
    return zero._global_grad_norm


def install_step_guard(engine, plan: GuardPlan, clip: float) -> StepGuard | None:
    """Hook a StepGuard onto the engine's optimizer where `plan` says rsclip skips or clips (else None).
    Refuses, loudly, an optimizer the plan did not expect: a guard that is not where it says it is
    guards nothing."""
    if not plan.ours:
        return None
    outer = engine.optimizer
    name = type(outer).__name__
    skips, clip = plan.skips == "rsclip", clip if plan.clips == "rsclip" else 0.0
    if name == "DeepSpeedZeroOptimizer":   # ZeRO-1/2: DeepSpeed's norm, computed before the update, or ours
        norm_of = partial(partition_norm, outer) if plan.norm == "rsclip" else lambda: outer._global_grad_norm
        return StepGuard(outer, outer.optimizer, clip, norm_of, skips=skips)
    if isinstance(outer, torch.optim.Optimizer) and not hasattr(outer, "optimizer"):   # stage 0: torch's own

        def norm_of() -> torch.Tensor:
            grads = [p.grad for g in outer.param_groups for p in g["params"] if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros(())
            scale = getattr(outer, "grad_scale", None)   # amp: torch's GradScaler leaves a fused AdamW the
            if scale is not None:                        # gradients scaled and this to divide them by
                norm = norm / scale.reshape(())
            outer._global_grad_norm = norm   # the engine's get_global_grad_norm() reads it
            outer.overflow = False           # StepGuard sets True for a step it skips
            return norm
        return StepGuard(outer, outer, clip, norm_of, skips=skips, torch_clipping=True)
    raise RuntimeError(f"the non-finite guard expected DeepSpeed's ZeRO-1/2 optimizer or torch's own at stage 0 "
                       f"({plan.reason}), and DeepSpeed built {name}: refusing to train unguarded")


# --------------------------------------------------------------------------- writing

def _finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool on t's device: every element finite (chunked: no tensor-sized temporary)."""
    flat = t.detach().reshape(-1)
    if flat.numel() <= CHUNK:
        return torch.isfinite(flat).all()
    return torch.stack([torch.isfinite(c).all() for c in flat.split(CHUNK)]).all()


# DeepSpeed 0.19.8's master partitions, by optimizer: ZeRO-1/2, ZeRO-3 (whose inner optimizer holds a
# sub-group's master only while it steps it), BF16_Optimizer
MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition")


def optimizer_tensors(engine) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of this rank's optimizer: its master partitions and every state tensor (AdamW's
    moments and step), in a fixed order -- what the rank's optimizer file of a checkpoint holds."""
    outer = engine.optimizer
    if outer is None:
        return []
    inner = getattr(outer, "optimizer", outer)
    masters: dict[int, torch.Tensor] = {}
    for attr in MASTER_ATTRS:
        for t in getattr(outer, attr, None) or []:
            if torch.is_tensor(t):
                masters.setdefault(id(t), t)
    if isinstance(inner, torch.optim.Optimizer):
        for p in [p for g in inner.param_groups for p in g["params"]] + list(inner.state):
            masters.setdefault(id(p), p)
    out = []
    for i, p in enumerate(masters.values()):
        out.append((f"optimizer master {i}", p))
        state = inner.state.get(p, {}) if isinstance(inner, torch.optim.Optimizer) else {}
        out += [(f"optimizer {key} {i}", v) for key, v in sorted(state.items()) if torch.is_tensor(v)]
    return out


def _held(engine) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) of everything this rank writes in a checkpoint: the module's parameters as
    this rank holds them (ZeRO-3: its partition, `ds_tensor`) and its optimizer's tensors."""
    for name, p in engine.module.named_parameters():
        yield name, getattr(p, "ds_tensor", p)
    yield from optimizer_tensors(engine)


def nonfinite_tensors(engine) -> list[str]:
    """The names of this rank's tensors (`_held`) that hold an inf or NaN (one host read)."""
    named = [(n, t) for n, t in _held(engine) if t.is_floating_point() and t.numel()]
    if not named:
        return []
    # one device at a time (offloaded states live on the CPU, the module on the GPU)
    flags: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(named):
        flags.setdefault(t.device, []).append(i)
    bad = []
    for device, idx in flags.items():
        ok = torch.stack([_finite(named[i][1]) for i in idx]).cpu().tolist()
        bad += [i for i, good in zip(idx, ok) if not good]
    return [named[i][0] for i in sorted(bad)]


def check_weights(engine, what: str, fix: str) -> None:
    """Every rank: raise NonFiniteWeights (the same message on every rank) when any rank holds a
    non-finite weight or optimizer state. One gather across ranks; `what` says what was refused
    ('not saving checkpoint step00000040'), `fix` what to do."""
    from rsclip_ds.runtime.storage import gather_on_every_rank

    views = gather_on_every_rank(nonfinite_tensors(engine))
    if not any(views):
        return
    where = "; ".join(f"rank {r}: {len(v)} tensor(s), e.g. {', '.join(v[:3])}" for r, v in enumerate(views) if v)
    raise NonFiniteWeights(f"{what}: the weights or optimizer states are not finite ({where}). {fix}")


def check_state_dict(state: dict[str, torch.Tensor], what: str, fix: str) -> None:
    """One process (export): raise NonFiniteWeights naming the tensors of `state` with an inf/NaN."""
    bad = [k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point() and not bool(_finite(v))]
    if bad:
        raise NonFiniteWeights(f"{what}: {len(bad)} tensor(s) are not finite, e.g. {', '.join(bad[:3])}. {fix}")

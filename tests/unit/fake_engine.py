"""What the train loop (rsclip_ds.loop.train) uses of a DeepSpeed engine, in one process without
DeepSpeed, and batches and a loss for it: the metrics and W&B tests drive the real loop with it.
Import from here."""

from __future__ import annotations

import math

import torch


class FakeEngine:
    """One weight w (``module.w``), loss (w x - 1)^2, plain SGD at lr 0.5 / (1 + applied steps). Like
    DeepSpeed's engine, a step whose gradient norm is not finite is skipped and counted
    (``skipped_steps``), and on rank 0 step() writes ("Train/Samples/lr", the lr after the step, samples
    so far) to an enabled ``monitor`` (``samples_per_step``)."""

    def __init__(self, w: float = 2.0, step: int = 0, samples_per_step: int = 0):
        self.module = torch.nn.Module()
        self.module.w = torch.nn.Parameter(torch.tensor([w]))
        self.w = self.module.w
        self.device, self.global_steps, self.micro_steps, self.monitor = torch.device("cpu"), step, step, None
        self.samples_per_step = samples_per_step
        self.skipped_steps = 0
        self._norm = None

    def __call__(self, pixels, input_ids):
        return self.w * pixels.float().mean() / 255, self.w, torch.tensor(1.0), torch.tensor(0.0)

    def backward(self, loss, scale_wrt_gas=True):
        loss.backward()

    def step(self):
        self._norm = float(self.w.grad.norm())
        if math.isfinite(self._norm):
            with torch.no_grad():
                self.w -= self.get_lr()[0] * self.w.grad
        else:
            self.skipped_steps += 1
        self.w.grad = None
        self.global_steps += 1
        self.micro_steps += 1
        if self.monitor is not None and self.monitor.enabled:
            self.monitor.write_events([("Train/Samples/lr", self.get_lr()[0],
                                        self.samples_per_step * self.global_steps)])

    def get_lr(self):
        return [0.5 / (1 + self.global_steps - self.skipped_steps)]

    def fp16_enabled(self):
        return False

    def bfloat16_enabled(self):
        return False

    def get_global_grad_norm(self):
        return self._norm


def fake_batches():
    i = 0
    while True:
        i += 1
        yield {"pixel_values": torch.full((2, 3, 4, 4), 40 + 20 * (i % 7), dtype=torch.uint8),
               "input_ids": torch.zeros(2, 4, dtype=torch.long)}


def fake_loss(image, text, scale, bias):
    return ((image - 1.0) ** 2).sum()


def fault_plan(*sets: str, world: int = 1):
    """The fault plan resolve() makes from `faults.*` overrides (e.g. "inject_nan_at_step=4")."""
    from rsclip_ds.config import load_config
    from rsclip_ds.resolve import World, fault_plan as plan

    return plan(load_config(None, [f"faults.{s}" for s in sets]), World(world, world))


def run_loop(engine, batches, steps: int, log_every: int, *, faults=None, metrics=None, hooks=(), resume=None,
             stop_after: int | None = None, reporter=None, sizes=None, accumulation: str = "plain", loss=fake_loss):
    """rsclip_ds.loop.train as the Trainer calls it, from the few numbers these tests vary; `faults`: a
    fault_plan(...) for rank 0, armed on the engine's module as the Trainer arms it."""
    from rsclip_ds.faults import NO_FAULTS, Faults
    from rsclip_ds.loop import Objective, Observers, train
    from rsclip_ds.resolve import BatchSizes, LoopPlan

    seam = NO_FAULTS if faults is None else Faults(faults, 0)
    if faults is not None:
        seam.arm(engine.module)
    plan = LoopPlan(sizes or BatchSizes(2, 1, 1), steps, log_every, accumulation, stop_after,
                    **({} if faults is None else {"stop_check_every": faults.stop_check_every,
                                                  "max_nonfinite_steps": faults.max_nonfinite_steps,
                                                  "count_nonfinite": faults.count_nonfinite}))
    return train(plan, engine, batches, Objective(loss), Observers(reporter, metrics, hooks=hooks),
                 resume=resume, faults=seam)

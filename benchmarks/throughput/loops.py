"""The training loops benchmarks/throughput/compare.py times, and the instruments on them.

  ours      `rsclip_ds.trainer.Trainer` itself: the run as `rsclip-ds train` assembles it. Two
            seams, no patching: a forward-pre-hook on the built bundle's model counts samples,
            `wrap_loader=LoaderProxy` times next(batch). The benchmark's process group exists
            before the Trainer enters, so the Trainer leaves it alone.
  bare      what a user writes from the DeepSpeed tutorial: deepspeed.initialize, then forward /
            loss / backward / step in a for loop; model, loss and loader from rsclip_ds's builders.
  trainer   transformers.Trainer with the same DeepSpeed config, model and loader.

Every loop is timed from the end of optimizer step 1 (lazy init, loader start-up) to the end of
the last step and returns a `Measured`; losses are per step, mean over ranks.
"""

from __future__ import annotations

import cProfile
import io
import sys
import tempfile
import time
from contextlib import redirect_stdout
from dataclasses import dataclass, field
from typing import Callable

import torch

from benchmarks.harness import mean_over_ranks, shared_run_dir
from rsclip_ds.config import RunConfig, load_config
from rsclip_ds.data import build_train_loader
from rsclip_ds.losses import build_loss
from rsclip_ds.model import ModelBundle, apply_activation_checkpointing, build_model
from rsclip_ds.profiles import activation_checkpointing_enabled, build_ds_config, load_profile
from rsclip_ds.trainer import Trainer

# Throughput runs save no checkpoint (an end-of-run save would be timed with the last step).
CHECKPOINT_OFF = ("checkpoint.at_end=false", "checkpoint.every=0")


@dataclass
class Ctx:
    """What every loop shares: the ranks, the data and the run's settings."""
    rank: int
    world: int
    on_gpu: bool
    data: dict              # harness.synthetic_data: train_pattern, val_urls, tokenizer
    precision: str
    profile: str
    micro: int
    threads: int = 1        # torch threads per rank
    profiler: cProfile.Profile | None = None   # enabled around the step loop only, when set

    def profiling(self, on: bool) -> None:
        if self.profiler is not None:
            self.profiler.enable() if on else self.profiler.disable()


@dataclass
class Measured:
    """One run of one loop on this rank."""
    elapsed: float          # seconds from the end of step 1 to the end of the last step
    cpu: float              # CPU seconds of this process (all its threads) over the same span
    samples: int            # samples through the model's forward with grad, on this rank
    data_wait: float        # seconds spent in next(batch) after step 1
    losses: list[float]     # per step, mean over ranks (ours: on rank 0 only, from the summary)
    extra: dict = field(default_factory=dict)


def run_config(ctx: Ctx, steps: int, negatives: str = "global", extra: tuple[str, ...] = ()) -> RunConfig:
    """The demo's settings (configs/tiny_demo.yaml) on the benchmark's shards."""
    return load_config(None, [
        f"profile={ctx.profile}", f"precision={ctx.precision}", f"steps={steps}", "seed=0",
        "model.preset=tiny", f"model.tokenizer={ctx.data['tokenizer']}", "loss.name=siglip",
        f"loss.negatives={negatives}", f"data.train_shards={ctx.data['train_pattern']}",
        "data.num_workers=1", "data.shuffle_buffer=256", f"batch.micro_batch_size={ctx.micro}",
        "batch.gradient_accumulation_steps=1", "optim.lr=1e-3", f"optim.warmup_steps={min(5, steps - 1)}",
        "optim.weight_decay=0.05", "logging.log_every=10", "logging.progress=plain", *extra])


# --------------------------------------------------------------------------- instruments

class TimedBatches:
    """Iterator over a loader that records the time spent waiting for each batch."""

    def __init__(self, loader):
        self.loader, self.it, self.waits = loader, iter(loader), []

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        t0 = time.perf_counter()
        batch = next(self.it)
        self.waits.append(time.perf_counter() - t0)
        return batch

    def close(self) -> None:
        """Stop the loader's worker processes now, not at some later garbage collection."""
        shutdown = getattr(self.it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self.it = self.loader = None


class LoaderProxy:
    """The Trainer's `wrap_loader`: iterating gives TimedBatches; state_dict / bad_data and the
    rest pass through to the TrainLoader."""

    def __init__(self, loader):
        self._loader, self.timed = loader, None

    def __iter__(self):
        self.timed = TimedBatches(self._loader)
        return self.timed

    def __getattr__(self, name):
        return getattr(self._loader, name)


class ForwardSamples:
    """Counts the samples of every forward-with-grad of a module (a hook on the DualEncoder)."""

    def __init__(self, module: torch.nn.Module):
        self.samples = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, _module, args):
        if torch.is_grad_enabled() and args:
            self.samples += len(args[0])

    def close(self) -> None:
        self.handle.remove()


def _span(marks: list[tuple[float, float]]) -> tuple[float, float]:
    """(wall, CPU) seconds between the first and the last (perf_counter, process_time) mark."""
    return marks[-1][0] - marks[0][0], marks[-1][1] - marks[0][1]


def _mark() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


# --------------------------------------------------------------------------- ours

def loop_ours(ctx: Ctx, steps: int, negatives: str = "global", overrides: tuple[str, ...] = CHECKPOINT_OFF,
              final_hook: Callable[[object, ModelBundle], dict] | None = None) -> Measured:
    """The Trainer as users get it (engine, loss, loader, fault guard, heartbeat), timed by a
    step hook, so the summary and any end-of-run save are outside the span.
    `final_hook(engine, bundle)` runs after the last step (the quality evaluation)."""
    marks, extra = [], {}

    def step_hook(step: int, engine):
        if step == 0:   # train() also calls hooks before the first step (evaluation from chance)
            return None
        marks.append(_mark())
        if step == steps and final_hook is not None:
            extra.update(final_hook(engine, trainer.parts.bundle))
        return None

    with shared_run_dir() as out_dir:   # the checkpointed variant saves there: one folder for all ranks
        run = run_config(ctx, steps, negatives, (f"output_dir={out_dir}", *overrides))
        with Trainer(run, hooks=[step_hook], wrap_loader=LoaderProxy) as trainer:
            parts = trainer.build()
            forward = ForwardSamples(parts.bundle.model)
            with redirect_stdout(io.StringIO() if ctx.rank == 0 else sys.stdout):   # the progress lines
                ctx.profiling(True)
                try:
                    summary = trainer.train() or {}
                finally:
                    ctx.profiling(False)
                    forward.close()
                    parts.loader.timed.close()
    elapsed, cpu = _span(marks)
    return Measured(elapsed, cpu, forward.samples, sum(parts.loader.timed.waits[1:]), summary.get("losses", []),
                    {**extra, "summary_samples_per_s": summary.get("samples_per_s"),
                     "checkpoints": summary.get("checkpoints")})


# --------------------------------------------------------------------------- bare and HF Trainer

def hand_built(ctx: Ctx, run: RunConfig) -> tuple[ModelBundle, dict, Callable, TimedBatches]:
    """What a user of plain DeepSpeed or of the HF Trainer wires by hand from rsclip_ds's public
    builders: the model (activation checkpointing as the profile says), the DeepSpeed config,
    the loss and the loader, with the run's seeds, so every loop sees the same batches."""
    profile = load_profile(run.profile)
    ds_config = build_ds_config(run, profile, ctx.world, on_gpu=ctx.on_gpu)
    bundle = build_model(run.model, run.seed, loss=run.loss.name)
    if activation_checkpointing_enabled(run, profile):
        apply_activation_checkpointing(bundle.model)
    loss_fn = build_loss(run.loss.name, negatives=run.loss.negatives, rank=ctx.rank, world_size=ctx.world,
                         chunk_size=run.loss.chunk_size)
    loader = build_train_loader(
        run.data, tokenizer=bundle.tokenizer, image_size=bundle.image_size,
        max_text_length=bundle.max_text_length, micro_batch_size=ctx.micro,
        rank=ctx.rank, world_size=ctx.world, seed=run.seed)
    return bundle, ds_config, loss_fn, TimedBatches(loader)


def loop_bare(ctx: Ctx, steps: int) -> Measured:
    """What a user writes from the DeepSpeed tutorial: no accumulation logic, no logging."""
    import deepspeed

    run = run_config(ctx, steps)
    bundle, ds_config, loss_fn, batches = hand_built(ctx, run)
    forward = ForwardSamples(bundle.model)
    engine, *_ = deepspeed.initialize(model=bundle.model, model_parameters=bundle.model.parameters(),
                                      config=ds_config)
    torch.manual_seed(run.seed + 1000 * ctx.rank)
    marks, losses = [], []
    try:
        ctx.profiling(True)
        for _ in range(steps):
            batch = next(batches)
            # uint8 pixels: the model normalises them in its own dtype
            image, text, scale, bias = engine(batch["pixel_values"].to(engine.device),
                                              batch["input_ids"].to(engine.device))   # (B,D) x2
            loss = loss_fn(image, text, scale, bias)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
            marks.append(_mark())
    finally:
        ctx.profiling(False)
        batches.close()
        forward.close()
    elapsed, cpu = _span(marks)
    return Measured(elapsed, cpu, forward.samples, sum(batches.waits[1:]),
                    mean_over_ranks([float(v) for v in losses]))


def loop_trainer(ctx: Ctx, steps: int) -> Measured:
    """transformers.Trainer with our DeepSpeed config, model and loader; compute_loss is the
    per-rank SigLIP loss, as a Trainer user would write it."""
    import transformers

    from rsclip_ds.losses import siglip_loss

    run = run_config(ctx, steps, negatives="local")
    bundle, ds_config, _, batches = hand_built(ctx, run)
    forward = ForwardSamples(bundle.model)
    marks, losses = [], []

    class StepTimes(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            ctx.profiling(True)   # after deepspeed_init, like the other loops

        def on_step_end(self, args, state, control, **kwargs):
            marks.append(_mark())

    class SiglipTrainer(transformers.Trainer):
        def get_train_dataloader(self):
            return batches

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            image, text, scale, bias = model(inputs["pixel_values"], inputs["input_ids"])
            loss = siglip_loss(image, text, scale, bias)
            losses.append(loss.detach())
            return loss

    o = run.optim
    with tempfile.TemporaryDirectory() as out_dir:
        # every value the Trainer checks against the DeepSpeed config, from the same run config
        args = transformers.TrainingArguments(
            output_dir=out_dir, max_steps=steps, per_device_train_batch_size=ctx.micro,
            gradient_accumulation_steps=1, learning_rate=o.lr, adam_beta1=o.betas[0],
            adam_beta2=o.betas[1], adam_epsilon=o.eps, weight_decay=o.weight_decay,
            warmup_steps=max(1, o.warmup_steps), max_grad_norm=o.gradient_clipping,
            bf16=run.precision == "bf16", deepspeed=ds_config, use_cpu=not ctx.on_gpu,
            logging_steps=run.logging.log_every, report_to="none", save_strategy="no",
            disable_tqdm=True, remove_unused_columns=False, seed=run.seed)
        torch.manual_seed(run.seed + 1000 * ctx.rank)
        trainer = SiglipTrainer(model=bundle.model, args=args, train_dataset=[None], callbacks=[StepTimes()])
        try:
            trainer.train()
        finally:
            ctx.profiling(False)
            batches.close()
            forward.close()
        del trainer
    elapsed, cpu = _span(marks)
    return Measured(elapsed, cpu, forward.samples, sum(batches.waits[1:]),
                    mean_over_ranks([float(v) for v in losses]))


LOOPS: dict[str, Callable[[Ctx, int], Measured]] = {
    "ours": loop_ours,
    "bare": loop_bare,
    "trainer": loop_trainer,
    "ours_local": lambda ctx, steps: loop_ours(ctx, steps, negatives="local"),
}

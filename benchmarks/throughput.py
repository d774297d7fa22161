"""Throughput of the rsclip_ds training loop against a bare DeepSpeed loop and the HF Trainer.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 benchmarks/throughput.py --out benchmarks/results/throughput.json
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 benchmarks/throughput.py --tiny --out /tmp/throughput.json

Writes the JSON given by --out and a PNG beside it; rank 0 prints the tables. The full run takes
~8 minutes on 2 CPU ranks of a 2-core machine; --tiny ~1.5 minutes (start-up and engine builds).
Needs `accelerate` for the Trainer column (`pip install accelerate`, or `pip install
rsclip_ds[bench]`); without it that column is skipped with a note.

Same model (tiny preset), profile (zero2), precision, synthetic shards, micro-batch, number of
steps and batches (every loop builds a fresh loader with the same seed, so each sees the same
batch sequence) for:
  ours        rsclip_ds.train.train with our engine, loss and loader, built as cli.run_training
              builds them (global-batch SigLIP loss: the product default)
  bare        deepspeed.initialize + forward / loss / backward / step in a for loop, the same
              loss and loader: the floor for our overhead
  trainer     transformers.Trainer with the same DeepSpeed config and loader, compute_loss =
              the per-rank SigLIP loss (what the Trainer computes)
  ours_local  ours with loss.negatives=local: the Trainer's loss, so ours_local / trainer
              compares the loops at equal work
Repeats are interleaved (ours, bare, trainer, ours_local, ours, ...) and every ratio is taken
within one repeat, so the shared machine's slow phases cancel; the report gives medians and the
min..max spread. Rates are global samples/s from the end of the first optimizer step (lazy init,
loader start-up) to the end of the last, on the slowest rank. Targets: ours >= 0.97 x bare,
ours > trainer.

Also measured: the loader alone (samples/s it delivers on all ranks at once, against what
training consumes), the time each loop waits in next(batch) (loader stalls), the Python self
time per step spent in our own code (cProfile, one extra run per loop), and quality at equal
compute: held-out retrieval R@1 on the synthetic val split after the same steps with our
global-batch loss against the per-rank loss.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import logging
import os
import pstats
import statistics
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager, redirect_stdout
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from common import environment, write_report
from rsclip_ds.config import RunConfig, load_config
from rsclip_ds.data import build_train_loader
from rsclip_ds.engine import engine_dtype
from rsclip_ds.losses import build_loss
from rsclip_ds.model import ModelBundle, apply_activation_checkpointing, build_model
from rsclip_ds.profiles import activation_checkpointing_enabled, build_ds_config, load_profile
from rsclip_ds.data.tokenizer import tokenize

LOOPS = ("ours", "bare", "trainer", "ours_local", "ours_fix")
# The overhead fixes proposed in docs/benchmarks.md, applied to 'ours' without touching
# rsclip_ds: agree on SIGTERM every 10 steps (one all-reduce + host sync per 10 steps, not
# per step). `ours_fix / bare` is the effect.
FIX_OVERRIDES = ("faults.stop_check_every=10",)
# Throughput runs save no checkpoint (the end-of-run save would land in the last step's time).
CHECKPOINT_OFF = ("checkpoint.at_end=false", "checkpoint.every=0")
ACCELERATE_MISSING = ("the Hugging Face Trainer needs `accelerate`: pip install accelerate "
                      "(or pip install -e '.[bench]'); the trainer column is skipped")


@dataclass(frozen=True)
class BenchConfig:
    steps: int            # optimizer steps per timed run (the first is not timed)
    repeats: int          # interleaved repeats of every loop
    micro: int            # samples per rank per step
    loader_batches: int   # batches per rank pulled from the loader alone (after the first)
    quality_steps: int    # steps of each run of the quality comparison
    num_train: int        # synthetic training samples
    num_val: int          # synthetic held-out samples (retrieval pool)
    shard_size: int
    profile_steps: int    # steps of the cProfile'd run of each loop


FULL = BenchConfig(steps=30, repeats=5, micro=32, loader_batches=60, quality_steps=150, num_train=4096,
                   num_val=512, shard_size=256, profile_steps=20)
TINY = BenchConfig(steps=4, repeats=1, micro=8, loader_batches=4, quality_steps=4, num_train=256,
                   num_val=32, shard_size=32, profile_steps=3)


@dataclass
class Measured:
    """One run of one loop on this rank."""
    elapsed: float          # seconds from the end of step 1 to the end of the last step
    cpu: float              # CPU seconds of this process (all its threads) over the same span
    samples: int            # samples through the model's forward (with grad) on this rank
    data_wait: float        # seconds spent in next(batch) after step 1
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- instruments

class TimedBatches:
    """Iterator over a loader that counts batches and the time spent waiting for them."""

    def __init__(self, loader):
        self.loader, self.it = loader, iter(loader)
        self.batches, self.wait, self.waits = 0, 0.0, []

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        t0 = time.perf_counter()
        batch = next(self.it)
        self.waits.append(time.perf_counter() - t0)
        self.batches += 1
        return batch

    def wait_after(self, first: int) -> float:
        return sum(self.waits[first:])

    def close(self) -> None:
        """Stop the loader's worker processes now, not at some later garbage collection."""
        shutdown = getattr(self.it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self.it = self.loader = None


class ForwardSamples:
    """Counts the samples of every forward-with-grad of a module (hook on the DualEncoder)."""

    def __init__(self, module: torch.nn.Module):
        self.samples = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, _module, args):
        if torch.is_grad_enabled() and args:
            self.samples += len(args[0])

    def close(self) -> None:
        self.handle.remove()


# --------------------------------------------------------------------------- shared set-up

@dataclass
class Ctx:
    rank: int
    world: int
    on_gpu: bool
    data: dict             # train_pattern, val_urls, tokenizer
    precision: str
    profile: str
    cfg: BenchConfig
    threads: int = 1
    profiler: cProfile.Profile | None = None   # enabled around the step loop only, when set

    def profiling(self, on: bool) -> None:
        if self.profiler is not None:
            self.profiler.enable() if on else self.profiler.disable()


def run_config(ctx: Ctx, steps: int, negatives: str = "global", extra: list[str] = ()) -> RunConfig:
    """The demo's settings (configs/tiny_demo.yaml) on the benchmark's shards."""
    return load_config(None, [
        f"profile={ctx.profile}", f"precision={ctx.precision}", f"steps={steps}", "seed=0",
        "model.preset=tiny", f"model.tokenizer={ctx.data['tokenizer']}", "loss.name=siglip",
        f"loss.negatives={negatives}", f"data.train_shards={ctx.data['train_pattern']}",
        "data.num_workers=1", "data.shuffle_buffer=256", f"batch.micro_batch_size={ctx.cfg.micro}",
        "batch.gradient_accumulation_steps=1", "optim.lr=1e-3", f"optim.warmup_steps={min(5, steps - 1)}",
        "optim.weight_decay=0.05", "logging.log_every=10", "logging.progress=plain", *extra])


def ds_config_for(ctx: Ctx, run: RunConfig) -> tuple[dict, bool]:
    profile = load_profile(run.profile)
    return build_ds_config(run, profile, ctx.world, on_gpu=ctx.on_gpu), \
        activation_checkpointing_enabled(run, profile)


def make_bundle(run: RunConfig, checkpointing: bool) -> ModelBundle:
    bundle = build_model(run.model, run.seed, loss=run.loss.name)
    if checkpointing:
        apply_activation_checkpointing(bundle.model)
    return bundle


def make_loader(ctx: Ctx, run: RunConfig, bundle: ModelBundle) -> TimedBatches:
    """Exactly cli.run_training's loader."""
    return TimedBatches(build_train_loader(
        run.data, tokenizer=bundle.tokenizer, image_size=bundle.image_size,
        image_mean=bundle.image_mean, image_std=bundle.image_std,
        max_text_length=bundle.max_text_length, micro_batch_size=ctx.cfg.micro,
        rank=ctx.rank, world_size=ctx.world, seed=run.seed))


def loss_for(ctx: Ctx, run: RunConfig) -> Callable:
    return build_loss(run.loss.name, negatives=run.loss.negatives, rank=ctx.rank,
                      world_size=ctx.world, chunk_size=run.loss.chunk_size)


# --------------------------------------------------------------------------- (a) ours

class LoaderProxy:
    """Our loader as run_training builds it, with next(batch) timed; state_dict / bad_data
    and the rest pass through."""

    def __init__(self, loader):
        self._loader, self.timed = loader, None

    def __iter__(self):
        self.timed = TimedBatches(self._loader)
        return self.timed

    def __getattr__(self, name):
        return getattr(self._loader, name)


@contextmanager
def instrumented_run_training(counters: dict):
    """cli.run_training as users get it, with three attributes swapped while it runs (it
    imports them at call time): build_model also counts forward samples, build_train_loader
    also times next(batch), destroy_distributed does nothing (the benchmark's process group
    outlives each run)."""
    import rsclip_ds.data
    import rsclip_ds.distributed
    import rsclip_ds.model

    saved = (rsclip_ds.model.build_model, rsclip_ds.data.build_train_loader,
             rsclip_ds.distributed.destroy_distributed)

    def build_model_counted(*a, **kw):
        bundle = saved[0](*a, **kw)
        counters["forward"] = ForwardSamples(bundle.model)
        return bundle

    def build_loader_timed(*a, **kw):
        counters["loader"] = LoaderProxy(saved[1](*a, **kw))
        return counters["loader"]

    rsclip_ds.model.build_model = build_model_counted
    rsclip_ds.data.build_train_loader = build_loader_timed
    rsclip_ds.distributed.destroy_distributed = lambda: None
    try:
        yield
    finally:
        rsclip_ds.model.build_model, rsclip_ds.data.build_train_loader, \
            rsclip_ds.distributed.destroy_distributed = saved


def loop_ours(ctx: Ctx, steps: int, negatives: str = "global", overrides: tuple[str, ...] = (),
              final_hook: Callable | None = None) -> Measured:
    """`rsclip_ds.cli.run_training` itself (engine, loss, loader, fault guard, heartbeat as
    users get them), timed by a step hook: from the end of step 1 to the end of the last step,
    so the checkpoint at the end (switched off here anyway) and the summary are not counted.
    `final_hook(engine)` runs after the last step (the quality evaluation)."""
    from rsclip_ds.cli import run_training

    times, counters, extra = [], {}, {}

    def step_hook(step: int, engine):
        if step == 0:   # train() also calls hooks before the first step (evaluation from chance)
            return None
        times.append((time.perf_counter(), time.process_time()))
        if step == steps and final_hook is not None:
            extra.update(final_hook(engine))
        return None

    with tempfile.TemporaryDirectory() as out_dir:
        run = run_config(ctx, steps, negatives, [f"output_dir={out_dir}", *CHECKPOINT_OFF, *overrides])
        quiet = io.StringIO() if ctx.rank == 0 else None
        with instrumented_run_training(counters), redirect_stdout(quiet or sys.stdout):
            ctx.profiling(True)
            try:
                run_training(run, hooks=[step_hook])
            finally:
                ctx.profiling(False)
                counters["forward"].close()
        summary = json.loads((Path(out_dir) / "summary.json").read_text()) if ctx.rank == 0 else {}
    timed = counters["loader"].timed
    timed.close()
    losses = summary.get("losses") or [None]
    return Measured(times[-1][0] - times[0][0], times[-1][1] - times[0][1], counters["forward"].samples,
                    timed.wait_after(1), {"final_loss": losses[-1], **extra,
                                          "summary_samples_per_s": summary.get("samples_per_s")})


# --------------------------------------------------------------------------- (b) bare

def loop_bare(ctx: Ctx, steps: int) -> Measured:
    """What a user writes from the DeepSpeed tutorial: no accumulation logic, no logging."""
    import deepspeed

    run = run_config(ctx, steps)
    ds_config, checkpointing = ds_config_for(ctx, run)
    bundle = make_bundle(run, checkpointing)
    counter = ForwardSamples(bundle.model)
    engine, *_ = deepspeed.initialize(model=bundle.model, model_parameters=bundle.model.parameters(),
                                      config=ds_config)
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    loss_fn = loss_for(ctx, run)
    batches = make_loader(ctx, run, bundle)
    torch.manual_seed(run.seed + 1000 * ctx.rank)
    t_first, cpu_first = time.perf_counter(), time.process_time()
    try:
        ctx.profiling(True)
        for step in range(steps):
            batch = next(batches)
            image, text, scale, bias = engine(batch["pixel_values"].to(engine.device, dtype),
                                              batch["input_ids"].to(engine.device))
            loss = loss_fn(image, text, scale, bias)
            engine.backward(loss)
            engine.step()
            if step == 0:
                t_first, cpu_first = time.perf_counter(), time.process_time()
        elapsed, cpu = time.perf_counter() - t_first, time.process_time() - cpu_first
    finally:
        ctx.profiling(False)
        batches.close()
        counter.close()
    return Measured(elapsed, cpu, counter.samples, batches.wait_after(1), {"final_loss": float(loss.detach())})


# --------------------------------------------------------------------------- (c) HF Trainer

def accelerate_available() -> bool:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True


def loop_trainer(ctx: Ctx, steps: int) -> Measured:
    """transformers.Trainer with our DeepSpeed config, model and loader; compute_loss is the
    per-rank SigLIP loss, as a Trainer user would write it."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from rsclip_ds.losses import siglip_loss

    run = run_config(ctx, steps, negatives="local")
    ds_config, checkpointing = ds_config_for(ctx, run)
    bundle = make_bundle(run, checkpointing)
    counter = ForwardSamples(bundle.model)
    batches = make_loader(ctx, run, bundle)
    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            ctx.profiling(True)   # after deepspeed_init, like the other loops

        def on_step_end(self, args, state, control, **kwargs):
            times.append((time.perf_counter(), time.process_time()))

    class SiglipTrainer(Trainer):
        def get_train_dataloader(self):
            return batches

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            image, text, scale, bias = model(inputs["pixel_values"], inputs["input_ids"])
            return siglip_loss(image, text, scale, bias)

    o = run.optim
    with tempfile.TemporaryDirectory() as out_dir:
        # every value the Trainer checks against the DeepSpeed config, from the same run config
        args = TrainingArguments(
            output_dir=out_dir, max_steps=steps, per_device_train_batch_size=ctx.cfg.micro,
            gradient_accumulation_steps=1, learning_rate=o.lr, adam_beta1=o.betas[0],
            adam_beta2=o.betas[1], adam_epsilon=o.eps, weight_decay=o.weight_decay,
            warmup_steps=max(1, o.warmup_steps), max_grad_norm=o.gradient_clipping,
            bf16=run.precision == "bf16", deepspeed=ds_config, use_cpu=not ctx.on_gpu,
            logging_steps=run.logging.log_every, report_to="none", save_strategy="no",
            disable_tqdm=True, remove_unused_columns=False, seed=run.seed)
        torch.manual_seed(run.seed + 1000 * ctx.rank)
        trainer = SiglipTrainer(model=bundle.model, args=args, train_dataset=[None],
                                callbacks=[StepTimes()])
        try:
            output = trainer.train()
        finally:
            ctx.profiling(False)
            batches.close()
            counter.close()
        del trainer
    return Measured(times[-1][0] - times[0][0], times[-1][1] - times[0][1], counter.samples, batches.wait_after(1),
                    {"final_loss": output.training_loss})


# --------------------------------------------------------------------------- measuring

def _over_ranks(values: list[float], op) -> list[float]:
    # on the accelerator: a GPU run's process group is NCCL only, which has no CPU tensors
    from deepspeed.accelerator import get_accelerator

    t = torch.tensor(values, dtype=torch.float64, device=get_accelerator().current_device_name())
    if dist.get_world_size() > 1:
        dist.all_reduce(t, op=op)
    return t.tolist()


def max_over_ranks(values: list[float]) -> list[float]:
    return _over_ranks(values, dist.ReduceOp.MAX)


def sum_over_ranks(values: list[float]) -> list[float]:
    return _over_ranks(values, dist.ReduceOp.SUM)


def run_loop(ctx: Ctx, name: str, steps: int) -> dict:
    dist.barrier()
    fn = {"ours": loop_ours, "bare": loop_bare, "trainer": loop_trainer,
          "ours_local": lambda c, s: loop_ours(c, s, negatives="local"),
          "ours_fix": lambda c, s: loop_ours(c, s, overrides=FIX_OVERRIDES)}[name]
    m = fn(ctx, steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(ctx.threads)   # accelerate sets its own count; never let it leak into the next loop
    gc.collect()
    elapsed, wait = max_over_ranks([m.elapsed, m.data_wait])
    samples, cpu = sum_over_ranks([m.samples, m.cpu])
    timed_samples = ctx.cfg.micro * ctx.world * (steps - 1)
    return {"loop": name, "steps": steps, "samples": int(samples), "elapsed_s": elapsed,
            "samples_per_s": timed_samples / elapsed, "data_wait_s": wait,
            "cpu_ms_per_sample": 1e3 * cpu / timed_samples,
            "data_wait_fraction": wait / elapsed, "final_loss": m.extra.get("final_loss"),
            "threads_at_end": threads}


def loader_rate(ctx: Ctx, batches: int) -> dict:
    """The loader alone, all ranks pulling at once (their workers compete as in training)."""
    run = run_config(ctx, 2)
    bundle = build_model(run.model, run.seed, loss=run.loss.name)
    dist.barrier()
    loader = make_loader(ctx, run, bundle)
    next(loader)                      # worker start-up, not counted
    t0 = time.perf_counter()
    for _ in range(batches):
        next(loader)
    elapsed = time.perf_counter() - t0
    loader.close()
    rate, = sum_over_ranks([batches * ctx.cfg.micro / elapsed])
    return {"batches_per_rank": batches, "samples_per_s": rate}


def summary_rate_with_checkpoint(ctx: Ctx, steps: int) -> dict:
    """`ours` as users run it by default (checkpoint.at_end=true): the summary's samples/s
    against the step-hook rate of the same run. The end-of-run save falls inside the summary's
    timed span (train.py: the save happens in the loop, before `end`)."""
    m = loop_ours(ctx, steps, overrides=("checkpoint.at_end=true",))
    steps_rate = ctx.cfg.micro * ctx.world * (steps - 1) / max_over_ranks([m.elapsed])[0]
    reported = m.extra["summary_samples_per_s"]   # rank 0's own clock, as the summary says
    return {"steps": steps, "step_hook_samples_per_s": steps_rate, "summary_samples_per_s": reported,
            "summary_over_steps": reported / steps_rate if reported else None}


def summarize(rows: list[dict], loops: list[str]) -> dict:
    """Medians and spread per loop, and ratios paired within each repeat."""
    by = {name: [r for r in rows if r["loop"] == name] for name in loops}
    out = {"loops": {}, "ratios": {}}
    for name, rs in by.items():
        rates = [r["samples_per_s"] for r in rs]
        out["loops"][name] = {"median_samples_per_s": statistics.median(rates), "min": min(rates),
                              "median_cpu_ms_per_sample": statistics.median(r["cpu_ms_per_sample"] for r in rs),
                              "max": max(rates), "runs": len(rates),
                              "median_data_wait_fraction": statistics.median(r["data_wait_fraction"] for r in rs),
                              "samples_per_run": sorted({r["samples"] for r in rs})}
    for num, den in (("ours", "bare"), ("ours_fix", "bare"), ("ours", "trainer"), ("ours_local", "trainer"),
                     ("trainer", "bare")):
        if num in by and den in by:
            ratios = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(by[num], by[den])]
            # CPU time per sample: work done, blind to the time a rank sat descheduled on a
            # shared machine (busy-waiting collectives still count); den / num, so > 1 = faster
            cpu = [b["cpu_ms_per_sample"] / a["cpu_ms_per_sample"] for a, b in zip(by[num], by[den])]
            out["ratios"][f"{num}/{den}"] = {"median": statistics.median(ratios), "min": min(ratios),
                                             "max": max(ratios), "per_repeat": ratios,
                                             "cpu_median": statistics.median(cpu), "cpu_per_repeat": cpu}
    return out


# --------------------------------------------------------------------------- Python time per step

# The loop's own code (not the model, the loss or DeepSpeed, which all loops run alike).
# The loader's main-process side (rsclip_ds/data.py) runs in every loop alike: reported apart.
OWN_CODE = {"ours": ("rsclip_ds/train.py", "rsclip_ds/progress.py", "rsclip_ds/engine.py",
                     "rsclip_ds/distributed.py", "rsclip_ds/checkpoint.py", "rsclip_ds/cli.py"),
            "bare": ("throughput.py",),
            "trainer": ("transformers/trainer", "transformers/integrations/deepspeed", "transformers/training_args",
                        "accelerate/")}


def profiled(ctx: Ctx, name: str, steps: int, own: tuple[str, ...]) -> dict:
    """Run a loop under cProfile on every rank; -> per-step self time (tottime) of functions
    whose file path contains one of `own` (the framework's own code, outside torch/deepspeed),
    and the top such functions. Self time: what removing Python work in the hot path can save."""
    prof = cProfile.Profile()
    dist.barrier()
    run_loop_fn = {"ours": loop_ours, "bare": loop_bare, "trainer": loop_trainer}[name]
    torch.manual_seed(0)
    run_loop_fn(replace(ctx, profiler=prof), steps)
    stats = pstats.Stats(prof)
    rows, loader = [], 0.0
    for (path, line, func), (_cc, _nc, tottime, _ct, _callers) in stats.stats.items():
        if any(o in path for o in own):
            rows.append((tottime, f"{Path(path).parent.name}/{Path(path).name}:{line}:{func}"))
        if "rsclip_ds/data.py" in path:
            loader += tottime
    rows.sort(reverse=True)
    total, loader = max_over_ranks([sum(t for t, _ in rows), loader])
    gc.collect()
    return {"loop": name, "steps": steps, "own_code": list(own), "self_ms_per_step": 1e3 * total / steps,
            "loader_main_process_ms_per_step": 1e3 * loader / steps,
            "top": [{"function": f, "ms_per_step": 1e3 * t / steps} for t, f in rows[:6]]}


# --------------------------------------------------------------------------- quality

def read_val(urls: list[str], tokenizer_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The val shards in order -> pixel_values (N,3,S,S), input_ids (N,L); decoded as the
    training data is (squash-resize, model mean/std)."""
    import io

    import numpy as np
    from PIL import Image

    from rsclip_ds.model import IMAGE_MEAN, IMAGE_STD, PRESETS, load_tokenizer

    size = PRESETS["tiny"]["vision"]["image_size"]
    mean, std = torch.tensor(IMAGE_MEAN).view(3, 1, 1), torch.tensor(IMAGE_STD).view(3, 1, 1)
    tokenizer = load_tokenizer(Path(tokenizer_dir))
    max_length = PRESETS["tiny"]["text"]["max_position_embeddings"]
    samples: dict[str, dict] = {}
    for url in urls:
        with tarfile.open(url) as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                if ext in ("jpg", "txt"):
                    samples.setdefault(key, {})[ext] = tar.extractfile(member).read()
    pixels, captions = [], []
    for key in sorted(samples):
        img = Image.open(io.BytesIO(samples[key]["jpg"])).convert("RGB").resize((size, size), Image.BICUBIC)
        x = torch.from_numpy(np.asarray(img, np.uint8).copy()).permute(2, 0, 1).float() / 255.0
        pixels.append((x - mean) / std)                                               # (3, S, S)
        captions.append(samples[key]["txt"].decode().strip())
    ids = tokenize(tokenizer, captions, max_length)                # (N, L)
    return torch.stack(pixels), ids


def retrieval_r1(module, pixels: torch.Tensor, ids: torch.Tensor) -> dict:
    from rsclip_ds.evaluation.metrics import retrieval_metrics

    module.eval()
    with torch.no_grad():
        image, text, _, _ = module(pixels, ids)                                       # (N, D) x2
    module.train()
    m = retrieval_metrics(image, text, torch.arange(len(image)))   # one caption per val image
    return {k: m[k] for k in ("i2t_R@1", "t2i_R@1", "i2t_R@5", "t2i_R@5", "mean_recall", "num_images")}


def quality(ctx: Ctx) -> list[dict]:
    """Ours with the global-batch loss and with the per-rank loss, same steps and data; each
    rank evaluates the final model (ZeRO-1/2 keep all of it on every rank) on the val split."""
    rows, val = [], {}

    def evaluate(engine):
        if not val:
            val["pixels"], val["ids"] = read_val(ctx.data["val_urls"], ctx.data["tokenizer"])
        return retrieval_r1(engine.module, val["pixels"].to(engine.device, engine_dtype(engine)),
                            val["ids"].to(engine.device))

    for negatives in ("global", "local"):
        m = loop_ours(ctx, ctx.cfg.quality_steps, negatives=negatives, final_hook=evaluate)
        rows.append({"negatives": negatives, "steps": ctx.cfg.quality_steps,
                     "global_batch": ctx.cfg.micro * ctx.world, "final_train_loss": m.extra["final_loss"],
                     **{k: v for k, v in m.extra.items() if k not in ("final_loss", "summary_samples_per_s")}})
        gc.collect()
    return rows


# --------------------------------------------------------------------------- data

def prepare_data(root: Path, cfg: BenchConfig, rank: int) -> dict:
    """Rank 0 writes synthetic shards and a tokenizer (once per size); the others wait."""
    from rsclip_ds.data.synthetic import make_synthetic
    from rsclip_ds.data.tokenizer import iter_captions, train_tokenizer

    folder = root / f"synthetic_{cfg.num_train}_{cfg.num_val}_{cfg.shard_size}"
    if rank == 0 and not (folder / "tokenizer" / "tokenizer.json").is_file():
        index = make_synthetic(folder, num_train=cfg.num_train, num_val=cfg.num_val,
                               shard_size=cfg.shard_size, image_size=64, seed=0, progress=False)
        urls = [str(folder / s["url"]) for s in index["train"]]
        train_tokenizer(iter_captions(urls), folder / "tokenizer", vocab_size=500, max_length=64)
    dist.barrier()
    n_train = -(-cfg.num_train // cfg.shard_size)
    n_val = -(-cfg.num_val // cfg.shard_size)
    return {"train_pattern": str(folder / f"train-{{000000..{n_train - 1:06d}}}.tar"),
            "val_urls": [str(folder / f"val-{i:06d}.tar") for i in range(n_val)],
            "tokenizer": str(folder / "tokenizer")}


# --------------------------------------------------------------------------- report

def print_tables(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    s = report["summary"]
    table = Table(title=f"throughput, global samples/s ({report['environment']['world_size']} ranks, "
                        f"{report['config']['precision']}, {report['config']['profile']}, "
                        f"micro {report['config']['micro']}, {report['config']['steps']} steps x "
                        f"{report['config']['repeats']} interleaved repeats)")
    for col in ("loop", "median", "min..max", "CPU ms/sample", "data wait", "samples/run"):
        table.add_column(col, justify="right")
    for name, r in s["loops"].items():
        table.add_row(name, f"{r['median_samples_per_s']:.1f}", f"{r['min']:.1f}..{r['max']:.1f}",
                      f"{r['median_cpu_ms_per_sample']:.2f}",
                      f"{100 * r['median_data_wait_fraction']:.1f}%", str(r["samples_per_run"]))
    ratios = Table(title="ratios, paired within each repeat")
    for col in ("ratio", "median", "min..max", "CPU-time ratio", "target"):
        ratios.add_column(col, justify="right")
    targets = {"ours/bare": ">= 0.97", "ours_fix/bare": ">= 0.97", "ours/trainer": "> 1"}
    for name, r in s["ratios"].items():
        ratios.add_row(name, f"{r['median']:.3f}", f"{r['min']:.3f}..{r['max']:.3f}", f"{r['cpu_median']:.3f}",
                       targets.get(name, ""))
    console = Console(width=140)
    console.print(table)
    console.print(ratios)
    ld = report["loader"]
    console.print(f"loader alone: {ld['samples_per_s']:.0f} samples/s on all ranks = "
                  f"{ld['headroom_over_ours']:.1f} x what 'ours' consumes")
    c = report["summary_rate_with_final_checkpoint"]
    if c["summary_over_steps"] is not None:
        console.print(f"with the default end-of-run checkpoint, summary.json says {c['summary_samples_per_s']:.1f} "
                      f"samples/s where the steps ran at {c['step_hook_samples_per_s']:.1f} "
                      f"({c['summary_over_steps']:.2f} x)")
    for p in report["python_self_time"]:
        console.print(f"{p['loop']}: {p['self_ms_per_step']:.2f} ms/step Python self time in its own code "
                      f"(+ {p['loader_main_process_ms_per_step']:.2f} ms in the loader's main-process side)")
    q = Table(title=f"quality at equal compute: held-out retrieval ({report['quality'][0]['num_images']} "
                    f"val pairs) after {report['quality'][0]['steps']} steps" if report["quality"] else "quality")
    for col in ("negatives", "i2t R@1", "t2i R@1", "mean recall", "final train loss"):
        q.add_column(col, justify="right")
    for r in report["quality"]:
        q.add_row(r["negatives"], f"{r['i2t_R@1']:.3f}", f"{r['t2i_R@1']:.3f}", f"{r['mean_recall']:.3f}",
                  f"{r['final_train_loss']:.3f}")
    console.print(q)
    for note in report["notes"]:
        console.print(f"note: {note}", markup=False)


def plot(report: dict, path: Path) -> str | None:
    try:
        import matplotlib
    except ImportError:
        print("note: matplotlib is not installed (pip install rsclip_ds[bench]); wrote the JSON only")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    loops = report["summary"]["loops"]
    names = list(loops)
    med = [loops[n]["median_samples_per_s"] for n in names]
    err = [[m - loops[n]["min"] for m, n in zip(med, names)], [loops[n]["max"] - m for m, n in zip(med, names)]]
    colors = {"ours": "C0", "bare": "C7", "trainer": "C3", "ours_local": "C1", "ours_fix": "C2"}
    axes[0].bar(names, med, yerr=err, capsize=4, color=[colors.get(n, "C4") for n in names])
    axes[0].set(title=f"global samples/s (median, min..max); loader alone "
                      f"{report['loader']['samples_per_s']:.0f}", ylabel="samples/s")
    axes[0].tick_params(axis="x", labelrotation=15)
    ratios = report["summary"]["ratios"]
    for i, (name, r) in enumerate(ratios.items()):
        axes[1].plot([i] * len(r["per_repeat"]), r["per_repeat"], "o", alpha=0.5, color="C0")
        axes[1].plot([i], [r["median"]], "D", color="C3", label="median (wall)" if i == 0 else None)
        axes[1].plot([i + 0.15], [r["cpu_median"]], "x", color="k", label="median (CPU time)" if i == 0 else None)
    axes[1].axhline(0.97, ls="--", color="k", lw=1, label="target ours/bare 0.97")
    axes[1].axhline(1.0, ls=":", color="gray", lw=1)
    axes[1].set_xticks(range(len(ratios)), list(ratios), rotation=15)
    axes[1].set(title="ratios paired per repeat (dots: wall, per repeat)")
    axes[1].legend(fontsize=8)
    q = report["quality"]
    if q:
        keys = ("i2t_R@1", "t2i_R@1", "mean_recall")
        for j, r in enumerate(q):
            axes[2].bar([k + 0.4 * j - 0.2 for k in range(len(keys))], [r[k] for k in keys], 0.4,
                        label=f"negatives={r['negatives']}")
        axes[2].set_xticks(range(len(keys)), keys)
        top = max(r[k] for r in q for k in keys)
        axes[2].set(title=f"held-out retrieval ({q[0]['num_images']} pairs) after {q[0]['steps']} steps",
                    ylim=(0, 1.3 * top + 1e-3))
        axes[2].legend(fontsize=8)
    env = report["environment"]
    fig.suptitle(f"tiny preset, {env['world_size']} ranks ({env['device']}), "
                 f"{report['config']['profile']} {report['config']['precision']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# --------------------------------------------------------------------------- entry point

def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON path; the PNG goes beside it")
    parser.add_argument("--tiny", action="store_true", help="seconds-long variant (used by a test)")
    parser.add_argument("--data", type=Path, default=Path("runs/bench_data"),
                        help="where the synthetic shards are written (reused when present)")
    parser.add_argument("--profile", default="zero2", help="ds_profiles/ name")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--repeats", type=int, default=None, help="override the interleaved repeats")
    parser.add_argument("--steps", type=int, default=None, help="override the steps per timed run")
    parser.add_argument("--skip-quality", action="store_true", help="throughput only")
    parser.add_argument("--no-trainer", action="store_true", help="leave out the Hugging Face Trainer column")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    return parser.parse_args(argv)


def bench_config(args) -> BenchConfig:
    cfg = TINY if args.tiny else FULL
    over = {k: v for k, v in (("repeats", args.repeats), ("steps", args.steps)) if v is not None}
    return BenchConfig(**{**asdict(cfg), **over})


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = bench_config(args)
    from rich.console import Console

    from rsclip_ds.distributed import destroy_distributed, init_distributed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    # 1 thread per rank: 2 ranks on 2 cores, no oversubscription (see contrastive.py)
    torch.set_num_threads(args.threads)
    # accelerate (the Trainer) sets OMP_NUM_THREADS / torch threads to its own default when the
    # variable is unset, which would change the thread count of every loop after it
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    info = init_distributed()
    try:
        rank, world = info.rank, info.world_size
        say = Console(soft_wrap=True, markup=False).print if rank == 0 else (lambda msg: None)
        t0 = time.perf_counter()
        ctx = Ctx(rank, world, info.on_gpu, prepare_data(args.data, cfg, rank), args.precision,
                  args.profile, cfg, args.threads)
        notes = []
        loops = list(LOOPS)
        if args.no_trainer or not accelerate_available():
            loops.remove("trainer")
            notes.append("--no-trainer: the trainer column is skipped" if args.no_trainer else ACCELERATE_MISSING)
            say(f"note: {notes[-1]}")
        rows = []
        for repeat in range(cfg.repeats):
            for name in loops:
                row = run_loop(ctx, name, cfg.steps)
                rows.append({"repeat": repeat, **row})
                say(f"repeat {repeat} {name:<10} {row['samples_per_s']:8.1f} samples/s  "
                    f"data wait {100 * row['data_wait_fraction']:.1f}%  ({row['samples']} samples)")
        summary = summarize(rows, loops)
        loader = loader_rate(ctx, cfg.loader_batches)
        loader["headroom_over_ours"] = loader["samples_per_s"] / summary["loops"]["ours"]["median_samples_per_s"]
        say(f"loader alone {loader['samples_per_s']:.0f} samples/s")
        with_checkpoint = summary_rate_with_checkpoint(ctx, cfg.steps)
        python_time = [profiled(ctx, name, cfg.profile_steps, OWN_CODE[name]) for name in OWN_CODE if name in loops]
        quality_rows = [] if args.skip_quality else quality(ctx)
        report = {"config": {**asdict(cfg), "tiny": args.tiny, "profile": args.profile,
                             "precision": args.precision, "preset": "tiny", "loops": loops},
                  "environment": environment(world, args.threads),
                  "runs": rows, "summary": summary, "loader": loader, "python_self_time": python_time,
                  "summary_rate_with_final_checkpoint": with_checkpoint,
                  "quality": quality_rows, "notes": notes, "seconds": time.perf_counter() - t0}
        if rank == 0:
            write_report(report, args.out, plot, print_tables)
            say(f"wrote {args.out} in {report['seconds']:.0f}s")
        dist.barrier()
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())

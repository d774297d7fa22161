"""Assembling a run: the one place a training run is built from a `RunConfig`.

    with Trainer(run) as trainer:          # resolve.py decides everything, then the process group, SIGTERM, heartbeat
        summary = trainer.train()          # model, engine, checkpointer, loader, loss -> loop.train()

`check_run` makes every decision before any process group (resolve.py; a refusal names the fix) and checks
what needs a file (the model source, the teacher, the shards). The order of assembly is stated once, in
`Trainer.build`: the checkpoint every rank verified -> the model (+ fine-tuning, activation checkpointing,
patch dropout, an injected fault's hook) -> the record again with what the run has learnt (the checkpoint,
the model's layers that cannot be ZeRO-3 leaves) -> {output_dir}/config.json, ds_config.json, resolved.json and
the start-up lines -> evaluation sets -> engine (+ step guard, stage-0 gradient buckets) -> checkpointer (+
resume) -> loader (at the resumed position; then the /dev/shm check) -> loss. The CLI, the evaluation worker,
the benchmarks and the tests all build runs here; a benchmark swaps a part through the seams (`model=`,
`loader=`, `wrap_loader=`, `hooks=`, `deepspeed_overrides=`), never by patching the package.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from rsclip_ds.checkpoint import (Checkpointer, checkpoint_root, complete_tags, finite_fallback, prepare_fresh_root,
                                  resume_tag, select_resume_tag, tag_for, write_hf_extras)
from rsclip_ds.config import ConfigError, RunConfig
from rsclip_ds.data import build_train_loader, check_shared_memory, expand_urls
from rsclip_ds.distill.teacher import Distiller, check_distill, load_teacher
from rsclip_ds.engine import build_engine, lr_scheduler, set_fp32_masters
from rsclip_ds.evaluation.hook import build_eval_hook
from rsclip_ds.faults import Faults
from rsclip_ds.finetune import apply_finetune, param_groups
from rsclip_ds.finite import check_weights, install_step_guard
from rsclip_ds.gradients import build_gradient_buckets
from rsclip_ds.hub import check_source, resolve_source_per_node
from rsclip_ds.loop import Hook, Objective, Observers, Preempted, TrainResult, train
from rsclip_ds.losses import build_loss
from rsclip_ds.model import (ModelBundle, PatchDropoutSwitch, apply_activation_checkpointing, apply_patch_dropout,
                             build_model)
from rsclip_ds.profiles import load_profile
from rsclip_ds.reporting.curves import plot_curves
from rsclip_ds.reporting.epochs import epochs_record, startup_lines
from rsclip_ds.reporting.load import DataWaitWatch
from rsclip_ds.reporting.metrics import MetricsLog, mfu_of
from rsclip_ds.reporting.progress import ProgressReporter
from rsclip_ds.reporting.summary import build_summary, print_summary, write_summary
from rsclip_ds.reporting.wandb_log import build_wandb_log
from rsclip_ds.reshard import load_resharded, saved_run
from rsclip_ds.resolve import (BatchSizes, Device, ResolvedRun, World, deepspeed_config, resolve,
                               teacher_ds_config, with_facts)
from rsclip_ds.runtime.compilation import apply_compile, compile_line, eager_hook
from rsclip_ds.runtime.distributed import (DistInfo, StopFlag, accelerator_is_gpu, check_launch_env, configure_logging,
                                           configure_wandb_offline, destroy_distributed, init_distributed,
                                           process_group_exists, seconds_since_process_start, set_threads)
from rsclip_ds.runtime.heartbeat import Heartbeat, default_store
from rsclip_ds.runtime.host_memory import host_memory_said, host_memory_state, keep_freed_memory
from rsclip_ds.runtime.integrity import DiskFullError, checkpoint_bytes, param_counts, saves_in_run, space_shortfall
from rsclip_ds.runtime.layers import unsafe_zero3_leaves
from rsclip_ds.runtime.rank_errors import PeerFailed, RankError, RankErrors, RunStopped
from rsclip_ds.runtime.storage import check_shared_dir
from rsclip_ds.data.workers import LoaderWorkerDied

log = logging.getLogger("rsclip_ds")


class DiskFull(RunStopped):
    exit_code = 6    # a checkpoint save found no room (ENOSPC/EDQUOT): the message names the intact tag
    shared = said_by_rank0 = True    # every rank raises rank 0's message after the save's all-gather


def check_run(run: RunConfig, *, shards: bool = True, world: World | None = None,
              device: Device | None = None) -> ResolvedRun:
    """Everything that can fail without a process group -> the resolved run (resolve.py) for the launcher's
    world (``world``) on this machine's accelerator (``device``): every decision and refusal, the checkpoint
    checkpoint.resume names, then what needs a file -- the model source, a teacher, the shards (unless the
    caller brings its own batches). Raises ConfigError naming the fix."""
    check_launch_env()   # before World.from_env() takes a missing WORLD_SIZE for a world of one
    profile = load_profile(run.profile)
    c = run.checkpoint
    tag = resume_tag(checkpoint_root(run.output_dir), c.resume) if c.resume else None   # verified in build()
    resolved = resolve(run, profile, world or World.from_env(), device or Device.current(),
                       saved=saved_run(checkpoint_root(run.output_dir), tag) if tag else None)
    check_source(run.model)
    check_distill(run.distill, resolved.zero.stage)
    if shards:
        if not run.data.train_shards:
            raise ConfigError("data.train_shards is not set: point it at webdataset shards, e.g. "
                              "--set data.train_shards='data/synthetic/train-{000000..000007}.tar' "
                              "(make some with `rsclip-ds make-synthetic --out data/synthetic`)")
        try:
            expand_urls(run.data.train_shards)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    return resolved


@dataclass
class Parts:
    """What `Trainer.build` made; `train()` runs them, tests and benchmarks may inspect them."""
    resolved: ResolvedRun       # the run's decisions, as the engine was built from them
    bundle: ModelBundle
    engine: Any
    checkpointer: Checkpointer
    loader: Any                 # TrainLoader, or what `wrap_loader` made of it
    loss_fn: Callable
    faults: Faults
    hooks: list[Hook]
    resume: dict | None         # this rank's saved client state
    distiller: Distiller | None = None   # distill.teacher's term (rsclip_ds.distill)

    @property
    def batch(self) -> BatchSizes:
        return self.resolved.batch

    @property
    def activation_checkpointing(self) -> bool:
        return self.resolved.activation_checkpointing


class Trainer:
    """One training run. A context manager: entering starts the process group (unless one
    exists: then it is left to its owner), the SIGTERM flag and the heartbeat; leaving stops
    them. Seams: ``model`` a ready ModelBundle instead of `build_model(run.model)`;
    ``loader`` a ready iterable of batches ({"pixel_values", "input_ids"}) instead of the shard
    loader (data.train_shards is then not needed, and the run has no loader workers);
    ``wrap_loader(loader)`` wraps the shard loader (it must keep `state_dict`/`bad_data` or pass them
    through); ``hooks(step, engine)`` run after every optimizer step; ``deepspeed_overrides(ds_config)``
    edits DeepSpeed's dict in place before the engine is built (a test's "what DeepSpeed would run without
    this decision of ours")."""

    def __init__(self, run: RunConfig, *, hooks: Sequence[Hook] = (), model: ModelBundle | None = None,
                 loader: Any = None, wrap_loader: Callable[[Any], Any] | None = None,
                 deepspeed_overrides: Callable[[dict], None] | None = None):
        self.extra_hooks, self.model = list(hooks), model
        self.loader, self.wrap_loader, self.deepspeed_overrides = loader, wrap_loader, deepspeed_overrides
        if loader is not None:   # the caller's batches: no loader workers share this rank's cores
            run = run.model_copy(update={"data": run.data.model_copy(update={"num_workers": 0})})
        self.resolved = check_run(run, shards=loader is None)
        self.ds_config = deepspeed_config(self.resolved)
        self.info: DistInfo | None = None
        self.parts: Parts | None = None
        self.wandb = None   # rank 0's reporting.wandb_log.WandbLog under logging.wandb (train() makes it)
        self.step_guard = None   # finite.StepGuard where rsclip_ds skips non-finite steps (build() installs it)
        self.gradient_buckets = None   # gradients.GradientBuckets: stage 0's all-reduce on more than one rank
        self._owns_group = False
        # seconds per start-up phase, in order (train() adds the first step; the summary has all)
        self.startup: dict[str, float | None] = {}

    @property
    def run(self) -> RunConfig:
        """The run config, its precision made concrete."""
        return self.resolved.config

    @property
    def profile(self):
        return self.resolved.profile

    @contextmanager
    def _phase(self, name: str):
        t0 = time.perf_counter()
        yield
        self.startup[name] = time.perf_counter() - t0

    # ---- process group and faults
    def __enter__(self) -> "Trainer":
        self.startup["to_trainer"] = seconds_since_process_start()
        self.stop = StopFlag().install().watch_launcher()
        self._owns_group = not process_group_exists()
        with self._phase("process_group"):
            self.info = init_distributed()
        f = self.run.faults
        # one rank's error reaches every rank as itself, through the heartbeat's keys (rank_errors.py)
        self.errors = RankErrors(self.info.rank, self.info.world_size, interval=f.heartbeat_s,
                                 store_factory=default_store, timeout=f.peer_timeout_s)
        self.stop.failing = self.errors.claimed
        self.heartbeat = Heartbeat(self.info.rank, self.info.world_size, interval=f.heartbeat_s,
                                   timeout=f.peer_timeout_s, stopping=self.stop, errors=self.errors).start()
        self._stop_asked = False   # this rank asked for an agreed stop (its loader worker died)
        configure_logging(self.info.rank)
        if self.run.logging.wandb:
            configure_wandb_offline(Path(self.run.output_dir) / "monitor")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """On an error: said once and told to every rank (RankErrors.fail) before the group goes."""
        try:
            if isinstance(exc, Exception):
                self.errors.fail(exc)
        finally:
            if self.wandb is not None:   # finished; a stop's or an error's exit code marks it failed
                self.wandb.finish(0 if exc is None else getattr(exc, "exit_code", 1))
            self.heartbeat.close()
            if self._owns_group:
                destroy_distributed()

    # ---- assembly
    def build(self) -> Parts:
        """Builds every part in the order the module docstring states (once)."""
        if self.parts is not None:
            return self.parts
        run, info = self.run, self.info
        root = checkpoint_root(run.output_dir)
        c = run.checkpoint
        if c.every or c.at_end or c.resume:   # every rank writes shards there and may read them back
            check_shared_dir(Path(run.output_dir))
        # resolved once: ranks reading the pointer at different moments could pick different steps
        # verified against its manifest; a broken one skipped for the newest intact one (auto/latest)
        tag = select_resume_tag(root, c.resume, checksums=c.verify == "checksum", rank=info.rank,
                                world_size=info.world_size) if c.resume else None
        if tag is None:
            prepare_fresh_root(root, run.checkpoint.overwrite, info.rank)
        saved = saved_run(root, tag) if tag else None
        world = World(info.world_size, self.resolved.world.local_size or info.local_world_size)
        self.resolved = resolve(self.resolved.asked, self.profile, world, self.resolved.device, saved=saved)
        faults = Faults(self.resolved.faults, info.rank)
        with self._phase("model"):
            bundle = self.model or build_model(run.model, run.seed, loss=run.loss.name,
                                               ds_config=deepspeed_config(self.resolved),
                                               source=resolve_source_per_node(run.model, info.local_rank))
            ac = self.resolved.activation_checkpointing
            bundle, trainable = apply_finetune(bundle, run.finetune, run.loss.name, checkpointing=ac)
            if ac:
                apply_activation_checkpointing(bundle.model)
            dropout = apply_patch_dropout(bundle.model, run.model.patch_dropout)
            faults.arm(bundle.model)   # faults.inject_nan_at_step's gradient hook
        if self.resolved.zero.leaf_modules:   # the facts of the built model: layers that cannot be leaves
            self.resolved = with_facts(self.resolved, saved=saved, unsafe_leaves=unsafe_zero3_leaves(bundle.model))
        resolved = self.resolved
        self.ds_config = deepspeed_config(resolved)
        if self.deepspeed_overrides is not None:
            self.deepspeed_overrides(self.ds_config)
        teacher, teacher_inputs = self._teacher() if resolved.distill is not None else (None, None)
        self.checkpoint_bytes = checkpoint_bytes(*param_counts(bundle.model), run.precision, run.bf16.master_weights,
                                                 resolved.zero.stage)
        if info.rank == 0:
            self._check_space(root, tag)
            self._write_run_files()
            log.info("model %s | %.2fM parameters, trainable %s", bundle.source, bundle.num_parameters() / 1e6,
                     ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in trainable.items()))
        with self._phase("eval_sets"):
            eval_hook = build_eval_hook(run, bundle, info.rank, info.world_size)  # reads the eval sets now
        if eval_hook and run.compile.enabled:   # eager: its batch shapes vary (runtime/compilation.py)
            eval_hook = eager_hook(eval_hook)
        hooks = self.extra_hooks + ([eval_hook] if eval_hook else [])
        switch = dropout and PatchDropoutSwitch(dropout, run.steps, run.model.patch_dropout_off_last_steps, info.rank)
        hooks += [switch] if switch else []
        groups = param_groups(bundle.model, run.optim, lr_factor=resolved.optimizer.lr / run.optim.lr)
        o = run.optim
        with self._phase("engine"):
            if run.compile.enabled:   # lazy (compiled in step 1, see _finish); before ZeRO-3 registers its hooks
                apply_compile(bundle.model, run.compile, zero_stage=resolved.zero.stage)
            engine = build_engine(bundle.model, self.ds_config, groups,
                                  lr_scheduler(o.warmup_steps, run.steps, o.min_lr_ratio))
            self.step_guard = install_step_guard(engine, resolved.guard, o.gradient_clipping)
            self.gradient_buckets = build_gradient_buckets(   # stage 0: our overlapped reduction (or none)
                engine, resolved.zero.stage, info.world_size, resolved.zero.bucket_elements)
        checkpointer = self._checkpointer(bundle)
        with self._phase("resume"):
            if resolved.resume.mode == "fresh":
                resume = None
            elif resolved.resume.mode in ("whole", "universal"):   # written by another number of ranks
                resume = load_resharded(checkpointer, engine, tag)
            else:
                resume = checkpointer.load(engine, tag)
            if resume is not None:   # a checkpoint written before saves were checked may hold inf/NaN
                check_weights(engine, f"not resuming from {tag}", finite_fallback(checkpointer.root, tag, "resume"))
            if resolved.precision.masters_from_pretrained and bundle.source and bundle.source.folder:
                set_fp32_masters(engine, Path(bundle.source.folder))   # not rounded to the 16-bit dtype
            if switch and resume:   # the loop runs hooks at step 0 of a fresh run only
                switch(resume["step"])
        data = resume["data"] if resume else None
        if isinstance(data, dict) and "streams" in data:   # exact resume keeps the saved worker count
            self.resolved = resolved = with_facts(resolved, saved=replace(saved, streams=len(data["streams"])),
                                                  unsafe_leaves=resolved.zero.dropped_leaves)
        with self._phase("loader"):
            loader = self.loader if self.loader is not None else build_train_loader(
                run.data, tokenizer=bundle.tokenizer, image_size=bundle.image_size,
                max_text_length=bundle.max_text_length, micro_batch_size=resolved.batch.micro,
                rank=info.rank, world_size=info.world_size, seed=run.seed, local_world_size=info.local_world_size,
                workers=resolved.host.workers, state=data, pin_memory=info.on_gpu, cache_dir=run.output_dir,
                teacher=teacher_inputs)
            if self.loader is None:   # its workers hand batches over /dev/shm: fail now, not with SIGBUS later
                check_shared_memory(loader, held=resolved.batch.accumulation, local_ranks=info.local_world_size)
            if hasattr(loader, "on_worker_death"):   # a dead worker: an agreed stop with a checkpoint
                loader.on_worker_death = self._worker_died
        set_threads(resolved.host.threads)
        if info.rank == 0:
            self._write_resolved()
            for line in resolved.lines():
                log.info(line)
            for line in startup_lines(loader):
                log.info("data: %s", line)
            if not info.on_gpu:
                log.info("host memory: %s", host_memory_said(host_memory_state(run.distributed.host_memory)))
        if self.wrap_loader is not None:
            loader = self.wrap_loader(loader)
        loss_fn = build_loss(run.loss.name, negatives=run.loss.negatives, rank=info.rank,
                             world_size=info.world_size, chunk_size=run.loss.chunk_size)
        distiller = teacher and Distiller(teacher, run.distill.weight, run.loss.name, info.rank,
                                          1 if run.loss.negatives == "local" else info.world_size)
        self.parts = Parts(self.resolved, bundle, engine, checkpointer, loader, loss_fn, faults, hooks, resume,
                           distiller)
        return self.parts

    def _teacher(self):
        """distill.teacher, frozen on this rank's device (or partitioned: distill.placement) -> (the
        teacher, the inputs the loader makes for it)."""
        from deepspeed.accelerator import get_accelerator   # the engine's device, before the engine

        d, info = self.resolved.distill, self.info
        with self._phase("teacher"):
            teacher, inputs = load_teacher(self.run.distill, device=get_accelerator().current_device_name(),
                                           on_gpu=info.on_gpu, local_rank=info.local_rank, dtype=d.dtype,
                                           ds_config=teacher_ds_config(self.resolved))
        if info.rank == 0:
            log.info("distilling from %s: %s, %s, weight %g", d.teacher, d.placement,
                     next(getattr(teacher, "module", teacher).parameters()).dtype, d.weight)
        return teacher, inputs

    def _checkpointer(self, bundle: ModelBundle) -> Checkpointer:
        run, f = self.run, self.resolved.faults
        extras = partial(write_hf_extras, model_config=bundle.model.config, tokenizer=bundle.tokenizer,
                         image_size=bundle.image_size, mean=bundle.image_mean, std=bundle.image_std,
                         source=bundle.source)
        return Checkpointer(run.checkpoint, checkpoint_root(run.output_dir), rank=self.info.rank,
                            world_size=self.info.world_size, run_config=run.model_dump(mode="json"),
                            write_extras=extras, kill_in_save_at=f.kill_in_save_at_step,
                            enospc_in_save_at=f.enospc_in_save_at_step, enospc_rank=f.enospc_rank,
                            expected_bytes=self.checkpoint_bytes)

    def _check_space(self, root: Path, tag: str | None) -> None:
        """Rank 0, at start-up: one warning when output_dir's file system cannot hold this run's
        checkpoints at their peak (one checkpoint's estimated bytes x (keep_last + 1))."""
        c, start = self.run.checkpoint, int(tag[4:]) if tag else 0
        short = space_shortfall(Path(self.run.output_dir), self.checkpoint_bytes, c.keep_last,
                                saves_in_run(c.every, c.at_end, self.run.steps, start), len(complete_tags(root)))
        if short:
            log.warning(short)

    def _worker_died(self, message: str) -> None:
        """The loader's callback: one of this rank's workers died (and was replaced at the same data
        position). Ask every rank to stop at the next sync point, saying why (rank_errors.STOP_KEY)."""
        self.errors.publish_stop(RankError(self.info.rank, LoaderWorkerDied.exit_code, "LoaderWorkerDied", message))
        self._stop_asked = True

    def _write_run_files(self) -> None:
        out = Path(self.run.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(self.run.model_dump_json(indent=2))
        (out / "ds_config.json").write_text(json.dumps(self.ds_config, indent=2))
        self._write_resolved()

    def _write_resolved(self) -> None:
        """{output_dir}/resolved.json: every decision of the run (resolve.ResolvedRun), as it stands."""
        (Path(self.run.output_dir) / "resolved.json").write_text(json.dumps(self.resolved.to_dict(), indent=2))

    # ---- running
    def train(self) -> dict | None:
        """Train; returns the summary on rank 0 (None elsewhere). Raises loop.Preempted after a
        SIGTERM (checkpoint saved) and loop.NonFiniteLoss; the CLI turns them into exit codes."""
        p, run, rank = self.build(), self.run, self.info.rank
        torch.manual_seed(run.seed + 1000 * rank)   # dropout / augmentation differ per rank
        reporter = ProgressReporter(run.steps, run.logging.progress, enabled=rank == 0)
        lg = run.logging
        self.wandb = build_wandb_log(lg, run.output_dir, rank=rank, resumed_at=p.resume["step"] if p.resume else None,
                                     config={**run.model_dump(mode="json"), "deepspeed": self.ds_config,
                                             "global_batch": self.resolved.batch.global_batch,
                                             "world_size": self.info.world_size})
        on_cuda = self.info.on_gpu and torch.cuda.is_available()
        device = torch.cuda.get_device_name(p.engine.device) if on_cuda else "cpu"
        metrics = MetricsLog(Path(run.output_dir) / "metrics.jsonl", p.engine.monitor, enabled=rank == 0,
                             resumed_at=p.resume["step"] if p.resume else None, wandb=self.wandb,
                             mfu=mfu_of(p.bundle.model.config, run.precision, self.info.world_size, device))
        if self.wandb is not None:   # DeepSpeed's own Train/Samples/* into the same run (MetricsLog has the original)
            p.engine.monitor = self.wandb.deepspeed_monitor(p.engine)
        observers = Observers(reporter, metrics, p.checkpointer, p.hooks,
                              DataWaitWatch(lg.data_wait_warn_fraction, lg.data_wait_warn_ratio))
        try:
            result = train(self.resolved.loop, p.engine, p.loader, Objective(p.loss_fn, p.distiller), observers,
                           resume=p.resume, stop=lambda: self.stop() or self._stop_asked, faults=p.faults)
        except DiskFullError as err:   # raised by the checkpointer on every rank, with one message
            raise DiskFull(str(err)) from None
        finally:
            reporter.close()
            metrics.close()
        self.startup["first_step"] = result.first_step_s   # loader workers start, first batch, lazy init
        reason = self.errors.stop_reason() if result.stopped else None   # None: SIGTERM
        if reason is not None:
            result.stopped = "loader_worker_died"
        summary = self._finish(result) if rank == 0 else None
        if result.stopped:
            raise self._stopped(result, reason)
        return summary

    def _stopped(self, result: TrainResult, reason: RankError | None) -> Exception:
        """The error an agreed stop ends in: Preempted (SIGTERM), or the loader death of a rank."""
        step = len(result.losses)
        saved = result.checkpoints[-1] if result.checkpoints and result.checkpoints[-1] == tag_for(step) else None
        if reason is None:
            return Preempted(f"stopped by SIGTERM after step {step}; checkpoint {saved or '(none)'} saved; continue "
                             f"with `rsclip-ds train ... --resume latest`")
        tail = (f". Checkpoint {saved} saved at the agreed stop after step {step}" if saved else
                f". No checkpoint saved at the stop after step {step} (checkpoints off, or a loss since the last "
                f"sync not finite)") + "; continue with `rsclip-ds train ... --resume latest`"
        if reason.rank == self.info.rank:
            return LoaderWorkerDied(reason.message + tail, shared=True)
        return PeerFailed(reason, tail)

    def _finish(self, result: TrainResult) -> dict:
        """Rank 0 writes and prints the summary and draws the curves."""
        run, p = self.run, self.parts
        summary = build_summary(result, profile=self.profile, batch=self.resolved.batch, precision=run.precision,
                                source=p.bundle.source or run.model.preset, num_parameters=p.bundle.num_parameters(),
                                activation_checkpointing=self.resolved.activation_checkpointing, loss=run.loss.name,
                                negatives=run.loss.negatives, accumulation=run.batch.accumulation,
                                output_dir=run.output_dir)
        summary["startup_s"] = {**self.startup, "total": sum(v for v in self.startup.values() if v)}
        epochs = epochs_record(p.loader)
        if epochs is not None:   # what each epoch delivered of its data (data.policy=exact: all but < 1 global batch)
            summary["epochs"] = epochs
        if not self.info.on_gpu:   # the allocator's settings and rank 0's memory in huge pages at the end
            summary["host_memory"] = host_memory_state(run.distributed.host_memory)
        compiled = ""
        if run.compile.enabled:
            step_s = self.resolved.batch.global_batch / result.samples_per_s if result.samples_per_s else None
            line, summary["compile"] = compile_line(run.compile, result.first_step_s, step_s)
            compiled = f"; {line}"
        log.info("start-up %.1f s to the end of step 1: %s%s", summary["startup_s"]["total"],
                 ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in self.startup.items() if v is not None),
                 compiled)
        write_summary(summary, run.output_dir)
        if self.wandb is not None:
            self.wandb.summary(summary)
        print_summary(summary)
        plot_curves(summary, Path(run.output_dir) / "curves.png")   # skipped (one log line) without matplotlib
        return summary


def run_training(run: RunConfig, hooks: Sequence[Hook] = ()) -> dict | None:
    """Build and train one run: the whole of `rsclip-ds train` after argument parsing. CPU ranks
    keep freed host memory for reuse first (host_memory: DeepSpeed's per-step buffers would
    otherwise be page-faulted in anew every step), unless distributed.host_memory=release."""
    if not accelerator_is_gpu() and run.distributed.host_memory == "keep":
        keep_freed_memory()
    with Trainer(run, hooks=hooks) as trainer:
        return trainer.train()

"""The composition root: the one place a training run is assembled from a `RunConfig`.

    with Trainer(run) as trainer:          # process group, SIGTERM flag, heartbeat, logging
        summary = trainer.train()          # model, engine, checkpointer, loader, loss -> train()

The order of assembly is stated once, in `Trainer.build`: profile and DeepSpeed config (checked
before any process group) -> model (+ activation checkpointing) -> evaluation hook (reads its
data sets before training) -> engine -> checkpointer (+ resume) -> loader (at the resumed
position; then the /dev/shm check) -> loss -> fault guard. The CLI, the evaluation worker, the
benchmarks and the tests all build runs here; a benchmark swaps a part through the seams
(`model=`, `wrap_loader=`, `hooks=`), never by patching the package.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from rsclip_ds.runtime.compilation import apply_compile, compile_line, eager_hook, refusal as compile_refusal
from rsclip_ds.checkpoint import (Checkpointer, checkpoint_root, complete_tags, finite_fallback,
                                  prepare_fresh_root, select_resume_tag, tag_for, write_hf_extras)
from rsclip_ds.config import ConfigError, RunConfig
from rsclip_ds.data import build_train_loader, check_shared_memory, expand_urls
from rsclip_ds.data.loader import available_cores
from rsclip_ds.runtime.distributed import (DistInfo, StopFlag, accelerator_has_bf16, accelerator_is_gpu,
                                           check_launch_env,
                                   configure_logging, configure_wandb_offline, destroy_distributed,
                                   init_distributed, set_threads_per_rank,
                                   process_group_exists, seconds_since_process_start, world_size_from_env)
from rsclip_ds.distill.teacher import Distiller, check_distill, load_teacher
from rsclip_ds.engine import build_engine, drop_unsafe_leaf_modules, lr_scheduler, set_fp32_masters
from rsclip_ds.evaluation.hook import build_eval_hook
from rsclip_ds.finetune import apply_finetune, param_groups
from rsclip_ds.runtime.heartbeat import Heartbeat, default_store
from rsclip_ds.runtime.rank_errors import PeerFailed, RankError, RankErrors
from rsclip_ds.runtime.host_memory import host_memory_said, host_memory_state, keep_freed_memory
from rsclip_ds.hub import check_source, resolve_source_per_node
from rsclip_ds.losses import build_loss
from rsclip_ds.model import (ModelBundle, PatchDropoutSwitch, apply_activation_checkpointing, apply_patch_dropout,
                             build_model)
from rsclip_ds.finite import check_weights, install_step_guard
from rsclip_ds.gradients import build_gradient_buckets
from rsclip_ds.precision import uses_fp16, weight_dtype
from rsclip_ds.profiles import (BatchSizes, Profile, activation_checkpointing_enabled, build_ds_config,
                                derive_batch, guard_plan, load_profile, one_rank_overlap, resolve_run_precision,
                                scaled_lr)
from rsclip_ds.reporting.curves import plot_curves
from rsclip_ds.reporting.epochs import epochs_record, startup_lines
from rsclip_ds.reporting.load import DataWaitWatch
from rsclip_ds.reporting.metrics import MetricsLog, mfu_of
from rsclip_ds.reporting.progress import ProgressReporter
from rsclip_ds.reporting.summary import build_summary, print_summary, write_summary
from rsclip_ds.reporting.wandb_log import build_wandb_log
from rsclip_ds.reshard import load_resharded, needs_universal, other_world, universal_ds_config
from rsclip_ds.runtime.storage import check_shared_dir
from rsclip_ds.runtime.integrity import DiskFullError, checkpoint_bytes, param_counts, saves_in_run, space_shortfall
from rsclip_ds.train import DiskFull, Guard, LoaderWorkerDied, Preempted, TrainResult, train

log = logging.getLogger("rsclip_ds")
Hook = Callable[[int, Any], "dict | None"]


def check_run(run: RunConfig, *, shards: bool = True) -> tuple[RunConfig, Profile, dict, str]:
    """Everything that can fail without a process group: profile, precision (`auto` made concrete for the
    profile and the device), DeepSpeed config, model source, shards (unless the caller brings its own
    batches) -> (the run with its precision, profile, DeepSpeed config, why that precision). Raises
    ConfigError naming the fix."""
    check_launch_env()   # before world_size_from_env() takes a missing WORLD_SIZE for a world of one
    profile = load_profile(run.profile)
    run, precision_why = resolve_run_precision(run, profile, accelerator_has_bf16())
    ds_config = build_ds_config(run, profile, world_size_from_env(), on_gpu=accelerator_is_gpu())
    check_source(run.model)
    check_distill(run.distill, ds_config.get("zero_optimization", {}).get("stage", 0))
    why = compile_refusal(run.compile, zero_stage=ds_config.get("zero_optimization", {}).get("stage", 0),
                          on_gpu=accelerator_is_gpu())
    if why:
        raise ConfigError(why)
    for key in ("inject_data_delay_rank", "inject_rank"):
        rank = getattr(run.faults, key)
        if rank is not None and rank >= world_size_from_env():
            raise ConfigError(f"faults.{key}={rank}, but the run has {world_size_from_env()} rank(s): name a rank "
                              f"below that")
    if run.faults.inject_worker_kill_at_step and run.data.num_workers == 0:
        raise ConfigError("faults.inject_worker_kill_at_step needs a DataLoader worker: set data.num_workers >= 1")
    if not shards:
        return run, profile, ds_config, precision_why
    if not run.data.train_shards:
        raise ConfigError("data.train_shards is not set: point it at webdataset shards, e.g. "
                          "--set data.train_shards='data/synthetic/train-{000000..000007}.tar' "
                          "(make some with `rsclip-ds make-synthetic --out data/synthetic`)")
    try:
        expand_urls(run.data.train_shards)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return run, profile, ds_config, precision_why


def step_decisions(run: RunConfig, profile: Profile, ds_config: dict, world_size: int) -> list[str]:
    """What build_ds_config decided about the step on the user's behalf, for the start-up line."""
    plan = guard_plan(run, profile)
    said = [f"a step whose gradient norm is not finite is skipped by "
            f"{'rsclip_ds' if plan.skips == 'rsclip' else 'DeepSpeed'} ({plan.reason})"]
    if plan.clips == "rsclip" and run.optim.gradient_clipping:
        said.append(f"clipping at {run.optim.gradient_clipping:g} by rsclip_ds's step guard (ds_config.json's "
                    f"gradient_clipping is 0)")
    if profile.stage == 0:
        said.append("no gradient all-reduce (one rank)" if world_size == 1 else
                    "gradients averaged by rsclip_ds's overlapped all-reduce (buckets of "
                    f"{int(ds_config.get('zero_optimization', {}).get('reduce_bucket_size', 10**7)):,} elements; "
                    "DeepSpeed's stage-0 reduction waits for the whole backward and copies every gradient twice)")
    if one_rank_overlap(profile, world_size):
        said.append(f"overlap_comm off (one rank: ZeRO-{profile.stage} has no reduction to overlap, and "
                    f"DeepSpeed would sync the device at every bucket)")
    return said


@dataclass
class Parts:
    """What `Trainer.build` made; `train()` runs them, tests and benchmarks may inspect them."""
    batch: BatchSizes
    bundle: ModelBundle
    activation_checkpointing: bool
    engine: Any
    checkpointer: Checkpointer
    loader: Any                 # TrainLoader, or what `wrap_loader` made of it
    loss_fn: Callable
    guard: Guard
    hooks: list[Hook]
    resume: dict | None         # this rank's saved client state
    distiller: Distiller | None = None   # distill.teacher's term (rsclip_ds.distill)


class Trainer:
    """One training run. A context manager: entering starts the process group (unless one
    exists: then it is left to its owner), the SIGTERM flag and the heartbeat; leaving stops
    them. Seams: ``model`` a ready ModelBundle instead of `build_model(run.model)`;
    ``loader`` a ready iterable of batches ({"pixel_values", "input_ids"}) instead of the shard
    loader (data.train_shards is then not needed); ``wrap_loader(loader)`` wraps the shard
    loader (it must keep `state_dict`/`bad_data` or pass them through); ``hooks(step, engine)``
    run after every optimizer step."""

    def __init__(self, run: RunConfig, *, hooks: Sequence[Hook] = (), model: ModelBundle | None = None,
                 loader: Any = None, wrap_loader: Callable[[Any], Any] | None = None):
        self.extra_hooks, self.model = list(hooks), model
        self.loader, self.wrap_loader = loader, wrap_loader
        self.run, self.profile, self.ds_config, self.precision_why = check_run(run, shards=loader is None)
        self.info: DistInfo | None = None
        self.parts: Parts | None = None
        self.wandb = None   # rank 0's reporting.wandb_log.WandbLog under logging.wandb (train() makes it)
        self.step_guard = None   # finite.StepGuard where rsclip_ds skips non-finite steps (build() installs it)
        self.gradient_buckets = None   # gradients.GradientBuckets: stage 0's all-reduce on more than one rank
        self._owns_group = False
        # seconds per start-up phase, in order (train() adds the first step; the summary has all)
        self.startup: dict[str, float | None] = {}

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
        batch = derive_batch(run, info.world_size)
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
        # a tag of another world size loads through DeepSpeed's universal format, which the
        # engine reads from its config at deepspeed.initialize: decided here, before the engine
        resharded = other_world(root, tag, info.world_size)
        if needs_universal(root, tag, info.world_size):   # ZeRO partitions (stage 0 loads as it is)
            self.ds_config = universal_ds_config(self.ds_config)
        with self._phase("model"):
            bundle = self.model or build_model(run.model, run.seed, loss=run.loss.name, ds_config=self.ds_config,
                                               source=resolve_source_per_node(run.model, info.local_rank))
            ac = activation_checkpointing_enabled(run, self.profile)
            bundle, trainable = apply_finetune(bundle, run.finetune, run.loss.name, checkpointing=ac)
            if ac:
                apply_activation_checkpointing(bundle.model)
            dropout = apply_patch_dropout(bundle.model, run.model.patch_dropout)
            guard = self._guard()
            guard.arm(bundle.model, info.rank, info.world_size)   # faults.inject_nan_at_step's gradient hook
        teacher, teacher_inputs = self._teacher() if run.distill.teacher is not None else (None, None)
        self.checkpoint_bytes = checkpoint_bytes(*param_counts(bundle.model), run.precision, run.bf16.master_weights,
                                                 self.ds_config.get("zero_optimization", {}).get("stage", 0))
        if info.rank == 0:
            self._check_space(root, tag)
            self._write_run_files()
            log.info("model %s | profile %s | precision %s%s | batch micro x accumulation x world = global: %s | "
                     "%.2fM parameters, trainable %s", bundle.source, self.profile.name, run.precision,
                     "" if self.precision_why == "as set" else f" ({self.precision_why})", batch,
                     bundle.num_parameters() / 1e6,
                     ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in trainable.items()))
            said = step_decisions(run, self.profile, self.ds_config, info.world_size)
            if said:
                log.info("DeepSpeed step: %s", "; ".join(said))
        with self._phase("eval_sets"):
            eval_hook = build_eval_hook(run, bundle, info.rank, info.world_size)  # reads the eval sets now
        if eval_hook and run.compile.enabled:   # eager: its batch shapes vary (runtime/compilation.py)
            eval_hook = eager_hook(eval_hook)
        hooks = self.extra_hooks + ([eval_hook] if eval_hook else [])
        switch = dropout and PatchDropoutSwitch(dropout, run.steps, run.model.patch_dropout_off_last_steps, info.rank)
        hooks += [switch] if switch else []
        groups = param_groups(bundle.model, run.optim, lr_factor=scaled_lr(run, info.world_size) / run.optim.lr)
        o = run.optim
        with self._phase("engine"):
            unsafe = drop_unsafe_leaf_modules(bundle.model, self.ds_config)
            if unsafe and info.rank == 0:
                log.info("ZeRO-3: no leaf modules (the profile's leaf_module): %d trained encoder layer(s) get an "
                         "input that needs no gradient (%s), which DeepSpeed cannot run as leaves; every submodule "
                         "is hooked instead (more host time a step, the same math)", len(unsafe), ", ".join(unsafe))
            if run.compile.enabled:   # lazy (compiled in step 1, see _finish); before ZeRO-3 registers its hooks
                apply_compile(bundle.model, run.compile,
                              zero_stage=self.ds_config.get("zero_optimization", {}).get("stage", 0))
            engine = build_engine(bundle.model, self.ds_config, groups,
                                  lr_scheduler(o.warmup_steps, run.steps, o.min_lr_ratio))
            self.step_guard = install_step_guard(engine, guard_plan(run, self.profile), o.gradient_clipping)
            self.gradient_buckets = build_gradient_buckets(   # stage 0: our overlapped reduction (or none)
                engine, self.profile.stage, info.world_size,
                int(self.ds_config.get("zero_optimization", {}).get("reduce_bucket_size", 10**7)))
        checkpointer = self._checkpointer(bundle)
        with self._phase("resume"):
            if tag is None:
                resume = None
            elif resharded:   # written by another number of ranks
                resume = load_resharded(checkpointer, engine, tag)
            else:
                resume = checkpointer.load(engine, tag)
            if resume is not None:   # a checkpoint written before saves were checked may hold inf/NaN
                check_weights(engine, f"not resuming from {tag}", finite_fallback(checkpointer.root, tag, "resume"))
            if resume is None and weight_dtype(run.precision) != "fp32" and bundle.source and bundle.source.folder:
                set_fp32_masters(engine, Path(bundle.source.folder))   # not rounded to the 16-bit dtype
            if switch and resume:   # the loop runs hooks at step 0 of a fresh run only
                switch(resume["step"])
        with self._phase("loader"):
            loader = self.loader if self.loader is not None else build_train_loader(
                run.data, tokenizer=bundle.tokenizer, image_size=bundle.image_size,
                max_text_length=bundle.max_text_length, micro_batch_size=batch.micro,
                rank=info.rank, world_size=info.world_size, seed=run.seed, local_world_size=info.local_world_size,
                state=resume["data"] if resume else None, pin_memory=info.on_gpu, cache_dir=run.output_dir,
                teacher=teacher_inputs)
            if self.loader is None:   # its workers hand batches over /dev/shm: fail now, not with SIGBUS later
                check_shared_memory(loader, held=batch.accumulation, local_ranks=info.local_world_size)
            if hasattr(loader, "on_worker_death"):   # a dead worker: an agreed stop with a checkpoint
                loader.on_worker_death = self._worker_died
        if info.rank == 0:
            for line in startup_lines(loader):
                log.info("data: %s", line)
        threads, why = set_threads_per_rank(run.distributed.threads_per_rank, available_cores(),
                                            info.local_world_size, getattr(loader, "num_workers", 0))
        if info.rank == 0:
            log.info("threads per rank: %d (%s)", threads, why)
            if not info.on_gpu:
                log.info("host memory: %s", host_memory_said(host_memory_state(run.distributed.host_memory)))
        if self.wrap_loader is not None:
            loader = self.wrap_loader(loader)
        loss_fn = build_loss(run.loss.name, negatives=run.loss.negatives, rank=info.rank,
                             world_size=info.world_size, chunk_size=run.loss.chunk_size)
        distiller = teacher and Distiller(teacher, run.distill.weight, run.loss.name, info.rank,
                                          1 if run.loss.negatives == "local" else info.world_size)
        self.parts = Parts(batch, bundle, ac, engine, checkpointer, loader, loss_fn, guard, hooks, resume,
                           distiller)
        return self.parts

    def _teacher(self):
        """distill.teacher, frozen on this rank's device (or partitioned: distill.placement) -> (the
        teacher, the inputs the loader makes for it)."""
        from deepspeed.accelerator import get_accelerator   # the engine's device, before the engine

        d, info = self.run.distill, self.info
        with self._phase("teacher"):
            teacher, inputs = load_teacher(d, device=get_accelerator().current_device_name(), on_gpu=info.on_gpu,
                                           local_rank=info.local_rank, ds_config=self.ds_config)
        if info.rank == 0:
            log.info("distilling from %s: %s, %s, weight %g", d.teacher, d.placement,
                     next(getattr(teacher, "module", teacher).parameters()).dtype, d.weight)
        return teacher, inputs

    def _checkpointer(self, bundle: ModelBundle) -> Checkpointer:
        run = self.run
        extras = partial(write_hf_extras, model_config=bundle.model.config, tokenizer=bundle.tokenizer,
                         image_size=bundle.image_size, mean=bundle.image_mean, std=bundle.image_std,
                         source=bundle.source)
        return Checkpointer(run.checkpoint, checkpoint_root(run.output_dir), rank=self.info.rank,
                            world_size=self.info.world_size, run_config=run.model_dump(mode="json"),
                            write_extras=extras, kill_in_save_at=run.faults.inject_kill_in_save_at_step,
                            enospc_in_save_at=run.faults.inject_enospc_in_save_at_step,
                            enospc_rank=run.faults.inject_enospc_rank, expected_bytes=self.checkpoint_bytes)

    def _check_space(self, root: Path, tag: str | None) -> None:
        """Rank 0, at start-up: one warning when output_dir's file system cannot hold this run's
        checkpoints at their peak (one checkpoint's estimated bytes x (keep_last + 1))."""
        c, start = self.run.checkpoint, int(tag[4:]) if tag else 0
        short = space_shortfall(Path(self.run.output_dir), self.checkpoint_bytes, c.keep_last,
                                saves_in_run(c.every, c.at_end, self.run.steps, start), len(complete_tags(root)))
        if short:
            log.warning(short)

    def _guard(self) -> Guard:
        f = self.run.faults
        return Guard(stop_requested=lambda: self.stop() or self._stop_asked, stop_check_every=f.stop_check_every,
                     max_nonfinite_steps=f.max_nonfinite_steps, count_nonfinite=not uses_fp16(self.run.precision),
                     inject_nan_at_step=f.inject_nan_at_step, inject_nan_steps=f.inject_nan_steps,
                     inject_nan_value=f.inject_nan_value, inject_kill_at_step=f.inject_kill_at_step,
                     inject_freeze_at_step=f.inject_freeze_at_step, inject_data_delay_s=f.inject_data_delay_s,
                     inject_data_delay_rank=f.inject_data_delay_rank, inject_error_at_step=f.inject_error_at_step,
                     inject_worker_kill_at_step=f.inject_worker_kill_at_step, inject_rank=f.inject_rank)

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

    # ---- running
    def train(self) -> dict | None:
        """Train; returns the summary on rank 0 (None elsewhere). Raises train.Preempted after a
        SIGTERM (checkpoint saved) and train.NonFiniteLoss; the CLI turns them into exit codes."""
        p, run, rank = self.build(), self.run, self.info.rank
        torch.manual_seed(run.seed + 1000 * rank)   # dropout / augmentation differ per rank
        reporter = ProgressReporter(run.steps, run.logging.progress, enabled=rank == 0)
        lg = run.logging
        self.wandb = build_wandb_log(lg, run.output_dir, rank=rank, resumed_at=p.resume["step"] if p.resume else None,
                                     config={**run.model_dump(mode="json"), "deepspeed": self.ds_config,
                                             "global_batch": p.batch.global_batch, "world_size": self.info.world_size})
        on_cuda = self.info.on_gpu and torch.cuda.is_available()
        device = torch.cuda.get_device_name(p.engine.device) if on_cuda else "cpu"
        metrics = MetricsLog(Path(run.output_dir) / "metrics.jsonl", p.engine.monitor, enabled=rank == 0,
                             resumed_at=p.resume["step"] if p.resume else None, wandb=self.wandb,
                             mfu=mfu_of(p.bundle.model.config, run.precision, self.info.world_size, device))
        if self.wandb is not None:   # DeepSpeed's own Train/Samples/* into the same run (MetricsLog has the original)
            p.engine.monitor = self.wandb.deepspeed_monitor(p.engine)
        batches = iter(p.loader)
        try:
            result = train(p.engine, batches, p.loss_fn, p.batch, run.steps, run.logging.log_every,
                           reporter, accumulation=run.batch.accumulation, hooks=p.hooks,
                           checkpointer=p.checkpointer, guard=p.guard, loader=p.loader,
                           resume=p.resume, stop_after=run.checkpoint.stop_after, metrics=metrics,
                           data_wait=DataWaitWatch(lg.data_wait_warn_fraction, lg.data_wait_warn_ratio),
                           distiller=p.distiller)
        except DiskFullError as err:   # raised by the checkpointer on every rank, with one message
            raise DiskFull(str(err)) from None
        finally:
            # the loader's workers end here, also on an error: left to interpreter exit (an error's
            # traceback keeps the iterator alive), multiprocessing's one SIGTERM is the one they absorb
            # (loader.py) and its join waits forever
            getattr(batches, "close", lambda: None)()
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
        summary = build_summary(result, profile=self.profile, batch=p.batch, precision=run.precision,
                                source=p.bundle.source or run.model.preset, num_parameters=p.bundle.num_parameters(),
                                activation_checkpointing=p.activation_checkpointing, loss=run.loss.name,
                                negatives=run.loss.negatives, accumulation=run.batch.accumulation)
        summary["startup_s"] = {**self.startup, "total": sum(v for v in self.startup.values() if v)}
        epochs = epochs_record(p.loader)
        if epochs is not None:   # what each epoch delivered of its data (data.policy=exact: all but < 1 global batch)
            summary["epochs"] = epochs
        if not self.info.on_gpu:   # the allocator's settings and rank 0's memory in huge pages at the end
            summary["host_memory"] = host_memory_state(run.distributed.host_memory)
        compiled = ""
        if run.compile.enabled:
            step_s = p.batch.global_batch / result.samples_per_s if result.samples_per_s else None
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

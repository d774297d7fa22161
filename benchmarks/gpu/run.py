"""Samples/s, MFU and peak memory of git-rsclip-base / -large on one GPU: each profile under each
precision (--profiles x --precisions: ddp, ZeRO-1/2/3; bf16, amp_bf16, fp32, or auto, the run's own
default per profile), with and without activation checkpointing; beside each preset, the plain
PyTorch twin of the step (benchmarks/twin.py), eager and compiled, on the same model and batch --
the floor ours is read against; and whether the data path keeps up: the same steps fed by the
real loader from JPEG shards (--data loader) against a batch already in device memory (--data
tensor, the default). No network; the shards are synthetic.

    python -m benchmarks.gpu.run --out benchmarks/results/gpu_h200.json
    python -m benchmarks.gpu.run --profiles ddp zero2 --precisions amp_bf16 bf16 --ac off --variants base \
        --out benchmarks/results/gpu_h200_base.json   # step.sh's base and zero parts in one command
    python -m benchmarks.gpu.run --profiles zero2 --ac off --data tensor loader \
        --out benchmarks/results/gpu_h200_loader.json        # the data path: 4 cases, ~4 min
    python -m benchmarks.gpu.run --open-clip kit --model git-rsclip-base --out benchmarks/results/gpu_h200_openclip.json
    python -m benchmarks.gpu.run --open-clip kit --planner-pick --model git-rsclip-base --openclip-precisions amp_bf16 \
        --out benchmarks/results/gpu_h200_openclip.json     # rsclip-ds train as the planner picks it
    DS_ACCELERATOR=cpu python -m benchmarks.gpu.run --model tiny --variants base patch_dropout --out /tmp/gpu_tiny.json
    bash benchmarks/gpu/step.sh OUT_DIR     # the GPU session's one script: the parts in order, < 9 min

The first: 8 configurations, 3 variants (benchmarks/gpu/variants.py: the same case again with
patch dropout, compilation or a distillation teacher) and 2 twins per preset, about 45 s each on
an H200 (start-up, engine, 2 warm-up steps, then timed steps for --seconds): ~11 minutes, so
--total-budget (560 s) skips the last cases; step.sh runs the parts the GPU session needs.
Each configuration runs in its own process (a fresh CUDA context, so peak memory is its own);
one that fails or runs out of its time is recorded with the reason and the others go on; the
report so far is in OUT.partial.json after every case (a command stopped from outside keeps
what ran). --append keeps OUT's cases from an earlier command (an earlier part of step.sh)
ahead of this command's, and pairs them all: cases run later still read against its twins. A
profile x precision pair a run refuses is left out with the reason (resolve's rule: bf16 /
fp16 weights on ddp, amp under ZeRO). The hybrid-sharding profiles are refused on one rank
(refuse_one_rank_hybrid says why; benchmarks/comms/multigpu_hybrid.sh measures them).
--open-clip: the open_clip comparison on one rank (docs/benchmarks/throughput.md), open_clip run
from VENV (benchmarks/throughput/openclip_env.sh) or, with `kit`, from the GPU kit's wheels (this
Python with PYTHONPATH=$OPENCLIP_PYTHONPATH: ../shared/gpu/kit.sh), against `rsclip-ds train` at
zero2 bf16, or with --planner-pick at the profile, precision, micro-batch and checkpointing that
rsclip_ds.planning.planner recommends for one GPU of this device (planner_pick), with the
patch-dropout and compile peers (--openclip-peers), ~8 minutes. The CPU smoke form is the last
python line.

Per configuration: samples/s (timed steps x micro / seconds, after warm-up, with a device sync
at both ends), model FLOPs per sample (rsclip_ds.planning.flops: 3 x the forward matmul FLOPs of both
towers), MFU = FLOPs per sample x samples/s / peak 16-bit (fp32: fp32) FLOP/s of the device
(peaks.py; --peak-tflops for others), HFU (counting the recomputed forward under activation
checkpointing), and torch.cuda.max_memory_allocated over engine build + steps. The engine, loss
and activation checkpointing are the run's (`rsclip_ds.assembly.Trainer(run, model=...,
loader=...).build()`: the model is `rsclip_ds.model.preset_bundle` with the preset's own
vocabulary, built whole on the device (see run_case for why also under ZeRO-3)); the step is
rsclip_ds.loop.micro_batch_step with the SigLIP loss (one rank: local = global).

The twins (--twins eager compiled, one process each, per preset, micro-batch and compute dtype:
bf16 and amp_bf16 share one, as the twin's recipe is one): the same preset_bundle built the same
way on the device, the same batch, the run's AdamW settings, clipping and learning-rate schedule
(its length is the run's `steps`), in benchmarks.twin.PlainLoop (fp32 weights, autocast to the
compute dtype, fused AdamW, no DeepSpeed, no checkpointing; `compiled`: every encoder layer
compiled). Their rows carry MFU like ours; `ours_vs_twin` pairs each of our tensor cases (any
profile and precision, and the compile variant; not patch dropout or distillation, which change
the work) with the twins of its compute dtype: our samples/s / the twin's, eager and compiled.

The batches: --data tensor, one synthetic batch in device memory that every step reuses (the
model's time alone): uint8 pixels and token ids (tensor_batch), what the loader sends, so ours
and the twin both normalise the pixels on the device in the model's forward, as a real step does,
from the very same bytes (until issue 36: float pixels in the engine's dtype, which skipped the
normalisation); --data loader, the Trainer's own loader (`Trainer(run, model=...)` without
`loader=`: build_train_loader with --loader-workers DataLoader workers, pinned memory) reading
--data-images make-synthetic scenes of --data-px px (JPEG q90; 256: Git-10M's tiles) written
once per command, with a tokenizer trained on their captions (ids below the preset's
vocabulary). A loader case also records the time the step loop waited in next(batch) and the CPU
seconds of the loader's workers: samples per worker-CPU-second on the GPU host's cores. The
report pairs each loader case with its tensor twin: loader / tensor samples/s is 1.0 when the
data path keeps up.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

if not __package__:   # `python benchmarks/gpu/run.py`: the package's imports below cannot resolve
    sys.exit("run the benchmarks as modules from the repository root: python -m benchmarks.gpu --out ...")

from benchmarks.gpu.peaks import mfu_per_device, peak_flops
from benchmarks.gpu.variants import (TWINS, VARIANTS, pair_with_base, pair_with_twins, teacher_batch, twin_precision,
                                     variant_case, variant_overrides, write_teacher)
from benchmarks.harness import (base_parser, environment, page_tables, process_group, run_script, synthetic_data,
                                write_report)
from benchmarks.results_tables.throughput import gpu as gpu_tables

# micro-batch per GPU: activations ~75 MiB/sample (base) and ~243 MiB/sample (large) without
# checkpointing (rsclip_ds.planning.memory) -> ~19 / ~31 GB, beside 16 bytes/param of model states.
MICRO = {"git-rsclip-base": 256, "git-rsclip-large": 128, "tiny": 8}
# --planner-pick without a GPU (a CPU smoke test): the budget it plans for, an H100's
DEFAULT_PICK_MEM = "80GB"
# --profiles hybrid names the hybrid-sharding set; this one-rank benchmark refuses its multi-node
# profiles (ONE_RANK_REFUSED) with the script that measures them
PROFILE_SETS = {"hybrid": ["zero3", "zero3_hpz", "zero3_zeropp"]}


ONE_RANK_REFUSED = ("zero3_hpz", "zero3_zeropp")


def refuse_one_rank_hybrid(profiles: list[str]) -> str | None:
    """The message refusing hybrid profiles in this one-rank benchmark (None: none asked for)."""
    asked = [p for p in profiles if p in ONE_RANK_REFUSED]
    if not asked:
        return None
    return (f"--profiles {' '.join(asked)}: on one GPU these equal zero3 (DeepSpeed skips the gather on one "
            f"rank, qgZ needs 2+ nodes) and zero3_zeropp JIT-builds a CUDA quantizer with nvcc; measure them "
            f"on 2+ nodes with benchmarks/comms/multigpu_hybrid.sh, and use --profiles zero2 zero3 here")


def expand_profiles(names: list[str]) -> list[str]:
    """--profiles with set names (PROFILE_SETS) replaced by their profiles, each once, in order."""
    out: list[str] = []
    for name in names:
        out += [p for p in PROFILE_SETS.get(name, [name]) if p not in out]
    return out


# what this benchmark runs: the twin refuses fp16 and amp (no GradScaler in it); auto is the run
# config's default, made concrete per profile (profile_precisions)
PRECISIONS = ("bf16", "amp_bf16", "fp32", "auto")


@dataclass(frozen=True)
class Case:
    preset: str
    profile: str
    checkpointing: bool
    micro: int
    data: str = "tensor"        # tensor: one batch in device memory; loader: the real loader
    variant: str = "base"       # variants.VARIANTS: a feature's overrides on the same case
    twin: str = ""              # variants.TWINS: the plain PyTorch loop instead of ours ("": ours)
    precision: str = "bf16"     # the run's precision; a twin's: the compute dtype (twin_precision)

    @property
    def name(self) -> str:
        if self.twin:
            return f"{self.preset}/twin-{self.twin}/{self.precision}/micro{self.micro}"
        name = (f"{self.preset}/{self.profile}/{self.precision}/{'ac' if self.checkpointing else 'no-ac'}"
                f"/micro{self.micro}")
        name = name if self.data == "tensor" else f"{name}/{self.data}"
        return name if self.variant == "base" else f"{name}/+{self.variant}"


def profile_precisions(profile: str, precisions: list[str]) -> tuple[list[str], list[str]]:
    """The precisions `profile` runs under, of `precisions` in order, each once (auto made concrete
    for the profile's stage as a run makes it: amp_bf16 on ddp, bf16 under ZeRO), and the refused
    ones with the reason (resolve's rule, its short form: bf16 / fp16 weights on ddp, amp under ZeRO)
    -> (runs, refused)."""
    from rsclip_ds.config import ConfigError, load_config
    from rsclip_ds.profiles import load_profile
    from rsclip_ds.resolve import GPU, World, resolve

    prof = load_profile(profile)
    runs, refused = [], []
    for choice in precisions:
        try:
            precision = resolve(load_config(None, [f"profile={profile}", f"precision={choice}"]), prof, World(1, 1),
                                GPU).precision.name
        except ConfigError as e:
            if f"{profile}/{choice}: {e.note}" not in refused:
                refused.append(f"{profile}/{choice}: {e.note}")
            continue
        if precision not in runs:
            runs.append(precision)
    return runs, refused


def cases(models: list[str], profiles: list[str], ac: list[bool], micro: int | None,
          data: list[str] = ("tensor",), variants: list[str] = ("base",), twins: list[str] = (),
          precisions: list[str] = ("bf16",)) -> list[Case]:
    """Every combination of preset, profile x precision (less the refused pairs: profile_precisions;
    a profile's precisions side by side) and checkpointing; a loader case right after its tensor
    twin, and the variants other than base right after the one tensor case they run on
    (variants.variant_case, under the profile's first precision): the same machine state for a
    pair. Without "base" in `variants` only the variants' case and its variants run (the base twin
    stays: each variant is read against it). `twins`: the plain loop's cases of each preset and
    compute dtype (no profile, no checkpointing: profile "plain"), right after the preset's first
    case in that dtype, before its variants: the floor measured next to the case first read
    against it."""
    runs = {p: profile_precisions(p, precisions)[0] for p in profiles}
    out: list[Case] = []
    for m in models:
        size, twinned = micro or MICRO.get(m, 8), set()
        for (p, q), a in itertools.product([(p, q) for p in profiles for q in runs[p]], ac):
            grid = [Case(m, p, a, size, d, precision=q) for d in data]
            on_this = variant_case(m, p, a, models[0]) and "tensor" in data and q == runs[p][0]
            extra = [v for v in variants if v != "base"] if on_this else []
            if "base" in variants or extra:
                out += grid[:1]
            if twin_precision(q) not in twinned:
                twinned.add(twin_precision(q))
                out += [Case(m, "plain", False, size, "tensor", "base", t, twin_precision(q)) for t in twins]
            out += [Case(m, p, a, size, "tensor", v, precision=q) for v in extra]
            if "base" in variants:
                out += grid[1:]
    return out


def timed_steps(step: Callable[[dict], object], batches: Iterator[dict], *, warmup: int, seconds: float,
                max_steps: int, sync: Callable[[], None], after_warmup: Callable[[], dict] = dict) -> dict:
    """`warmup` untimed steps, then steps for `seconds` (at least one, at most `max_steps`) between
    two device syncs. data_wait_s: time spent in next(batches) within the timed span (a loader
    that keeps up answers at once: its workers prepared the batch while the GPU ran)."""
    losses = [float(step(next(batches))) for _ in range(warmup)]
    sync()
    measured = after_warmup()
    steps, waited, t0 = 0, 0.0, time.perf_counter()
    while steps < max_steps and (steps == 0 or time.perf_counter() - t0 < seconds):
        w0 = time.perf_counter()
        batch = next(batches)
        waited += time.perf_counter() - w0
        loss = step(batch)
        steps += 1
    sync()
    elapsed = time.perf_counter() - t0
    losses.append(float(loss))
    return {"timed_steps": steps, "elapsed_s": elapsed, "data_wait_s": waited, "first_loss": losses[0],
            "final_loss": losses[-1], **measured}


def _children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's children (the DataLoader workers)."""
    import psutil

    total = 0.0
    for proc in psutil.Process().children(recursive=True):
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


# --------------------------------------------------------------------------- one case (worker)

def memory_after_warmup(on_gpu: bool) -> dict:
    """After the warm-up steps (step 2: optimizer states, buckets and NCCL communicators exist):
    the device's used bytes (mem_get_info) against the caching allocator's reserved bytes. The
    difference -- CUDA context, NCCL buffers and communicators, cuBLAS workspaces -- is what the
    planner's flat 1 GiB reserve (planning/memory.py) stands for, to be fitted from these rows."""
    if not on_gpu:
        return {}
    import torch

    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    return {"after_warmup": {"device_used_bytes": total - free, "device_total_bytes": total,
                             "reserved_bytes": reserved, "allocated_bytes": torch.cuda.memory_allocated(),
                             "outside_allocator_bytes": total - free - reserved}}


def tensor_batch(config, micro: int, device, seed: int) -> dict:
    """The --data tensor batch, ours and the twin's alike: uint8 pixels (what the loader sends; the
    model normalises them on the device) and token ids below the vocabulary, seeded."""
    import torch

    v, t = config.vision_config, config.text_config
    g = torch.Generator(device=device).manual_seed(seed)
    return {"pixel_values": torch.randint(0, 256, (micro, 3, v.image_size, v.image_size), device=device,
                                          generator=g, dtype=torch.uint8),                        # (B,3,H,W)
            "input_ids": torch.randint(0, t.vocab_size, (micro, t.max_position_embeddings),
                                       device=device, generator=g)}                               # (B,L)


def case_run(case: Case, args, out_dir: str):
    """The run config of a case (a twin's too: it takes the optimizer and clipping from it)."""
    from rsclip_ds.config import load_config

    overrides = [f"precision={case.precision}", f"batch.micro_batch_size={case.micro}",
                 "steps=1000", "optim.warmup_steps=10", f"model.preset={case.preset}",
                 f"model.activation_checkpointing={case.checkpointing}",
                 f"output_dir={out_dir}", "checkpoint.at_end=false", *variant_overrides(case.variant, args.teacher)]
    if not case.twin:
        overrides.append(f"profile={case.profile}")
    if case.data == "loader":
        overrides += [f"data.train_shards={args.shards}", f"data.num_workers={args.loader_workers}"]
    return load_config(None, overrides)


@contextmanager
def case_setup(case: Case, args):
    """What a case's process (ours or a twin) runs in: its one-rank group, the device, the run config
    (case_run, output in a temporary folder), the peak-memory counter reset -> (info, accelerator,
    device, run)."""
    import torch
    from deepspeed.accelerator import get_accelerator

    with process_group(args.threads) as info, tempfile.TemporaryDirectory() as out_dir:
        acc = get_accelerator()
        device = torch.device(acc.device_name(info.local_rank) if info.on_gpu else "cpu")
        run = case_run(case, args, out_dir)
        if info.on_gpu:
            torch.cuda.reset_peak_memory_stats()
        yield info, acc, device, run


def run_case(case: Case, args) -> dict:
    """Build with the Trainer, warm up, time; -> the row. Runs inside its own process."""
    import torch

    from rsclip_ds.engine import engine_dtype
    from rsclip_ds.model import load_tokenizer, preset_bundle
    from rsclip_ds.loop import micro_batch_step
    from rsclip_ds.assembly import Trainer

    loader_mode = case.data == "loader"
    with case_setup(case, args) as (info, acc, device, run):
        t0 = time.perf_counter()
        # Built whole, on the device (-large: seconds on a GPU, a minute on the CPU), for every
        # profile: on one rank deepspeed.zero.Init (a ZeRO-3 run's build) has nothing to
        # partition, and it draws the seeded initial weights in another order, so ZeRO-3 rows
        # would start from another model than ZeRO-2 rows. The tensor batch carries token ids
        # and needs no tokenizer (nothing Trainer.build runs here reads one: our loader, no
        # evaluation, no checkpoint saved); the loader tokenises with the one written beside the
        # shards (ids below the preset's vocabulary, which the model keeps).
        tokenizer = load_tokenizer(Path(args.tokenizer)) if loader_mode else None
        with torch.device(device):
            bundle = preset_bundle(case.preset, tokenizer, run.seed, own_vocabulary=True)
        batch = tensor_batch(bundle.model.config, case.micro, device, info.rank)
        if case.variant == "distill":   # the teacher's own inputs, as the loader's second view carries them
            g = torch.Generator(device=device).manual_seed(info.rank + 1)
            batch.update(teacher_batch(args.teacher, case.micro, device, g))
        with Trainer(run, model=bundle, loader=None if loader_mode else [batch]) as trainer:
            parts = trainer.build()
            engine, loss_fn = parts.engine, parts.loss_fn
            build_s = time.perf_counter() - t0
            dtype = engine_dtype(engine)
            build_peak = torch.cuda.max_memory_allocated() if info.on_gpu else None
            if info.on_gpu:   # the steps' own peak: not the whole fp32 model ZeRO-3 built before partitioning
                torch.cuda.reset_peak_memory_stats()
            if loader_mode:   # the run's loader: worker processes, shards, decode, pinned batches
                batches = iter(parts.loader)
            else:             # every step trains on the one batch: the time is the model's, not a loader's
                [batch] = parts.loader
                batches = itertools.repeat(batch)
            cpu0 = _children_cpu_seconds()
            timing = timed_steps(lambda b: micro_batch_step(engine, b, loss_fn, dtype, parts.distiller), batches,
                                 warmup=args.warmup, seconds=args.seconds, max_steps=args.max_steps,
                                 sync=acc.synchronize, after_warmup=lambda: memory_after_warmup(info.on_gpu))
            loader_cpu_s = _children_cpu_seconds() - cpu0   # warm-up included: the workers start there
            params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in bundle.model.parameters())
            del batches
    row = rate_row(case, args, info, device, bundle.model.config, timing)
    row.update(parameters=params, activation_checkpointing=parts.activation_checkpointing, build_s=build_s,
               build_peak_memory_bytes=build_peak)
    if loader_mode:
        fed = (args.warmup + timing["timed_steps"]) * case.micro   # the workers' CPU covers the warm-up batches too
        row.update(loader_workers=args.loader_workers, loader_cpu_s=loader_cpu_s,
                   loader_samples_per_cpu_s=fed / loader_cpu_s if loader_cpu_s else None,
                   data_images=args.data_images, data_px=args.data_px)
    return row


def run_twin(case: Case, args) -> dict:
    """The plain PyTorch loop (benchmarks/twin.py) on the case's model and batch, built as
    run_case builds ours (the same preset_bundle on the device, the same tensor_batch, the run's
    AdamW, clipping, loss and learning-rate schedule over the run's `steps`, as ours steps it);
    `case.twin` compiled: every encoder layer compiled. -> the row."""
    import torch

    from benchmarks.twin import PlainLoop
    from rsclip_ds.model import preset_bundle

    with case_setup(case, args) as (info, acc, device, run):
        t0 = time.perf_counter()
        with torch.device(device):
            bundle = preset_bundle(case.preset, None, run.seed, own_vocabulary=True)
        batch = tensor_batch(bundle.model.config, case.micro, device, info.rank)
        loop = PlainLoop(bundle.model, precision=case.precision, optim=run.optim, clip=run.optim.gradient_clipping,
                         compiled=case.twin == "compiled", steps=run.steps, loss=run.loss.name)
        build_s = time.perf_counter() - t0
        build_peak = torch.cuda.max_memory_allocated() if info.on_gpu else None
        if info.on_gpu:
            torch.cuda.reset_peak_memory_stats()
        timing = timed_steps(loop.step, itertools.repeat(batch), warmup=args.warmup, seconds=args.seconds,
                             max_steps=args.max_steps, sync=acc.synchronize,
                             after_warmup=lambda: memory_after_warmup(info.on_gpu))
        row = rate_row(case, args, info, device, bundle.model.config, timing)
    row.update(parameters=sum(p.numel() for p in bundle.model.parameters()), activation_checkpointing=False,
               build_s=build_s, build_peak_memory_bytes=build_peak)
    return row


def rate_row(case: Case, args, info, device, config, timing: dict) -> dict:
    """A case's row from its timed steps: samples/s, step time, FLOPs, MFU and HFU, peak memory."""
    import torch

    from rsclip_ds.planning.flops import flops_per_sample

    steps, elapsed = timing["timed_steps"], timing["elapsed_s"]
    samples_per_s = steps * case.micro * info.world_size / elapsed
    flops = flops_per_sample(config)
    name = torch.cuda.get_device_name(device) if info.on_gpu else "cpu"   # e.g. 'NVIDIA H200'
    peak = peak_flops(name, case.precision, args.peak_tflops)   # one device's, at the run's precision
    return {"case": case.name, **asdict(case), "ok": True,
            "device": name, "world_size": info.world_size, **timing,
            "data_wait_fraction": timing["data_wait_s"] / elapsed,
            "samples_per_s": samples_per_s, "samples_per_s_per_device": samples_per_s / info.world_size,
            "step_ms": 1e3 * elapsed / steps,
            "flops_per_sample": flops.to_dict(),
            "achieved_tflops": flops.train() * samples_per_s / info.world_size / 1e12,
            "peak_tflops": peak / 1e12 if peak else None,
            "mfu": mfu_per_device(flops.train(), samples_per_s, info.world_size, peak),
            "hfu": mfu_per_device(flops.train(case.checkpointing, hardware=True), samples_per_s, info.world_size,
                                  peak),
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if info.on_gpu else None}   # the steps'


def pair_with_tensor(rows: list[dict]) -> list[dict]:
    """Each ok loader row with its ok tensor twin (same preset, profile, precision, checkpointing,
    micro): loader / tensor samples/s (1.0: the data path keeps up) and the loader's data wait."""
    key = lambda r: (r["preset"], r["profile"], r.get("precision", "bf16"), r["checkpointing"], r["micro"])
    tensor = {key(r): r for r in rows
              if r.get("ok") and r.get("data", "tensor") == "tensor" and r.get("variant", "base") == "base"
              and not r.get("twin")}
    pairs = []
    for r in rows:
        twin = tensor.get(key(r))
        if r.get("ok") and r.get("data") == "loader" and twin:
            pairs.append({"case": twin["case"], "tensor_samples_per_s": twin["samples_per_s"],
                          "loader_samples_per_s": r["samples_per_s"],
                          "loader_over_tensor": r["samples_per_s"] / twin["samples_per_s"],
                          "data_wait_fraction": r["data_wait_fraction"], "loader_workers": r["loader_workers"],
                          "loader_samples_per_cpu_s": r["loader_samples_per_cpu_s"]})
    return pairs


# --------------------------------------------------------------------------- driver

def run_in_process(case: Case, args, timeout: float) -> dict:
    """One case in a fresh Python process; a crash or a timeout becomes a row with the reason."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "row.json"
        cli = ["--worker", "--out", str(result), "--model", case.preset, "--profiles", case.profile,
               "--ac", "on" if case.checkpointing else "off", "--micro", str(case.micro),
               "--precision", case.precision, "--warmup", str(args.warmup), "--seconds", str(args.seconds),
               "--max-steps", str(args.max_steps), "--threads", str(args.threads), "--data", case.data,
               "--variants", case.variant, "--twins", *([case.twin] if case.twin else [])]
        if args.teacher:
            cli += ["--teacher", args.teacher]
        if case.data == "loader":
            cli += ["--shards", args.shards, "--tokenizer", args.tokenizer, "--loader-workers", str(args.loader_workers),
                    "--data-images", str(args.data_images), "--data-px", str(args.data_px)]
        if args.peak_tflops:
            cli += ["--peak-tflops", str(args.peak_tflops)]
        t0 = time.perf_counter()
        row = run_script("benchmarks.gpu", cli, result, timeout)
        if not row.get("ok", True) and row["error"].startswith("timed out"):
            row["error"] += " (raise --case-timeout)"
        return {"case": case.name, **asdict(case), **row, "process_s": time.perf_counter() - t0}


def parse_args(argv):
    parser = base_parser(__doc__)
    parser.add_argument("--model", nargs="*", default=["git-rsclip-base", "git-rsclip-large"],
                        help="presets (tiny: the CPU smoke test)")
    parser.add_argument("--profiles", nargs="*", default=["zero2", "zero3"],
                        help=f"profiles, or sets of them: {PROFILE_SETS}")
    parser.add_argument("--ac", nargs="*", default=["off", "on"], choices=["off", "on"],
                        help="activation checkpointing settings to run")
    parser.add_argument("--micro", type=int, default=None, help="micro-batch (default per preset: MICRO)")
    parser.add_argument("--precision", default="bf16", choices=PRECISIONS, help="one precision: --precisions P")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS,
                        help="each profile under each (default: --precision); auto: the run's default per profile "
                             "(amp_bf16 on ddp, bf16 under ZeRO); pairs a run refuses (ddp with bf16) are left out")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="timed seconds per case (at least one step, at most --max-steps)")
    parser.add_argument("--max-steps", type=int, default=50, help="timed steps at most per case")
    parser.add_argument("--case-timeout", type=float, default=120.0, help="seconds before a case's process is killed")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS),
                        help="base: the grid; patch_dropout, compile, distill: the same run with that feature on, "
                             "on git-rsclip-base / zero2 / no AC only (benchmarks/gpu/variants.py)")
    parser.add_argument("--twins", nargs="*", default=list(TWINS), choices=list(TWINS),
                        help="the plain PyTorch loop (benchmarks/twin.py) on each preset's model and batch: eager, "
                             "compiled (every encoder layer); none: --twins alone")
    parser.add_argument("--teacher-preset", default=None,
                        help="the distill variant's teacher shape (default git-rsclip-large; tiny with --model tiny)")
    parser.add_argument("--total-budget", type=float, default=560.0,
                        help="seconds for all cases; cases that would start after it are skipped")
    parser.add_argument("--append", action="store_true",
                        help="keep the cases of the report already at --out (an earlier part of step.sh) ahead "
                             "of this command's; the pairs (ours / twin, ...) are made over all of them")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU if not in PEAK_BF16_TFLOPS")
    parser.add_argument("--data", nargs="*", default=["tensor"], choices=["tensor", "loader"],
                        help="batches: one in device memory (tensor) and/or the real loader from JPEG shards")
    parser.add_argument("--loader-workers", type=int, default=8, help="data.num_workers of the loader cases")
    parser.add_argument("--data-images", type=int, default=2048, help="synthetic JPEGs the loader cases read")
    parser.add_argument("--data-px", type=int, default=256, help="their side in px (256: Git-10M's tiles)")
    parser.add_argument("--open-clip", type=Path, metavar="VENV",
                        help="run the open_clip comparison instead: open_clip's trainer (--openclip-precisions) "
                             "against rsclip-ds train (zero2, bf16) on one GPU, the shape of the first --model "
                             "(git-rsclip-base, or tiny for a CPU smoke test); VENV from "
                             "benchmarks/throughput/openclip_env.sh, or `kit`: this Python with "
                             "PYTHONPATH=$OPENCLIP_PYTHONPATH (the GPU kit's wheels: source .gpu/env.sh)")
    parser.add_argument("--openclip-precisions", nargs="*", default=["amp_bf16", "pure_bf16"],
                        choices=["amp_bf16", "pure_bf16"], help="--open-clip: open_clip's side")
    parser.add_argument("--openclip-peers", nargs="*", default=["patch_dropout", "compile"],
                        help="--open-clip: features run on both sides at the same setting, against amp_bf16 "
                             "(benchmarks/throughput/openclip_cases.py PEERS)")
    parser.add_argument("--openclip-steps", type=int, default=40,
                        help="--open-clip: steps per run; the rate leaves out the first quarter")
    parser.add_argument("--planner-pick", action="store_true",
                        help="--open-clip: run rsclip-ds train as rsclip_ds.planning.planner recommends it for one GPU "
                             "(its profile, precision, micro-batch and checkpointing; --micro, default MICRO, is the "
                             "batch per step it plans for) instead of zero2 bf16; open_clip at the same micro-batch "
                             "and checkpointing")
    parser.add_argument("--pick-gpu-mem", metavar="SIZE",
                        help="--planner-pick: the GPU memory it plans for, e.g. 80GB or 16GiB (default: this GPU's, "
                             f"torch.cuda; without one {DEFAULT_PICK_MEM}, stated in the report)")
    parser.add_argument("--shards", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--teacher", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def planner_pick(shape: str, batch: int, gpu_bytes: int) -> dict:
    """What rsclip_ds.planning.planner recommends for one GPU of `gpu_bytes` training the open_clip
    comparison's model (openclip_shapes.SHAPES[shape]: the one both tools train, not the preset of
    that name: git-rsclip-base's at 224 px) at `batch` samples a step, as `rsclip-ds plan --gpus 1
    --global-batch BATCH` would: plan() over every profile, precision auto (amp_bf16 on ddp, bf16
    under ZeRO), recommend(), reason() -> {"budget_bytes", "batch", "row": the pick's Row as a
    dict (profile, precision, micro, accumulation, checkpointing, predicted GiB), "reason"}. A
    pick that accumulates is refused: both tools would need k micro-batches a step (open_clip
    --accum-freq), which this comparison does not run; a smaller --micro fits in one."""
    from types import SimpleNamespace

    from benchmarks.throughput.openclip_shapes import SHAPES, siglip_config
    from rsclip_ds.planning.memory import model_spec
    from rsclip_ds.planning.planner import Budget, plan, reason, recommend

    # the token ids only fill the config's special-token fields; the sizes are what the plan reads
    ids = SimpleNamespace(pad_token_id=1, bos_token_id=0, eos_token_id=2)
    spec = model_spec(siglip_config(SHAPES[shape], ids), shape)
    budget = Budget(gpus_per_node=1, nodes=1, gpu_bytes=gpu_bytes)
    rows = plan(spec, budget, batch)
    best = recommend(rows)
    if best is None:
        raise SystemExit(f"--planner-pick: nothing fits one GPU of {gpu_bytes / 2**30:.1f} GiB at {batch} samples a "
                         f"step for {shape}; give a smaller --micro or a larger --pick-gpu-mem")
    if best.accumulation > 1:
        raise SystemExit(f"--planner-pick: the pick for {batch} samples a step is {best.profile} at micro {best.micro} "
                         f"x {best.accumulation} micro-batches, which this comparison does not run on both sides: "
                         f"give --micro {best.micro} (or less)")
    return {"budget_bytes": gpu_bytes, "batch": batch, "row": best.to_dict(), "reason": reason(best, rows, budget)}


def pick_budget(stated: str | None) -> tuple[int, str]:
    """--pick-gpu-mem's bytes, or this GPU's total memory, or DEFAULT_PICK_MEM without a GPU ->
    (bytes, where they came from)."""
    import torch

    from rsclip_ds.cli.plan import parse_bytes

    if stated:
        return parse_bytes(stated), f"--pick-gpu-mem {stated}"
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, f"{torch.cuda.get_device_name()}'s memory"
    return parse_bytes(DEFAULT_PICK_MEM), f"{DEFAULT_PICK_MEM}, stated: no GPU here"


def comparison_setup(args):
    """--open-clip's one-rank openclip.Bench, its cases (openclip_cases.cases) and the planner's pick
    (None without --planner-pick; with it, its micro-batch, checkpointing, profile and precision
    are the bench's and our case's) -> (bench, cases, pick)."""
    import torch

    from benchmarks.throughput.openclip import cases as openclip_cases
    from benchmarks.throughput.openclip import one_rank_bench

    shape = args.model[0]
    micro, profile, precision, checkpointing, pick = args.micro or MICRO.get(shape, 8), "zero2", "bf16", False, None
    if args.planner_pick:
        gpu_bytes, said = pick_budget(args.pick_gpu_mem)
        pick = {**planner_pick(shape, micro, gpu_bytes), "budget": said}
        row = pick["row"]
        micro, profile, precision, checkpointing = row["micro"], row["profile"], row["precision"], row["checkpointing"]
    bench = one_rank_bench(shape, micro, args.openclip_steps, args.loader_workers,
                           timeout_s=max(args.case_timeout, 300.0),
                           device="cuda" if torch.cuda.is_available() else "cpu", checkpointing=checkpointing)
    todo = openclip_cases(args.openclip_precisions, [profile], [precision], args.openclip_peers, peer_profile=profile)
    return bench, todo, pick


def openclip_comparison(args) -> int:
    """--open-clip VENV: benchmarks/throughput/openclip.py's comparison on one rank, the same
    report (JSON + PNG + tables): open_clip_train (VENV's python, or with `kit` this one with
    PYTHONPATH=$OPENCLIP_PYTHONPATH; `torch.distributed.run --nproc_per_node 1`) with --precision
    amp_bf16 / pure_bf16 against `deepspeed --num_gpus 1 --module rsclip_ds train` with zero2 bf16
    -- or, with --planner-pick, with the profile, precision, micro-batch and checkpointing of
    planner_pick for this GPU (the report's `planner_pick`; open_clip at the same micro-batch and
    checkpointing) -- the model of openclip_shapes.SHAPES[--model], --micro (default MICRO),
    --loader-workers workers each, synthetic JPEGs at the model's size; and each of
    --openclip-peers on both sides (open_clip's first partner of our precision, amp_bf16, against
    ours). The report so far is in OUT.partial.json after every run; SIGTERM (a time limit) stops
    the run under way and leaves it there."""
    import signal

    from benchmarks.throughput.openclip import compare
    from benchmarks.throughput.openclip_report import plot

    bench, todo, pick = comparison_setup(args)
    if pick:
        row = pick["row"]
        ac = " with activation checkpointing" if row["checkpointing"] else ""
        print(f"planner's pick for 1 GPU of {pick['budget_bytes'] / 2**30:.1f} GiB ({pick['budget']}): "
              f"{row['profile']} {row['precision']} micro {row['micro']}{ac} -- {pick['reason']}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # unwinds through launch(), which stops the run
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_suffix(".partial.json")
    report = compare(bench, todo, args.open_clip, Path("runs/bench_data"), Path("runs/bench_openclip"),
                     say=lambda m: print(m, flush=True), partial=partial)
    partial.unlink(missing_ok=True)
    if pick:
        report["planner_pick"] = pick
    write_report(report, args.out, page_tables(gpu_tables, args.out.name), plot)
    print(f"wrote {args.out} in {report['seconds']:.0f}s")
    return 0 if all(r["ok"] for r in report["runs"]) else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.open_clip:
        return openclip_comparison(args)
    args.profiles = expand_profiles(args.profiles)
    refused = refuse_one_rank_hybrid(args.profiles)
    if refused:
        print(refused, file=sys.stderr)
        return 2
    if args.worker:   # one case, from its own flags (run_in_process): --precision is the case's, concrete
        case = Case(args.model[0], args.profiles[0], args.ac[0] == "on", args.micro or MICRO.get(args.model[0], 8),
                    args.data[0], args.variants[0], args.twins[0] if args.twins else "", args.precision)
        args.out.write_text(json.dumps(run_twin(case, args) if case.twin else run_case(case, args)))
        return 0
    args.precisions = args.precisions or [args.precision]
    args.left_out = [why for p in args.profiles for why in profile_precisions(p, args.precisions)[1]]
    for why in args.left_out:
        print(f"left out: {why}", file=sys.stderr)
    todo = cases(args.model, args.profiles, [a == "on" for a in args.ac], args.micro, args.data, args.variants,
                 args.twins, args.precisions)
    if not todo:
        print("no case to run: every --profiles x --precisions pair is refused (above)", file=sys.stderr)
        return 2
    earlier = json.loads(args.out.read_text()) if args.append and args.out.is_file() else None
    if args.append and earlier is None:
        print(f"--append: no report at {args.out} yet; starting one", flush=True)
    with tempfile.TemporaryDirectory() as data_dir:
        if "loader" in args.data:   # written once: every loader case reads the same shards
            t0 = time.perf_counter()
            data = synthetic_data(Path(data_dir), num_train=args.data_images, num_val=1, shard_size=64,
                                  image_size=args.data_px)
            args.shards, args.tokenizer = data["train_pattern"], data["tokenizer"]
            print(f"loader data: {args.data_images} x {args.data_px} px JPEG in {time.perf_counter() - t0:.0f}s",
                  flush=True)
        if any(c.variant == "distill" for c in todo):   # written once: a random-weight teacher folder
            t0 = time.perf_counter()
            preset = args.teacher_preset or ("tiny" if args.model[0] == "tiny" else "git-rsclip-large")
            args.teacher = str(write_teacher(Path(data_dir) / "teacher", preset,
                                             Path(args.tokenizer) if args.tokenizer else None))
            print(f"distill teacher: {preset}, random weights, in {time.perf_counter() - t0:.0f}s", flush=True)
        report = run_cases(todo, args, earlier)
    write_report(report, args.out, page_tables(gpu_tables, args.out.name))
    args.out.with_suffix(".partial.json").unlink(missing_ok=True)
    print(f"wrote {args.out} in {report['seconds']:.0f}s")
    return 0 if all(r["ok"] for r in report["cases"]) else 1


def run_cases(todo: list[Case], args, earlier: dict | None = None) -> dict:
    """Each case in its own process, within --total-budget, after `earlier`'s cases (--append);
    the report so far in OUT.partial.json after every case -> the report."""
    t0 = time.perf_counter()
    kept = earlier["cases"] if earlier else []
    partial = args.out.with_suffix(".partial.json")
    partial.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, case in enumerate(todo):
        left = args.total_budget - (time.perf_counter() - t0)
        if left < 20:
            rows.append({"case": case.name, **asdict(case), "ok": False,
                         "error": f"skipped: --total-budget {args.total_budget:.0f}s used up"})
            continue
        rows.append(run_in_process(case, args, min(args.case_timeout, left)))
        row = rows[-1]
        status = f"{row['samples_per_s']:.1f} samples/s" if row["ok"] else row["error"]
        print(f"[{i + 1}/{len(todo)}] {case.name}: {status} ({time.perf_counter() - t0:.0f}s)", flush=True)
        partial.write_text(json.dumps(report_of(kept + rows, args, earlier, time.perf_counter() - t0), indent=2))
    return report_of(kept + rows, args, earlier, time.perf_counter() - t0)


def report_of(rows: list[dict], args, earlier: dict | None, seconds: float) -> dict:
    """The report of `rows` (an --append's earlier ones first): this command's config (`precision`:
    every precision our rows ran, the table's heading; `appended_to`: the earlier command's config),
    the pairs over all rows, and the seconds of both commands."""
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    ran = list(dict.fromkeys(r["precision"] for r in rows if not r.get("twin") and r.get("precision")))
    config = {"models": args.model, "profiles": args.profiles, "ac": args.ac, "precision": ", ".join(ran),
              "precisions": args.precisions, "left_out": args.left_out,
              "warmup": args.warmup, "seconds": args.seconds, "max_steps": args.max_steps,
              "data": args.data, "loader_workers": args.loader_workers, "data_images": args.data_images,
              "data_px": args.data_px, "variants": args.variants, "twins": args.twins}
    if earlier:
        config["appended_to"] = earlier["config"]
    return {"config": config, "environment": environment(args.threads, device=device), "cases": rows,
            "loader_vs_tensor": pair_with_tensor(rows), "variants_vs_base": pair_with_base(rows),
            "ours_vs_twin": pair_with_twins(rows),
            "seconds": seconds + (earlier["seconds"] if earlier else 0.0)}


if __name__ == "__main__":
    sys.exit(main())

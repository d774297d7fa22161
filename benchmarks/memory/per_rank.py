"""Model-state and activation bytes per rank, measured on real engines against `rsclip_ds.planning.memory`.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module benchmarks.memory.per_rank --out benchmarks/results/memory.json
    deepspeed --num_gpus 8 --module benchmarks.memory.per_rank --preset git-rsclip-base --precision bf16 --out ...
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module benchmarks.memory.per_rank --set finetune.lock_image=true \
        --out benchmarks/results/memory_lock_image.json

`--set finetune.KEY=VALUE` (repeatable) runs with fine-tuning controls, as `rsclip-ds train --set`
would (`Trainer.build` applies them: locked towers and LoRA's frozen weights get no gradients or
optimizer states, LoRA adds its adapters' weights); the prediction is then the planner's for the
same controls (`preset_spec(preset, run.finetune)`, its `.trainable` and `.finetune_json`).
`--precision amp_bf16` (or `amp` with `--profiles ddp`: DeepSpeed's ZeRO refuses it) measures the autocast
precisions: fp32 weights, and activations that include autocast's 16-bit weight copies autograd saves
(`activations.autocast_weight_bytes`; not under ZeRO-3, whose linear saves the fp32 weight). The ddp
profile (stage 0) counts the module's own parameters, their `.grad` and AdamW's state (with DeepSpeed's
fp32 copies under bf16/fp16); `--num_gpus 1` measures it without the all-reduce.
`--precision bf16 --set bf16.master_weights=bf16` measures bf16 master weights against
`model_state_bytes(..., master="bf16")` (the offload profiles need `--set optim.impl=deepspeed` on
CPU ranks: DeepSpeedCPUAdam, JIT-built on first use); `--set bf16.grad_accum_dtype=...` likewise.

Writes the JSON given by --out and a PNG beside it (same name, .png); rank 0 prints the table.
On 2 CPU ranks of a 2-core machine the tiny preset takes ~1 minute, mostly engine builds.

For every profile in ds_profiles/ the process builds the engine, loss and activation
checkpointing a run gets (`rsclip_ds.assembly.Trainer(run, model=..., loader=...).build()`; the
model is `rsclip_ds.model.preset_bundle` with the preset's own vocabulary, as `memory.preset_spec`
counts it, built as a run builds it: partitioned inside deepspeed.zero.Init under ZeRO-3; the
loader is this script's random batches of the preset's shapes), runs --steps train steps on
them, and in the last one counts, on each rank, the bytes of the tensors the engine holds (each
storage once, by data_ptr):

  parameters  ZeRO-1/2: the optimizer's flat 16-bit buffers `bit16_groups_flat` (the module's
              trainable params are views of them) and the frozen params, which stay whole on
              every rank outside them; ZeRO-3: the partitions `p.ds_tensor`. ZeRO-3 also keeps
              every parameter under `stage3_param_persistence_threshold` (1e5 elements) gathered
              on every rank; those bytes are reported as `persistent_gathered_bytes`, beside the
              comparison: memory.py does not model the threshold (all of the tiny preset is under it).
  gradients   counted after backward and before engine.step(), the moment they all exist:
              ZeRO-1/2: `averaged_gradients` (in 0.19.8 stage 1 also reduces during backward and
              keeps only its partition; the params' `.grad` are None), `grads_in_partition`, the
              fp32 partition's `.grad` (offload); ZeRO-3: `grad_partitions_flat_buffer` and the fp32
              partitions' `.grad`. Each storage counts whole: a partition that is a view of a larger
              buffer (params straddling the partition boundary) counts the buffer. After step()
              ZeRO-1/2 free them, so counting "after a step" would find none.
  optimizer   the fp32 master partitions `single_partition_of_fp32_groups` (ZeRO-1/2) or
              `fp32_partitioned_groups_flat` (ZeRO-3) and every tensor in the torch optimizer's
              `state` (Adam m, v; the scalar `step` counts too, it is a few bytes).
  buckets     ipg reduce buckets and the offload staging buffers: transient in the model
              (`StateBytes.train_extra`), reported but not compared.

On CPU ranks the "GPU" and "CPU" are the same memory, so bytes are classed by *role*: offloaded
per the profile (optimizer states and fp32 gradients with offload_optimizer; parameters with
offload_param) or on the accelerator. Compared per rank:
  gpu      measured accelerator-role params + grads + optimizer  vs  model_state_bytes(...).gpu
  offload  measured offloaded-role bytes  vs  model_state_bytes(...).cpu_node / gpus per node, which
           is max(fp32 model every rank builds, offloaded states): only the offloaded-states branch
           is comparable, and the JSON says which branch won (`cpu_term`).
Target: both within 10% (0 predicted and 0 measured is a match); `activations` within 15%:
bytes saved for backward by one micro-batch forward of the towers (the loss excluded, parameters
and gathered ZeRO-3 parameters excluded) vs activation_bytes_per_sample(...) x micro. With
activation checkpointing (zero3_offload) measured = saved by the forward (layer inputs) + the
largest single recomputed layer during backward, the quantity the model's formula describes.
Peak memory (what decides whether a run fits), with `--accumulation K [K ...]`: per profile and K,
a fresh engine with K micro-batches per optimizer step; the peak over its second optimizer step
against `memory.peak(...)` (allocated on a GPU, `.host` on CPU ranks), within 15%. How it is
measured on CPU ranks (the resident set's high-water mark, glibc tuned): benchmarks/memory/peak.py.

    for p in zero1 zero2 zero2_offload zero3 zero3_offload; do for k in 1 4; do
      DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module benchmarks.memory.per_rank --preset git-rsclip-base --micro 2 \
        --accumulation $k --profiles $p --out benchmarks/results/peak/$p-$k.json
    done; done
    python -m benchmarks.memory.per_rank --combine benchmarks/results/peak/*.json --out benchmarks/results/memory_peak_base.json

With --accumulation only the peaks are measured (a 203M-parameter engine per profile and K). One
launch each: an engine built after another in the same process finds memory the first did not
give back (measured here: 8 GiB resident per rank after three builds of git-rsclip-base, where one
step's peak is 4), which the resident-set measurement would count and a 24 GiB machine does not hold.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.harness import (base_parser, environment, finish, max_over_ranks, page_tables, process_group, pyplot,
                                rank0_print, save_figure)
from benchmarks.memory.counting import measured_step
from benchmarks.memory.peak import measured_peak, resident_bytes, tune_host_allocator
from benchmarks.results_tables.memory import memory_finetune, memory_peak
from rsclip_ds.planning import memory
from rsclip_ds.planning.activations import activation_bytes_per_sample, autocast_weight_bytes
from rsclip_ds.config import load_config
from rsclip_ds.runtime.distributed import local_world_size_from_env
from rsclip_ds.engine import engine_dtype
from rsclip_ds.model import preset_bundle
from rsclip_ds.precision import PRECISIONS
from rsclip_ds.profiles import available_profiles, runnable_profiles
from rsclip_ds.loop import micro_batch_step
from rsclip_ds.assembly import Trainer

MODEL_TOL, ACT_TOL, PEAK_TOL = 0.10, 0.15, 0.15
ROLES = ("params", "grads", "optimizer")


# --------------------------------------------------------------------------- one profile

def make_batch(config, micro: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    size, length = config.vision_config.image_size, config.text_config.max_position_embeddings
    return {"pixel_values": torch.randn(micro, 3, size, size, generator=g),                 # (B,3,H,W)
            "input_ids": torch.randint(0, config.text_config.vocab_size, (micro, length), generator=g)}


def random_batches(config, micro: int, seeds: list[int]):
    """The Trainer's loader here: one random batch of the preset's shapes per seed, made when read."""
    return (make_batch(config, micro, seed) for seed in seeds)


def run_profile(name: str, args, on_gpu: bool) -> dict:
    """One profile: the model, engine, loss and profile a run gets (`Trainer.build`, the preset's
    own vocabulary through the `model=` seam, random batches through `loader=`), --steps train
    steps, then the counted step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    with tempfile.TemporaryDirectory() as out_dir, torch_linear_after():
        run = run_config(name, args, out_dir)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        # No tokenizer: the batches carry token ids, and nothing Trainer.build runs here reads one
        # (our loader, no evaluation, no checkpoint saved: write_hf_extras would need it).
        bundle = preset_bundle(args.preset, None, run.seed, own_vocabulary=True)   # whole, as runs build presets
        config = bundle.model.config
        seeds = [100 * step + rank for step in range(args.steps)] + [99 + rank]   # the last one is counted
        with Trainer(run, model=bundle, loader=random_batches(config, args.micro, seeds)) as trainer:
            parts = trainer.build()
            engine, prof, batches = parts.engine, trainer.profile, iter(parts.loader)
            dtype = engine_dtype(engine)
            places = {"params": "cpu" if prof.offload_param else "gpu",
                      "grads": "cpu" if prof.offload_optimizer else "gpu",
                      "optimizer": "cpu" if prof.offload_optimizer else "gpu"}
            times = []
            for _ in range(args.steps):
                batch = next(batches)
                dist.barrier()
                t0 = time.perf_counter()
                micro_batch_step(engine, batch, parts.loss_fn, dtype)
                times.append(time.perf_counter() - t0)
            held, persistent, act, act_parts = measured_step(engine, next(batches), parts.loss_fn, dtype,
                                                             prof.stage, places, parts.activation_checkpointing)
            checkpointing = parts.activation_checkpointing
        del trainer, parts, engine, bundle, batches   # the next profile starts without this one's engine
    gc.collect()
    spec = memory.preset_spec(args.preset, run.finetune)   # LoRA's weights in .params; .trainable
    per_node = min(world, local_world_size_from_env())
    states = memory.model_state_bytes(spec.params, prof.stage, prof.offload_optimizer, prof.offload_param,
                                      args.precision, world, per_node, trainable=spec.trainable,
                                      master=run.bf16.master_weights)
    zero3 = prof.stage == 3
    act_pred = sum(activation_bytes_per_sample(config, args.precision, checkpointing, spec.finetune_json,
                                               zero3=zero3).values()) * args.micro
    # under autocast the forward also saves its 16-bit weight copies (new storages, not the parameters'); ZeRO-3's
    # linear casts them inside its own forward and saves the fp32 weight: they are cached there, not saved
    act_pred += 0 if zero3 else autocast_weight_bytes(config, args.precision, spec.finetune_json)
    return compare(name, prof, spec, states, held, persistent, act, act_pred, act_parts,
                   statistics.median(times[1:] or times), per_node, checkpointing)


def run_peak(name: str, args, on_gpu: bool, accumulation: int) -> dict:
    """The peak of one rank over an optimizer step of `accumulation` micro-batches ('plain'
    accumulation, as the planner is asked), measured (memory_peak.py) and predicted."""
    world, rank = dist.get_world_size(), dist.get_rank()
    base = 0 if on_gpu else resident_bytes()   # before the model: what the process holds anyway
    with tempfile.TemporaryDirectory() as out_dir, torch_linear_after():
        run = run_config(name, args, out_dir, [f"batch.gradient_accumulation_steps={accumulation}",
                                               "batch.accumulation=plain"])
        bundle = preset_bundle(args.preset, None, run.seed, own_vocabulary=True)
        config = bundle.model.config
        seeds = [1000 * accumulation + 10 * i + rank for i in range(2 * accumulation)]
        batch = make_batch(config, args.micro, 0)
        input_bytes = sum(t.nbytes for t in batch.values()) // args.micro
        with Trainer(run, model=bundle, loader=random_batches(config, args.micro, seeds)) as trainer:
            parts = trainer.build()
            del bundle
            measured = measured_peak(parts.engine, iter(parts.loader), parts.loss_fn, accumulation, on_gpu, base)
            prof, checkpointing = trainer.profile, parts.activation_checkpointing
        del trainer, parts
    gc.collect()
    per_node = min(world, local_world_size_from_env())
    spec = memory.preset_spec(args.preset, run.finetune)
    pred = memory.peak(spec, prof, args.precision, world, per_node, micro=args.micro,
                       accumulation_steps=accumulation, checkpointing=checkpointing, accumulation="plain",
                       device="cuda" if on_gpu else "cpu", input_bytes=input_bytes,
                       grad_accum=run.bf16.grad_accum_dtype, master=run.bf16.master_weights)
    predicted = pred.allocated if on_gpu else pred.host
    peak_bytes, seconds = max_over_ranks([float(measured["peak"]), measured["seconds"]])
    return {"accumulation": accumulation, "world_size": world, "predicted": predicted, "measured": int(peak_bytes),
            "ratio": _ratio(peak_bytes, predicted), "reserved_measured": measured["reserved"],
            "reserved_predicted": pred.reserved if on_gpu else None, "terms": pred.to_dict(),
            "step_seconds": seconds, "pass": bool(abs(_ratio(peak_bytes, predicted) - 1) <= PEAK_TOL)}


@contextmanager
def torch_linear_after():
    """Puts torch's F.linear back when a profile is done. A ZeRO-3 engine build replaces
    torch.nn.functional.linear for the rest of the process with DeepSpeed's
    LinearFunctionForZeroStage3 (zero.Init's memory_efficient_linear, on by default), which saves
    its input for backward even when the weight is frozen. So each profile measures what a run
    of it alone would, and the prediction runs with torch's linear, as `rsclip-ds plan` does
    (the probe's results are cached: one linear for all of them)."""
    linear = torch.nn.functional.linear
    try:
        yield
    finally:
        torch.nn.functional.linear = linear


def run_config(profile: str, args, out_dir: str, extra: list[str] = ()):
    """The run config of one profile: this script's settings, then the --set fine-tuning controls."""
    return load_config(None, [f"profile={profile}", f"precision={args.precision}", f"model.preset={args.preset}",
                              f"batch.micro_batch_size={args.micro}", f"steps={args.steps + 1}",
                              "optim.warmup_steps=0", f"output_dir={out_dir}", "checkpoint.at_end=false",
                              *extra, *args.set])


def _ratio(measured: float, predicted: float) -> float:
    if predicted == 0:
        return 1.0 if measured == 0 else float("inf")
    return measured / predicted


def compare(name, prof, spec, states, held, persistent, act, act_pred, act_parts, step_s,
            per_node, checkpointing) -> dict:
    gpu = held["params", "gpu"] + held["grads", "gpu"] + held["optimizer", "gpu"]
    cpu = held["params", "cpu"] + held["grads", "cpu"] + held["optimizer", "cpu"]
    offloaded = prof.offload_optimizer or prof.offload_param
    build_copy = 4 * spec.params * per_node   # memory.py's other branch of cpu_node
    cpu_pred = states.cpu_node // per_node if offloaded else 0
    row = {
        "profile": name, "stage": prof.stage, "offload_optimizer": prof.offload_optimizer,
        "offload_param": prof.offload_param, "activation_checkpointing": checkpointing,
        "measured": {f"{role}_{place}": held[role, place] for role in (*ROLES, "buckets") for place in ("gpu", "cpu")},
        "persistent_gathered_bytes": persistent,
        "gpu": {"predicted": states.gpu, "measured": gpu, "ratio": _ratio(gpu, states.gpu)},
        "offload": {"predicted": cpu_pred, "measured": cpu, "ratio": _ratio(cpu, cpu_pred),
                    "cpu_term": ("offloaded states" if states.cpu_node > build_copy else "fp32 build copy")
                    if offloaded else "none"},
        "activations": {"predicted": act_pred, "measured": act, "ratio": _ratio(act, act_pred), **act_parts},
        "step_seconds": step_s,
    }
    row["offload"]["comparable"] = row["offload"]["cpu_term"] != "fp32 build copy"
    ok_gpu = abs(row["gpu"]["ratio"] - 1) <= MODEL_TOL
    ok_cpu = not row["offload"]["comparable"] or abs(row["offload"]["ratio"] - 1) <= MODEL_TOL
    row["model_states_pass"] = bool(ok_gpu and ok_cpu)
    row["activations_pass"] = bool(abs(row["activations"]["ratio"] - 1) <= ACT_TOL)
    return row


def reduce_over_ranks(row: dict) -> None:
    """Byte counts and times in `row` become the largest rank's (partitions differ by padding
    only), and the ratios are taken again from them."""
    keys = ("gpu", "offload", "activations")
    flat = max_over_ranks([float(row[k]["measured"]) for k in keys] + [row["step_seconds"]]
                          + [float(v) for v in row["measured"].values()])
    for k, v in zip(keys, flat):
        row[k]["measured"] = int(v)
        row[k]["ratio"] = _ratio(row[k]["measured"], row[k]["predicted"])
    row["step_seconds"] = flat[3]
    row["measured"] = dict(zip(row["measured"], map(int, flat[4:])))


# --------------------------------------------------------------------------- report

def mode_label(config: dict) -> str:
    """' finetune.lock_image=true' for a report made with --set, '' for the default one."""
    return "".join(f" {item}" for item in config.get("set", []))


def plot_peak_report(report: dict, path: Path) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    rows = report["profiles"]
    fig, ax = plt.subplots(figsize=(10, 5))
    plot_peaks(ax, rows, sorted({p["accumulation"] for r in rows for p in r["peaks"]}))
    cfg, env = report["config"], report["environment"]
    fig.suptitle(f"{cfg['preset']} {cfg['precision']}, micro {cfg['micro']}, {env['world_size']} ranks "
                 f"({env['device']}); label = measured / predicted")
    return save_figure(plt, fig, path)


def plot(report: dict, path: Path) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    rows = report["profiles"]
    names = [r["profile"] for r in rows]
    x = range(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for ax, key, title in zip(axes, ("gpu", "offload", "activations"),
                              ("model states on the accelerator, per rank", "offloaded model states, per rank",
                               "saved activations, one micro-batch")):
        pred = [r[key]["predicted"] / 2**20 for r in rows]
        meas = [r[key]["measured"] / 2**20 for r in rows]
        ax.bar([i - 0.2 for i in x], pred, 0.4, label="predicted (memory.py)")
        ax.bar([i + 0.2 for i in x], meas, 0.4, label="measured")
        for i, r in enumerate(rows):
            label = f"{r[key]['ratio']:.2f}" if r[key]["predicted"] or r[key]["measured"] else "0 = 0"
            ax.annotate(label, (i + 0.2, meas[i]), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x), names, rotation=20)
        ax.set(title=title, ylabel="MiB", ylim=(0, 1.3 * max(pred + meas + [1e-3])))
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    cfg, env = report["config"], report["environment"]
    fig.suptitle(f"{cfg['preset']} {cfg['precision']}{mode_label(cfg)}, micro {cfg['micro']}, "
                 f"{env['world_size']} ranks ({env['device']}); label = measured / predicted")
    return save_figure(plt, fig, path)


def plot_peaks(ax, rows: list[dict], ks: list[int]) -> None:
    """Predicted and measured peak per rank, one pair of bars per (profile, accumulation)."""
    width = 0.8 / (2 * len(ks))
    for j, k in enumerate(ks):
        peaks = [next(p for p in r["peaks"] if p["accumulation"] == k) for r in rows]
        at = [i - 0.4 + width * (2 * j + 0.5) for i in range(len(rows))]
        ax.bar(at, [p["predicted"] / 2**30 for p in peaks], width, label=f"predicted, accumulation {k}")
        ax.bar([a + width for a in at], [p["measured"] / 2**30 for p in peaks], width, label=f"measured, accumulation {k}")
        for a, p in zip(at, peaks):
            ax.annotate(f"{p['ratio']:.2f}", (a + width, p["measured"] / 2**30), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), [r["profile"] for r in rows], rotation=20)
    ax.set(title="peak per rank over an optimizer step", ylabel="GiB")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")


def combine(paths: list[Path], out: Path) -> dict:
    """Peak reports of the same preset and settings made one launch per profile and accumulation
    (an engine built after another in the same process finds memory the first did not give back),
    joined into --out (+ PNG): a profile's peaks from several reports become one row."""
    reports = [json.loads(p.read_text()) for p in paths]
    keys = ("preset", "precision", "micro")
    if any({k: r["config"].get(k) for k in keys} != {k: reports[0]["config"].get(k) for k in keys} for r in reports):
        raise SystemExit(f"--combine: the reports differ in {keys}")
    rows: dict[str, dict] = {}
    for r in reports:
        for row in r["profiles"]:
            rows.setdefault(row["profile"], {"profile": row["profile"], "peaks": []})["peaks"] += row["peaks"]
    order = {name: i for i, name in enumerate(available_profiles())}
    # an environment key the launches differ on (ddp on one rank beside zero2 on two) shows each value
    env = {key: " or ".join(dict.fromkeys(str(r["environment"].get(key)) for r in reports))
           if len({str(r["environment"].get(key)) for r in reports}) > 1 else value
           for key, value in reports[0]["environment"].items()}
    report = {**reports[0], "environment": env,
              "profiles": sorted(rows.values(), key=lambda r: order.get(r["profile"], len(order))),
              "seconds": sum(r["seconds"] for r in reports), "combined_from": [str(p) for p in paths]}
    for row in report["profiles"]:
        row["peaks"].sort(key=lambda p: p["accumulation"])
    report["all_pass"] = all(p["pass"] for row in report["profiles"] for p in row["peaks"])
    finish(report, out, 0, page_tables(memory_peak, "memory_peak_base.json"), plot_peak_report)
    return report


# --------------------------------------------------------------------------- entry point

def parse_args(argv):
    parser = base_parser(__doc__)
    parser.add_argument("--preset", default="tiny", help="model preset (rsclip_ds.model.PRESETS)")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS,
                        help="the run's precision (amp only with --profiles ddp: DeepSpeed's ZeRO refuses it)")
    parser.add_argument("--micro", type=int, default=4, help="samples per rank per micro-batch")
    parser.add_argument("--steps", type=int, default=3, help="train steps before the measured one")
    parser.add_argument("--accumulation", type=int, nargs="*", default=[], metavar="K",
                        help="also measure each profile's peak over an optimizer step of K micro-batches "
                             "(e.g. 1 4; memory_peak.py) against memory.peak")
    parser.add_argument("--profiles", nargs="*", default=None, help="default: every ds_profiles/*.json")
    parser.add_argument("--combine", type=Path, nargs="+", metavar="JSON",
                        help="no measurement: join reports made one profile per launch into --out (+ PNG)")
    parser.add_argument("--set", action="append", default=[], metavar="finetune.KEY=VALUE",
                        help="a fine-tuning control or precision setting (finetune.*, bf16.*, optim.impl; "
                             "repeatable), e.g. finetune.lock_image=true, 'finetune.lora.towers=[image,text]', "
                             "bf16.master_weights=bf16")
    args = parser.parse_args(argv)
    check_sets(parser, args.set)
    return args


SET_KEYS = ("finetune.", "bf16.", "optim.impl=")


def check_sets(parser, sets: list[str]) -> None:
    """--set takes finetune.*, bf16.* and optim.impl only (the rest of the run is this script's),
    and they must validate: a bad key or value stops here, before any process group exists."""
    from rsclip_ds.config import ConfigError

    for item in sets:
        if not item.startswith(SET_KEYS) or "=" not in item:
            parser.error(f"--set {item!r}: only finetune.KEY=VALUE, bf16.KEY=VALUE and optim.impl=VALUE are "
                         "accepted here (`rsclip-ds show-config` lists the keys)")
    try:
        load_config(None, sets)
    except ConfigError as err:
        parser.error(f"--set: {err}")


COMPARED = {"gpu": "accelerator-role params + grads (before step) + optimizer vs StateBytes.gpu",
            "offload": "offloaded-role bytes vs StateBytes.cpu_node / gpus per node "
                       "(only when that is the offloaded-states branch)",
            "activations": "saved-for-backward bytes of one micro-batch (towers, no loss, "
                           "no parameters) vs activation_bytes_per_sample x micro",
            "peaks": "per --accumulation K: the peak over the second optimizer step (GPU: "
                     "max_memory_allocated vs Peak.allocated; CPU ranks: VmHWM minus the resident set "
                     "before the model vs Peak.host; memory_peak.py), within PEAK_TOL",
            "not_compared": "buckets_*, persistent_gathered_bytes (ZeRO-3 params under "
                            "stage3_param_persistence_threshold), step_seconds"}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.combine:
        report = combine(args.combine, args.out)
        print(f"wrote {args.out}; all within target: {report['all_pass']}")
        return 0
    if args.accumulation:
        return main_peaks(args)
    with process_group(args.threads) as info:
        t0 = time.perf_counter()
        rows = []
        for name in args.profiles or runnable_profiles(info.on_gpu):
            row = run_profile(name, args, info.on_gpu)
            reduce_over_ranks(row)
            rows.append(row)
            rank0_print(info.rank)(f"{name}: gpu {row['gpu']['ratio']:.3f} offload {row['offload']['ratio']:.3f} "
                                   f"activations {row['activations']['ratio']:.3f}")
        finetune = load_config(None, args.set).finetune
        spec = memory.preset_spec(args.preset, finetune)
        config = {"preset": args.preset, "precision": args.precision, "micro": args.micro,
                  "steps": args.steps, "parameters": spec.params, "largest_layer": spec.largest_layer,
                  "model_tolerance": MODEL_TOL, "activation_tolerance": ACT_TOL}
        if args.set:   # the default report stays as it was
            config.update(set=args.set, finetune=finetune.model_dump(exclude_defaults=True),
                          trainable=spec.trainable)
        report = {"config": config,
                  "environment": environment(args.threads), "compared": COMPARED,
                  "profiles": rows, "seconds": time.perf_counter() - t0}
        report["all_pass"] = all(r["model_states_pass"] and r["activations_pass"] for r in rows)
        finish(report, args.out, info.rank, page_tables(memory_finetune, args.out.name), plot)
        rank0_print(info.rank)(f"wrote {args.out} in {report['seconds']:.0f}s; all within target: {report['all_pass']}")
    return 0


def main_peaks(args) -> int:
    """--accumulation: only the peaks (one engine per profile and K; see the module docstring)."""
    if not torch.cuda.is_available():
        tune_host_allocator()   # before anything large exists (memory_peak.py)
    with process_group(args.threads) as info:
        t0 = time.perf_counter()
        rows = []
        for name in args.profiles or runnable_profiles(info.on_gpu):
            rows.append({"profile": name, "peaks": [run_peak(name, args, info.on_gpu, k) for k in args.accumulation]})
            rank0_print(info.rank)(f"{name}:" + "".join(f" peak k={p['accumulation']} {p['ratio']:.3f}"
                                                        for p in rows[-1]["peaks"]))
        spec = memory.preset_spec(args.preset, load_config(None, args.set).finetune)
        report = {"config": {"preset": args.preset, "precision": args.precision, "micro": args.micro,
                             "parameters": spec.params, "peak_tolerance": PEAK_TOL, "set": args.set},
                  "environment": environment(args.threads), "compared": {"peaks": COMPARED["peaks"]},
                  "profiles": rows, "seconds": time.perf_counter() - t0}
        report["all_pass"] = all(p["pass"] for r in rows for p in r["peaks"])
        finish(report, args.out, info.rank, page_tables(memory_peak, "memory_peak_base.json"), plot_peak_report)
        rank0_print(info.rank)(f"wrote {args.out} in {report['seconds']:.0f}s; all within target: {report['all_pass']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

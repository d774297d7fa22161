"""Model-state and activation bytes per rank, measured on real engines against `rsclip_ds.memory`.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 benchmarks/memory.py --out benchmarks/results/memory.json
    deepspeed --num_gpus 8 benchmarks/memory.py --preset git-rsclip-base --precision bf16 --out ...

Writes the JSON given by --out and a PNG beside it (same name, .png); rank 0 prints the table.
On 2 CPU ranks of a 2-core machine the tiny preset takes ~1 minute, mostly engine builds.

For every profile in ds_profiles/ one process builds a fresh model and engine from a client-free
DeepSpeed config (`build_ds_config`, so the optimizer is the one users get), runs --steps train
steps on random batches of the preset's shapes, and in the last one counts, on each rank, the
bytes of the tensors the engine holds (each storage once, by data_ptr):

  parameters  ZeRO-1/2: the optimizer's flat 16-bit buffers `bit16_groups_flat` (the module's
              params are views of them); ZeRO-3: the partitions `p.ds_tensor`. ZeRO-3 also keeps
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
Peak memory: `ru_maxrss` of the process on CPU (monotonic over the run, so it is the peak *so
far*; profiles run in file order), `torch.cuda.max_memory_allocated` (reset per profile) on GPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common import environment, write_report
from common import max_over_ranks as common_max_over_ranks
from rsclip_ds import memory
from rsclip_ds.config import load_config
from rsclip_ds.engine import build_engine, engine_dtype
from rsclip_ds.losses import build_loss
from rsclip_ds.model import apply_activation_checkpointing, new_dual_encoder, preset_config
from rsclip_ds.profiles import (activation_checkpointing_enabled, available_profiles, build_ds_config,
                                load_profile)
from rsclip_ds.train import _inputs, train_step

MODEL_TOL, ACT_TOL = 0.10, 0.15
ROLES = ("params", "grads", "optimizer")


# --------------------------------------------------------------------------- counting

class Ledger:
    """Bytes by (role, place), each storage counted once (the first role that claims it wins:
    params, then grads, then optimizer, then buckets)."""

    def __init__(self):
        self.seen: set[int] = set()
        self.bytes: dict[tuple[str, str], int] = {}

    def add(self, role: str, place: str, tensors) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.numel() == 0:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in self.seen or storage.nbytes() == 0:
                continue
            self.seen.add(storage.data_ptr())
            self.bytes[role, place] = self.bytes.get((role, place), 0) + storage.nbytes()

    def get(self, role: str, place: str | None = None) -> int:
        return sum(v for (r, p), v in self.bytes.items() if r == role and place in (None, p))


def _flat(values) -> list:
    out = []
    for v in values or []:
        if isinstance(v, (list, tuple)):
            out += _flat(v)
        elif isinstance(v, dict):
            out += _flat(list(v.values()))
        elif v is not None:
            out.append(v)
    return out


def count_params(ledger: Ledger, engine, stage: int, place: str) -> int:
    """Partitions the engine owns; returns the bytes of ZeRO-3 persistent (gathered) params."""
    opt = engine.optimizer
    if stage < 3:
        ledger.add("params", place, _flat(opt.bit16_groups_flat))
        return 0
    params = list(engine.module.parameters())
    ledger.add("params", place, [p.ds_tensor for p in params])
    return sum(p.numel() * p.element_size() for p in params if getattr(p, "ds_persist", False))


def count_grads(ledger: Ledger, engine, stage: int, place: str) -> None:
    opt = engine.optimizer
    if stage < 3:
        ledger.add("grads", place, [p.grad for p in engine.module.parameters()])
        ledger.add("grads", place, [getattr(opt, "grads_in_partition", None)])
        ledger.add("grads", place, _flat(list(getattr(opt, "averaged_gradients", {}).values())))
        ledger.add("grads", place, [t.grad for t in opt.single_partition_of_fp32_groups])
    else:
        ledger.add("grads", place, [opt.grad_partitions_flat_buffer])
        ledger.add("grads", place, [t.grad for t in opt.fp32_partitioned_groups_flat])


def count_optimizer(ledger: Ledger, engine, stage: int, place: str) -> None:
    opt = engine.optimizer
    masters = opt.single_partition_of_fp32_groups if stage < 3 else opt.fp32_partitioned_groups_flat
    ledger.add("optimizer", place, masters)
    ledger.add("optimizer", place, _flat([dict(s) for s in opt.optimizer.state.values()]))


def count_buckets(ledger: Ledger, engine, place: str) -> None:
    opt = engine.optimizer
    for bucket in getattr(opt, "ipg_buckets", {}).values():
        ledger.add("buckets", place, _flat([bucket.buffer]))
    ledger.add("buckets", place, _flat(getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", [])))
    for name in ("temp_grad_buffer_for_cpu_offload", "temp_grad_buffer_for_gpu_offload"):
        ledger.add("buckets", place, [getattr(opt, name, None)])


class SavedActivations:
    """Bytes autograd saves for backward, by storage, minus the parameters' storages (looked up
    at pack time: ZeRO-3 gathers them into new storages during forward). `window()` starts a new
    count; the recompute of a checkpointed layer in backward opens one per layer."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.windows: list[dict[int, int]] = [{}]

    def window(self, *_) -> None:
        self.windows.append({})

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        params = {p.untyped_storage().data_ptr() for p in self.module.parameters()}
        params |= {p.ds_tensor.untyped_storage().data_ptr() for p in self.module.parameters()
                   if hasattr(p, "ds_tensor")}
        if storage.data_ptr() not in params:
            self.windows[-1][storage.data_ptr()] = storage.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)


# --------------------------------------------------------------------------- one profile

def make_batch(config, micro: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    size, length = config.vision_config.image_size, config.text_config.max_position_embeddings
    return {"pixel_values": torch.randn(micro, 3, size, size, generator=g),                 # (B,3,H,W)
            "input_ids": torch.randint(0, config.text_config.vocab_size, (micro, length), generator=g)}


def measured_step(engine, batch, loss_fn, dtype, stage: int, places: dict, checkpointing: bool):
    """train_step split open: count saved activations in forward (and the recompute in
    backward), gradients between backward and step, parameters and optimizer after step."""
    # the first submodule of each encoder layer: the layer's own pre-hooks do not fire when
    # reentrant checkpointing recomputes it in backward, its submodules' do
    layers = [m.layer_norm1 for tower in (engine.module.vision_model, engine.module.text_model)
              for m in tower.encoder.layers]
    saved = SavedActivations(engine.module)
    with saved.hooks():
        image, text, logit_scale, logit_bias = engine(*_inputs(engine, batch, dtype))   # (B,D) x2
        forward = sum(saved.windows[0].values())
        saved.window()   # the loss's own saved tensors are not activations of the towers
        loss = loss_fn(image, text, logit_scale, logit_bias)
        handles = [m.register_forward_pre_hook(saved.window) for m in layers] if checkpointing else []
        try:
            engine.backward(loss)
        finally:
            for h in handles:
                h.remove()
    recompute = max((sum(w.values()) for w in saved.windows[2:]), default=0)
    ledger = Ledger()
    count_params(ledger, engine, stage, places["params"])   # claim param storages before grads
    count_grads(ledger, engine, stage, places["grads"])
    grads = {place: ledger.get("grads", place) for place in ("gpu", "cpu")}
    engine.step()
    ledger = Ledger()
    persistent = count_params(ledger, engine, stage, places["params"])
    count_optimizer(ledger, engine, stage, places["optimizer"])
    count_buckets(ledger, engine, places["optimizer"] if stage < 3 else "gpu")
    held = {(role, place): ledger.get(role, place) for role in ("params", "optimizer", "buckets")
            for place in ("gpu", "cpu")}
    held.update({("grads", place): b for place, b in grads.items()})
    return held, persistent, forward + recompute, {"forward": forward, "largest_recompute": recompute}


def run_profile(name: str, args, rank: int, world: int, on_gpu: bool) -> dict:
    prof = load_profile(name)
    run = load_config(None, [f"precision={args.precision}", f"batch.micro_batch_size={args.micro}",
                             f"steps={args.steps + 1}", "optim.warmup_steps=0"])
    ds_config = build_ds_config(run, prof, world, on_gpu=on_gpu)
    config = preset_config(args.preset)
    checkpointing = activation_checkpointing_enabled(run, prof)
    model = new_dual_encoder(config, "siglip", seed=0)
    if checkpointing:
        apply_activation_checkpointing(model)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    engine = build_engine(model, ds_config)
    dtype = engine_dtype(engine)
    loss_fn = build_loss("siglip", negatives="global", rank=rank, world_size=world)
    places = {"params": "cpu" if prof.offload_param else "gpu",
              "grads": "cpu" if prof.offload_optimizer else "gpu",
              "optimizer": "cpu" if prof.offload_optimizer else "gpu"}
    times = []
    for step in range(args.steps):
        batch = make_batch(config, args.micro, seed=100 * step + rank)
        dist.barrier()
        t0 = time.perf_counter()
        train_step(engine, batch, loss_fn, dtype)
        times.append(time.perf_counter() - t0)
    held, persistent, act, act_parts = measured_step(engine, make_batch(config, args.micro, 99 + rank),
                                                     loss_fn, dtype, prof.stage, places, checkpointing)
    peak = torch.cuda.max_memory_allocated() if on_gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    spec = memory.preset_spec(args.preset)
    per_node = min(world, int(os.environ.get("LOCAL_SIZE", world)))
    states = memory.model_state_bytes(spec.params, spec.largest_layer, prof.stage, prof.offload_optimizer,
                                      prof.offload_param, args.precision, world, per_node,
                                      prof.strategy.get("zero_optimization"))
    act_pred = sum(memory.activation_bytes_per_sample(config, args.precision, checkpointing).values()) * args.micro
    del engine, model
    gc.collect()
    return compare(name, prof, spec, states, held, persistent, act, act_pred, act_parts, peak,
                   statistics.median(times[1:] or times), per_node, checkpointing)


def _ratio(measured: float, predicted: float) -> float:
    if predicted == 0:
        return 1.0 if measured == 0 else float("inf")
    return measured / predicted


def compare(name, prof, spec, states, held, persistent, act, act_pred, act_parts, peak, step_s,
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
        "peak_bytes": peak, "step_seconds": step_s,
    }
    row["offload"]["comparable"] = row["offload"]["cpu_term"] != "fp32 build copy"
    ok_gpu = abs(row["gpu"]["ratio"] - 1) <= MODEL_TOL
    ok_cpu = not row["offload"]["comparable"] or abs(row["offload"]["ratio"] - 1) <= MODEL_TOL
    row["model_states_pass"] = bool(ok_gpu and ok_cpu)
    row["activations_pass"] = bool(abs(row["activations"]["ratio"] - 1) <= ACT_TOL)
    return row


def max_over_ranks(row: dict) -> dict:
    """Byte counts and times: the largest rank's (partitions differ by padding only)."""
    keys = [("gpu", "measured"), ("offload", "measured"), ("activations", "measured")]
    vals = [float(row[a][b]) for a, b in keys] + [float(row["peak_bytes"]), row["step_seconds"]] + \
        [float(v) for v in row["measured"].values()]
    return common_max_over_ranks(vals)


# --------------------------------------------------------------------------- report

def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    mib = 2**20
    table = Table(title=f"{report['config']['preset']} {report['config']['precision']}, "
                        f"{report['environment']['world_size']} ranks: per rank, MiB (max over ranks)")
    for col in ("profile", "gpu pred", "gpu meas", "ratio", "offl pred", "offl meas", "ratio",
                "states", "act pred", "act meas", "ratio", "act", "persist", "peak", "step ms"):
        table.add_column(col, justify="right")
    for r in report["profiles"]:
        g, o, a = r["gpu"], r["offload"], r["activations"]
        table.add_row(r["profile"], f"{g['predicted'] / mib:.3f}", f"{g['measured'] / mib:.3f}",
                      f"{g['ratio']:.3f}", f"{o['predicted'] / mib:.3f}", f"{o['measured'] / mib:.3f}",
                      f"{o['ratio']:.3f}" + ("" if o["comparable"] else "*"),
                      "PASS" if r["model_states_pass"] else "FAIL",
                      f"{a['predicted'] / mib:.3f}", f"{a['measured'] / mib:.3f}", f"{a['ratio']:.3f}",
                      "PASS" if r["activations_pass"] else "FAIL",
                      f"{r['persistent_gathered_bytes'] / mib:.3f}", f"{r['peak_bytes'] / mib:.0f}",
                      f"{r['step_seconds'] * 1e3:.1f}")
    Console(width=200).print(table)


def plot(report: dict, path: Path) -> str | None:
    try:
        import matplotlib
    except ImportError:
        print("note: matplotlib is not installed (pip install rsclip_ds[bench]); wrote the JSON only")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.suptitle(f"{cfg['preset']} {cfg['precision']}, micro {cfg['micro']}, {env['world_size']} ranks "
                 f"({env['device']}); label = measured / predicted")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# --------------------------------------------------------------------------- entry point

def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON path; the PNG goes beside it")
    parser.add_argument("--preset", default="tiny", help="model preset (rsclip_ds.model.PRESETS)")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--micro", type=int, default=4, help="samples per rank per micro-batch")
    parser.add_argument("--steps", type=int, default=3, help="train steps before the measured one")
    parser.add_argument("--profiles", nargs="*", default=None, help="default: every ds_profiles/*.json")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import logging

    from rsclip_ds.distributed import destroy_distributed, init_distributed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)   # 2 ranks on 2 cores: 1 thread each, no oversubscription
    info = init_distributed()
    try:
        rank, world = info.rank, info.world_size
        t0 = time.perf_counter()
        rows = []
        for name in args.profiles or available_profiles():
            row = run_profile(name, args, rank, world, info.on_gpu)
            flat = max_over_ranks(row)
            row["gpu"]["measured"], row["offload"]["measured"], row["activations"]["measured"] = map(int, flat[:3])
            row["peak_bytes"], row["step_seconds"] = int(flat[3]), flat[4]
            row["measured"] = dict(zip(row["measured"], map(int, flat[5:])))
            for key in ("gpu", "offload", "activations"):
                row[key]["ratio"] = _ratio(row[key]["measured"], row[key]["predicted"])
            rows.append(row)
            if rank == 0:
                print(f"{name}: gpu {row['gpu']['ratio']:.3f} offload {row['offload']['ratio']:.3f} "
                      f"activations {row['activations']['ratio']:.3f}", flush=True)
        spec = memory.preset_spec(args.preset)
        report = {"config": {"preset": args.preset, "precision": args.precision, "micro": args.micro,
                             "steps": args.steps, "parameters": spec.params, "largest_layer": spec.largest_layer,
                             "model_tolerance": MODEL_TOL, "activation_tolerance": ACT_TOL},
                  "environment": environment(world, args.threads),
                  "compared": {"gpu": "accelerator-role params + grads (before step) + optimizer vs StateBytes.gpu",
                               "offload": "offloaded-role bytes vs StateBytes.cpu_node / gpus per node "
                                          "(only when that is the offloaded-states branch)",
                               "activations": "saved-for-backward bytes of one micro-batch (towers, no loss, "
                                              "no parameters) vs activation_bytes_per_sample x micro",
                               "not_compared": "buckets_*, persistent_gathered_bytes (ZeRO-3 params under "
                                               "stage3_param_persistence_threshold), peak_bytes, step_seconds"},
                  "profiles": rows, "seconds": time.perf_counter() - t0}
        report["all_pass"] = all(r["model_states_pass"] and r["activations_pass"] for r in rows)
        if rank == 0:
            write_report(report, args.out, plot, print_table)
            print(f"wrote {args.out} in {report['seconds']:.0f}s; all within target: {report['all_pass']}")
        dist.barrier()
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Bytes each rank sends per optimizer step, logged on real engines, against `rsclip_ds.planning.comms`.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module benchmarks.comms.traffic --out benchmarks/results/comms_w2.json
    DS_ACCELERATOR=cpu deepspeed --num_gpus 3 --module benchmarks.comms.traffic --out benchmarks/results/comms_w3.json
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module benchmarks.comms.traffic --bucket 1000000 --out /tmp/comms_b1m.json
    # hpZ: zero3 with zero_hpz_partition_size 2 on 4 ranks (two "nodes" of 2), beside plain zero3 (~5 min)
    DS_ACCELERATOR=cpu deepspeed --num_gpus 4 --module benchmarks.comms.traffic --profiles zero3+hpz2 zero3 --hidden 256 \
        --out benchmarks/results/comms_w4_hpz.json

For every profile in ds_profiles/ (a copy with DeepSpeed's comms logger switched on:
`"comms_logger": {"enabled": true, "prof_all": true}`; --bucket also shrinks its bucket sizes)
and every case (accumulation 1; accumulation 4 with the 'plain' and the 'global' loop), the
process builds the run `rsclip_ds.assembly.Trainer` builds (model through the `model=` seam: a
SigLIP of two 2-layer towers, hidden --hidden, ~9.5M parameters at 384, whose 1024 x 384 and
larger matrices are above ZeRO-3's persistence threshold and its biases below it; random
batches through `loader=`), runs one optimizer step (ZeRO-3 records its parameter trace; the
engine's initial broadcasts happened in the build), clears the log, then runs --steps optimizer
steps with `rsclip_ds.loop.optimizer_step` (the train loop's own step) and divides by --steps:
  logged    DeepSpeed's comms logger (`deepspeed.comm.comms_logger.get_raw_data()`): every
            collective DeepSpeed issues through deepspeed.comm, as message bytes (the size of
            the tensor argument: all-reduce / reduce-scatter input, all-gather this rank's shard)
  c10d      the torch profiler's `gloo:*` events over the same steps: every collective and send
            on the process group, DeepSpeed's and the loss's, by the bytes of its input
            tensors (receives not counted); it shows what gloo ran: reduce_scatter_tensor runs
            as an all-reduce of the whole input there, the loss's ring as sends
against `rsclip_ds.planning.comms.step_traffic` in the message convention: the engine's collectives
(logged) and the engine's + the loss's (c10d). Target: both within 5%. Ratios are measured /
predicted; bytes are the largest rank's (partitions differ by padding). Writes the JSON given
by --out; rank 0 prints the table. ~2 minutes on 2 CPU ranks of a 2-core machine (15 builds).

Of the hybrid ZeRO-3 strategies only hpZ runs on CPU ranks: qwZ and qgZ quantise with DeepSpeed's
CUDA QuantizerBuilder op, and DeepSpeed 0.19.8 removed MiCS (`mics_shard_size` is a
DeepSpeedConfigError).

--precision amp_bf16 (fp32 weights, torch.autocast): DeepSpeed's ZeRO reduces the gradients of the
Linear/Conv parameters in bf16 and the rest in fp32 (`comm_dtype` per parameter), the model splits each
gradient collective the same way (`comms.step_traffic(autocast=Ψ_a)`, Ψ_a counted here on the model);
ZeRO-3 also all-gathers the Linear/Conv weights in bf16.
The ddp profile (stage 0) reduces with rsclip_ds.gradients, through torch.distributed: DeepSpeed's comms
logger sees none of it (its `engine` part is then 0 against 0), the torch profiler's `c10d` part all of it.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module benchmarks.comms.traffic --precision amp_bf16 \
        --profiles ddp zero1 zero2 zero3 --accumulation 1 4 --modes plain \
        --out benchmarks/results/comms_w2_amp_bf16.json
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.harness import base_parser, environment, finish, max_over_ranks, page_tables, process_group, rank0_print
from benchmarks.results_tables.comms import comms_tables
from rsclip_ds.planning import comms
from rsclip_ds.config import load_config
from rsclip_ds.engine import engine_dtype
from rsclip_ds.hub import ModelSource
from rsclip_ds.model import IMAGE_MEAN, IMAGE_STD, ModelBundle, new_dual_encoder
from rsclip_ds.planning.memory import autocast_elements
from rsclip_ds.profiles import load_profile, runnable_profiles
from rsclip_ds.loop import optimizer_step
from rsclip_ds.assembly import Trainer

TOL = 0.05
IMAGE, PATCH, TOKENS, VOCAB = 32, 8, 16, 1000
# DeepSpeed's logged op names -> the model's collectives
DS_OPS = {"all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "inference_all_reduce": "all_reduce",
          "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter": "reduce_scatter",
          "all_gather_into_tensor": "all_gather", "all_gather": "all_gather", "reduce": "reduce",
          "broadcast": "broadcast", "all_to_all_single": "all_to_all", "send": "send", "isend": "send",
          "batch_isend_irecv": "send", "barrier": "barrier"}
# torch profiler event -> collective; gloo:recv is the other end of a send, not counted
GLOO_OPS = {"gloo:all_reduce": "all_reduce", "gloo:all_gather": "all_gather", "gloo:reduce_scatter": "reduce_scatter",
            "gloo:broadcast": "broadcast", "gloo:send": "send", "gloo:scatter": "all_to_all", "gloo:reduce": "reduce",
            "gloo:gather": "gather"}
ITEMSIZE = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4,
            "unsigned char": 1, "signed char": 1, "bool": 1, "short int": 2}


def siglip_config(hidden: int):
    """Two 2-layer towers of width `hidden` (head dim 64), 32 px images in 16 patches, 16 tokens."""
    from transformers import SiglipConfig

    shape = dict(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=2,
                 num_attention_heads=max(1, hidden // 64))
    return SiglipConfig(text_config={**shape, "max_position_embeddings": TOKENS, "vocab_size": VOCAB,
                                     "pad_token_id": 1, "bos_token_id": None, "eos_token_id": 1},
                        vision_config={**shape, "image_size": IMAGE, "patch_size": PATCH})


def random_batches(micro: int, rank: int):
    """The Trainer's loader: endless random batches of the model's shapes, different per rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    while True:
        yield {"pixel_values": torch.randn(micro, 3, IMAGE, IMAGE, generator=g),            # (B,3,H,W)
               "input_ids": torch.randint(0, VOCAB, (micro, TOKENS), generator=g)}          # (B,L)


def split_hpz(name: str) -> tuple[str, int]:
    """'zero3+hpz2' -> ('zero3', 2): a ZeRO-3 profile with zero_hpz_partition_size 2; 'zero3' -> ('zero3', 1)."""
    base, _, hpz = split_precision(name, "")[0].partition("+hpz")
    return base, int(hpz or 1)


def split_precision(name: str, default: str) -> tuple[str, str]:
    """'zero2@amp_bf16' -> ('zero2', 'amp_bf16'): a case in another precision than --precision (so that one launch
    measures both, without another launch's start-up); 'zero2' -> ('zero2', default)."""
    base, _, precision = name.partition("@")
    return base, precision or default


def run_order(names: list[str]) -> list[str]:
    """hpZ cases last: DeepSpeed 0.19.8 keeps the hpZ group it creates in a module global
    (`groups._ZERO_PARAM_INTRA_PARALLEL_GROUP`) and hands it to every later ZeRO-3 engine of the
    process, so a plain zero3 built after an hpZ one gathers from the secondary too (measured)."""
    return sorted(names, key=lambda n: split_hpz(n)[1] > 1)


def logged_profile(name: str, folder: Path, bucket: int | None) -> Path:
    """A copy of the shipped profile with the comms logger on (and its buckets at `bucket`);
    'NAME+hpzH' adds zero_hpz_partition_size H (hpZ's secondary partition over groups of H ranks)."""
    base, hpz = split_hpz(name)
    raw = json.loads(load_profile(base).path.read_text())
    raw["comms_logger"] = {"enabled": True, "prof_all": True, "verbose": False, "debug": False}
    if hpz > 1:
        raw["zero_optimization"]["zero_hpz_partition_size"] = hpz
    if bucket:
        zero = raw["zero_optimization"]
        for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"):
            if key in zero:
                zero[key] = bucket
    path = folder / f"{name.replace('+', '_').replace('@', '_')}.json"
    path.write_text(json.dumps(raw))
    return path


def logged_bytes(raw: dict) -> tuple[dict[str, float], dict[str, int]]:
    """comms logger data {name: {msg_size: [count, ...]}} -> bytes and calls per collective."""
    size: dict[str, float] = {}
    calls: dict[str, int] = {}
    for name, by_size in raw.items():
        op = DS_OPS.get(name.split(" |")[0], name)
        for msg, (count, *_) in by_size.items():
            size[op] = size.get(op, 0.0) + msg * count
            calls[op] = calls.get(op, 0) + count
    return size, calls


def c10d_bytes(events) -> dict[str, float]:
    """Bytes of the input tensors of every gloo collective / send the profiler saw."""
    out: dict[str, float] = {}
    for e in events:
        op = GLOO_OPS.get(e.name)
        if op is None:
            continue
        nbytes = sum(ITEMSIZE[dtype] * _numel(shape) for shape, dtype in zip(e.input_shapes, e.input_dtypes)
                     if dtype)
        out[op] = out.get(op, 0.0) + nbytes
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def layer_elements(model, threshold: int) -> int:
    """Elements of the encoder layers' parameters above the persistence threshold (what
    activation checkpointing recomputes, of what ZeRO-3 gathers)."""
    layers = [*model.vision_model.encoder.layers, *model.text_model.encoder.layers]
    return sum(p.numel() for layer in layers for p in layer.parameters() if p.numel() > threshold)


def run_case(name: str, k: int, mode: str, args, folder: Path) -> dict:
    """One profile and accumulation: build, one step, then --steps measured optimizer steps."""
    import deepspeed.comm as ds_comm

    rank = dist.get_rank()
    precision = split_precision(name, args.precision)[1]
    run = load_config(None, [f"profile={logged_profile(name, folder, args.bucket)}", f"precision={precision}",
                             f"batch.micro_batch_size={args.micro}", f"batch.gradient_accumulation_steps={k}",
                             f"batch.accumulation={mode}", f"steps={args.steps + 2}", "optim.warmup_steps=0",
                             f"loss.name={args.loss}", f"output_dir={folder / 'run'}", "checkpoint.at_end=false"])
    config = siglip_config(args.hidden)
    model = new_dual_encoder(config, args.loss, seed=0)
    sizes = [p.numel() for p in model.parameters()]                # before ZeRO-3 partitions them
    zero = load_profile(run.profile).strategy["zero_optimization"]   # with hpZ's group size if set
    threshold = int(zero.get("stage3_param_persistence_threshold", 1e5))
    in_layers = layer_elements(model, threshold)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    low = autocast_elements(model)   # Ψ_a: the gradients on the 16-bit wire under autocast
    low_all, low_small = (autocast_elements(model, trainable=False, at_most=n) for n in (None, threshold))
    bundle = ModelBundle(model, None, IMAGE, IMAGE_MEAN, IMAGE_STD, TOKENS, ModelSource("preset", "comms-bench"))
    with Trainer(run, model=bundle, loader=random_batches(args.micro, rank)) as trainer:
        parts = trainer.build()
        engine, batches, prof = parts.engine, iter(parts.loader), trainer.profile
        dtype = engine_dtype(engine)
        optimizer_step(engine, batches, parts.loss_fn, parts.batch, mode, dtype)   # ZeRO-3 records its trace
        ds_comm.reset_log()
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as tp:
            for _ in range(args.steps):
                optimizer_step(engine, batches, parts.loss_fn, parts.batch, mode, dtype)
        seconds = (time.perf_counter() - t0) / args.steps
        logged, calls = logged_bytes(ds_comm.comms_logger.get_raw_data())
        seen = c10d_bytes(tp.events())
        optimizer = type(engine.optimizer).__name__
        checkpointing = parts.activation_checkpointing
        ds_comm.reset_log()
        del parts, engine, batches
    persistent = comms.persistent_elements(sizes, threshold) if prof.stage == 3 else 0
    checkpointed = in_layers if checkpointing else 0
    loss = comms.LossTraffic(args.loss, "global", args.micro, config.vision_config.hidden_size)
    step = comms.step_traffic(sum(sizes), trainable, stage=prof.stage, world=dist.get_world_size(),
                              accumulation=k, precision=precision, zero=zero, persistent=persistent,
                              accumulation_mode=mode, checkpointed=checkpointed, autocast=low,
                              autocast_all=low_all, autocast_persistent=low_small if prof.stage == 3 else 0)
    # stage 0's gradients are rsclip_ds's own all-reduce (rsclip_ds.gradients): not DeepSpeed's, not logged
    engine_traffic, ours = ([], step) if prof.stage == 0 else (step, [])
    loss_part = ours + comms.loss_traffic(loss, dist.get_world_size(), k, mode)
    row = compare(name, prof, k, mode, engine_traffic, loss_part, logged, calls, seen, seconds, optimizer,
                  sum(sizes), trainable, persistent, args.steps)
    row["activation_checkpointing"] = checkpointing
    row.update(precision=precision, autocast_elements=low)
    return row


def compare(name, prof, k, mode, engine_traffic, loss_part, logged, calls, seen, seconds, optimizer,
            params, trainable, persistent, steps) -> dict:
    """``engine_traffic``: DeepSpeed's collectives (its comms logger's); ``loss_part``: the rest the torch
    profiler sees, the loss's and stage 0's rsclip_ds all-reduce."""
    world = dist.get_world_size()
    ops = sorted(set(logged) | set(seen) | {t.op for t in engine_traffic + loss_part})
    # measured per step, the largest rank's
    flat = max_over_ranks([logged.get(op, 0.0) / steps for op in ops] + [seen.get(op, 0.0) / steps for op in ops]
                          + [calls.get(op, 0) / steps for op in ops])
    logged_ps, seen_ps, calls_ps = (dict(zip(ops, flat[i * len(ops):(i + 1) * len(ops)])) for i in range(3))
    pred_engine = comms.by_collective(engine_traffic, world, "message")
    pred_all = comms.by_collective(engine_traffic + loss_part, world, "message")
    on_gloo = dict(pred_all)   # gloo runs reduce_scatter_tensor as an all-reduce of the whole input
    if dist.get_backend() == "gloo" and "reduce_scatter" in on_gloo:
        on_gloo["all_reduce"] = on_gloo.get("all_reduce", 0.0) + on_gloo.pop("reduce_scatter")
        if "loss feature gradients" in {t.what for t in loss_part}:   # torch's gloo fallback: all-to-all
            rs = sum(t.size for t in loss_part if t.op == "reduce_scatter")
            on_gloo["all_reduce"] -= rs
            on_gloo["all_to_all"] = on_gloo.get("all_to_all", 0.0) + rs
    scalar = ("barrier",)
    logged_total = sum(v for op, v in logged_ps.items() if op not in scalar)
    row = {
        "profile": name, "stage": prof.stage, "offload_optimizer": prof.offload_optimizer,
        "offload_param": prof.offload_param, "accumulation": k, "mode": mode, "optimizer": optimizer,
        "hpz": split_hpz(name)[1],
        "parameters": params, "trainable": trainable, "persistent": persistent,
        "engine": {"predicted": sum(pred_engine.values()), "logged": logged_total,
                   "by_op": {op: {"predicted": pred_engine.get(op, 0.0), "logged": logged_ps.get(op, 0.0),
                                  "calls_logged": calls_ps.get(op, 0.0)} for op in ops}},
        "c10d": {"predicted": sum(on_gloo.values()), "seen": sum(seen_ps.values()),
                 "by_op": {op: {"predicted": on_gloo.get(op, 0.0), "seen": seen_ps.get(op, 0.0)} for op in ops}},
        "ring_bytes_per_rank": comms.by_collective(engine_traffic + loss_part, world, "ring"),
        "calls_predicted": {t.what: t.calls for t in engine_traffic + loss_part},
        "step_seconds": seconds,
    }
    for key, measured in (("engine", "logged"), ("c10d", "seen")):
        part = row[key]
        # nothing predicted and nothing logged (stage 0: DeepSpeed sends none of the gradients) is a match
        part["ratio"] = part[measured] / part["predicted"] if part["predicted"] else (
            1.0 if part[measured] == 0 else float("nan"))
        part["pass"] = bool(abs(part["ratio"] - 1) <= TOL)
    return row


# --------------------------------------------------------------------------- report

def parse_args(argv):
    parser = base_parser(__doc__)
    parser.add_argument("--profiles", nargs="*", default=None,
                        help="default: every ds_profiles/*.json; NAME+hpzH: a ZeRO-3 profile with hpZ over H ranks "
                             "(e.g. zero3+hpz2 on 4 ranks: two 'nodes' of 2), run after the others; NAME@PRECISION: in "
                             "that precision instead of --precision (e.g. zero2@amp_bf16)")
    parser.add_argument("--accumulation", nargs="+", type=int, default=[1, 4], help="micro-batches per step")
    parser.add_argument("--modes", nargs="+", default=["plain", "global"], choices=("plain", "global"),
                        help="accumulation loops for accumulation > 1 (at 1 they are the same step)")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32", "amp_bf16"),
                        help="amp_bf16: fp32 weights under torch.autocast, gradients on the wire per parameter")
    parser.add_argument("--loss", default="siglip", choices=("siglip", "clip"))
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=384, help="tower width (2 layers each)")
    parser.add_argument("--steps", type=int, default=2, help="measured optimizer steps per case")
    parser.add_argument("--bucket", type=int, default=None,
                        help="reduce / allgather / prefetch bucket size in elements (default: the profile's)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    with process_group(args.threads) as info, tempfile.TemporaryDirectory() as tmp:
        t0, rows = time.perf_counter(), []
        for name in run_order(args.profiles or runnable_profiles(info.on_gpu)):
            for k in args.accumulation:
                for mode in (args.modes if k > 1 else ["plain"]):
                    row = run_case(name, k, mode, args, Path(tmp))
                    rows.append(row)
                    rank0_print(info.rank)(f"{name} k={k} {mode}: engine {row['engine']['ratio']:.4f} "
                                           f"c10d {row['c10d']['ratio']:.4f}")
        report = {"config": {"precision": args.precision, "loss": args.loss, "micro": args.micro,
                             "hidden": args.hidden, "steps": args.steps, "bucket": args.bucket,
                             "parameters": rows[0]["parameters"], "tolerance": TOL},
                  "environment": environment(args.threads), "rows": rows,
                  "seconds": time.perf_counter() - t0}
        report["all_pass"] = all(r["engine"]["pass"] and r["c10d"]["pass"] for r in rows)
        finish(report, args.out, info.rank, page_tables(comms_tables, args.out.name))
        rank0_print(info.rank)(f"wrote {args.out} in {report['seconds']:.0f}s; all within {TOL:.0%}: "
                               f"{report['all_pass']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

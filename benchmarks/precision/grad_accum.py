"""bf16 gradient accumulation in bf16 vs fp32, against the fp32 big-batch gradient.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module benchmarks.precision.grad_accum --out benchmarks/results/grad_accum.json

For every profile in ds_profiles/ and every case below, the process builds an engine from the
DeepSpeed config `rsclip_ds.profiles.build_ds_config` makes for a bf16 run (so the
`data_types.grad_accum_dtype` our config chose is what DeepSpeed gets), with one change that
makes the update the gradient: a client SGD with lr=1, no momentum, no decay, no clipping, no
schedule (as tests/integration/parity_worker.py does). It runs one optimizer step of k = --k
micro-batches of --micro samples per rank with the 'global' accumulation loop (the big-batch
SigLIP loss over all k x micro x world samples) on the `tiny` preset, and compares minus the
change of the fp32 master weights (`deepspeed.utils.safe_get_full_fp32_param`) with the gradient
of the same loss on the whole batch computed in fp32 by one process. Cases:
  accum bf16       grad_accum_dtype bf16 (DeepSpeed's bf16 default)
  accum fp32       grad_accum_dtype fp32, gradients reduced in bf16
  accum fp32/comm fp32   the same with communication_data_type fp32
  auto             bf16.grad_accum_dtype=auto, the default: the profile's choice
Reported per case:
  rel_err          ||g - g_ref|| / ||g_ref|| over all trainable parameters
  rel_err_towers   the same over the towers' parameters (logit scale and bias left out)
  zero_update      parameters whose update is exactly 0 although their reference gradient is not
                   (a lost gradient, not a rounding error)
  accum_err        bf16 case only: ||g_bf16 accumulation - g_fp32 accumulation|| / ||g_ref|| over the
                   towers: the part of the error that the accumulation dtype makes
and what reached the engine: the optimizer class, the dtype and bytes per trainable parameter of
the buffer that accumulates this rank's gradients (inspected after one more backward). ~30 s.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.harness import base_parser, environment, finish, process_group, rank0_print
from rsclip_ds.config import load_config
from rsclip_ds.losses import LOSSES, build_loss
from rsclip_ds.model import new_dual_encoder, preset_config
from rsclip_ds.profiles import build_ds_config, load_profile, runnable_profiles
from rsclip_ds.train import train_step_global

SEED = 0
CASES = (  # name, bf16.grad_accum_dtype, communication_data_type
    ("accum bf16", "bf16", None),
    ("accum fp32", "fp32", None),
    ("accum fp32/comm fp32", "fp32", "fp32"),
    ("auto", "auto", None),   # what a run gets by default
)


def batch(n: int, config) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    size, length = config.vision_config.image_size, config.text_config.max_position_embeddings
    return (torch.randn(n, 3, size, size, generator=g),                                  # (N,3,H,W)
            torch.randint(0, config.text_config.vocab_size, (n, length), generator=g))   # (N,L)


def reference_grads(config, pixels, ids) -> list[torch.Tensor]:
    """fp32, one process, the whole batch: the gradient every case is compared with."""
    model = new_dual_encoder(config, "siglip", SEED)
    LOSSES["siglip"](*model(pixels, ids)).backward()
    return [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]


def ds_config(profile: str, accum: str, comm: str | None, micro: int, k: int, world: int, folder: Path) -> dict:
    """Our config for a bf16 run of this profile, made an SGD(lr=1) config (update = gradient)."""
    run = load_config(None, [f"profile={profile}", "precision=bf16", f"bf16.grad_accum_dtype={accum}",
                             f"batch.micro_batch_size={micro}", f"batch.gradient_accumulation_steps={k}",
                             "batch.accumulation=global", "steps=2", "optim.warmup_steps=0",
                             f"distributed.communication_data_type={comm or 'auto'}"])
    config = build_ds_config(run, load_profile(profile), world, on_gpu=False)
    config.pop("optimizer")
    config.update(gradient_clipping=0.0, zero_allow_untested_optimizer=True, zero_force_ds_cpu_optimizer=False)
    return config


def fp32_masters(engine) -> list[torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    return [safe_get_full_fp32_param(p).detach().clone() for p in engine.module.parameters() if p.requires_grad]


def accumulation_buffer(opt) -> torch.Tensor | None:
    """The tensor that holds this rank's accumulated gradients, by optimizer: BF16_Optimizer's fp32
    copy, ZeRO-3's flat partition, ZeRO-1/2's fp32 partition buffer (grad_accum fp32), or its
    16-bit partition; None where none is held between backward and step (ZeRO-2 offload, bf16)."""
    if hasattr(opt, "fp32_groups_gradients_flat"):
        return torch.cat([t.view(-1) for t in opt.fp32_groups_gradients_flat])
    if getattr(opt, "grad_partitions_flat_buffer", None) is not None:
        return opt.grad_partitions_flat_buffer
    groups = [g for g in getattr(opt, "averaged_gradients", {}).values() if hasattr(g, "flat_partition")]
    if groups:
        return torch.cat([g.flat_partition.view(-1) for g in groups])
    return getattr(opt, "grads_in_partition", None)


def run_case(profile: str, case: tuple, args, ref: list[torch.Tensor], folder: Path) -> dict:
    import deepspeed

    name, accum, comm = case
    rank, world = dist.get_rank(), dist.get_world_size()
    k, micro = args.k, args.micro
    config_tiny = preset_config("tiny")
    pixels, ids = batch(args.micro * args.k * world, config_tiny)
    mine = slice(rank * micro * k, (rank + 1) * micro * k)
    batches = [{"pixel_values": p, "input_ids": i} for p, i in zip(pixels[mine].split(micro), ids[mine].split(micro))]
    model = new_dual_encoder(config_tiny, "siglip", SEED)
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    trainable = sum(p.numel() for p in params)   # before ZeRO-3 partitions them
    config = ds_config(profile, accum, comm, micro, k, world, folder)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(params, lr=1.0), config=config)
    before = fp32_masters(engine)
    loss_fn = build_loss("siglip", negatives="global", rank=rank, world_size=world)
    train_step_global(engine, batches, loss_fn, torch.bfloat16)
    grads = [b - a for b, a in zip(before, fp32_masters(engine))]
    # one more backward, no step: the accumulation buffer exists now
    image, text, scale, bias = engine(batches[0]["pixel_values"].to(torch.bfloat16), batches[0]["input_ids"])
    engine.backward(loss_fn(image, text, scale, bias))
    buf, opt = accumulation_buffer(engine.optimizer), engine.optimizer
    towers = [i for i, n in enumerate(names) if n.startswith(("vision_model.", "text_model."))]
    row = {"profile": profile, "case": name, "k": k, "micro": micro, "grad_accum_dtype": accum,
           "communication_data_type": comm or "bf16", "data_types": config.get("data_types"),
           "optimizer": type(opt).__name__,
           "buffer_dtype": str(buf.dtype).removeprefix("torch.") if buf is not None else None,
           "buffer_bytes_per_trainable_param": (buf.numel() * buf.element_size() / trainable) if buf is not None else 0.0,
           "rel_err": rel_err(grads, ref), "rel_err_towers": rel_err(grads, ref, towers),
           "zero_update": [n for n, g, r in zip(names, grads, ref) if not g.any() and r.any()]}
    engine.destroy()
    return row, [grads[i] for i in towers]


def rel_err(got: list[torch.Tensor], ref: list[torch.Tensor], keep: list[int] | None = None) -> float:
    """||got - ref|| / ||ref|| over the parameters `keep` (all by default), as one vector."""
    keep = range(len(ref)) if keep is None else keep
    err = sum(float((got[i] - ref[i]).double().pow(2).sum()) for i in keep)
    return (err / sum(float(ref[i].double().pow(2).sum()) for i in keep)) ** 0.5


def trainable_names(config) -> list[tuple[str, int]]:
    model = new_dual_encoder(config, "siglip", SEED)
    return [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]


def _norm(tensors: list[torch.Tensor]) -> float:
    return sum(float(t.double().pow(2).sum()) for t in tensors) ** 0.5


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg = report["config"]
    table = Table(title=f"tiny, bf16, {report['environment']['world_size']} ranks, micro {cfg['micro']} x k "
                        f"{cfg['k']} per rank: gradient vs fp32 big batch (relative L2 error)")
    for col in ("profile", "case", "rel err", "towers", "accum err", "zero update", "optimizer", "buffer",
                "bytes/param"):
        table.add_column(col, justify="right")
    for r in report["rows"]:
        accum = f"{r['accum_err']:.2e}" if "accum_err" in r else ""
        table.add_row(r["profile"], r["case"], f"{r['rel_err']:.2e}", f"{r['rel_err_towers']:.2e}", accum,
                      ", ".join(r["zero_update"]) or "-", r["optimizer"], str(r["buffer_dtype"]),
                      f"{r['buffer_bytes_per_trainable_param']:.2f}")
    Console(width=200).print(table)


def parse_args(argv=None) -> argparse.Namespace:
    parser = base_parser(__doc__)
    parser.add_argument("--profiles", nargs="*", default=None, help="default: every ds_profiles/*.json")
    parser.add_argument("--k", type=int, default=8, help="micro-batches per optimizer step")
    parser.add_argument("--micro", type=int, default=4, help="samples per rank per micro-batch")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    with process_group(args.threads) as info, tempfile.TemporaryDirectory() as tmp:
        t0, rows = time.perf_counter(), []
        config = preset_config("tiny")
        ref = reference_grads(config, *batch(args.micro * args.k * info.world_size, config))
        towers_ref = [r for (n, _), r in zip(trainable_names(config), ref) if n.startswith(("vision_", "text_"))]
        for profile in args.profiles or runnable_profiles(on_gpu=False):   # its configs are CPU ones
            grads = {}
            for case in CASES:
                row, grads[case[0]] = run_case(profile, case, args, ref, Path(tmp))
                rows.append(row)
                rank0_print(info.rank)(f"{profile} {case[0]}: {row['rel_err_towers']:.3e} ({row['optimizer']}, "
                                       f"{row['buffer_dtype']})")
            by_case = {r["case"]: r for r in rows[-len(CASES):]}
            diff = [b - f for b, f in zip(grads["accum bf16"], grads["accum fp32"])]
            by_case["accum bf16"]["accum_err"] = _norm(diff) / _norm(towers_ref)
        report = {"config": {"preset": "tiny", "k": args.k, "micro": args.micro, "loss": "siglip global",
                             "accumulation": "global"},
                  "environment": environment(args.threads), "rows": rows, "seconds": time.perf_counter() - t0}
        finish(report, args.out, info.rank, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

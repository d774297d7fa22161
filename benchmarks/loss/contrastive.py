"""Memory and time of the global-batch contrastive losses and of the accumulation modes.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module benchmarks.loss.contrastive --out benchmarks/results/contrastive.json
    python -m benchmarks.loss.contrastive --tiny --out /tmp/contrastive.json     # 1 rank, seconds

Writes the JSON given by --out and a PNG beside it (same name, .png); rank 0 prints the tables.
The full run takes ~4 minutes on 2 CPU ranks of a 2-core machine (3m20 measuring, the rest
start-up); --tiny ~1 minute, mostly start-up and engine builds. Times are noisy on a shared
machine; the byte counts are deterministic.

(a) Loss forms vs global batch B (random L2-normalised features of width D=768, the base tower's):
    per rank, the bytes autograd saves for backward during the loss forward (+ for the chunked
    ring, the one logit block that backward recomputes at a time), and forward+backward time.
    Expect on W ranks: naive builds (B, B) logits on every rank, ring / local-loss (B/W, B), so
    naive/ring bytes -> W as B grows (2 ranks: 3.2 at B=128, 2.09 at 4096; gathered features of
    width D weigh in at small B); clip naive/local climbs towards W more slowly (1.05 -> 1.64:
    both forms hold the gathered (B, D) features); naive/chunked ring -> 4 W^2 (17.5 at 4096).
    Time naive/ring ~2.5 from B=512 on; the chunked ring pays one recompute (naive/chunked ~2.5).
(b) Accumulation with a small SigLIP dual encoder under ZeRO-2, micro-batch 8 per rank, k
    micro-batches per optimizer step: 'plain' (k x train_step), 'global' (train_step_global: one
    loss over all k x 8 x W samples) and 'big batch' (one micro-batch of 8k). Expect the global
    peak of saved activations = the plain peak (13.8 MiB: one micro-batch's graph at a time), the
    big-batch peak = k x that (110 MiB at k=8), and global time ~1.15-1.6 x plain (one extra
    no-grad forward per micro-batch).
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.harness import (base_parser, environment, finish, max_over_ranks, process_group, pyplot, rank0_print,
                     save_figure)
from rsclip_ds.losses import build_loss, clip_loss_global, naive_global_loss, siglip_loss_global
from rsclip_ds.model import new_dual_encoder, preset_config
from rsclip_ds.train import train_step, train_step_global


@dataclass(frozen=True)
class BenchConfig:
    dim: int                         # feature width of part (a)
    global_batches: tuple[int, ...]  # B_global values of part (a)
    loss_repeats: int                # timed forward+backward calls per point (after 1 warm-up)
    micro: int                       # samples per rank per micro-batch in part (b)
    ks: tuple[int, ...]              # accumulation steps of part (b)
    step_repeats: int                # timed optimizer steps per point (after 1 warm-up)
    width: int                       # hidden size of both towers in part (b)
    layers: int                      # encoder layers of each tower
    image_size: int                  # pixels; patch 8 -> (image_size / 8)^2 tokens
    text_length: int                 # tokens per caption


FULL = BenchConfig(dim=768, global_batches=(128, 256, 512, 1024, 2048, 4096), loss_repeats=3,
                   micro=8, ks=(1, 2, 4, 8), step_repeats=5, width=128, layers=2, image_size=64,
                   text_length=32)
TINY = BenchConfig(dim=64, global_batches=(16, 32), loss_repeats=2, micro=8, ks=(1, 2),
                   step_repeats=2, width=32, layers=1, image_size=32, text_length=16)


# --------------------------------------------------------------------------- measuring

class SavedBytes:
    """Bytes of the tensors autograd saves for backward, in windows (one per forward-with-graph).

    Counted by unique storage (`untyped_storage().nbytes()`): views such as `text.T` share their
    base's storage and must count once. Storages listed in `exclude` are skipped: the loss inputs
    in part (a) (the tower outputs exist whatever the loss form; we want what the loss *adds*), and
    the parameters in part (b) (ZeRO-2 keeps them in flat buffers that every linear layer would
    otherwise count as one huge saved tensor; they are model state, not activations).
    Non-reentrant checkpointing installs its own hooks inside, so a checkpointed region shows up
    as nothing: the chunked ring's (chunk, B_local) blocks exist only transiently, one at a time,
    while backward recomputes them, and are not in these numbers."""

    def __init__(self, exclude: set[int] = frozenset()):
        self.exclude = set(exclude)
        self.windows: list[dict[int, int]] = []
        self.new_window()

    def new_window(self, *_) -> None:
        self.windows.append({})

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.exclude:
            self.windows[-1][storage.data_ptr()] = storage.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def peak(self) -> int:
        return max(sum(w.values()) for w in self.windows)


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls, each started together on all ranks."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --------------------------------------------------------------------------- (a) loss forms

def chunk_size(b_local: int) -> int:
    return max(1, b_local // 4)


def loss_forms(rank: int, world: int, b_local: int) -> dict:
    """name -> loss(image, text, logit_scale, logit_bias) for this rank."""
    ring = partial(siglip_loss_global, rank=rank, world_size=world)
    return {
        "siglip_naive": partial(naive_global_loss, "siglip", rank=rank, world_size=world),
        "siglip_ring": ring,
        "siglip_ring_chunked": partial(ring, chunk_size=chunk_size(b_local)),
        "clip_naive": partial(naive_global_loss, "clip", rank=rank, world_size=world),
        "clip_local": partial(clip_loss_global, rank=rank, world_size=world),
    }


def loss_inputs(b_local: int, dim: int, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    image = F.normalize(torch.randn(b_local, dim, generator=g), dim=-1)            # (B_local, D)
    text = F.normalize(image + 0.5 * torch.randn(b_local, dim, generator=g), dim=-1)
    scale, bias = torch.tensor([2.3]), torch.tensor([-10.0])                       # (1,) each
    return [x.requires_grad_() for x in (image, text, scale, bias)]


def bench_loss_point(loss, inputs, repeats: int) -> tuple[int, float]:
    """(bytes saved for backward by one loss forward, median forward+backward seconds)."""
    def fwd_bwd():
        for x in inputs:
            x.grad = None
        loss(*inputs).backward()

    counter = SavedBytes(exclude={x.untyped_storage().data_ptr() for x in inputs})
    with counter.hooks():   # doubles as the warm-up call
        fwd_bwd()
    return counter.peak, timed(fwd_bwd, repeats)


def recompute_block_bytes(inputs: list[torch.Tensor], chunk: int) -> int:
    """What the chunked form holds *during* backward: checkpoint recomputes one (chunk, B_local)
    logit block at a time and frees it after its backward. Measured as the bytes one unchunked
    (chunk, B_local) sigmoid block saves (a one-rank ring on chunk image rows is exactly that)."""
    image, text, scale, bias = inputs
    rows = image[:chunk].detach().requires_grad_()                                # (chunk, D)
    counter = SavedBytes(exclude={x.untyped_storage().data_ptr() for x in (rows, text, scale, bias)})
    with counter.hooks():
        siglip_loss_global(rows, text, scale, bias, rank=0, world_size=1)        # (chunk, B_local) block
    return counter.peak


def bench_losses(cfg: BenchConfig, rank: int, world: int, say) -> list[dict]:
    rows = []
    for b_global in cfg.global_batches:
        b_local = b_global // world
        inputs = loss_inputs(b_local, cfg.dim, rank)
        for name, loss in loss_forms(rank, world, b_local).items():
            nbytes, seconds = bench_loss_point(loss, inputs, cfg.loss_repeats)
            block = recompute_block_bytes(inputs, chunk_size(b_local)) if "chunked" in name else 0
            nbytes, block, seconds = max_over_ranks([nbytes, block, seconds])
            # held = saved for backward + the largest transient recomputed block (chunked only):
            # the number to compare across forms; for the chunked form `saved` alone is ~0.
            rows.append({"form": name, "B_global": b_global, "B_local": b_local,
                         "saved_bytes_max_rank": int(nbytes), "recompute_block_bytes": int(block),
                         "held_bytes_max_rank": int(nbytes + block), "seconds_max_rank": seconds})
            say(f"loss {name:<20} B={b_global:<5} saved {nbytes / 2**20:8.2f} MiB  "
                f"+ recomputed {block / 2**20:6.2f} MiB  {seconds * 1e3:8.1f} ms")
    return rows


LOSS_PAIRS = {"siglip naive/ring": ("siglip_naive", "siglip_ring"),
              "siglip naive/ring_chunked": ("siglip_naive", "siglip_ring_chunked"),
              "clip naive/local": ("clip_naive", "clip_local")}


def loss_ratios(rows: list[dict]) -> list[dict]:
    at = {(r["form"], r["B_global"]): r for r in rows}
    out = []
    for b in sorted({r["B_global"] for r in rows}):
        for label, (num, den) in LOSS_PAIRS.items():
            n, d = at[num, b], at[den, b]
            out.append({"pair": label, "B_global": b,
                        "saved_bytes_ratio": n["saved_bytes_max_rank"] / max(1, d["saved_bytes_max_rank"]),
                        "bytes_ratio": n["held_bytes_max_rank"] / d["held_bytes_max_rank"],
                        "time_ratio": n["seconds_max_rank"] / d["seconds_max_rank"]})
    return out


# --------------------------------------------------------------------------- (b) accumulation

def model_config(cfg: BenchConfig):
    """The tiny preset widened/deepened so that activations, not parameters, dominate."""
    config = copy.deepcopy(preset_config("tiny"))
    for tower in (config.vision_config, config.text_config):
        tower.hidden_size, tower.intermediate_size = cfg.width, 4 * cfg.width
        tower.num_hidden_layers, tower.num_attention_heads = cfg.layers, max(1, cfg.width // 32)
    config.vision_config.image_size, config.vision_config.patch_size = cfg.image_size, 8
    config.text_config.max_position_embeddings = cfg.text_length
    config.text_config.projection_size = cfg.width   # text head: hidden -> projection (= D)
    return config


def bare_engine(config, micro: int, k: int, world: int):
    """A minimal ZeRO-2 engine around a fresh model: the scaffolding for comparing the step
    functions (train_step, train_step_global) on one engine, not a run (no shards, loader or
    schedule are involved, so not the Trainer)."""
    import deepspeed

    model = new_dual_encoder(config, "siglip", seed=0)
    ds_config = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": k,
        "train_batch_size": micro * k * world, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": False}, "fp16": {"enabled": False}, "steps_per_print": 10**9,
    }
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=1e-4),
                                      config=ds_config)
    return engine


def make_batches(config, micro: int, k: int, rank: int) -> list[dict]:
    g = torch.Generator().manual_seed(2000 + rank)
    size, length = config.vision_config.image_size, config.text_config.max_position_embeddings
    return [{"pixel_values": torch.randn(micro, 3, size, size, generator=g),          # (B,3,H,W)
             "input_ids": torch.randint(0, config.text_config.vocab_size, (micro, length), generator=g)}
            for _ in range(k)]


def bench_mode(engine, step, repeats: int) -> tuple[int, float]:
    """(peak saved-activation bytes of one forward-with-graph, median optimizer-step seconds).
    A forward pre-hook opens a new window on every forward, so each window holds one micro-batch's
    graph (plus its loss); the no-grad forwards of 'global' save nothing."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    counter = SavedBytes(exclude=param_ptrs)
    handle = engine.module.register_forward_pre_hook(counter.new_window)
    try:
        with counter.hooks():   # doubles as the warm-up step
            step()
    finally:
        handle.remove()
    return counter.peak, timed(step, repeats)


def bench_k(cfg: BenchConfig, config, k: int, rank: int, world: int) -> dict:
    loss_fn = build_loss("siglip", negatives="global", rank=rank, world_size=world)
    batches = make_batches(config, cfg.micro, k, rank)
    big = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}        # (8k, ...)
    engine = bare_engine(config, cfg.micro, k, world)
    results = {
        "plain": bench_mode(engine, lambda: [train_step(engine, b, loss_fn, torch.float32)
                                             for b in batches], cfg.step_repeats),
        "global": bench_mode(engine, lambda: train_step_global(engine, batches, loss_fn, torch.float32),
                             cfg.step_repeats),
    }
    del engine
    engine = bare_engine(config, cfg.micro * k, 1, world)
    results["big_batch"] = bench_mode(engine, lambda: train_step(engine, big, loss_fn, torch.float32),
                                      cfg.step_repeats)
    del engine
    gc.collect()
    names = list(results)
    flat = max_over_ranks([v for name in names for v in results[name]])
    return {name: {"peak_saved_bytes": int(flat[2 * i]), "step_seconds": flat[2 * i + 1]}
            for i, name in enumerate(names)}


def bench_accumulation(cfg: BenchConfig, rank: int, world: int, say) -> tuple[list[dict], dict]:
    config = model_config(cfg)
    n_params = sum(p.numel() for p in new_dual_encoder(config, "siglip").parameters())
    rows = []
    for k in cfg.ks:
        for mode, r in bench_k(cfg, config, k, rank, world).items():
            rows.append({"mode": mode, "k": k, "samples_per_step": cfg.micro * k * world, **r})
            say(f"accumulation {mode:<9} k={k}  peak {r['peak_saved_bytes'] / 2**20:8.2f} MiB  "
                f"step {r['step_seconds'] * 1e3:8.1f} ms")
    model = {"parameters": n_params, "parameter_bytes_fp32": 4 * n_params,
             "vision": config.vision_config.to_dict(), "text": config.text_config.to_dict()}
    return rows, model


def accumulation_ratios(rows: list[dict]) -> list[dict]:
    at = {(r["mode"], r["k"]): r for r in rows}
    out = []
    for k in sorted({r["k"] for r in rows}):
        plain, glob, big = at["plain", k], at["global", k], at["big_batch", k]
        out.append({"k": k,
                    "global_over_plain_time": glob["step_seconds"] / plain["step_seconds"],
                    "global_over_plain_peak": glob["peak_saved_bytes"] / plain["peak_saved_bytes"],
                    "big_batch_over_global_peak": big["peak_saved_bytes"] / glob["peak_saved_bytes"]})
    return out


# --------------------------------------------------------------------------- report

def print_tables(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="loss forms: naive / distributed (max over ranks)")
    for col in ("pair", "B_global", "held bytes ratio", "time ratio"):
        table.add_column(col, justify="right")
    for r in report["loss_ratios"]:
        table.add_row(r["pair"], str(r["B_global"]), f"{r['bytes_ratio']:.2f}", f"{r['time_ratio']:.2f}")
    acc = Table(title="accumulation (ZeRO-2, micro 8 per rank)")
    for col in ("k", "mode", "peak saved MiB", "step ms"):
        acc.add_column(col, justify="right")
    for r in report["accumulation"]:
        acc.add_row(str(r["k"]), r["mode"], f"{r['peak_saved_bytes'] / 2**20:.2f}",
                    f"{r['step_seconds'] * 1e3:.1f}")
    console = Console()
    console.print(table)
    console.print(acc)


def plot(report: dict, path: Path) -> str | None:
    """Four panels -> PNG; returns the path, or None (with a note) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    import matplotlib.ticker

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for form in dict.fromkeys(r["form"] for r in report["loss_forms"]):
        rows = [r for r in report["loss_forms"] if r["form"] == form]
        bs = [r["B_global"] for r in rows]
        axes[0, 0].loglog(bs, [r["held_bytes_max_rank"] / 2**20 for r in rows], "o-", label=form)
        axes[0, 1].loglog(bs, [r["seconds_max_rank"] * 1e3 for r in rows], "o-", label=form)
    for mode, style in (("plain", "s--"), ("global", "o-"), ("big_batch", "^-")):   # plain ~ global
        rows = [r for r in report["accumulation"] if r["mode"] == mode]
        ks = [r["k"] for r in rows]
        axes[1, 0].plot(ks, [r["peak_saved_bytes"] / 2**20 for r in rows], style, label=mode)
        axes[1, 1].plot(ks, [r["step_seconds"] * 1e3 for r in rows], style, label=mode)
    world = report["environment"]["world_size"]
    titles = [(f"loss: saved for backward (+ recomputed block) per rank, W={world}", "B_global", "MiB"),
              ("loss: forward+backward (max over ranks)", "B_global", "ms"),
              ("accumulation: peak saved activations of one forward", "k micro-batches per step", "MiB"),
              ("accumulation: optimizer step time", "k micro-batches per step", "ms")]
    ticks = [report["config"]["global_batches"]] * 2 + [report["config"]["ks"]] * 2
    for ax, (title, xlabel, ylabel), xs in zip(axes.flat, titles, ticks):
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.set_xscale("log", base=2)   # powers of two: label each measured point, no minor ticks
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


# --------------------------------------------------------------------------- entry point

def parse_args(argv=None) -> argparse.Namespace:
    return base_parser(__doc__, tiny=True).parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = TINY if args.tiny else FULL
    with process_group(args.threads) as info:   # a one-rank group on localhost without a launcher
        rank, world = info.rank, info.world_size
        say = rank0_print(rank)
        t0 = time.perf_counter()
        losses = bench_losses(cfg, rank, world, say)
        accumulation, model = bench_accumulation(cfg, rank, world, say)
        report = {"config": {**asdict(cfg), "tiny": args.tiny, "model": model},
                  "environment": environment(args.threads),
                  "loss_forms": losses, "loss_ratios": loss_ratios(losses),
                  "accumulation": accumulation, "accumulation_ratios": accumulation_ratios(accumulation),
                  "seconds": time.perf_counter() - t0}
        finish(report, args.out, rank, print_tables, plot)
        say(f"wrote {args.out} in {report['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

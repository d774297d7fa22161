"""The per-step op census: what one training step dispatches, by kind, for our engine under each
profile and for the plain PyTorch twin (benchmarks/twin.py) on the same model and batch. It runs
anywhere (CPU included): a change made without a GPU shows here that it removes work.

    python -m benchmarks.census --out benchmarks/results/census_base.json
    python -m benchmarks.census --model tiny --profiles zero2 --out /tmp/census.json   # seconds

The model is git-rsclip-base's shape (width, heads, MLP, image and text length, vocabulary) cut
to --layers layers per tower (default 2: the per-layer ops repeat, and the step's fixed ops --
optimizer, clipping, overflow checks -- scale with the parameter tensors, which a cut model has
fewer of, so the ratio is per tensor as on the full model: see `per_layer` in the JSON), bf16,
one rank, one micro-batch per optimizer step (--micro samples). Each subject runs in its own
process: 2 warm-up steps (lazy initialisation, buckets, optimizer states), then one step under
a TorchDispatchMode that records every aten op that reaches a kernel (and c10d collectives).

Kinds (KINDS): matmul (mm, addmm, bmm, linear, the patch convolution), attention (SDPA),
norm (layer norm forward/backward), copy (copy_, _to_copy, clone, cat: casts and moves),
reduction (sum, amax, amin, norms, any/all), optimizer (fused AdamW, _foreach_*), communication
(c10d), elementwise (the rest that computes), and view (metadata only: no kernel, not counted
as ops). Bytes: the tensors each non-matmul op reads and writes (its tensor arguments and
results, each storage once), the memory traffic a GPU kernel pays for it. Python calls: one more
step under sys.setprofile, function calls by package (python_calls): the host work, where
ZeRO-3's per-module hooks show.

The JSON: per subject the ops by kind, the named ops (op -> count), bytes by kind; per profile
`non_matmul_ops_vs_twin` = our non-matmul, non-view ops / the eager twin's (the issue's target:
<= 1.15 under ZeRO-1/2, <= 1.5 under ZeRO-3) and `non_matmul_bytes_vs_twin`.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

if not __package__:
    sys.exit("run the benchmarks as modules from the repository root: python -m benchmarks.census --out ...")

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.harness import base_parser, environment, page_tables, process_group, run_script, write_report
from benchmarks.results_tables import census as census_tables

MATMUL = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "convolution_backward",
          "_scaled_mm", "addmv", "mv", "dot"}
ATTENTION_PREFIX = ("_scaled_dot_product", "_flash_attention", "_efficient_attention", "scaled_dot_product")
NORM = {"native_layer_norm", "native_layer_norm_backward", "layer_norm", "_fused_rms_norm"}
COPY = {"copy_", "_to_copy", "clone", "cat", "_copy_from", "_copy_from_and_resize", "index_put_", "stack",
        "contiguous", "to", "copy", "lift_fresh", "_local_scalar_dense"}
REDUCTION = {"sum", "mean", "amax", "amin", "max", "min", "linalg_vector_norm", "norm", "any", "all",
             "argmax", "_foreach_norm", "prod", "logsumexp", "var_mean", "std"}
VIEW = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "as_strided", "slice",
        "select", "unsqueeze", "squeeze", "detach", "alias", "split", "split_with_sizes", "chunk", "unbind",
        "narrow", "flatten", "unflatten", "view_as", "expand_as", "_reshape_alias", "diagonal", "empty",
        "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set_", "resize_",
        "_has_compatible_shallow_copy_type",
        "is_same_size", "_nested_tensor_from_mask_left_aligned", "lift", "numpy_T", "_unsafe_split",
        "record_stream", "is_nonzero", "item", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
        "size", "stride", "dim", "_shape_as_tensor", "result_type", "broadcast_tensors"}
KINDS = ("matmul", "attention", "norm", "copy", "reduction", "optimizer", "communication", "elementwise")


def kind_of(func) -> str:
    """An OpOverload -> its kind (KINDS, or 'view' for metadata-only ops)."""
    namespace = func.namespace
    name = func._opname if hasattr(func, "_opname") else func.__name__.split(".")[0]
    if namespace == "c10d" or namespace == "_c10d_functional":
        return "communication"
    if name in VIEW:
        return "view"
    if name in MATMUL:
        return "matmul"
    if name.startswith(ATTENTION_PREFIX):
        return "attention"
    if name in NORM:
        return "norm"
    if name.startswith("_fused_adam") or name.startswith("_foreach_") and name != "_foreach_norm" \
            or name in ("adam", "adamw"):
        return "optimizer"
    if name in COPY:
        return "copy"
    if name in REDUCTION:
        return "reduction"
    return "elementwise"


def _tensors(tree) -> list[torch.Tensor]:
    out = []
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return out


def _bytes(tensors: list[torch.Tensor]) -> int:
    """Each storage once: an in-place op's argument and result are the same bytes."""
    seen, total = set(), 0
    for t in tensors:
        try:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        except (RuntimeError, NotImplementedError):
            continue
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def is_host_sync(func, args, out) -> bool:
    """An op that makes the host wait for the device: a value read on the host (item(), bool(), float():
    _local_scalar_dense) or a copy from an accelerator into CPU memory. On CPU ranks only the first
    kind exists; the count is what a GPU would wait on."""
    name = func._opname if hasattr(func, "_opname") else func.__name__.split(".")[0]
    if name == "_local_scalar_dense":
        return True
    if name in ("_to_copy", "copy_"):
        src = args[1] if name == "copy_" and len(args) > 1 else (args[0] if args else None)
        dst = args[0] if name == "copy_" else out
        return isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and \
            src.device.type != "cpu" and dst.device.type == "cpu"
    return False


class OpCensus(TorchDispatchMode):
    """Counts every aten/c10d op dispatched while active: ops[kind], named[op], bytes[kind], and the
    host syncs among them (is_host_sync)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.named: Counter = Counter()
        self.bytes: Counter = Counter()
        self.host_syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.host_syncs += is_host_sync(func, args, out)
        kind = kind_of(func)
        if kind != "view":
            self.ops[kind] += 1
            self.named[str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)] += 1
            if kind not in ("matmul", "attention"):
                self.bytes[kind] += _bytes(_tensors((args, kwargs or {}, out)))
        return out

    def record(self) -> dict:
        non_matmul = sum(n for k, n in self.ops.items() if k not in ("matmul", "attention"))
        return {"ops": {k: self.ops.get(k, 0) for k in KINDS}, "total_ops": sum(self.ops.values()),
                "non_matmul_ops": non_matmul, "bytes": {k: self.bytes.get(k, 0) for k in KINDS if k not in
                                                        ("matmul", "attention")},
                "non_matmul_bytes": sum(self.bytes.values()), "host_syncs": self.host_syncs,
                "named": dict(self.named.most_common())}


# --------------------------------------------------------------------------- one subject (worker)

def census_model(preset: str, layers: int | None, seed: int = 0):
    """The preset's DualEncoder with each tower cut to ``layers`` layers (None: whole)."""
    from rsclip_ds.model import _bundle, IMAGE_MEAN, IMAGE_STD, new_dual_encoder, preset_config
    from rsclip_ds.hub import ModelSource

    config = preset_config(preset)
    if layers:
        config.vision_config.num_hidden_layers = config.text_config.num_hidden_layers = layers
    model = new_dual_encoder(config, "siglip", seed)
    return _bundle(model, None, "siglip", IMAGE_MEAN, IMAGE_STD, ModelSource("preset", preset))


def synthetic_batch(config, micro: int, seed: int = 0) -> dict:
    """uint8 pixels (what the loader sends) and token ids, as in a real step."""
    g = torch.Generator().manual_seed(seed)
    v, t = config.vision_config, config.text_config
    return {"pixel_values": torch.randint(0, 256, (micro, 3, v.image_size, v.image_size), dtype=torch.uint8,
                                          generator=g),                                          # (B,3,H,W)
            "input_ids": torch.randint(0, t.vocab_size, (micro, t.max_position_embeddings), generator=g)}  # (B,L)


def count_subject(subject: str, args) -> dict:
    """Build `subject` ('twin' or a profile name), warm up, count one step. In its own process."""
    row = _count_subject(subject, args)
    row["device"] = torch.cuda.get_device_name() if torch.cuda.is_initialized() else "cpu"
    return row


def _count_subject(subject: str, args) -> dict:
    from rsclip_ds.config import load_config

    with process_group(args.threads), tempfile.TemporaryDirectory() as out_dir:
        bundle = census_model(args.model, args.layers)
        batch = synthetic_batch(bundle.model.config, args.micro)
        run = load_config(None, [f"precision={args.precision}", f"batch.micro_batch_size={args.micro}", "steps=100",
                                 f"profile={subject if subject != 'twin' else 'zero2'}", f"output_dir={out_dir}",
                                 "checkpoint.at_end=false", "model.activation_checkpointing=false",
                                 *args.set])
        if subject == "twin":   # on the engine's device (a GPU run: CUDA), as the Trainer places ours
            from deepspeed.accelerator import get_accelerator

            from benchmarks.twin import PlainLoop

            model = bundle.model.to(get_accelerator().current_device_name())
            loop = PlainLoop(model, precision=args.precision, optim=run.optim, clip=run.optim.gradient_clipping)
            return _count(loop.step, batch, args)
        from rsclip_ds.engine import engine_dtype
        from rsclip_ds.train import train_step
        from rsclip_ds.trainer import Trainer

        with Trainer(run, model=bundle, loader=[batch]) as trainer:
            parts = trainer.build()
            dtype = engine_dtype(parts.engine)
            row = _count(lambda b: train_step(parts.engine, b, parts.loss_fn, dtype), batch, args)
            row["ds_config"] = {k: trainer.ds_config.get(k) for k in ("zero_optimization", "bf16")}
            return row


# Python packages whose function calls python_calls counts (by the file's path)
PACKAGES = ("deepspeed", "torch", "transformers", "rsclip_ds")


def python_calls(step, batch: dict) -> dict[str, int]:
    """Python function calls during one step, by package (PACKAGES, else 'other'): the host work a
    GPU waits for when kernels are small -- ZeRO-3's per-module hooks show here, not in the ops."""
    calls = Counter()

    def profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename
            calls[next((p for p in PACKAGES if f"/{p}/" in path), "other")] += 1

    sys.setprofile(profile)
    try:
        step(batch)
    finally:
        sys.setprofile(None)
    return {p: calls.get(p, 0) for p in (*PACKAGES, "other")}


def _count(step, batch: dict, args) -> dict:
    losses = [float(step(batch)) for _ in range(args.warmup)]
    census = OpCensus()
    t0 = time.perf_counter()
    with census:
        loss = step(batch)
    seconds = time.perf_counter() - t0
    calls = python_calls(step, batch)   # one more step: the dispatch mode's own calls stay out
    return {**census.record(), "losses": losses + [float(loss)], "counted_step_s": seconds,
            "python_calls": calls}


# --------------------------------------------------------------------------- driver

def parse_args(argv):
    parser = base_parser(__doc__)
    parser.add_argument("--model", default="git-rsclip-base", help="preset whose shape is counted")
    parser.add_argument("--layers", type=int, default=2, help="layers per tower (0: the preset's own)")
    parser.add_argument("--micro", type=int, default=2, help="samples per step")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--profiles", nargs="*", default=["zero1", "zero2", "zero3"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="run-config overrides for every subject (e.g. compile.enabled=true)")
    parser.add_argument("--label", default="", help="a name for this census in the report (e.g. 'before')")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per subject's process")
    parser.add_argument("--subject", help=argparse_suppress())
    return parser.parse_args(argv)


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


def ratios(subjects: dict[str, dict]) -> dict[str, dict]:
    """Per profile: ours / the eager twin's non-matmul ops and bytes."""
    twin = subjects.get("twin")
    out = {}
    for name, row in subjects.items():
        if name == "twin" or not row.get("ok", True) or not twin or not twin.get("ok", True):
            continue
        out[name] = {"non_matmul_ops_vs_twin": row["non_matmul_ops"] / twin["non_matmul_ops"],
                     "python_calls_vs_twin": sum(row["python_calls"].values()) / sum(twin["python_calls"].values()),
                     "non_matmul_bytes_vs_twin": row["non_matmul_bytes"] / twin["non_matmul_bytes"],
                     "matmul_ops_vs_twin": row["ops"]["matmul"] / max(1, twin["ops"]["matmul"])}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.subject:   # one subject, in this process (run_script)
        args.out.write_text(json.dumps(count_subject(args.subject, args)))
        return 0
    t0 = time.perf_counter()
    subjects: dict[str, dict] = {}
    for subject in ["twin", *args.profiles]:
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "row.json"
            cli = ["--subject", subject, "--out", str(result), "--model", args.model, "--layers", str(args.layers),
                   "--micro", str(args.micro), "--precision", args.precision, "--warmup", str(args.warmup),
                   "--threads", str(args.threads)]
            cli += ["--set", *args.set] if args.set else []
            subjects[subject] = run_script("benchmarks.census", cli, result, args.timeout)
        row = subjects[subject]
        said = f"{row['non_matmul_ops']} non-matmul ops" if row.get("ok", True) else row["error"]
        print(f"{subject}: {said} ({time.perf_counter() - t0:.0f}s)", flush=True)
    report = {"label": args.label,
              "config": {"model": args.model, "layers": args.layers, "micro": args.micro, "precision": args.precision,
                         "warmup": args.warmup, "set": args.set},
              "environment": environment(args.threads), "subjects": subjects, "vs_twin": ratios(subjects),
              "seconds": time.perf_counter() - t0}
    write_report(report, args.out, page_tables(census_tables.census, args.out.name))
    return 0 if all(r.get("ok", True) for r in subjects.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The op census: what the training loop dispatches per optimizer step, by kind, for our engine
under each profile and precision and for the plain PyTorch twin (benchmarks/twin.py), which does
the same math on the same model and batch. It runs anywhere (CPU included): a change made without
a GPU shows here that it removes work.

    python -m benchmarks.census --out benchmarks/results/census_base.json          # ~6 min on 2 cores
    python -m benchmarks.census --set compile.enabled=true --out benchmarks/results/census_base_compiled.json
    python -m benchmarks.census --model tiny --profiles zero2 --precisions bf16 --out /tmp/census.json   # seconds

What is counted is the loop's whole optimizer step, not the step function alone. Ours runs the
real loop (Trainer.train -> rsclip_ds.loop.train: the step guard, the sync of the losses and the
stop flag at log steps, the metrics line), the twin benchmarks.twin.plain_train (its log step
reads the mean loss with one `.item()`), both with a log step every --steps (K, default 10: the
runs' default logging.log_every, so a window holds one sync point, as every 10 steps of a run
do). After --warmup steps (lazy initialisation, buckets, optimizer states, a compiled run's
graphs) K steps run under a TorchDispatchMode that records every aten op that reaches a kernel
(and c10d collectives), the next K under sys.setprofile (Python calls: the dispatch mode's own
stay out); the report gives totals and K, the tables per step. A window opens when the loop pulls
its first step's batch and closes at the pull after its last (StepWindows): K whole loop
iterations, whatever the loop does between two pulls.

The model is git-rsclip-base's shape (width, heads, MLP, image and text length, vocabulary) cut
to --layers layers per tower (default 2: the per-layer ops repeat; the step's fixed ops --
optimizer, clipping, overflow checks -- scale with the parameter tensors, which a cut model has
fewer of, so the ratio is per tensor as on the full model), one rank, one micro-batch per
optimizer step (--micro samples). Subjects: each of --profiles under each of --precisions
(`zero2/amp_bf16`) and the twin of each precision (`twin/bf16`: fp32 weights, the forward
autocast to the precision's compute dtype -- one recipe for bf16 and amp_bf16), each in its own
process. `--set compile.enabled=true` compiles our encoder layers and the twin's
(PlainLoop(compiled=True)): compiled subjects are read against the compiled twin only.

Kinds (KINDS): matmul (mm, addmm, bmm, linear, the patch convolution), attention (SDPA),
norm (layer norm forward/backward), copy (copy_, _to_copy, clone, cat: casts and moves),
reduction (sum, amax, amin, norms, any/all), optimizer (fused AdamW, _foreach_*), communication
(c10d), elementwise (the rest that computes), fused (a kernel inductor generated for a compiled
graph: one op, whose bytes are its tensor arguments; the dispatch mode never sees inside one and
sees the graph's library calls, such as its matmuls, as ops) and view (metadata only: no kernel,
not counted as ops). Bytes: the tensors each non-matmul op reads and writes (its tensor arguments
and results, each storage once), the memory traffic a GPU kernel pays for it. Python calls:
function calls by package (python_calls), the host work, where ZeRO-3's per-module hooks show.
Host syncs: the ops that make the host wait for the device (is_host_sync).

The JSON: per subject the window's totals (ops by kind, named ops, bytes by kind, host syncs,
Python calls by package) and `steps` (K); `vs_twin`: per subject its non-matmul ops, bytes and
Python calls over its precision's twin's; `targets`: issue 44's targets (TARGETS), whether each
subject meets its profile's and what it misses, and per profile the verdict.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
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
KINDS = ("matmul", "attention", "norm", "copy", "reduction", "optimizer", "communication", "elementwise", "fused")
# inductor's generated kernels, by their names in a compiled graph's module (CPU: cpp_fused_*, CUDA: triton_*)
KERNEL_PREFIXES = ("cpp_fused", "triton_")


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
    host syncs among them (is_host_sync); `kernel()` adds a compiled graph's generated kernel."""

    active: "OpCensus | None" = None   # the one counting now: count_compiled_kernels' wrappers report to it

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.named: Counter = Counter()
        self.bytes: Counter = Counter()
        self.host_syncs = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # A compiled graph runs as compiled under this mode (torch turns the mode off while compiling
        # and on while the graph runs: its library calls are counted, its generated kernels through
        # count_compiled_kernels). Without this, dynamo skips every compiled frame under an active mode
        # and runs the eager code: a compiled subject would count as eager.
        return True

    def __enter__(self):
        OpCensus.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        OpCensus.active = None
        return super().__exit__(*exc)

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

    def kernel(self, name: str, args) -> None:
        """One generated kernel of a compiled graph ran on `args` (its buffers, written in place)."""
        self.ops["fused"] += 1
        self.named[name] += 1
        self.bytes["fused"] += _bytes(_tensors(args))

    def record(self) -> dict:
        non_matmul = sum(n for k, n in self.ops.items() if k not in ("matmul", "attention"))
        return {"ops": {k: self.ops.get(k, 0) for k in KINDS}, "total_ops": sum(self.ops.values()),
                "non_matmul_ops": non_matmul, "bytes": {k: self.bytes.get(k, 0) for k in KINDS if k not in
                                                        ("matmul", "attention")},
                "non_matmul_bytes": sum(self.bytes.values()), "host_syncs": self.host_syncs,
                "named": dict(self.named.most_common())}


class _CountedKernel:
    """A generated kernel that reports each launch to the active OpCensus, then runs. Inductor's CPU
    kernels are called with their buffers; Triton's through `.run(*buffers, stream=...)`."""

    def __init__(self, kernel, name: str):
        self.kernel, self.name = kernel, name

    def __call__(self, *args, **kwargs):
        if OpCensus.active is not None:
            OpCensus.active.kernel(self.name, args)
        return self.kernel(*args, **kwargs)

    def run(self, *args, **kwargs):
        if OpCensus.active is not None:
            OpCensus.active.kernel(self.name, args)
        return self.kernel.run(*args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self.kernel, attr)


def count_compiled_kernels() -> list[tuple[object, str, object]]:
    """Make every kernel of the graphs compiled so far count as one 'fused' op of the active
    OpCensus: each graph's module (inductor's PyCodeCache) looks its kernels up by name at every
    call, so wrapping the module's names reaches every launch. Call after the warm-up, which
    compiled the graphs. -> (module, name, kernel) of each wrapped one, for `uncount`."""
    from torch._inductor.codecache import PyCodeCache

    wrapped = []
    for module in list(PyCodeCache.modules):
        for name, obj in list(vars(module).items()):
            if name.startswith(KERNEL_PREFIXES) and callable(getattr(obj, "run", obj)) and \
                    not isinstance(obj, _CountedKernel):
                setattr(module, name, _CountedKernel(obj, name))
                wrapped.append((module, name, obj))
    return wrapped


def uncount(wrapped: list[tuple[object, str, object]]) -> None:
    """The kernels as they were (the wrappers' own Python calls stay out of python_calls)."""
    for module, name, kernel in wrapped:
        setattr(module, name, kernel)


# Python packages whose function calls python_calls counts (by the file's path)
PACKAGES = ("deepspeed", "torch", "transformers", "rsclip_ds")


class StepWindows:
    """The batches of a counted run -- one batch, over and over -- and its two windows of `steps`
    loop iterations after `warmup`: the first under an OpCensus, the second under sys.setprofile.
    A window opens when the loop pulls its first step's batch and closes when it pulls the batch of
    the step after its last, so it holds `steps` whole iterations of whatever loop pulls: the step,
    the guard, a log step's sync, the next step's learning-rate read. The loop runs
    warmup + 2 x steps + 1 steps (`total`): its last step, which always syncs, stays outside."""

    def __init__(self, batch: dict, *, warmup: int, steps: int):
        self.batch, self.warmup, self.steps = batch, warmup, steps
        self.total = warmup + 2 * steps + 1
        self.census = OpCensus()
        self.calls: Counter = Counter()
        self.counted_s = 0.0
        self.kernels: list = []

    def __iter__(self):
        pulls = 0
        while True:
            pulls += 1
            self._at(pulls)
            yield self.batch

    def _at(self, pull: int) -> None:
        first = self.warmup + 1
        if pull == first:
            self.kernels = count_compiled_kernels()
            self.census.__enter__()
            self._t0 = time.perf_counter()
        elif pull == first + self.steps:
            self.counted_s = time.perf_counter() - self._t0
            self.census.__exit__(None, None, None)
            uncount(self.kernels)
            sys.setprofile(self._profile)
        elif pull == first + 2 * self.steps:
            sys.setprofile(None)

    def _profile(self, frame, event, arg) -> None:
        if event == "call":
            path = frame.f_code.co_filename
            self.calls[next((p for p in PACKAGES if f"/{p}/" in path), "other")] += 1

    def record(self) -> dict:
        return {**self.census.record(), "steps": self.steps, "warmup": self.warmup, "counted_s": self.counted_s,
                "compiled_kernels": len(self.kernels),
                "python_calls": {p: self.calls.get(p, 0) for p in (*PACKAGES, "other")}}


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
    """Build `subject` ('twin/<precision>' or '<profile>/<precision>'), run its loop, count its windows.
    In its own process."""
    kind, precision = subject.split("/")
    row = _count_subject(kind, precision, args)
    row["device"] = torch.cuda.get_device_name() if torch.cuda.is_initialized() else "cpu"
    return row


def _count_subject(kind: str, precision: str, args) -> dict:
    from rsclip_ds.config import load_config

    with process_group(args.threads), tempfile.TemporaryDirectory() as out_dir:
        bundle = census_model(args.model, args.layers)
        windows = StepWindows(synthetic_batch(bundle.model.config, args.micro), warmup=args.warmup, steps=args.steps)
        run = load_config(None, [f"precision={precision}", f"batch.micro_batch_size={args.micro}",
                                 f"steps={windows.total}", f"optim.warmup_steps={min(10, windows.total - 1)}",
                                 f"logging.log_every={args.steps}", "logging.progress=plain",
                                 f"profile={kind if kind != 'twin' else 'zero2'}", f"output_dir={out_dir}",
                                 "checkpoint.at_end=false", "model.activation_checkpointing=false",
                                 f"distributed.threads_per_rank={args.threads}", *args.set])
        if kind == "twin":   # on the engine's device (a GPU run: CUDA), as the Trainer places ours
            from deepspeed.accelerator import get_accelerator

            from benchmarks.twin import PlainLoop, plain_train

            model = bundle.model.to(get_accelerator().current_device_name())
            loop = PlainLoop(model, precision=precision, optim=run.optim, clip=run.optim.gradient_clipping,
                             compiled=run.compile.enabled, steps=run.steps, loss=run.loss.name)
            logged = plain_train(loop, iter(windows), windows.total, run.logging.log_every)
            return {**windows.record(), "logged_losses": logged}
        from rsclip_ds.assembly import Trainer

        with Trainer(run, model=bundle, loader=windows) as trainer:
            summary = trainer.train()
            return {**windows.record(), "losses": summary["losses"],
                    "ds_config": {k: trainer.ds_config.get(k) for k in ("zero_optimization", "bf16", "torch_autocast")}}


# --------------------------------------------------------------------------- issue 44's targets

@dataclass(frozen=True)
class Target:
    """What a profile's subjects may cost against their twin (issue 44): at most these ratios of
    non-matmul ops, non-matmul bytes and Python calls per step (None: reported, no target), and at
    most `syncs` host syncs a step (plus the twin's own where `plus_twin`). `precisions`: the
    subjects it applies to; `lighter`: the profile meets it when the lighter of them does (fewer
    non-matmul ops per step)."""
    ops: float | None
    bytes: float | None
    calls: float | None
    syncs: float
    plus_twin: bool = False
    precisions: tuple[str, ...] = ("bf16", "amp_bf16")
    lighter: bool = False


TARGETS = {"ddp": Target(1.05, 1.05, 2.5, 1, plus_twin=True, precisions=("amp_bf16",)),
           "zero1": Target(1.5, 1.5, 6, 2, lighter=True),
           "zero2": Target(1.5, 1.5, 6, 2, lighter=True),
           "zero3": Target(None, None, None, 2)}


def per_step(row: dict, key: str) -> float:
    """A window total per optimizer step (a report without `steps` counted one step). `key`: a field,
    a dict field (its sum: python_calls) or 'ops.<kind>'."""
    value = row["ops"][key[4:]] if key.startswith("ops.") else row[key]
    return (sum(value.values()) if isinstance(value, dict) else value) / row.get("steps", 1)


def ratios(subjects: dict[str, dict]) -> dict[str, dict]:
    """Per subject of ours: its non-matmul ops, bytes, Python calls and matmuls per step over the twin's of
    its precision, and both host syncs per step."""
    out = {}
    for name, row in subjects.items():
        kind, precision = name.split("/")
        twin = subjects.get(f"twin/{precision}")
        if kind == "twin" or not row.get("ok", True) or not twin or not twin.get("ok", True):
            continue
        out[name] = {f"{key.replace('ops.', '')}_vs_twin": per_step(row, key) / per_step(twin, key)
                     for key in ("non_matmul_ops", "non_matmul_bytes", "python_calls", "ops.matmul")}
        out[name].update(host_syncs_per_step=per_step(row, "host_syncs"),
                         twin_host_syncs_per_step=per_step(twin, "host_syncs"))
    return out


def misses(target: Target, vs: dict) -> list[str]:
    """What a subject's ratios (`ratios`) miss of `target`: ['ops 1.62 > 1.5', ...]; [] meets it."""
    said = []
    for key, limit, name in (("non_matmul_ops_vs_twin", target.ops, "ops"),
                             ("non_matmul_bytes_vs_twin", target.bytes, "bytes"),
                             ("python_calls_vs_twin", target.calls, "calls")):
        if limit is not None and vs[key] > limit:
            said.append(f"{name} {vs[key]:.2f} > {limit:g}")
    syncs = target.syncs + (vs["twin_host_syncs_per_step"] if target.plus_twin else 0.0)
    if vs["host_syncs_per_step"] > syncs + 1e-9:
        said.append(f"syncs {vs['host_syncs_per_step']:.2f} > {syncs:g}")
    return said


def judge(vs_twin: dict[str, dict]) -> dict:
    """Each subject against its profile's target, and per profile the verdict (on the lighter
    precision where the target says so)."""
    subjects, profiles = {}, {}
    for name, vs in vs_twin.items():
        kind, precision = name.split("/")
        target = TARGETS.get(kind)
        if target is not None and precision in target.precisions:
            subjects[name] = {"misses": misses(target, vs)}
            subjects[name]["meets"] = not subjects[name]["misses"]
    for kind, target in TARGETS.items():
        judged = [n for n in subjects if n.split("/")[0] == kind]
        if not judged:
            continue
        if target.lighter:   # the lighter precision: fewer non-matmul ops per step
            judged = [min(judged, key=lambda n: vs_twin[n]["non_matmul_ops_vs_twin"])]
        profiles[kind] = {"target": asdict(target), "judged": judged,
                          "meets": all(subjects[n]["meets"] for n in judged)}
    return {"subjects": subjects, "profiles": profiles}


# --------------------------------------------------------------------------- driver

def parse_args(argv):
    parser = base_parser(__doc__)
    parser.add_argument("--model", default="git-rsclip-base", help="preset whose shape is counted")
    parser.add_argument("--layers", type=int, default=2, help="layers per tower (0: the preset's own)")
    parser.add_argument("--micro", type=int, default=2, help="samples per step")
    parser.add_argument("--precisions", nargs="+", default=["bf16", "amp_bf16"], choices=["bf16", "amp_bf16", "fp32"],
                        help="each profile under each (and the twin of each)")
    parser.add_argument("--profiles", nargs="*", default=["ddp", "zero1", "zero2", "zero3"])
    parser.add_argument("--warmup", type=int, default=2, help="loop steps before the counted windows")
    parser.add_argument("--steps", type=int, default=10,
                        help="K: loop steps per counted window, and the log steps' interval (logging.log_every)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="run-config overrides for every subject (e.g. compile.enabled=true)")
    parser.add_argument("--label", default="", help="a name for this census in the report (e.g. 'before')")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per subject's process")
    parser.add_argument("--subject", help=argparse_suppress())
    return parser.parse_args(argv)


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


def subjects_of(args) -> list[str]:
    """The twin of each precision, then each profile under each precision (a profile's rows side by side),
    less the pairs a run refuses (resolve: ddp with bf16 weights, amp under ZeRO)."""
    from rsclip_ds.config import ConfigError, load_config
    from rsclip_ds.profiles import load_profile
    from rsclip_ds.resolve import Device, World, resolve

    def runs(profile: str, precision: str) -> bool:
        try:
            resolve(load_config(None, [f"profile={profile}", f"precision={precision}", *args.set]),
                    load_profile(profile), World(1, 1), Device.current())
        except ConfigError:
            return False
        return True
    return [f"twin/{p}" for p in args.precisions] + [f"{k}/{p}" for k in args.profiles for p in args.precisions
                                                      if runs(k, p)]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.subject:   # one subject, in this process (run_script)
        args.out.write_text(json.dumps(count_subject(args.subject, args)))
        return 0
    t0 = time.perf_counter()
    subjects: dict[str, dict] = {}
    for subject in subjects_of(args):
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "row.json"
            cli = ["--subject", subject, "--out", str(result), "--model", args.model, "--layers", str(args.layers),
                   "--micro", str(args.micro), "--warmup", str(args.warmup), "--steps", str(args.steps),
                   "--threads", str(args.threads)]
            cli += ["--set", *args.set] if args.set else []
            subjects[subject] = run_script("benchmarks.census", cli, result, args.timeout)
        row = subjects[subject]
        said = f"{per_step(row, 'non_matmul_ops'):.1f} non-matmul ops a step" if row.get("ok", True) else row["error"]
        print(f"{subject}: {said} ({time.perf_counter() - t0:.0f}s)", flush=True)
    vs_twin = ratios(subjects)
    report = {"label": args.label,
              "config": {"model": args.model, "layers": args.layers, "micro": args.micro,
                         "precisions": args.precisions, "warmup": args.warmup, "steps": args.steps,
                         "log_every": args.steps, "set": args.set},
              "environment": environment(args.threads), "subjects": subjects, "vs_twin": vs_twin,
              "targets": judge(vs_twin), "seconds": time.perf_counter() - t0}
    write_report(report, args.out, page_tables(census_tables.census, args.out.name))
    return 0 if all(r.get("ok", True) for r in subjects.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

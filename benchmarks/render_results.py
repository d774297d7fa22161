"""docs/results.md from benchmarks/results/*.json: every measurement's numbers as tables, with the
command that wrote them and the machine they ran on, so that no doc types a number by hand.

    python -m benchmarks.render_results                 # writes docs/results.md
    python -m benchmarks.render_results --check         # exit 1, with a diff summary, when it is stale
    python -m benchmarks.render_results --results DIR --out PATH

FAMILIES lists the page's sections in order: each has a stable anchor that other docs link to
(`results.md#memory`), a table function (benchmarks/results_tables/) and its sources, the results
files it shows (a name under the results folder, or a glob) with the command that writes each. A
results file that no source matches stops the render, naming the file: a new benchmark gets its
source and its section here. The render reads only JSON (no torch), walks files in sorted order
and prints no time of its own, so the same JSON gives the same bytes.
"""

from __future__ import annotations

import argparse
import difflib
import fnmatch
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.results_tables import comms, data, memory, throughput, training

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "results.md"
LINK = "../benchmarks/results"          # the results folder as seen from docs/
PAGE_LIMIT = 30_000                      # bytes: no doc over 30 KB


class ResultsError(RuntimeError):
    """A results file the page cannot show: unknown to FAMILIES, or not in the shape its section reads."""


# --------------------------------------------------------------------------- what writes what

@dataclass(frozen=True)
class Source:
    """Results files (a name under the results folder, or a glob) and the command that writes them;
    `note` instead of a command for a kept earlier run of another source's command."""
    pattern: str
    command: str | None = None
    note: str = ""


@dataclass(frozen=True)
class Family:
    """A section of the page: its anchor (stable: other docs link to it), title, table function, sources."""
    anchor: str
    title: str
    tables: Callable[[dict[str, dict]], list[str]]
    sources: tuple[Source, ...]


def py(module: str, args: str) -> str:
    return f"python -m benchmarks.{module} {args}"


def ds(ranks: int, module: str, args: str) -> str:
    """A benchmark launched on CPU ranks the way users launch training."""
    return f"DS_ACCELERATOR=cpu deepspeed --num_gpus {ranks} --module benchmarks.{module} {args}"


R = "benchmarks/results"
BASE = "--preset git-rsclip-base --micro 2 --steps 1 --profiles zero2 zero3 zero3_offload"
LORA = "--set 'finetune.lora.towers=[image,text]'"
OLDER = "/path/to/older/checkout"
PEAK = ("for p in zero1 zero2 zero2_offload zero3 zero3_offload; do for k in 1 4; do "
        + ds(2, "memory.per_rank", f"--preset git-rsclip-base --micro 2 --accumulation $k --profiles $p "
                                   f"--out {R}/peak/$p-$k.json") + "; done; done")
OPENCLIP = ("--open-clip runs/openclip-venv --repeats 3 --steps 60 --precisions fp32 bf16 bf16_masters "
            "--wait-quiet 120 --max-foreign 0.15")

FAMILIES = (
    Family("throughput", "Throughput: our loop, a bare DeepSpeed loop, the Hugging Face Trainer",
           throughput.throughput, (
               Source("throughput.json", ds(2, "throughput.compare", f"--out {R}/throughput.json")),
               Source("throughput.run*.json",
                      note="earlier runs of the same command on a loaded machine, kept for the spread"))),
    Family("throughput-openclip", "Throughput against open_clip's own trainer", throughput.throughput_openclip, (
        Source("throughput_openclip.json",
               py("throughput.compare", f"{OPENCLIP} --out {R}/throughput_openclip.json")),)),
    Family("gpu", "One GPU: samples/s, MFU, peak memory", throughput.gpu, (
        Source("gpu_h200.json", py("gpu", f"--out {R}/gpu_h200.json")),
        Source("gpu_h200_loader.json", py("gpu", f"--profiles zero2 --ac off --data tensor loader "
                                                 f"--out {R}/gpu_h200_loader.json")),
        Source("gpu_h200_hybrid.json", py("gpu", f"--model git-rsclip-base --profiles hybrid --ac off "
                                                 f"--out {R}/gpu_h200_hybrid.json")),
        Source("gpu_h200_openclip.json", py("gpu", f"--open-clip VENV --model git-rsclip-base "
                                                   f"--out {R}/gpu_h200_openclip.json")))),
    Family("memory", "Model states and activations per rank", memory.memory, (
        Source("memory.json", ds(2, "memory.per_rank", f"--out {R}/memory.json")),)),
    Family("memory-finetune", "Fine-tuning controls: a locked tower, LoRA", memory.memory_finetune, (
        Source("memory_lock_image.json", ds(2, "memory.per_rank", f"--set finetune.lock_image=true "
                                                                  f"--out {R}/memory_lock_image.json")),
        Source("memory_lora.json", ds(2, "memory.per_rank", f"{LORA} --out {R}/memory_lora.json")),
        Source("memory_base.json", ds(2, "memory.per_rank", f"{BASE} --out {R}/memory_base.json")),
        Source("memory_base_lock_image.json", ds(2, "memory.per_rank", f"{BASE} --set finetune.lock_image=true "
                                                                       f"--out {R}/memory_base_lock_image.json")),
        Source("memory_base_lora.json", ds(2, "memory.per_rank", f"{BASE} {LORA} --out {R}/memory_base_lora.json")))),
    Family("memory-peak", "Peak memory per rank over an optimizer step", memory.memory_peak, (
        Source("peak/*.json", PEAK),
        Source("memory_peak_base.json", py("memory.per_rank", f"--combine {R}/peak/*.json "
                                                              f"--out {R}/memory_peak_base.json")))),
    Family("build-rss", "Host memory of the model build: whole against zero.Init", memory.build_rss, (
        Source("build_rss.json",
               "DS_ACCELERATOR=cpu " + py("memory.per_rank", f"--build-rss --out {R}/build_rss.json")),)),
    Family("checkpoint-bytes", "Checkpoint bytes per rank", memory.checkpoint_bytes, (
        Source("checkpoint_bytes.json", py("memory.checkpoint_bytes", f"--out {R}/checkpoint_bytes.json")),
        Source("checkpoint_bytes_before.json",
               py("memory.checkpoint_bytes", f"--tree {OLDER} --out {R}/checkpoint_bytes_before.json")))),
    Family("step-faults", "Per-step host memory: page faults and system time", memory.step_faults, (
        Source("step_faults.json", py("memory.step_faults", f"--out {R}/step_faults.json")),)),
    Family("decode", "JPEG decoders on one core", data.decode, (
        Source("decode.json", py("data.decode", f"--out {R}/decode.json --simd-python /tmp/simd/bin/python")),)),
    Family("loader", "The loader per CPU-second", data.loader, (
        Source("loader.json", py("data.loader", f"--out {R}/loader.json")),
        Source("loader.before_uint8.json", note="the same command before the uint8 transport (the file's `note`)"))),
    Family("comms", "Bytes per optimizer step: DeepSpeed's comms logger against the model", comms.comms, (
        Source("comms_w2.json", ds(2, "comms.traffic", f"--out {R}/comms_w2.json")),
        Source("comms_w3.json", ds(3, "comms.traffic", f"--out {R}/comms_w3.json")),
        Source("comms_w2_bucket1m.json",
               ds(2, "comms.traffic", f"--profiles zero1 zero2 zero3 --modes plain --bucket 1000000 "
                                      f"--out {R}/comms_w2_bucket1m.json")))),
    Family("comms-hpz", "Hybrid ZeRO-3: hpZ on 4 ranks", comms.comms_hpz, (
        Source("comms_w4_hpz.json", ds(4, "comms.traffic", "--profiles zero3+hpz2 zero3 --hidden 256 "
                                                           f"--out {R}/comms_w4_hpz.json")),)),
    Family("scaling", "Scaling on paper: minutes per Git-10M epoch", comms.scaling, (
        Source("scaling.json", py("comms.scaling", f"--out {R}/scaling.json")),)),
    Family("heartbeat", "Heartbeat store traffic at 64 and 256 ranks", comms.heartbeat, (
        Source("heartbeat.json", py("comms.heartbeat", f"--out {R}/heartbeat.json")),)),
    Family("contrastive", "Loss memory and time; plain against global accumulation", training.contrastive, (
        Source("contrastive.json", ds(2, "loss.contrastive", f"--out {R}/contrastive.json")),)),
    Family("grad-accum", "bf16 gradient accumulation against the fp32 big batch", training.grad_accum, (
        Source("grad_accum.json", ds(2, "precision.grad_accum", f"--out {R}/grad_accum.json")),)),
    Family("pure-bf16", "bf16 master weights at equal steps", training.pure_bf16, (
        Source("pure_bf16.json", ds(2, "precision.pure_bf16", f"--out {R}/pure_bf16.json")),)),
)


def assign(results: Path) -> dict[str, dict[str, dict]]:
    """{anchor: {file name: report}} for every *.json under `results` (sub-folders too), each file in
    the order of its family's sources, then by name; a file no source matches, or two do, is an error."""
    owner: dict[str, tuple[str, int]] = {}
    for name in sorted(p.relative_to(results).as_posix() for p in results.rglob("*.json")):
        hits = [(f.anchor, i) for f in FAMILIES for i, src in enumerate(f.sources)
                if fnmatch.fnmatchcase(name, src.pattern)]
        if not hits:
            raise ResultsError(f"{results / name}: no section of docs/results.md shows this file; add a Source for it "
                               "(the command that writes it) to a Family in benchmarks/render_results.py, with a "
                               "table function in benchmarks/results_tables/ that reads it")
        if len(hits) > 1:
            raise ResultsError(f"{results / name}: matched by more than one source {hits}; make the patterns disjoint")
        owner[name] = hits[0]
    grouped: dict[str, dict[str, dict]] = {f.anchor: {} for f in FAMILIES}
    for name in sorted(owner, key=lambda n: (owner[n][1], n)):
        try:
            grouped[owner[name][0]][name] = json.loads((results / name).read_text())
        except json.JSONDecodeError as e:
            raise ResultsError(f"{results / name}: not JSON ({e})") from None
    return grouped


# --------------------------------------------------------------------------- the page

ENV_LABELS = {"cpu_count": "{} CPUs", "device": "device {}", "world_size": "{} ranks", "ranks": "{} ranks"}
ENV_FIRST = ("cpu_model", "cpu_count", "device", "world_size", "ranks", "threads_per_rank", "torch", "deepspeed")
NOT_RECORDED = "not recorded in the JSON"
ENV_LEFT_OUT = {"python", "backend"}     # in every JSON; the page shows the machine and the libraries measured


def machine(files: dict[str, dict]) -> str:
    """The files' environment records as one line: a key the files agree on once, a key they differ
    on with each value and its files; the known keys first, `date` last."""
    envs = {name: rep.get("environment") or {} for name, rep in files.items()}
    if not any(envs.values()):
        return NOT_RECORDED
    seen = {k for env in envs.values() for k in env}
    keys = ([k for k in ENV_FIRST if k in seen] + sorted(seen - set(ENV_FIRST) - ENV_LEFT_OUT - {"date"})
            + sorted(seen & {"date"}))
    parts = []
    for k in keys:
        label = ENV_LABELS.get(k, f"{k} {{}}")
        values: dict[str, list[str]] = {}
        for name, env in envs.items():
            text = label.format(env[k]) if k in env else f"{k} not recorded"
            values.setdefault(text, []).append(f"`{name}`")
        parts.append(next(iter(values)) if len(values) == 1 else
                     "; ".join(f"{v} ({', '.join(n)})" for v, n in values.items()))
    return ", ".join(parts)


def section(family: Family, files: dict[str, dict], results: Path, machines: dict[str, str]) -> list[str]:
    """Anchor, title, the commands, the machine (a line some section printed before points there),
    the figures, then the family's tables. A results file that no command, figure or table names is
    listed by name, so that every file shows on the page."""
    try:
        body = family.tables(files)
    except (KeyError, TypeError, IndexError, StopIteration, ValueError) as e:
        raise ResultsError(f"section {family.anchor!r} cannot read {', '.join(files) or 'its files'}: "
                           f"{type(e).__name__}: {e}") from e
    commands = [src.command or f"# {src.pattern}: {src.note}" for src in family.sources]
    out = [f'<a id="{family.anchor}"></a>', "", f"## {family.title}", "", "```bash", *commands, "```", ""]
    if files:
        line = machine(files)
        seen = machines.get(line)
        out += [f"Machine: as for [{seen}](#{seen})." if seen else f"Machine: {line}.", ""]
        if line != NOT_RECORDED:
            machines.setdefault(line, family.anchor)
        pngs = [Path(n).with_suffix(".png").as_posix() for n in files]
        figures = [f"[{Path(p).stem}]({LINK}/{p})" for p in pngs if (results / p).exists()]
        shown = "\n".join(commands + figures + body)
        unnamed = [f"`{n}`" for n, p in zip(files, pngs, strict=True) if n not in shown and p not in shown]
        out += [f"Figures: {', '.join(figures)}."] if figures else []
        out += [f"Also from {', '.join(unnamed)}."] if unnamed else []
    return out + ([""] if out[-1] else []) + body


def render(results: Path = RESULTS) -> str:
    """The page, from the JSON under `results`."""
    grouped = assign(results)
    out = ["# Benchmark results", "",
           "Generated by `python -m benchmarks.render_results` from `benchmarks/results/*.json`; do not edit by hand "
           "(`tests/unit/test_results_page.py` fails when this page and the JSON differ). How each benchmark works "
           "and what its numbers mean: [benchmarks.md](benchmarks.md).", ""]
    machines: dict[str, str] = {}     # a machine line -> the first section that printed it
    for family in FAMILIES:
        out += section(family, grouped[family.anchor], results, machines)
    return "\n".join(out).rstrip("\n") + "\n"


def check(page: str, path: Path) -> list[str]:
    """[] when `path` holds `page`; else a summary of the differences, with the fix."""
    old = path.read_text() if path.exists() else ""
    if old == page:
        return []
    diff = list(difflib.unified_diff(old.splitlines(), page.splitlines(), str(path), "a fresh render",
                                     lineterm="", n=0))
    changed = sum(1 for d in diff if d[:1] in "+-" and d[:3] not in ("+++", "---"))
    return [f"{path} is stale: {changed} lines differ from a fresh render; run `python -m benchmarks.render_results`. "
            "First differences:", *diff[2:22]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the folder of result JSON files")
    parser.add_argument("--out", type=Path, default=PAGE, help="the page to write (with --check: to compare)")
    parser.add_argument("--check", action="store_true", help="exit 1 when --out differs from a fresh render")
    args = parser.parse_args(argv)
    try:
        page = render(args.results)
    except ResultsError as e:
        print(f"render_results: {e}", file=sys.stderr)
        return 2
    if args.check:
        problems = check(page, args.out)
        if problems:
            print(*problems, sep="\n", file=sys.stderr)
        return 1 if problems else 0
    args.out.write_text(page)
    size = len(page.encode())
    print(f"wrote {args.out} ({size:,} bytes)")
    if size > PAGE_LIMIT:
        print(f"render_results: {size:,} bytes is over the {PAGE_LIMIT:,} a doc may have; trim a table "
              "(keep the most-cited columns, the rest stays in the JSON)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

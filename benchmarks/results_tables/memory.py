"""Sections of docs/results/memory.md: benchmarks/memory/ (states and activations per rank, fine-tuning
controls, the peak of a step, checkpoint bytes) and two removed one-off scripts' JSON (the model
build, per-step page faults)."""

from __future__ import annotations

from benchmarks.results_tables.format import GiB, MiB, fix, pct, pvm, sig, table


def _offloaded(o: dict, unit: int) -> str:
    """The offloaded states against the model; where the model's CPU term is another quantity (the
    fp32 copy every rank builds first, `comparable` false) the measured bytes and that term's name."""
    if o["predicted"] == 0 and o["measured"] == 0:
        return "-"
    if o["comparable"]:
        return pvm(o, unit)
    return f"{sig(o['measured'] / unit, 4)} (model: {o['cpu_term']})"


def _memory_rows(rep: dict, unit: int, mode: str | None = None) -> list[list]:
    """A row per profile: states, offloaded states, measured gradients + optimizer (all places),
    activations, and the process's peak RSS so far where the file has it (`peak_bytes`)."""
    rows = []
    for p in rep["profiles"]:
        m = p["measured"]
        grads_optim = m["grads_gpu"] + m["grads_cpu"] + m["optimizer_gpu"] + m["optimizer_cpu"]
        rows.append(([mode] if mode else []) + [
            p["profile"], pvm(p["gpu"], unit), _offloaded(p["offload"], unit), sig(grads_optim / unit, 4),
            pvm(p["activations"], unit), sig(p["peak_bytes"] / unit, 4) if "peak_bytes" in p else "-"])
    return rows


MEMORY_COLUMNS = ["profile", "states on the accelerator", "offloaded states", "grads + optim",
                  "activations (one micro-batch)", "peak RSS so far"]
PEAK_RSS = ("peak RSS so far: the process's `ru_maxrss` after the profile (`peak_bytes`), cumulative over the rows "
            "(one process runs them in order); a step's own peak: [memory-peak](#memory-peak)")


def _memory_label(rep: dict) -> str:
    """preset, precision, micro; Ψ (parameters) and Ψ_t (trainable, when some are frozen)."""
    c = rep["config"]
    trainable = f", Ψ_t {c['trainable']:,}" if "trainable" in c else ""
    return f"{c['preset']}, {c['precision']}, micro {c['micro']}: Ψ {c['parameters']:,}{trainable}"


def memory(files: dict) -> list[str]:
    """memory.json (every profile, fp32), then each other precision's run (memory_<precision>.json) in its own
    table."""
    rep = files["memory.json"]
    c = rep["config"]
    out = [f"{_memory_label(rep)}; MiB per rank, predicted / measured (ratio); tolerances: states "
           f"{pct(c['model_tolerance'])}, activations {pct(c['activation_tolerance'])}; {PEAK_RSS}:", ""]
    out += table(MEMORY_COLUMNS, _memory_rows(rep, MiB))
    for name, other in files.items():
        if name != "memory.json":
            out += ["", f"`{name}` ({_memory_label(other)}; activations: the towers' saved tensors and, but under "
                    "ZeRO-3, autocast's 16-bit weight copies that autograd saves):", ""]
            out += table(MEMORY_COLUMNS, _memory_rows(other, MiB))
    return out


def memory_finetune(files: dict) -> list[str]:
    """The fine-tuning runs (--set finetune.*) and git-rsclip-base's, one table, a group of rows per file."""
    out = ["MiB per rank, predicted / measured (ratio) and peak RSS so far, as in [memory](#memory) (the full tiny "
           "model); each file's first row names its run:", ""]
    rows = []
    for name, rep in files.items():
        group = _memory_rows(rep, MiB, f"`{name}` ({_memory_label(rep)})")
        rows += group[:1] + [["", *r[1:]] for r in group[1:]]
    return out + table(["run", *MEMORY_COLUMNS], rows)


PEAK_COLUMNS = ["profile", "k", "predicted", "measured", "ratio", "states", "forward/backward (train)", "step",
                "host_states + host_step", "peak in"]


def _peak_rows(rep: dict, ranks: bool = False) -> list[list]:
    rows = []
    for p in rep["profiles"]:
        for k in p["peaks"]:
            t = k["terms"]
            rows.append([p["profile"], *([k["world_size"]] if ranks else []), k["accumulation"],
                         fix(k["predicted"] / GiB, 3), fix(k["measured"] / GiB, 3), fix(k["ratio"], 3),
                         fix(t["states"] / GiB, 3), fix(t["train"] / GiB, 3), fix(t["step"] / GiB, 3),
                         fix((t["host_states"] + t["host_step"]) / GiB, 3), t["phase"]])
    return rows


def memory_peak(files: dict) -> list[str]:
    """memory_peak_base.json (the peak/*.json launches combined): measured peak against the model's, by term;
    then each other combined file (memory_peak_base_<what>.json: ddp, the autocast precisions), with the
    ranks of each row (stage 0 on one rank: no all-reduce) and autocast's weight copies."""
    rep = files["memory_peak_base.json"]
    c = rep["config"]
    out = [f"{c['preset']}, {c['precision']}, micro {c['micro']}; GiB per rank; tolerance "
           f"{pct(c['peak_tolerance'])}; the terms are the model's:", ""]
    out += table(PEAK_COLUMNS, _peak_rows(rep))
    for name, other in files.items():
        if not name.startswith("memory_peak_base_"):
            continue
        c = other["config"]
        weights = max((k["terms"].get("autocast_weights", 0) for p in other["profiles"] for k in p["peaks"]), default=0)
        copies = f"; of forward/backward, autocast's 16-bit weight copies {fix(weights / GiB, 3)}" if weights else ""
        out += ["", f"`{name}`: {c['preset']}, {c['precision']}, micro {c['micro']}; GiB per rank; tolerance "
                    f"{pct(c['peak_tolerance'])}{copies}:", ""]
        out += table(PEAK_COLUMNS[:1] + ["ranks"] + PEAK_COLUMNS[1:], _peak_rows(other, ranks=True))
    return out


def build_rss(files: dict) -> list[str]:
    """Per precision x allocator x build: parameters held and the resident set after each stage."""
    rep = files["build_rss.json"]
    c = rep["config"]
    out = [f"{c['preset']}, `{c['profile']}`, {c['ranks']} ranks; GiB per rank, the larger rank:", ""]
    g = (lambda b: fix(b / GiB, 3))
    rows = []
    for v in rep["variants"]:
        m = v["max_over_ranks"]
        rows.append([v["precision"], v["mmap_threshold"], v["build"], g(m["model"]["params_held"]),
                     g(m["start"]["hwm"]), g(m["model"]["hwm"]), g(m["model"]["rss"]), g(m["engine"]["hwm"]),
                     g(m["engine"]["rss"]), g(m["trimmed"]["rss"])])
    return out + table(["precision", "mmap_threshold", "build", "params held", "start HWM", "model-build HWM",
                        "RSS after model", "engine-build HWM", "RSS after engine", "RSS after malloc_trim"], rows)


def checkpoint_bytes(files: dict) -> list[str]:
    """Each file (this checkout, an older one) x ranks: bytes by kind of checkpoint file, and in all."""
    b = (lambda r, kind: f"{r['bytes'][kind]:,}")
    rows = [[f"`{name}`", r["ranks"], f"{r['model_states_file_bytes'][0]:,}", b(r, "deepspeed_model_states"),
             b(r, "deepspeed_optim_states"), b(r, "rsclip_ds"), f"{r['total']:,}", sig(r["overhead_per_rank"])]
            for name, rep in files.items() for r in rep["runs"] if r.get("ok", True)]
    steps = next(iter(files.values()))["config"]["steps"]    # ZeRO-3 and tiny: the script's fixed setting
    head = f"ZeRO-3, tiny, {steps} steps, one checkpoint; bytes:"
    return [head, ""] + table(["file", "ranks", "model-state file per rank", "DeepSpeed model states (all ranks)",
                               "optimizer states", "rsclip_ds files", "total", "overhead per rank"], rows)


def step_faults(files: dict) -> list[str]:
    """Minor page faults and system time per step, per case (engine, allocator, AdamW, pages)."""
    rep = files["step_faults.json"]
    c = rep["config"]
    phases = ("forward", "backward", "step")
    rows = [[name, ", ".join(c["cases"][name]), sig(r["faults_total_per_step"]), fix(r["mb_per_step"], 1),
             " / ".join(fix(r["faults_per_step"][p] * 4096 / 1e6, 1) for p in phases), sig(r["sys_ms_total"]),
             sig(sum(r["wall_ms_per_step"].values()))]
            for name, r in rep["cases"].items()]
    out = [f"Rank 0, {c['steps']} steps after {c['warmup']}; MB = minor faults x 4096 bytes (a fault in a huge "
           "page fills 2 MiB: compare the huge-pages cases by faults and time):", ""]
    return out + table(["case", "engine, allocator, AdamW, pages", "faults / step", "MB faulted / step",
                        "forward / backward / step MB", "sys ms / step", "wall ms / step"], rows)

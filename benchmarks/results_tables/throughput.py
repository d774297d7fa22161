"""Sections of docs/results/throughput.md: benchmarks/throughput/ (against open_clip's trainer),
benchmarks/gpu/run.py, and the JSON of removed one-off scripts (our loop against a bare DeepSpeed loop
and the Hugging Face Trainer; patch dropout, distillation, compilation on CPU ranks)."""

from __future__ import annotations

from benchmarks.results_tables.format import GiB, fix, pct, sig, spread, table


def throughput(files: dict) -> list[str]:
    """throughput.json in full; every run (earlier ones too) as a column of the ratios and a row of
    its other headline numbers."""
    cur = files["throughput.json"]
    c = cur["config"]
    out = [f"{c['preset']} preset, `{c['profile']}`, {c['precision']}, micro {c['micro']} per rank x "
           f"{cur['environment']['world_size']} ranks, {c['steps']} steps x {c['repeats']} interleaved repeats "
           "(`throughput.json`); global samples/s on the slowest rank:", ""]
    rate = (lambda x: sig(x, 4))
    out += table(["loop", "samples/s median (min..max)", "CPU ms/sample", "data wait"],
                 [[name, spread({**r, "median": r["median_samples_per_s"]}, rate), fix(r["median_cpu_ms_per_sample"]),
                   pct(r["median_data_wait_fraction"], 1)] for name, r in cur["summary"]["loops"].items()])
    names = list(dict.fromkeys(n for rep in files.values() for n in rep["summary"]["ratios"]))
    ratio = (lambda r: "-" if r is None else f"{spread(r, fix)} / {fix(r['cpu_median'])}")
    out += ["Ratios paired within each repeat, per run: wall-clock median (min..max) / CPU time per sample:", ""]
    out += table(["ratio", *(f"`{name}`" for name in files)],
                 [[n, *(ratio(rep["summary"]["ratios"].get(n)) for rep in files.values())] for n in names])
    loops = [p["loop"] for p in cur["python_self_time"]]
    out += ["Per run: Python self time per step in each loop's own code; summary.json's rate over the steps' "
            "(with the final save):", ""]
    out += table(["run", "wall s", "loader alone, samples/s", "x what ours consumes",
                  "Python ms/step: " + " / ".join(loops), "summary / steps"],
                 [[f"`{name}`", sig(rep["seconds"]),
                   rate(rep["loader"]["samples_per_s"]), fix(rep["loader"]["headroom_over_ours"], 1),
                   " / ".join(fix(p["self_ms_per_step"]) for p in rep["python_self_time"]),
                   fix(rep["summary_rate_with_final_checkpoint"]["summary_over_steps"])]
                  for name, rep in files.items()])
    q = cur["quality"]
    out += [f"Quality at equal compute ({q[0]['steps']} steps, global batch {q[0]['global_batch']}, "
            f"{q[0]['num_images']} held-out pairs):", ""]
    keys = ["i2t_R@1", "t2i_R@1", "i2t_R@5", "t2i_R@5", "mean_recall", "final_train_loss"]
    return out + table(["negatives", *keys], [[r["negatives"], *(fix(r[k], 3) for k in keys)] for r in q])


def openclip_tables(rep: dict) -> list[str]:
    """The open_clip comparison (throughput/openclip.py, gpu/run.py --open-clip): a row per case, the
    paired ratios ("rsclip_ds/... / open_clip/...") beside the rsclip_ds case they belong to."""
    c, m, s = rep["config"], rep["models"], rep["summary"]
    out = [f"Shape {c['shape']} ({m['rsclip_ds_parameters']:,} parameters in rsclip_ds, "
           f"{m['open_clip_parameters']:,} in open_clip), micro {c['micro']} x {c['ranks']} ranks, "
           f"{c['steps']} steps x {c['repeats']} repeats, rates over steps {c['skip'] + 1}..{c['steps']}:", ""]
    paired: dict[str, list[str]] = {}
    for key, r in s["ratios"].items():
        ours, theirs = key.split(" / ")
        paired.setdefault(ours, []).append(f"{theirs.removeprefix('open_clip/')}: {spread(r, fix)}")
    pss = lambda r: fix(r["peak_pss_gb"]["median"], 2) if r.get("peak_pss_gb", {}).get("median") else "-"
    ran = {case: r for case, r in s["cases"].items() if r["runs"]}
    out += table(["case", "samples/s median (min..max)", "peak PSS GB (process tree)", "start-up s",
                  "minor faults / step / rank", "sys ms / step",
                  "samples/s over open_clip's, paired per repeat: median (min..max)"],
                 [[case, spread(r["samples_per_s"], lambda x: sig(x, 4)), pss(r), sig(r["startup_s"]["median"]),
                   sig(r["minflt_per_step_per_rank"]["median"]), sig(r["sys_ms_per_step"]["median"]),
                   "; ".join(paired.get(case, [])) or "-"] if case in ran else [case, "failed", *["-"] * 5]
                  for case, r in s["cases"].items()])
    foreign = max((r["foreign_cpu_share"]["max"] for r in ran.values()), default=0.0)
    return out + [f"Other processes took at most {pct(foreign, 1)} of the cores during a kept run "
                  "(`foreign_cpu_share`).", ""]


def throughput_openclip(files: dict) -> list[str]:
    """The harness-style comparison, then (when measured) the users' style and the peers."""
    out = openclip_tables(files["throughput_openclip.json"])
    for name, what in (("throughput_openclip_users.json", "each tool's own thread default, default checkpoints"),
                       ("throughput_openclip_peers.json", "the same feature on both sides")):
        if name in files:
            out += [f"`{name}` ({what}):", "", *openclip_tables(files[name])]
    return out


def _gpu_cases(rep: dict) -> list[str]:
    rows = []
    for r in rep["cases"]:
        if not r["ok"]:
            rows.append([r["case"], "-", "-", "-", "-", "-", "-", r.get("error", "failed")])
            continue
        mem = r["peak_memory_bytes"]
        rows.append([r["case"], sig(r["samples_per_s"], 4), sig(r["step_ms"]), sig(r["achieved_tflops"]),
                     pct(r["mfu"], 1), pct(r["hfu"], 1), fix(mem / GiB, 1) if mem else "-",
                     pct(r["data_wait_fraction"], 1) if r.get("data") == "loader" else ""])
    out = table(["case", "samples/s", "step ms", "TFLOP/s", "MFU", "HFU", "peak GiB", "data wait / error"], rows)
    if rep.get("loader_vs_tensor"):
        out += table(["case", "tensor samples/s", "loader samples/s", "loader / tensor", "data wait", "workers"],
                     [[p["case"], sig(p["tensor_samples_per_s"], 4), sig(p["loader_samples_per_s"], 4),
                       fix(p["loader_over_tensor"], 3), pct(p["data_wait_fraction"], 1), p["loader_workers"]]
                      for p in rep["loader_vs_tensor"]])
    if rep.get("variants_vs_base"):
        out += table(["case", "variant", "base samples/s", "variant samples/s", "variant / base", "peak memory ratio"],
                     [[p["case"], p["variant"], sig(p["base_samples_per_s"], 4), sig(p["variant_samples_per_s"], 4),
                       fix(p["variant_over_base"], 3), fix(p["peak_memory_ratio"], 2) if p["peak_memory_ratio"] else "-"]
                      for p in rep["variants_vs_base"]])
    if rep.get("ours_vs_twin"):
        out += ["Ours against the plain PyTorch twin (`benchmarks/twin.py`) on the same model and batch: samples/s "
                "ours / the twin's (1.00: the floor's speed), MFU beside:", ""]
        out += table(["case", "samples/s", "MFU", "twin eager samples/s", "twin eager MFU", "ours / eager",
                      "twin compiled samples/s", "twin compiled MFU", "ours / compiled"],
                     [[p["case"], sig(p["samples_per_s"], 4), pct(p["mfu"], 1),
                       sig(p["twin_eager_samples_per_s"], 4), pct(p["twin_eager_mfu"], 1), fix(p["over_twin_eager"], 3),
                       sig(p["twin_compiled_samples_per_s"], 4), pct(p["twin_compiled_mfu"], 1),
                       fix(p["over_twin_compiled"], 3)]
                      for p in rep["ours_vs_twin"]])
    if rep.get("hybrid_vs_zero3"):
        out += table(["case", "samples/s vs zero3", "final loss", "zero3 final loss"],
                     [[p["case"], fix(p["speed_vs_zero3"], 3), fix(p["final_loss"], 4), fix(p["zero3_final_loss"], 4)]
                      for p in rep["hybrid_vs_zero3"]])
    return out


def gpu(files: dict) -> list[str]:
    """benchmarks/gpu/run.py's reports: its cases (and the loader, variant, twin and hybrid pairings
    when run), or, from --open-clip, the open_clip comparison."""
    if not files:
        return ["Not measured yet: none of these files is in `benchmarks/results/`.", ""]
    out = []
    for name, rep in files.items():
        if "cases" not in rep:
            out += [f"`{name}`:", "", *openclip_tables(rep)]
            continue
        devices = sorted({r["device"] for r in rep["cases"] if r["ok"]})
        out += [f"`{name}` ({', '.join(devices) or 'no case ran'}, {rep['config']['precision']}, one rank):", ""]
        out += _gpu_cases(rep)
    return out


def patch_dropout(files: dict) -> list[str]:
    """A row per patch-dropout fraction: samples/s and its ratio to p = 0, FLOPs and activation bytes
    (measured on the CPU beside the planner's estimate), and quality after the same matmul FLOPs."""
    rep = files["patch_dropout.json"]
    c = rep["config"]
    out = [f"{c['model']}; `{c['profile']}`, {c['precision']}, micro {c['micro']} per rank x "
           f"{rep['environment']['world_size']} ranks; {c['data']}. Samples/s over the masked steps after step 1; "
           f"activations: bytes per sample saved for backward by both towers; quality after the matmul FLOPs of "
           f"{c['steps_p0']} unmasked steps (a masked run's last {c['tail']} steps unmasked), evaluated on every "
           "patch:", ""]
    rows = [[fix(r["patch_dropout"]), sig(r["samples_per_s"]), fix(r["samples_per_s_ratio"]), fix(r["flops_ratio"]),
             f"{sig(r['measured_activation_bytes']['both'] / 2**20)} / "
             f"{sig(sum(r['planned_activation_bytes'].values()) / 2**20)}",
             f"{fix(r['activation_ratio'])} / {fix(r['planned_activation_ratio'])}", r["steps"],
             fix(r["final_train_loss"], 3), pct(r["zero_shot_top1"], 1), pct(r["retrieval_mean_recall"], 1)]
            for r in rep["rows"]]
    out += table(["p", "samples/s", "samples/s ratio", "FLOPs ratio", "activation MiB measured / planned",
                  "activation ratio measured / planned", "steps", "train loss (last 3)", "zero-shot top-1",
                  "retrieval mean recall"], rows)
    chance = rep["rows"][0]["chance_zero_shot_top1"] if rep["rows"] else None
    return out + [f"Zero-shot top-1 of the untrained model (step 0): {pct(chance, 1)}.", ""]


def distill(files: dict) -> list[str]:
    """A row per (accumulation, teacher) case: samples/s and seconds per step; the teacher's cost as the
    samples/s ratio paired within each repeat, beside the FLOPs count's prediction."""
    rep = files["distill.json"]
    c = rep["config"]
    out = ([f"**Preliminary**: {rep['preliminary']}", ""] if rep.get("preliminary") else [])
    out += [f"Student: {c['student']} ({c['parameters']['student']:,} parameters); teacher: {c['teacher']} "
            f"({c['parameters']['teacher']:,}). `{c['profile']}`, {c['precision']}, micro {c['micro']} x "
            f"{c['accumulation_steps']} micro-batches per step x {rep['environment']['world_size']} ranks, "
            f"{c['steps']} steps (timed 2..{c['steps']}) x {c['repeats']} interleaved repeats; {c['data']}:", ""]
    out += table(["case", "samples/s median (min..max)", "s/step median (min..max)"],
                 [[name, spread(r["samples_per_s"], sig), spread(r["seconds_per_step"], sig)]
                  for name, r in rep["summary"]["cases"].items()])
    out += ["Samples/s with the teacher over without, paired per repeat, and the matmul FLOPs count's ratio:", ""]
    return out + table(["accumulation", "measured median (min..max)", "planned (FLOPs)"],
                       [[acc, spread(r, fix), fix(r["planned"])] for acc, r in rep["summary"]["ratios"].items()])


def compile_profiles(files: dict) -> list[str]:
    """A row per ZeRO profile: eager and compiled samples/s of each interleaved pair, their ratio, the
    compile seconds (the start-up line's), the losses' agreement; a refused profile with its reason."""
    rep = files["compile.json"]
    c = rep["config"]
    out = [f"{c['model']}; `{c['backend']}`, {c['precision']}, micro {c['micro']} per rank x "
           f"{rep['environment']['world_size']} ranks, {c['steps']} steps per run, {c['repeats']} eager/compiled "
           f"pair(s) per profile; {c['data']}. Samples/s over steps 2..{c['steps']}; compile s: the compiled run's "
           "first step minus its mean later step (the first pair compiles cold, later pairs may hit inductor's "
           "on-disk cache); loss diff: the largest relative difference of the per-step losses of a pair:", ""]
    if c.get("note"):
        out[0] = f"**{c['note']}** " + out[0]
    rows = []
    for r in rep["rows"]:
        if r["status"] == "refused":
            rows.append([f"`{r['profile']}`", "refused", "-", "-", "-", r["reason"]])
            continue
        rows.append([f"`{r['profile']}`", ", ".join(sig(v) for v in r["eager_samples_per_s"]),
                     ", ".join(sig(v) for v in r["compiled_samples_per_s"]), fix(r["ratio_median"]),
                     ", ".join(fix(v, 1) for v in r["compile_s"]), f"{r['loss_max_rel_diff']:.1e}"])
    out += table(["profile", "eager samples/s", "compiled samples/s", "compiled / eager (median)", "compile s",
                  "loss diff / refusal"], rows)
    return out

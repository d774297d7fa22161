"""Sections of docs/results/training.md, from the JSON of scripts removed once their findings were
recorded (render_results.RESTORE restores them): benchmarks/loss/ (loss memory and accumulation) and
benchmarks/precision/ (bf16 gradient accumulation, bf16 master weights)."""

from __future__ import annotations

from benchmarks.results_tables.format import MiB, fix, pct, sig, table


def contrastive(files: dict) -> list[str]:
    """Loss forms per global batch (held bytes, their ratios, time); accumulation per k (saved
    activations, step seconds)."""
    rep = files["contrastive.json"]
    c = rep["config"]
    held = {(r["form"], r["B_global"]): r["held_bytes_max_rank"] for r in rep["loss_forms"]}
    ratio = (lambda pair, b, key: next(r[key] for r in rep["loss_ratios"] if (r["pair"], r["B_global"]) == (pair, b)))
    siglip = ("siglip_naive", "siglip_ring", "siglip_ring_chunked")
    rows = [[b, " / ".join(sig(held[(f, b)] / MiB) for f in siglip), fix(ratio("siglip naive/ring", b, "bytes_ratio")),
             sig(ratio("siglip naive/ring_chunked", b, "bytes_ratio")),
             fix(ratio("siglip naive/ring", b, "time_ratio")), fix(ratio("clip naive/local", b, "bytes_ratio"))]
            for b in c["global_batches"]]
    out = [f"Loss forms on {rep['environment']['world_size']} ranks, D = {c['dim']} features; held bytes are the "
           "larger rank's:", ""]
    out += table(["B_global", "SigLIP held MiB naive / ring / ring+chunks", "bytes naive / ring",
                  "bytes naive / ring+chunks", "time naive / ring", "CLIP bytes naive / local"], rows)
    acc = {(r["mode"], r["k"]): r for r in rep["accumulation"]}
    modes = ("plain", "global", "big_batch")
    out += [f"Accumulation: {c['layers']}-layer width-{c['width']} SigLIP, micro {c['micro']} per rank:", ""]
    return out + table(["k", "peak saved MiB " + " / ".join(modes), "step s " + " / ".join(modes),
                        "step time global / plain"],
                       [[a["k"], " / ".join(sig(acc[(m, a["k"])]["peak_saved_bytes"] / MiB) for m in modes),
                         " / ".join(fix(acc[(m, a["k"])]["step_seconds"], 3) for m in modes),
                         fix(a["global_over_plain_time"])] for a in rep["accumulation_ratios"]])


def grad_accum(files: dict) -> list[str]:
    """A row per profile, a column per case: the towers' gradient error against the fp32 big batch."""
    rep = files["grad_accum.json"]
    c = rep["config"]
    cases = list(dict.fromkeys(r["case"] for r in rep["rows"]))
    by = {(r["profile"], r["case"]): r for r in rep["rows"]}
    rows = [[p, *(f"{by[(p, k)]['rel_err_towers']:.2e}" if (p, k) in by else "-" for k in cases),
             f"{by[(p, cases[0])]['accum_err']:.2e}", by[(p, "accum fp32")]["optimizer"],
             by[(p, "auto")]["buffer_dtype"] or "-"]
            for p in dict.fromkeys(r["profile"] for r in rep["rows"])]
    out = [f"{c['preset']}, k = {c['k']} micro-batches of {c['micro']}, {c['loss']} loss, '{c['accumulation']}' "
           "accumulation; relative L2 error of the towers' gradient against the fp32 big batch "
           "(`rel_err_towers`):", ""]
    return out + table(["profile", *cases, f"{cases[0]} vs fp32 (`accum_err`)", "optimizer with fp32",
                        "buffer dtype under auto"], rows)


def pure_bf16(files: dict) -> list[str]:
    """A row per precision mode: held-out retrieval and zero-shot (mean over seeds), loss, speed."""
    rep = files["pure_bf16.json"]
    c = rep["config"]
    keys = ["retrieval/i2t_R@1", "retrieval/t2i_R@1", "retrieval/i2t_R@5", "retrieval/t2i_R@5"]
    rows = []
    for mode, m in rep["modes"].items():
        recall = [100 * r["retrieval/mean_recall"] for r in rep["runs"] if r["mode"] == mode]
        rows.append([mode, *(fix(100 * m[k], 1) for k in keys),
                     f"{fix(100 * m['retrieval/mean_recall'], 1)} ({fix(min(recall), 1)}-{fix(max(recall), 1)})",
                     fix(100 * m["zero_shot/top1"], 1), fix(m["final_train_loss"]), sig(m["samples_per_s"]),
                     pct(m["unchanged_fraction"], 1)])
    seeds = ", ".join(map(str, c["seeds"]))
    out = [f"{c['preset']} (`{c['base_config']}`), `{c['profile']}`, micro {c['micro']} per rank, {c['steps']} "
           f"steps, seeds {seeds}; mean over the seeds, in %, mean recall with its range:", ""]
    return out + table(["mode", *(k.split("/")[1] for k in keys), "mean recall", "zero-shot top-1",
                        "final train loss", "samples/s", "masters never moved"], rows)

"""Sections of docs/results/comms.md: benchmarks/comms/ (bytes per step against the model, hpZ, scaling on
paper with the 4 x A100 check) and the removed heartbeat script's JSON (store traffic)."""

from __future__ import annotations

from benchmarks.results_tables.format import MiB, fix, pct, sig, table


def _comms_cells(r: dict) -> list[str]:
    e = r["engine"]
    return [f"{fix(e['predicted'] / MiB)} / {fix(e['logged'] / MiB)} ({fix(e['ratio'], 4)})",
            fix(r["c10d"]["ratio"], 4), fix(sum(r["ring_bytes_per_rank"].values()) / MiB)]


C10D = ("c10d: the torch profiler's bytes (the engine's and the loss's collectives) over the model's "
        "(`c10d` in the JSON); ring: what the model says a rank sends with ring algorithms (engine + loss)")


def comms_tables(files: dict[str, dict]) -> list[str]:
    """One row per (profile, k, loop), a column triple per file (its world size): engine bytes
    predicted / logged (ratio), the c10d ratio (engine + loss) and the ring bytes."""
    keyed = {n: {(r["profile"], r["accumulation"], r["mode"]): r for r in rep["rows"]} for n, rep in files.items()}
    keys = list(dict.fromkeys(k for rows in keyed.values() for k in rows))
    header = ["profile", "k", "loop"]
    for rep in files.values():
        w = rep["environment"]["world_size"]
        header += [f"{w} ranks: predicted / logged MiB (ratio)", f"{w} ranks: c10d", f"{w} ranks: ring MiB"]
    gap = ["-", "-", "-"]
    rows = [[*key, *(c for rows in keyed.values() for c in (_comms_cells(rows[key]) if key in rows else gap))]
            for key in keys]
    return table(header, rows)


def _calls_changed(a: dict, b: dict) -> str:
    """'op a -> b' for each collective whose calls per step differ between rows a and b."""
    before = {op: v["calls_logged"] for op, v in a["engine"]["by_op"].items()}
    return ", ".join(f"{op} {before.get(op, 0):g} -> {v['calls_logged']:g}" for op, v in b["engine"]["by_op"].items()
                     if v["calls_logged"] != before.get(op, 0))


def comms(files: dict) -> list[str]:
    """The default-bucket runs in comms_w2.json's precision side by side by world size; a run in another
    precision (comms_w2_amp_bf16.json) in its own table; a run with --bucket against comms_w2.json."""
    main = files["comms_w2.json"]["config"]["precision"]
    plain = {n: rep for n, rep in files.items()
             if rep["config"]["bucket"] is None and rep["config"]["precision"] == main}
    c = next(iter(plain.values()))["config"]
    out = [f"Per optimizer step and rank (messages, DeepSpeed's comms logger); {c['precision']}, micro {c['micro']}, "
           f"width {c['hidden']} ({c['parameters']:,} parameters); tolerance {pct(c['tolerance'])}; {C10D}:", ""]
    out += comms_tables(plain)
    for name, rep in files.items():
        c = rep["config"]
        if c["bucket"] is None and c["precision"] != main:
            out += ["", f"`{name}`: {c['precision']}, micro {c['micro']}, width {c['hidden']} ({c['parameters']:,} "
                    "parameters): the gradients of Linear/Conv parameters on the wire in bf16, the rest in fp32; "
                    "ddp's all-reduce is rsclip_ds's (torch.distributed: the c10d column, the logger sees none of it):",
                    ""]
            out += comms_tables({name: rep})
    base = {(r["profile"], r["accumulation"], r["mode"]): r for r in files["comms_w2.json"]["rows"]}
    for name, rep in files.items():
        if rep["config"]["bucket"] is None:   # shown above
            continue
        out += [f"`{name}`: buckets of {rep['config']['bucket']:,} elements against the profiles' own "
                "(`comms_w2.json`):", ""]
        rows = []
        for r in rep["rows"]:
            own = base[(r["profile"], r["accumulation"], r["mode"])]
            rows.append([r["profile"], r["accumulation"], r["mode"],
                         f"{fix(own['engine']['logged'] / MiB)} / {fix(r['engine']['logged'] / MiB)}",
                         _calls_changed(own, r)])
        out += table(["profile", "k", "loop", "logged MiB, own / small buckets", "calls per step that changed"], rows)
    return out


def comms_hpz(files: dict) -> list[str]:
    """ZeRO-3 with hpZ beside plain ZeRO-3 on 4 ranks."""
    rep = files["comms_w4_hpz.json"]
    c = rep["config"]
    out = [f"{c['precision']}, micro {c['micro']}, width {c['hidden']} ({c['parameters']:,} parameters); columns as in "
           "[comms](#comms):", ""]
    return out + comms_tables(files)


def scaling(files: dict) -> list[str]:
    """Minutes per epoch per (network, nodes) and profile, as benchmarks/comms/scaling.py's own
    markdown lays them out, computed here from its rows (not its pre-rendered text, so the page
    follows the numbers); then the 4 x A100 check."""
    rep = files["scaling.json"]
    c = rep["config"]
    rows = []
    for net in c["networks"]:
        for nodes in c["nodes"]:
            mine = [next(r for r in rep["rows"] if (r["network"], r["nodes"], r["profile"]) == (net, nodes, p))
                    for p in c["profiles"]]
            fit = [r for r in mine if r["fits"]]
            shape = sorted({f"{r['micro']}x{r['accumulation']}{' ckpt' if r['checkpointing'] else ''}" for r in fit})
            z3 = next((r for r in fit if r["profile"] == "zero3"), None)
            bound = (lambda r: max(r["compute_s"], r["comm_s"]))       # step s with perfect overlap
            ideal = min(fit, key=bound) if fit else None
            rows.append([net, nodes, ", ".join(shape) or "-",
                         *(sig(r["epoch_h"] * 60) if r["fits"] else "no fit" for r in mine),
                         pct(z3["comm_s"] / z3["step_s"]) if z3 else "-",
                         f"{sig(ideal['steps_per_epoch'] * bound(ideal) / 60)} ({ideal['profile']})" if ideal else "-"])
    out = [f"{c['model']} on N nodes x {c['gpus_per_node']} GPUs of {sig(c['gpu_mem_gb'])} GB, global batch "
           f"{c['global_batch']:,}, {sig(c['samples'])} samples per epoch, {pct(c['mfu'])} MFU of "
           f"{sig(c['peak_tflops'])} TFLOP/s, {sig(c['intra_gbs'])} GB/s inside a node, overlap "
           f"{fix(c['overlap'], 1)}. Minutes per epoch:", ""]
    out += table(["network", f"nodes x {c['gpus_per_node']}", "micro x k", *c["profiles"],
                  "comm share (zero3)", "best, perfect overlap"], rows)
    if rep.get("a100"):
        out += a100(rep["a100"])
    return out


def a100(check: list[dict]) -> list[str]:
    """The 4 x A100 check, a row per (model, samples/GPU): the 1-GPU side, then per link the 4-GPU
    side at each overlap (profile, step s, comm s: the planner may pick another profile once
    communication hides) and the speed-up at each overlap."""
    def shape(side: dict, n: int) -> str:       # micro x k only where it is not samples/GPU x 1
        mk = "" if (side["micro"], side["accumulation"]) == (n, 1) else f" {side['micro']}x{side['accumulation']}"
        return side["profile"] + mk + (" ckpt" if side["checkpointing"] else "")

    links = list(dict.fromkeys(r["link"] for r in check))
    overlaps = list(dict.fromkeys(r["overlap"] for r in check))
    at = {(r["model"], r["per_gpu"], r["link"], r["overlap"]): r for r in check}
    rows = []
    for model, n in dict.fromkeys((r["model"], r["per_gpu"]) for r in check):
        mine = [at[(model, n, link, o)] for link in links for o in overlaps]
        one = dict.fromkeys(f"{shape(r['one'], n)}, {fix(r['one']['step_s'], 3)}" for r in mine)  # 1 GPU: no comm
        row = [model, n, " / ".join(one)]
        for link in links:
            four = [at[(model, n, link, o)]["four"] for o in overlaps]
            row += [f"{shape(f, n)}, {fix(f['step_s'], 3)} ({fix(f['comm_s'], 3)})" for f in four]
            row += [" / ".join(f"{fix(at[(model, n, link, o)]['speedup'])}x" for o in overlaps)]
        rows.append(row)
    over = " / ".join(f"{o:g}" for o in overlaps)
    header = ["model", "samples/GPU", "1 GPU",
              *(c for link in links for c in (*(f"{link}: 4 GPUs, overlap {o:g}" for o in overlaps),
                                               f"{link}: speed-up, overlap {over}"))]
    return ["4 x A100 80GB against one (weak scaling): the planner's profile, step s (comm s) at each overlap; "
            "speed-up = 4 x step(1) / step(4):", "", *table(header, rows)]


def heartbeat(files: dict) -> list[str]:
    """Store requests and waits per protocol and world size; the dead-rank runs: who reported, how soon."""
    rep = files["heartbeat.json"]
    rows = []
    for r in rep["runs"]:
        beats = (f"{sig(r['beats_per_rank_median'])} of {r['beats_expected_per_rank']}"
                 if "beats_per_rank_median" in r else "-")
        dead = (f"rank {r['dead_rank']}: {len(r['reported_by'])} ranks, "
                f"{fix(r['seconds_to_report_after_death'], 1)} s" if "dead_rank" in r else "-")
        rows.append([r["protocol"], r["ranks"], sig(r["requests_per_s"]), sig(r["requests_per_interval"]),
                     f"{pct(r['store_wait_per_interval_median'], 1)} ({pct(r['store_wait_per_interval_max'], 1)})",
                     beats, dead])
    ratio = ", ".join(f"{w} ranks {fix(x, 1)}x" for w, x in rep["ratio_requests_per_s"].items())
    out = [f"Simulated ranks on one TCPStore, a beat every {sig(rep['config']['interval'])} s; all-to-all / rank0 "
           f"requests per second: {ratio}.", ""]
    return out + table(["protocol", "ranks", "requests/s", "requests / interval",
                        "store wait, share of an interval: median (max)", "beats per rank",
                        "a dead rank: reported by, after"], rows)

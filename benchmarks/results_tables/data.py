"""Sections of docs/results/data.md: benchmarks/data/loader.py (the loader per CPU-second) and the JSON
of removed one-off scripts (JPEG decoders on one core, make-shards, check-leakage)."""

from __future__ import annotations

import statistics

from benchmarks.results_tables.format import fix, pct, sig, spread, table


def decode(files: dict) -> list[str]:
    """A row per method, a column per (source px -> model px): `pil`'s rate, the others' ratio to it."""
    rep = files["decode.json"]
    res = rep["results"]
    rows = []
    for m in dict.fromkeys(m for r in res for m in r["methods"]):
        cells = []
        for r in res:
            x = r["methods"].get(m)
            if x is None:
                cells.append("-")
            elif m == "pil":
                cells.append(sig(x["per_core_summary"]["median"], 4))
            else:
                diff = x["pixels"]["max"]
                cells.append(fix(x["ratio_to_pil_summary"]["median"]) + (f" ({diff})" if diff else ""))
        rows.append([m, *cells])
    out = [f"{rep['setup']['num_images']} JPEGs per source size, one core; `pil`: samples per CPU-second; the others: "
           "x `pil`, median over the repeats (largest pixel difference from `pil` in grey levels, when not 0):", ""]
    return out + table(["method", *(f"{r['source_px']} -> {r['size']}" for r in res)], rows)


def _loader_cells(r: dict, full: bool) -> list[str]:
    med = (lambda k: sig(r[k]["per_cpu_second_summary"]["median"], 4))
    ratio = spread(r["ratios"]["loader/bare_pil"], fix)
    if not full:
        return [med("loader"), ratio]
    return [med("loader"), med("loader_pil"), med("bare_pil"), med("bare_fast"), ratio,
            spread(r["ratios"]["loader_pil/bare_pil"], fix), pct(statistics.median(r["loader"]["main_cpu_share"]))]


def _rates(cur: dict, earlier: dict[str, dict]) -> list[str]:
    key = (lambda r: (r["image_size"], r["workers"]))
    old = {n: {key(r): r for r in rep["results"]} for n, rep in earlier.items()}
    rows = [[*key(r), *_loader_cells(r, True),
             *(c for by in old.values() for c in (_loader_cells(by[key(r)], False) if key(r) in by else ["-", "-"]))]
            for r in cur["results"]]
    return table(["input", "workers", "loader", "loader_pil", "bare_pil", "bare_fast", "loader / bare_pil",
                  "loader_pil / bare_pil", "main process share",
                  *(c for n in earlier for c in (f"`{n}`: loader", "loader / bare_pil"))], rows)


def _cores(files: dict) -> list[str]:
    cur = files["loader.json"]["cores_per_gpu"]
    cell = (lambda c: f"{fix(c['cores_per_gpu'])} ({fix(min(c['cores_per_gpu_range']))}.."
                      f"{fix(max(c['cores_per_gpu_range']))})")
    return table(["preset", "input", "needs samples/s", *(f"`{n}`" for n in files), "with PIL's decode"],
                 [[p, c["image_size"], f"{c['samples_per_s_per_gpu']:,}",
                   *(cell(rep["cores_per_gpu"][p]) for rep in files.values()), fix(c["cores_per_gpu_pil_loader"])]
                  for p, c in cur.items()])


def _breakdown(files: dict) -> list[str]:
    cols = [(n, size) for n, rep in files.items() for size in rep["breakdown"]]
    bd = (lambda n, size: files[n]["breakdown"][size])
    stages = list(dict.fromkeys(k for n, size in cols for k in bd(n, size)["us_per_sample"]))
    rows = [[st, *(sig(bd(n, sz)["us_per_sample"].get(st)) for n, sz in cols)] for st in stages]
    rows += [["loader with 1 worker", *(sig(bd(n, sz)["loader_us_per_sample_1_worker"]) for n, sz in cols)],
             ["hand-over + main process",
              *(sig(bd(n, sz)["hand-over + main process (loader minus stream)"]) for n, sz in cols)]]
    return table(["stage", *(f"{sz} px, {bd(n, sz)['pixel_dtype'].removeprefix('torch.')} (`{n}`)" for n, sz in cols)],
                 rows)


def loader(files: dict) -> list[str]:
    """loader.json in full; an earlier run (its `note` says which) as its loader column and ratio, and
    beside it in the cores-per-GPU and per-stage tables."""
    cur = files["loader.json"]
    s, earlier = cur["setup"], {n: rep for n, rep in files.items() if n != "loader.json"}
    out = [f"{s['num_images']} JPEGs of {s['source_px']} px, micro {s['micro_batch_size']}, {s['repeats']} repeats; "
           "samples per CPU-second (main process + workers), median; ratios median (min..max)"
           + "".join(f"; `{n}`: {rep.get('note', 'an earlier run')}" for n, rep in earlier.items()) + ":", ""]
    out += _rates(cur, earlier)
    out += ["Cores per GPU (the preset's samples/s / the loader's samples per CPU-second):", "", *_cores(files)]
    return out + ["Where a sample's CPU time goes (`--breakdown`), microseconds per sample:", "", *_breakdown(files)]


def ingest(files: dict) -> list[str]:
    """ingest.json: make-shards --hf-dataset against the bare pyarrow + tarfile loop, per CPU-second,
    and the Git-10M projection."""
    rep = files["ingest.json"]
    res, p = rep["results"], rep["git10m_projection"]
    out = [f"{rep['rows']:,} Git-10M-shaped rows (256 px JPEGs) in parquet files of {rep['rows_per_file']:,} rows, "
           f"shards of {rep['shard_size']:,}, {rep['repeats']} repeats, each variant in a fresh process; rows per "
           "CPU-second of the process and its workers (user + system), median (min..max); the ratio to the bare "
           f"loop paired per repeat (target >= {rep['target_ratio']}); past start-up: (rows - {rep['small_rows']}) / "
           f"(CPU - the {rep['small_rows']}-row run's CPU), the rate a long conversion sees; the bytes written are "
           "identical:", ""]
    four = (lambda x: sig(x, 4))
    rows = [[name, spread(r["rows_per_cpu_s"], four), spread(r["ratio_to_bare"], fix) if "ratio_to_bare" in r else "1",
             sig(statistics.median(r["startup_cpu_s"]), 2), spread(r["steady_rows_per_cpu_s"], four),
             spread(r["steady_ratio_to_bare"], fix) if "steady_ratio_to_bare" in r else "1",
             spread(r["rows_per_s_wall"], four), pct(statistics.median(m / c for m, c in zip(r["main_cpu_s"], r["cpu_s"])))]
            for name, r in res.items()]
    out += table(["variant", "rows per CPU-second", "ratio to bare", f"start-up CPU s ({rep['small_rows']} rows)",
                  "past start-up", "ratio past start-up", "rows/s (wall)", "main process share"], rows)
    return out + [f"Git-10M ({p['rows']:,} rows) on {p['cores']} cores: {sig(p['hours'], 2)} h, bound by the "
                  f"{p['bound_by']} ({sig(p['cores_bound_rows_per_s'], 3)} rows/s from the cores at the 2-worker "
                  f"rate, {sig(p['main_process_rows_per_cpu_s'], 3)} rows per CPU-second of the main process); "
                  f"{p['note']}.", ""]


def leakage(files: dict) -> list[str]:
    """leakage.json: check-leakage per core (hash, query, a worker's whole path), what the hashes
    catch and confuse, and the Git-10M projection."""
    rep = files["leakage.json"]
    four = (lambda x: sig(x, 4))
    out = [f"Synthetic scenes as JPEG q90, per CPU-second of one process (one core), median (min..max) of "
           f"{rep['repeats']} rounds (the steps in turn); {rep['hash_method']}:", ""]
    rows = [[f"hash ({px} px, {sig(h['kb_per_image'], 2)} KB)", spread(h["images_per_cpu_s"], four), "-"]
            for px, h in rep["hash"].items()]
    rows += [[f"query against {q['indexed']:,} hashes ({kind})", spread(q["queries_per_cpu_s"], four),
              sig(q["candidates_per_query"], 3)] for kind, q in rep["query"].items()]
    s = rep["shard"]
    rows.append([f"a worker's path: tar read + hash + query ({s['indexed']:,} indexed)",
                 spread(s["images_per_cpu_s"], four), "-"])
    out += table(["step", "images per CPU-second", "candidates per query"], rows)
    d = rep["discrimination"]
    out += [f"What the defaults (64-bit distance <= {d['max_distance']}, 256-bit <= {d['max_fine_distance']}) "
            f"catch among {d['scenes']} scenes at {d['px']} px and their copies, and confuse among their "
            f"{d['distinct_pairs']:,} distinct pairs: {d['distinct_matched_coarse_only']} distinct pairs within the "
            f"64-bit distance alone, {d['distinct_matched']} within both.", ""]
    out += table(["copy", "found", "found by the 64-bit hash alone", "median distance (64 / 256 bits)"],
                 [[name, pct(c["found"], 1), pct(c["found_coarse_only"], 1),
                   f"{fix(c['median_distance'], 0)} / {fix(c['median_fine_distance'], 0)}"]
                  for name, c in d["copies"].items()])
    p = rep["git10m_projection"]
    return out + [f"Git-10M ({p['images']:,} images) on {p['cores']} cores at the worker's rate: "
                  f"{sig(p['minutes'], 2)} min (workers are independent; the disk is assumed to keep up).", ""]

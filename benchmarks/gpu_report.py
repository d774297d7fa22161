"""The tables benchmarks/gpu.py prints from its report: the cases, the loader / tensor pairs and
the variant / base pairs."""

from __future__ import annotations


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report['environment']['device']}, {report['config']['precision']}, one rank")
    for col in ("case", "samples/s", "step ms", "TFLOP/s", "MFU", "HFU", "peak GiB", "note"):
        table.add_column(col, justify="right")
    for r in report["cases"]:
        if not r["ok"]:
            table.add_row(r["case"], "-", "-", "-", "-", "-", "-", r["error"])
            continue
        pct = (lambda x: f"{100 * x:.1f}%" if x is not None else "-")
        mem = r["peak_memory_bytes"]
        table.add_row(r["case"], f"{r['samples_per_s']:.1f}", f"{r['step_ms']:.1f}", f"{r['achieved_tflops']:.2f}",
                      pct(r["mfu"]), pct(r["hfu"]), f"{mem / 2**30:.1f}" if mem else "-",
                      f"data wait {100 * r['data_wait_fraction']:.0f}%" if r.get("data") == "loader" else "")
    console = Console(width=160)
    console.print(table)
    if report.get("loader_vs_tensor"):
        pairs = Table(title="the data path: the real loader against a batch in device memory")
        for col in ("case", "tensor samples/s", "loader samples/s", "loader / tensor", "data wait", "workers",
                    "samples per worker-CPU-s"):
            pairs.add_column(col, justify="right")
        for p in report["loader_vs_tensor"]:
            rate = p["loader_samples_per_cpu_s"]
            pairs.add_row(p["case"], f"{p['tensor_samples_per_s']:.1f}", f"{p['loader_samples_per_s']:.1f}",
                          f"{p['loader_over_tensor']:.3f}", f"{100 * p['data_wait_fraction']:.1f}%",
                          str(p["loader_workers"]), f"{rate:.0f}" if rate else "-")
        console.print(pairs)
    if report.get("variants_vs_base"):
        pairs = Table(title="variants: the same case with a feature on, against the case as it is")
        for col in ("case", "variant", "base samples/s", "variant samples/s", "variant / base", "peak memory ratio"):
            pairs.add_column(col, justify="right")
        for p in report["variants_vs_base"]:
            mem = p["peak_memory_ratio"]
            pairs.add_row(p["case"], p["variant"], f"{p['base_samples_per_s']:.1f}", f"{p['variant_samples_per_s']:.1f}",
                          f"{p['variant_over_base']:.3f}", f"{mem:.2f}" if mem else "-")
        console.print(pairs)

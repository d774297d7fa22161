"""benchmarks/census.py's reports: aten ops per training step by kind, ours per profile beside the
plain PyTorch twin, the ratio the issue targets (non-matmul ops, ours / the eager twin), and the
named ops that make the difference."""

from __future__ import annotations

from benchmarks.results_tables.format import MiB, fix, sig, table

KINDS = ("matmul", "attention", "norm", "copy", "reduction", "optimizer", "communication", "elementwise")
# the named ops of the matmul and attention kinds (benchmarks/census.py MATMUL, ATTENTION_PREFIX)
MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "convolution_backward",
              "_scaled_mm", "addmv", "mv", "dot"}


def _excess(row: dict, twin: dict, n: int = 5) -> str:
    """The n non-matmul ops this subject runs most more often than the twin: 'op +count'."""
    diff = {op: c - twin["named"].get(op, 0) for op, c in row["named"].items()
            if op not in MATMUL_OPS and "attention" not in op}
    top = sorted(((c, op) for op, c in diff.items() if c > 0), key=lambda x: (-x[0], x[1]))[:n]
    return ", ".join(f"{op} +{c}" for c, op in top) or "-"


def census(files: dict) -> list[str]:
    if not files:
        return ["Not measured yet: none of these files is in `benchmarks/results/`.", ""]
    out = []
    for name, rep in files.items():
        c = rep["config"]
        said = f" -- {rep['label']}" if rep.get("label") else ""
        extra = f", `--set {' '.join(c['set'])}`" if c.get("set") else ""
        devices = sorted({r.get("device", "cpu") for r in rep["subjects"].values() if r.get("ok", True)}) or ["cpu"]
        out += [f"`{name}`{said} ({c['model']} shape, {c['layers'] or 'all'} layers per tower, micro {c['micro']}, "
                f"{c['precision']}, one rank on {', '.join(devices)}{extra}):", ""]
        rows, failed = [], []
        twin = rep["subjects"].get("twin", {})
        for subject, row in rep["subjects"].items():
            if not row.get("ok", True):
                failed.append(f"- {subject}: {row.get('error', 'failed')}")
                continue
            vs = rep["vs_twin"].get(subject)
            calls = sum(row["python_calls"].values()) if "python_calls" in row else None
            calls_vs = vs.get("python_calls_vs_twin") if vs else (1.0 if calls else None)
            rows.append([subject, *[row["ops"][k] for k in KINDS], row["non_matmul_ops"],
                         sig(row["non_matmul_bytes"] / MiB), fix(vs["non_matmul_ops_vs_twin"]) if vs else "1.00",
                         f"{calls:,}" if calls else "-", fix(calls_vs, 1), row.get("host_syncs", "-"),
                         _excess(row, twin) if vs else "-"])
        out += table(["subject", *KINDS, "non-matmul ops", "non-matmul MiB", "ops vs twin", "Python calls",
                      "calls vs twin", "host syncs", "most over the twin"], rows)
        out += failed + ([""] if failed else [])
    return out

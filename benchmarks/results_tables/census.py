"""benchmarks/census.py's reports: aten ops per optimizer step by kind, ours per profile and precision
beside the plain PyTorch twin, the ratios issue 44 targets (non-matmul ops, bytes and Python calls,
ours / the twin's; host syncs a step), whether each subject meets its target, and the named ops that
make the difference. Reports of one `train_step` per subject (before issue 44: no `steps` in their
config) keep their own table."""

from __future__ import annotations

from benchmarks.results_tables.format import MiB, fix, sig, table

KINDS = ("matmul", "attention", "norm", "copy", "reduction", "optimizer", "communication", "elementwise")
# the named ops of the matmul and attention kinds (benchmarks/census.py MATMUL, ATTENTION_PREFIX)
MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "convolution_backward",
              "_scaled_mm", "addmv", "mv", "dot"}
KERNEL_PREFIXES = ("cpp_fused", "triton_")   # benchmarks/census.py's: inductor's generated kernels


def _excess(row: dict, twin: dict, n: int = 5) -> str:
    """The n non-matmul ops this subject runs most more often than the twin, per step: 'op +count'. A
    compiled graph's kernels are left out: their names are the graph's own, not comparable across graphs
    (the fused column counts them)."""
    steps, twin_steps = row.get("steps", 1), twin.get("steps", 1)
    diff = {op: c / steps - twin["named"].get(op, 0) / twin_steps for op, c in row["named"].items()
            if op not in MATMUL_OPS and "attention" not in op and not op.startswith(KERNEL_PREFIXES)}
    top = sorted(((c, op) for op, c in diff.items() if c > 0), key=lambda x: (-x[0], x[1]))[:n]
    return ", ".join(f"{op} +{_count(c)}" for c, op in top) or "-"


def _count(x: float) -> str:
    """A count per step: whole where it is (178), else one decimal (0.1, 88.5)."""
    return f"{x:,.0f}" if abs(x - round(x)) < 0.05 else f"{x:,.1f}"


def census(files: dict) -> list[str]:
    if not files:
        return ["Not measured yet: none of these files is in `benchmarks/results/`.", ""]
    out = []
    for name, rep in files.items():
        out += _loop_report(name, rep) if "steps" in rep["config"] else _step_report(name, rep)
    return out


def _heading(name: str, rep: dict, what: str) -> list[str]:
    c = rep["config"]
    said = f" -- {rep['label']}" if rep.get("label") else ""
    extra = f", `--set {' '.join(c['set'])}`" if c.get("set") else ""
    devices = sorted({r.get("device", "cpu") for r in rep["subjects"].values() if r.get("ok", True)}) or ["cpu"]
    return [f"`{name}`{said} ({c['model']} shape, {c['layers'] or 'all'} layers per tower, micro {c['micro']}, "
            f"{what}, one rank on {', '.join(devices)}{extra}):", ""]


# --------------------------------------------------------------------------- the loop's optimizer step

def _targets_line(rep: dict) -> str:
    """Issue 44's targets, as the report judged them."""
    parts = []
    for kind, verdict in rep["targets"]["profiles"].items():
        t = verdict["target"]
        limits = [f"{what} <= {t[key]:g}" for key, what in (("ops", "ops"), ("bytes", "MiB"), ("calls", "calls"))
                  if t[key] is not None]
        limits.append(f"host syncs a step <= {'the twin' + chr(39) + 's + ' if t['plus_twin'] else ''}{t['syncs']:g}")
        which = "the lighter of " + "/".join(t["precisions"]) if t["lighter"] else "/".join(t["precisions"])
        parts.append(f"{kind} ({which}): {', '.join(limits)}")
    return "Targets (issue 44; ratios to the twin): " + "; ".join(parts) + "."


def _meets(subject: str, rep: dict) -> str:
    """'yes', 'no: what it misses', '- (judged: the lighter one)', or '-' where no target applies."""
    judged = rep["targets"]["subjects"].get(subject)
    if judged is None:
        return "-"
    verdict = rep["targets"]["profiles"][subject.split("/")[0]]
    if subject not in verdict["judged"]:
        return f"- (judged: {verdict['judged'][0].split('/')[1]}, the lighter)"
    return "yes" if judged["meets"] else "no: " + ", ".join(judged["misses"])


def _loop_report(name: str, rep: dict) -> list[str]:
    c = rep["config"]
    out = _heading(name, rep, f"{' and '.join(c['precisions'])}, per optimizer step over {c['steps']} loop steps "
                              f"with a log step every {c['log_every']}")
    rows, failed = [], []
    for subject, row in rep["subjects"].items():
        if not row.get("ok", True):
            failed.append(f"- {subject}: {row.get('error', 'failed')}")
            continue
        k = row["steps"]
        twin = rep["subjects"].get(f"twin/{subject.split('/')[1]}", {})
        vs = rep["vs_twin"].get(subject)
        ratio = (lambda key: fix(vs[key])) if vs else (lambda key: "1.00")
        rows.append([subject, *[_count(row["ops"].get(kind, 0) / k) for kind in (*KINDS, "fused")],
                     _count(row["non_matmul_ops"] / k), sig(row["non_matmul_bytes"] / k / MiB),
                     ratio("non_matmul_ops_vs_twin"), ratio("non_matmul_bytes_vs_twin"),
                     f"{sum(row['python_calls'].values()) / k:,.0f}", ratio("python_calls_vs_twin"),
                     fix(row["host_syncs"] / k, 1), _meets(subject, rep),
                     _excess(row, twin) if vs else "-"])
    out += table(["subject", *KINDS, "fused", "non-matmul ops", "non-matmul MiB", "ops vs twin", "MiB vs twin",
                  "Python calls", "calls vs twin", "host syncs", "meets target", "most over the twin"], rows)
    out += failed + ([""] if failed else [])
    if rep.get("targets", {}).get("profiles"):
        out += [_targets_line(rep), ""]
    return out


# --------------------------------------------------------------------------- one train_step (before issue 44)

def _step_report(name: str, rep: dict) -> list[str]:
    out = _heading(name, rep, rep["config"]["precision"])
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

"""docs/results/ is the render of benchmarks/results/*.json (benchmarks/render_results.py): each
committed page equals a fresh render and stays under the size limit, the anchors other docs link to
sit on their pages, its numbers move with the JSON, a results file without a section or a page over
the limit stops the render, --check finds a stale, missing or extra page, and the commands the
pages show name flags their scripts define."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks import render_results as rr

ROOT = Path(__file__).resolve().parents[2]
ANCHORS = {      # other docs link to these anchors on these pages (`results/memory.md#memory-peak`): keep them
    "throughput.md": ["throughput", "throughput-openclip", "patch-dropout", "distill", "compile", "gpu", "census"],
    "memory.md": ["memory", "memory-finetune", "memory-peak", "build-rss", "checkpoint-bytes", "step-faults"],
    "data.md": ["decode", "loader", "ingest", "leakage"],
    "comms.md": ["comms", "comms-hpz", "scaling", "heartbeat"],
    "training.md": ["contrastive", "grad-accum", "pure-bf16"],
    "faults.md": ["nonfinite", "checksum", "faults-chaos"],
    "evaluation.md": ["eval-report"],
}
ANCHOR = re.compile(r'<a id="([a-z0-9-]+)"></a>')
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.fixture()
def results(tmp_path) -> Path:
    """A copy of benchmarks/results/ to change."""
    return Path(shutil.copytree(rr.RESULTS, tmp_path / "results"))


def edit(path: Path, change) -> None:
    report = json.loads(path.read_text())
    change(report)
    path.write_text(json.dumps(report))


def page_of(anchor: str) -> str:
    return next(name for name, anchors in ANCHORS.items() if anchor in anchors)


def section(page: str, anchor: str) -> str:
    start = page.index(f'<a id="{anchor}"></a>')
    end = page.find("<a id=", start + 1)
    return page[start:end if end > 0 else len(page)]


def row(page: str, anchor: str, first_cells: str) -> str:
    """The first table line of the section `anchor` that starts with these cells."""
    lines = [line for line in section(page, anchor).splitlines() if line.startswith(f"| {first_cells} |")]
    assert lines, (anchor, first_cells)
    return lines[0]


def test_the_committed_pages_are_the_render_of_the_committed_json():
    pages = rr.render()
    assert list(pages) == [rr.INDEX, *ANCHORS]
    assert sorted(p.name for p in rr.PAGES_DIR.iterdir()) == sorted(pages), "docs/results/ has a page too many or few"
    for name, text in pages.items():
        assert (rr.PAGES_DIR / name).read_text() == text, (
            f"docs/results/{name} differs from benchmarks/results/*.json: run `python -m benchmarks.render_results` "
            "and commit the pages")
        assert len(text.encode()) <= rr.PAGE_LIMIT, f"docs/results/{name} is {len(text.encode()):,} bytes"
        assert ANCHOR.findall(text) == ANCHORS.get(name, []), name
    everything = "\n".join(pages.values())
    for json_file in sorted(rr.RESULTS.rglob("*.json")):      # every file shows: by name, or by its figure
        name = json_file.relative_to(rr.RESULTS).as_posix()
        assert name in everything or name.replace(".json", ".png") in everything, name
    assert rr.render() == pages                                # byte-stable


def test_the_index_links_every_page_and_then_its_sections_in_order():
    index = rr.render()[rr.INDEX]
    ours = [target for target in LINK.findall(index) if not target.startswith("../")]
    assert ours == [link for name, anchors in ANCHORS.items() for link in [name, *(f"{name}#{a}" for a in anchors)]]
    gpu = next(line for line in index.splitlines() if "(throughput.md#gpu)" in line)
    assert gpu.endswith("(not measured yet)")                  # no gpu_h200*.json committed yet
    assert "python -m benchmarks.render_results --check" in index


def test_every_relative_link_on_the_pages_resolves():
    pages = rr.render()
    for name, text in pages.items():
        for target in LINK.findall(text):
            path, _, anchor = target.partition("#")
            file = (rr.PAGES_DIR / (path or name)).resolve()
            assert file.exists(), f"docs/results/{name}: {target} does not exist"
            if anchor:
                body = pages[file.name] if file.parent == rr.PAGES_DIR else file.read_text()
                assert f'<a id="{anchor}"></a>' in body, f"docs/results/{name}: no anchor {target}"


@pytest.mark.parametrize("name, change, anchor, first_cells, cell", [
    ("throughput.json", lambda r: r["summary"]["loops"]["ours"].update(median_samples_per_s=4321.25),
     "throughput", "ours", "| 4,321 (348.0..373.2) |"),
    ("throughput.run2.json", lambda r: r["summary"]["ratios"]["ours/bare"].update(median=0.5, cpu_median=0.25),
     "throughput", "ours/bare", "| 0.50 (0.61..1.04) / 0.25 |"),
    ("memory.json", lambda r: r["profiles"][3]["gpu"].update(measured=7 * 2**20, ratio=2.875),
     "memory", "zero3", "| 2.434 / 7.000 (2.88) |"),
    ("memory.json", lambda r: r["profiles"][3].update(peak_bytes=777 * 2**20),
     "memory", "zero3", "| 777.0 |"),
    ("comms_w3.json", lambda r: r["rows"][0]["engine"].update(logged=99.5 * 2**20, ratio=4.0),
     "comms", "zero1 | 1 | plain", "| 24.14 / 99.50 (4.0000) |"),
    ("comms_w3.json", lambda r: r["rows"][0]["c10d"].update(ratio=1.2345),
     "comms", "zero1 | 1 | plain", "| 1.2345 |"),
    ("memory_peak_base.json", lambda r: r["profiles"][0]["peaks"][1].update(measured=5 * 2**30, ratio=1.5),
     "memory-peak", "zero1 | 4", "| 3.406 | 5.000 | 1.500 |"),
    ("scaling.json", lambda r: r["a100"][1]["four"].update(step_s=0.5),            # nvlink3 at overlap 1
     "scaling", "git-rsclip-base | 32", "| zero1, 0.500 (0.004) |"),
    ("contrastive.json", lambda r: r["accumulation"][1].update(step_seconds=9.875),  # global, k = 1
     "contrastive", "1", "| 0.291 / 9.875 / 0.246 |"),
    ("distill.json", lambda r: r["summary"]["ratios"]["plain"].update(median=0.125, planned=0.875),
     "distill", "plain", "| 0.12 (0.57..0.59) | 0.88 |"),
    ("compile.json", lambda r: next(x for x in r["rows"] if x["profile"] == "zero2").update(ratio_median=2.5),
     "compile", "`zero2`", "| 2.50 |"),
], ids=["throughput", "throughput-run2", "memory", "memory-peak-rss", "comms", "comms-c10d", "memory-peak",
        "a100-overlap-1", "contrastive-step-s", "distill-ratio", "compile-ratio"])
def test_a_number_on_a_page_comes_from_its_json(results, tmp_path, name, change, anchor, first_cells, cell):
    page = page_of(anchor)
    assert cell not in row(rr.render(results)[page], anchor, first_cells)
    edit(results / name, change)
    out = tmp_path / "pages"
    assert rr.main(["--results", str(results), "--out", str(out)]) == 0
    assert cell in row((out / page).read_text(), anchor, first_cells)


def test_a_results_file_without_a_section_stops_the_render(results, tmp_path, capsys):
    (results / "new_benchmark.json").write_text(json.dumps({"environment": {}, "rows": [1, 2]}))
    with pytest.raises(rr.ResultsError, match="new_benchmark.json: no section of docs/results/"):
        rr.render(results)
    assert rr.main(["--results", str(results), "--out", str(tmp_path / "pages")]) == 2
    assert "new_benchmark.json" in capsys.readouterr().err
    assert not (tmp_path / "pages").exists()


def test_a_file_its_section_cannot_read_names_the_section_and_the_file(results):
    edit(results / "decode.json", lambda r: r.pop("results"))
    with pytest.raises(rr.ResultsError, match=r"section 'decode' cannot read decode.json: KeyError"):
        rr.render(results)


def test_a_page_over_the_limit_stops_the_render_naming_the_page(results, tmp_path, capsys):
    edit(results / "heartbeat.json", lambda r: r.update(runs=r["runs"] * 60))     # 360 rows, ~37 KB
    with pytest.raises(rr.ResultsError, match=r"^comms.md would be [\d,]+ bytes, over the 30,000"):
        rr.render(results)
    assert rr.main(["--results", str(results), "--out", str(tmp_path / "pages")]) == 2
    assert "comms.md would be" in capsys.readouterr().err
    assert not (tmp_path / "pages").exists()


def test_check_reports_a_stale_page_with_the_command_that_fixes_it(results, tmp_path, capsys):
    out = tmp_path / "pages"
    assert rr.main(["--results", str(results), "--out", str(out)]) == 0
    assert rr.main(["--check", "--results", str(results), "--out", str(out)]) == 0
    edit(results / "heartbeat.json", lambda r: r["runs"][0].update(requests_per_s=123456.0))
    capsys.readouterr()
    assert rr.main(["--check", "--results", str(results), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"{out / 'comms.md'} is stale: 2 lines differ" in err and "python -m benchmarks.render_results" in err
    assert "123,456" in err and "data.md" not in err


def test_check_reports_a_missing_and_an_extra_page(results, tmp_path, capsys):
    out = tmp_path / "pages"
    assert rr.main(["--results", str(results), "--out", str(out)]) == 0
    (out / "data.md").unlink()
    (out / "results.md").write_text("# the one page of an earlier layout\n")
    capsys.readouterr()
    assert rr.main(["--check", "--results", str(results), "--out", str(out)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"{out / 'data.md'} is missing; run `python -m benchmarks.render_results`.",
                   f"{out / 'results.md'} is not a page of the render (PAGES in benchmarks/render_results.py); "
                   "delete it."]
    with pytest.raises(SystemExit):               # the old one-file form of --out is refused, not overwritten
        rr.main(["--results", str(results), "--out", str(out / "results.md")])
    assert (out / "results.md").read_text() == "# the one page of an earlier layout\n"


def test_a_gpu_report_fills_the_gpu_section(results):
    """gpu/run.py's rows as benchmarks/gpu/run.py writes them (fields of a CPU smoke run, numbers changed)."""
    case = {"case": "git-rsclip-base/zero2/no-ac/micro256", "preset": "git-rsclip-base", "profile": "zero2",
            "checkpointing": False, "micro": 256, "data": "tensor", "ok": True, "device": "NVIDIA H200",
            "samples_per_s": 1987.4, "step_ms": 128.8, "achieved_tflops": 276.2, "mfu": 0.2793, "hfu": 0.2793,
            "data_wait_fraction": 0.0, "peak_memory_bytes": 61 * 2**30}
    failed = {"case": "git-rsclip-large/zero3/ac/micro128", "ok": False, "error": "timed out | (raise --case-timeout)"}
    (results / "gpu_h200.json").write_text(json.dumps({
        "config": {"precision": "bf16"}, "environment": {"cpu_count": 16, "torch": "2.13.0"},
        "cases": [case, failed], "loader_vs_tensor": [], "hybrid_vs_zero3": []}))
    pages = rr.render(results)
    page = pages["throughput.md"]
    gpu = section(page, "gpu")
    assert "Not measured yet" not in gpu and "`gpu_h200.json` (NVIDIA H200, bf16, one rank)" in gpu
    assert "| 1,987 | 129 | 276 | 27.9% | 27.9% | 61.0 |" in row(page, "gpu", case["case"])
    assert row(page, "gpu", failed["case"]).endswith("| timed out \\| (raise --case-timeout) |")   # its pipe escaped
    assert not next(line for line in pages[rr.INDEX].splitlines() if "#gpu)" in line).endswith("(not measured yet)")


def _flag_sources(module: str) -> str:
    """The text of benchmarks/<module>.py, the harness and the benchmarks modules it imports."""
    path = ROOT / "benchmarks" / (module.replace(".", "/") + ".py")
    assert path.exists(), f"{module}: no {path}"
    text = path.read_text() + (ROOT / "benchmarks" / "harness.py").read_text()
    for package, names in re.findall(r"from benchmarks\.([\w.]+) import \(?([\w, ]+)", path.read_text()):
        for dotted in [package, *(f"{package}.{n.split(' as ')[0].strip()}" for n in names.split(",") if n.strip())]:
            other = ROOT / "benchmarks" / (dotted.replace(".", "/") + ".py")
            text += other.read_text() if other.exists() else ""
    return text


@pytest.mark.parametrize("source", [s for f in rr.FAMILIES for s in f.sources if s.command],
                         ids=lambda s: s.pattern)
def test_each_command_on_the_page_names_a_script_and_flags_it_defines(source):
    module = re.search(r"benchmarks\.([\w.]+)", source.command).group(1)
    text = _flag_sources(module)
    flags = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", source.command)) - {"--num_gpus", "--module"}
    assert flags, source.command
    missing = sorted(f for f in flags if f'"{f}"' not in text)
    assert not missing, f"{source.command}: {missing} not defined by benchmarks.{module}"
    out = re.search(r"--out ([^\s;]+)", source.command).group(1)
    assert fnmatch.fnmatchcase(out, f"benchmarks/results/{source.pattern}"), f"{source.command} does not write it"


def test_a_skipped_chaos_fault_renders_as_a_note_under_the_table():
    """faults_chaos.json's rows as benchmarks/faults/chaos.py wrote them (the script is removed, its
    section stays): a row run to the end is a table line, a skipped one (a key this version rejects)
    a note naming why."""
    from benchmarks.results_tables.chaos import faults_chaos

    row = {"fault": "python_error", "what": "rank 1 raises a Python error at step 7", "exit_code": 1,
           "first_message": "[01:14:19 rank1] x", "steps_lost": 2, "final_loss": 4.25, "equal": True}
    lines = faults_chaos({"faults_chaos.json": {"reference": {"final_loss": 4.25},
                                                "rows": [row, {"fault": "later_key", "what": "w", "skipped": "no key"}]}})
    assert "| `python_error`: rank 1 raises a Python error at step 7 | 1 | `[rank1] x` | 2 | 4.25000 (equal) |" in lines
    assert lines[-2] == "`later_key` (w): skipped, no key."

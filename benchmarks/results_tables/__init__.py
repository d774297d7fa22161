"""The tables of docs/results.md, one function per results family: each takes {file name: report}
(the JSON of benchmarks/results/, in SOURCES order) and returns markdown lines. Pure functions of
the JSON (no torch), grouped like benchmarks/; benchmarks/render_results.py assembles the page."""

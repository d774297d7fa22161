"""The tables of the results pages (docs/results/), one function per results family: each takes
{file name: report} (the JSON of benchmarks/results/, in its sources' order) and returns markdown
lines. Pure functions of the JSON (no torch), a module per page, grouped like benchmarks/;
benchmarks/render_results.py assembles the pages."""

"""The faults page's chaos section (the removed benchmarks/faults/chaos.py): each fault, the exit code, the first
message a user sees, the steps lost and the final loss after `--resume auto`."""

from __future__ import annotations

import re

from benchmarks.results_tables.format import sig, table

FIRST = 160   # characters of the first message shown; the JSON has all of it


def faults_chaos(files: dict) -> list[str]:
    rep = files["faults_chaos.json"]
    ref = rep["reference"]
    rows, notes = [], []
    for r in rep["rows"]:
        if "skipped" in r:
            notes.append(f"`{r['fault']}` ({r['what']}): skipped, {r['skipped']}.")
            continue
        if r.get("truncated") and r["exit_code"]:
            notes.append(f"`{r['fault']}`: `--resume auto` stopped on the torn `{r['truncated']}` (no fall-back to "
                         f"the tag before); the row's resume names that tag by hand.")
        message = re.sub(r"^\[\d\d:\d\d:\d\d (rank\d+)\] ", r"[\1] ", r["first_message"] or "(none of ours)")
        short = message if len(message) <= FIRST else message[:FIRST - 3] + "..."
        final = "-" if r["final_loss"] is None else (
            f"{sig(r['final_loss'], 6)} ({'equal' if r['equal'] else 'differs'})")
        rows.append([f"`{r['fault']}`: {r['what']}", r["exit_code"], f"`{short}`",
                     "-" if r["steps_lost"] is None else r["steps_lost"], final])
    out = [f"2 CPU ranks, `tiny` (ZeRO-2, fp32, 12 steps, a checkpoint every 4: `config.run` in the JSON); the "
           f"uninterrupted run's final loss {sig(ref['final_loss'], 6)}. Each fault is followed by `--resume auto` to "
           f"step 12; steps lost: completed steps the resume repeats; final loss: bit for bit against the "
           f"uninterrupted run's.", ""]
    out += table(["fault", "exit code", "first message a user sees", "steps lost", "final loss"], rows)
    return out + ([" ".join(notes), ""] if notes else [])

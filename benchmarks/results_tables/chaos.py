"""The faults page's chaos section (benchmarks/faults/chaos.py): each fault, the exit code, the first
message a user sees, the steps lost and the final loss after `--resume auto`."""

from __future__ import annotations

from benchmarks.results_tables.format import sig, table

FIRST = 160   # characters of the first message shown; the JSON has all of it


def faults_chaos(files: dict) -> list[str]:
    rep = files["faults_chaos.json"]
    ref = rep["reference"]
    rows, skipped = [], []
    for r in rep["rows"]:
        if "skipped" in r:
            skipped.append(f"`{r['fault']}` ({r['what']}): skipped, {r['skipped']}.")
            continue
        message = r["first_message"] or "(none of ours)"
        short = message if len(message) <= FIRST else message[:FIRST - 3] + "..."
        final = "-" if r["final_loss"] is None else (
            f"{sig(r['final_loss'], 6)} ({'equal' if r['equal'] else 'differs'})")
        rows.append([f"`{r['fault']}`: {r['what']}", r["exit_code"], f"`{short}`",
                     "-" if r["steps_lost"] is None else r["steps_lost"], final])
    out = [f"2 CPU ranks, `tiny`, {len(rep['config']['run'])} settings in the JSON (ZeRO-2, fp32, 12 steps, a "
           f"checkpoint every 4); the uninterrupted run's final loss {sig(ref['final_loss'], 6)}. Each fault is "
           f"followed by `--resume auto` to step 12; steps lost: completed steps the resume repeats; final loss: "
           f"bit for bit against the uninterrupted run's.", ""]
    out += table(["fault", "exit code", "first message a user sees", "steps lost", "final loss"], rows)
    return out + ([" ".join(skipped), ""] if skipped else [])

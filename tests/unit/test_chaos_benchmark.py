"""benchmarks/faults/chaos.py without a launch: its arguments, the plan (a fault whose key the config
rejects, or a tmpfs that cannot be mounted, is skipped with the reason), the first message it picks
from a launcher's output, the steps lost and a row; and the render of its section."""

from __future__ import annotations

import json

import pytest

from tests.unit.benchmark_modules import import_benchmark


@pytest.fixture(scope="module")
def chaos():
    yield from import_benchmark("faults.chaos")


OUTPUT = """[2026-12-02 01:14:23,392] [INFO] [launch.py:245:main] process 25812 spawned with command: [...]
[01:14:13 rank0] model tiny | profile zero2 | precision fp32 | batch micro x accumulation x world = global: 16 x 1 x 2 = 32
[01:14:19 rank0] step 6/12  loss 8.28  lr 0.001  samples/s 209.1  (0.5s)
[01:14:19 rank1] fault injection: rank 1 raises InjectedError at step 7
/usr/lib/python3/site-packages/torch/distributed/c10d_logger.py:83: FutureWarning: deprecated
Traceback (most recent call last):
  File "/work/rsclip_ds/train.py", line 204, in before_step
    raise InjectedError(f"fault injection: rank {rank} raises at step {step}")
rsclip_ds.train.InjectedError: fault injection: rank 1 raises at step 7
rsclip-ds: rank 1 failed: InjectedError: fault injection: rank 1 raises at step 7 (seen by rank 0; exiting with its code 1)
""".splitlines(keepends=True)


def test_plan_first_message_and_row(chaos, tmp_path):
    args = chaos.parse_args(["--only", "python_error,disk_full_tmpfs,later_key", "--out", str(tmp_path / "c.json")])
    faults = chaos.FAULTS + (chaos.Fault("later_key", "a key this version lacks", ("faults.inject_later_at_step=8",)),)
    planned = {f.name: why for f, why in chaos.plan(args, faults, can_mount=lambda: "no tmpfs here")}
    assert planned == {"python_error": None, "disk_full_tmpfs": "no tmpfs here",
                       "later_key": "this version's config rejects it: faults.inject_later_at_step: unknown key"}
    with pytest.raises(SystemExit, match="--only names no fault"):
        chaos.plan(chaos.parse_args(["--only", "nope"]))
    assert args.out == tmp_path / "c.json" and args.timeout == 600

    marker = next(i for i, x in enumerate(OUTPUT) if "fault injection: " in x)
    assert chaos.first_message(OUTPUT, marker) == \
        "[traceback] rsclip_ds.train.InjectedError: fault injection: rank 1 raises at step 7"
    assert chaos.first_message(OUTPUT[:4]) is None                    # start-up and progress lines only
    assert chaos.first_message(OUTPUT[-1:]).startswith("rsclip-ds: rank 1 failed: InjectedError")

    metrics = "\n".join(json.dumps(r) for r in [{"event": "start"}] + [{"kind": "train", "step": s} for s in range(1, 7)]
                        + [{"event": "resume", "step": 4}, {"kind": "train", "step": 5}])
    assert chaos.steps_lost(metrics, 4) == 2 and chaos.steps_lost(metrics, None) is None
    fault = chaos.FAULTS[0]
    row = chaos.make_row(fault, {"code": 1, "first": "x", "seconds": 10.0},
                         {"code": 0, "lost": 2, "final_loss": 4.25, "seconds": 20.0}, 4.25)
    assert row == {"fault": "python_error", "what": fault.what, "exit_code": 1, "first_message": "x", "steps_lost": 2,
                   "resume_exit_code": 0, "final_loss": 4.25, "reference_final_loss": 4.25, "equal": True,
                   "seconds": 30.0}
    assert chaos.make_row(fault, {"code": 1, "first": "x", "seconds": 1.0}, None, 4.25)["equal"] is None

    from benchmarks.results_tables.chaos import faults_chaos

    report = {"config": {"run": chaos.RUN}, "reference": {"final_loss": 4.25},
              "rows": [row, {"fault": "later_key", "what": "w", "skipped": "no key"}]}
    lines = faults_chaos({"faults_chaos.json": report})
    assert "| `python_error`: rank 1 raises a Python error at step 7 | 1 | `x` | 2 | 4.25000 (equal) |" in lines
    assert lines[-2] == "`later_key` (w): skipped, no key."

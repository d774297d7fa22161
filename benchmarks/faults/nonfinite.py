"""Issue 43's table, rerun: what a step with an inf/NaN gradient does to the run, on every shipped stage
and precision, with and without offload.

    python -m benchmarks.faults.nonfinite --out benchmarks/results/nonfinite_w1.json
    deepspeed --num_gpus 2 --module benchmarks.faults.nonfinite --out benchmarks/results/nonfinite_w2.json

Each case is two `tiny` runs of four loop steps on the ranks of the launch (the Trainer, synthetic
batches in memory; 1-2 minutes for the whole table on 2 CPU cores):

- the run: at step 2 the last row of the token embedding's gradient becomes NaN or inf on rank 0
  (`faults.inject_nan_at_step`; no batch uses that token, so the loss stays finite); a checkpoint
  at steps 2 and 4;
- its reference: the same batches without the second, three optimizer steps of the same
  four-step schedule -- the run in which step 2's batch contributed nothing.

A case passes when the run ends with the reference's weights (gathered), fp32 masters and this
rank's optimizer states (AdamW's moments and step count), bit for bit, its learning rate, one
skipped step, and every tensor of every checkpoint file finite. The JSON says who skipped the step
(rsclip_ds's step guard or DeepSpeed: rsclip_ds/finite.py) and each check, per case and rank;
tests/unit/test_nonfinite_steps.py runs the same cases on forked ranks and asserts them.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

if not __package__:
    sys.exit("run the benchmarks as modules from the repository root: python -m benchmarks.faults.nonfinite --out ...")

import torch

from benchmarks.harness import base_parser, environment, finish, page_tables, process_group, synthetic_data
from rsclip_ds.precision import uses_fp16

MICRO = 4
# (profile, precision): every shipped stage, with and without offload, in fp32, bf16, bf16 masters, the bf16
# variants DeepSpeed guards itself and the autocast precisions (amp: stage 0 only)
# The autocast cases come last: DeepSpeed 0.19.8 keeps torch_autocast's state in module globals
# (runtime/torch_autocast.py, TORCH_AUTOCAST_INITIALIZED), which the first engine with the section sets for
# the process, so a later engine without it would reduce as if under autocast (a run has one engine).
CASES = [("ddp", "fp32"),
         ("zero1", "fp32"), ("zero1", "bf16"), ("zero1", "bf16 masters"), ("zero1", "bf16 fp32-accumulation"),
         ("zero2", "fp32"), ("zero2", "bf16"), ("zero2", "bf16 masters"), ("zero2", "bf16 checked"),
         ("zero2", "bf16 k=2"),
         ("zero2_offload", "fp32"), ("zero2_offload", "bf16"),
         ("zero3", "fp32"), ("zero3", "bf16"), ("zero3", "bf16 masters"), ("zero3_offload", "fp32"),
         ("zero3_offload", "bf16"),
         ("ddp", "amp_bf16"), ("ddp", "amp"), ("zero1", "amp_bf16"), ("zero2", "amp_bf16"),
         ("zero2_offload", "amp_bf16"), ("zero3", "amp_bf16"), ("zero3_offload", "amp_bf16")]
FP16_CASES = [("zero2", "fp16"), ("zero3", "fp16")]   # where the processor runs fp16 (DeepSpeed's CPU check)
PRECISION = {"fp32": ["precision=fp32"], "bf16": ["precision=bf16"], "fp16": ["precision=fp16"],
             "amp_bf16": ["precision=amp_bf16"], "amp": ["precision=amp"],
             "bf16 masters": ["precision=bf16", "bf16.master_weights=bf16"],
             "bf16 fp32-accumulation": ["precision=bf16", "bf16.grad_accum_dtype=fp32"],
             "bf16 checked": ["precision=bf16", "bf16.check_grad_overflow=true"],
             # two micro-batches a step: bf16 accumulates in DeepSpeed's flat fp32 partition (auto at k > 1)
             "bf16 k=2": ["precision=bf16", "batch.gradient_accumulation_steps=2"]}


def cases() -> list[tuple[str, str]]:
    """CASES, and the fp16 ones where DeepSpeed's CPU accelerator runs fp16 (or on a GPU)."""
    fp16 = torch.cuda.is_available() or torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return (FP16_CASES if fp16 else []) + CASES


def batches(rank: int, vocab: int, drop: int | None, per_step: int = 1) -> list[dict]:
    """Four steps' micro-batches of this rank, ``per_step`` each (token ids below the last: its embedding row
    is never used); ``drop``: leave that 1-based step's out."""
    g = torch.Generator().manual_seed(100 + rank)
    out = [{"pixel_values": torch.randint(0, 256, (MICRO, 3, 64, 64), dtype=torch.uint8, generator=g),
            "input_ids": torch.randint(0, vocab - 1, (MICRO, 16), generator=g)} for _ in range(4 * per_step)]
    return [b for i, b in enumerate(out) if i // per_step + 1 != drop]


def run_state(engine) -> dict[str, list[torch.Tensor]]:
    """Whole weights (ZeRO-3 gathered), whole fp32 masters and this rank's optimizer states, in a fixed
    order. The masters go through DeepSpeed's accessor where it has one: a ZeRO-3 rank's flat master
    partition holds padding (a 1-element parameter's share on the second rank), never initialised."""
    from deepspeed.utils import safe_get_full_fp32_param

    from rsclip_ds.finite import optimizer_tensors
    from rsclip_ds.model import maybe_gathered

    params = list(engine.module.parameters())
    with maybe_gathered(params):
        weights = [p.detach().clone() for p in params]
    optimizer = [(n, t.detach().clone()) for n, t in optimizer_tensors(engine)]
    masters = [safe_get_full_fp32_param(p) for p in params]
    if any(m is None for m in masters):   # no accessor (stage 0): the optimizer's own tensors
        masters = [t for n, t in optimizer if "master" in n]
    return {"weights": weights, "masters": [m.clone() for m in masters],
            "states": [t for n, t in optimizer if "master" not in n]}


def finite_file(path: Path) -> bool:
    """Every floating tensor in a checkpoint file (however nested) is finite, and it holds some."""
    stack, tensors = [torch.load(path, map_location="cpu", weights_only=False)], []
    while stack:
        x = stack.pop()
        if torch.is_tensor(x):
            tensors.append(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return bool(tensors) and all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def run_case(rank: int, out: Path, tokenizer, profile: str, precision: str, value: str | None, save: bool) -> dict:
    """One run of four loop steps; ``value``: 'nan'/'inf' into the gradient at step 2, or None for the
    reference (batch 2 left out, three steps of the same four-step schedule)."""
    from rsclip_ds.checkpoint import complete_tags
    from rsclip_ds.config import load_config
    from rsclip_ds.model import preset_bundle
    from rsclip_ds.assembly import Trainer

    fault = ["faults.inject_nan_at_step=2", "faults.inject_nan_steps=1", f"faults.inject_nan_value={value}",
             "faults.inject_rank=0"] if value else ["checkpoint.stop_after=3"]
    run = load_config(None, [f"profile={profile}", *PRECISION[precision], "steps=4", f"batch.micro_batch_size={MICRO}",
                             "optim.warmup_steps=2", "optim.lr=5e-3", f"output_dir={out}", "logging.log_every=1",
                             f"checkpoint.every={2 if save else 0}", "checkpoint.at_end=false",
                             "distributed.threads_per_rank=1", "logging.progress=plain", *fault])
    around: dict[int, dict] = {}   # the state after steps 1 and 2: the skipped step must change none of it

    def watch(step: int, engine) -> None:
        if value and step in (1, 2):
            around[step] = {**run_state(engine), "skipped": engine.skipped_steps, "lr": engine.get_lr()}
    per_step = run.batch.gradient_accumulation_steps
    with Trainer(run, model=preset_bundle("tiny", tokenizer, 0), hooks=[watch],
                 loader=iter(batches(rank, len(tokenizer), None if value else 2, per_step))) as trainer:
        trainer.train()
        engine = trainer.parts.engine
        result = {"state": run_state(engine), "skipped": engine.skipped_steps, "lr": engine.get_lr(),
                  "unchanged": value and _equal(around[1], around[2]),
                  "counted": value and (around[2]["skipped"] - around[1]["skipped"] == 1
                                        and around[2]["lr"] == around[1]["lr"]),
                  "guard": "rsclip" if trainer.step_guard is not None and trainer.step_guard.skips else "deepspeed"}
    if save and rank == 0:   # every tensor of every file of every checkpoint the run wrote
        root = out / "checkpoints"
        result["checkpoints"] = {tag: all(finite_file(f) for f in sorted((root / tag).glob("*.pt")))
                                 for tag in complete_tags(root)}
    return result


def matrix(rank: int, world: int, folder: Path, tokenizer, cases: list[tuple[str, str]]) -> list[dict]:
    """Every case on this rank, in one process group (each Trainer leaves it to its owner) -> one row
    per case: who skipped, the equality of each part with the reference, finiteness, checkpoints."""
    folder = Path(folder)
    rows = []
    for i, (profile, precision) in enumerate(cases):
        value = ("nan", "inf")[i % 2]   # alternating: every profile meets both
        t0 = time.perf_counter()
        ref = run_case(rank, folder / f"{i}-ref", tokenizer, profile, precision, None, False)
        bad = run_case(rank, folder / f"{i}-bad", tokenizer, profile, precision, value, True)
        rows.append({"profile": profile, "precision": precision, "value": value, "guard": bad["guard"],
                     "unchanged": bad["unchanged"], "counted": bad["counted"], "equal": _equal(ref["state"], bad["state"]),
                     "scaled": uses_fp16(PRECISION[precision][0].split("=")[1]),
                     "finite": all(bool(torch.isfinite(t).all()) for ts in bad["state"].values() for t in ts),
                     "skipped": [ref["skipped"], bad["skipped"]], "lr_equal": ref["lr"] == bad["lr"],
                     "states": len(bad["state"]["states"]), "checkpoints": bad.get("checkpoints"),
                     "seconds": time.perf_counter() - t0})
    return rows


def _equal(a: dict[str, list[torch.Tensor]], b: dict[str, list[torch.Tensor]]) -> dict[str, bool]:
    """Per part (weights, masters, states): the same tensors, bit for bit."""
    return {k: len(a[k]) == len(b[k]) and all(torch.equal(x, y) for x, y in zip(a[k], b[k]))
            for k in ("weights", "masters", "states")}


def passed(row: dict) -> bool:
    """Skipped: nothing moved in step 2 and it was counted with the learning rate held; every checkpoint finite;
    and, where no loss scale differs afterwards, the run's end bit-equal to the run without the batch (its
    skipped count and learning rate too). fp16 and amp are left that last part: their scaler halves its scale at
    the skip, so later steps round otherwise, and it skips steps of its own while it finds its scale."""
    end = row["scaled"] or (all(row["equal"].values()) and row["skipped"] == [0, 1] and row["lr_equal"])
    return (all(row["unchanged"].values()) and row["counted"] and end and row["finite"] and row["states"] > 0
            and (row["checkpoints"] is None or all(row["checkpoints"].values())))


def parse_args(argv):
    return base_parser(__doc__).parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from benchmarks.results_tables import faults as tables
    from rsclip_ds.runtime.storage import gather_on_every_rank

    t0 = time.perf_counter()
    with process_group(args.threads) as info, tempfile.TemporaryDirectory() as tmp:
        from transformers import PreTrainedTokenizerFast

        root = Path(gather_on_every_rank(tmp)[0])   # rank 0's folder: a run's ranks share its output_dir
        # a tokenizer to build the model with (rank 0 trains it on synthetic captions)
        data = gather_on_every_rank(synthetic_data(root, num_train=32, num_val=8, shard_size=8)
                                    if info.rank == 0 else None)[0]
        tokenizer = PreTrainedTokenizerFast.from_pretrained(data["tokenizer"])
        (root / "runs").mkdir(exist_ok=True)
        per_rank = gather_on_every_rank(matrix(info.rank, info.world_size, root / "runs", tokenizer, cases()))
        report = {"config": {"cases": len(per_rank[0]), "micro": MICRO, "steps": 4, "fault_step": 2},
                  "environment": environment(args.threads), "ranks": per_rank,
                  "passed": all(passed(r) for rows in per_rank for r in rows),
                  "seconds": time.perf_counter() - t0}
        finish(report, args.out, info.rank, page_tables(tables.nonfinite, args.out.name))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

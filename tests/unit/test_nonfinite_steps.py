"""A step whose gradient norm is not finite never reaches the weights (issue 43, rsclip_ds/finite.py).

The reference for "skipped": the same run in which step 2's batch contributed nothing -- its
batches without the second, three optimizer steps on the same schedule. The run with an inf/NaN in
the gradient of one token-embedding row at step 2 (a row no batch uses) must end with every weight,
master, moment and step count of the reference, bit for bit, on every shipped stage, with and
without offload, in fp32, bf16 and bf16 masters, on 1 and 2 ranks; every checkpoint it writes is
finite. Before issue 43, bf16 at ZeRO-1/2 applied the step (a NaN row, NaN moments, NaN
checkpoints, exit 0)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.faults import nonfinite
from rsclip_ds.config import ConfigError, load_config
from rsclip_ds.resolve import plan_guard
from rsclip_ds.profiles import load_profile
from rsclip_ds.resolve import build_ds_config, guard_plan
from tests.unit.forked_ranks import run_ranks

MICRO = nonfinite.MICRO


def _matrix(rank, world, folder, tokenizer, cases):
    from rsclip_ds.runtime.distributed import init_distributed

    init_distributed()   # one process group for every case: each Trainer leaves it to its owner
    return nonfinite.matrix(rank, world, folder, tokenizer, cases)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_a_step_with_a_nonfinite_gradient_is_skipped_on_every_stage_and_precision(tmp_path, tiny_tokenizer, world):
    """benchmarks/faults/nonfinite.py's cases (fp16 where this processor runs it), on forked ranks."""
    ranks = run_ranks(_matrix, world, tmp_path, tmp_path, tiny_tokenizer, nonfinite.cases(), launcher_env=True,
                      timeout=900)
    for r in ranks:
        assert "value" in r, r.get("traceback")
    for row in ranks[0]["value"]:
        case = f"{row['profile']} {row['precision']} {row['value']}"
        assert row["unchanged"] == {"weights": True, "masters": True, "states": True}, case   # step 2 moved nothing
        assert row["counted"], case                                    # ... counted, the learning rate held
        if not row["scaled"]:   # fp16 / amp: the scaler halved its scale at the skip, later steps round otherwise
            assert row["equal"] == {"weights": True, "masters": True, "states": True}, case
            assert row["skipped"] == [0, 1] and row["lr_equal"], case
        assert row["finite"] and row["states"] > 0, case
        # checkpoints at steps 2 (right after the skipped step) and 4, every tensor finite
        assert row["checkpoints"] == {"step00000002": True, "step00000004": True}, case
        assert nonfinite.passed(row), case
    ours = {(p, "bf16") for p in ("zero1", "zero2", "zero2_offload")} | {
        (p, q) for p in ("zero1", "zero2") for q in ("fp32", "amp_bf16", "bf16 masters")} | {
        ("ddp", "fp32"), ("ddp", "amp_bf16"), ("ddp", "amp"), ("zero2", "bf16 k=2")}
    assert {(r["profile"], r["precision"]) for r in ranks[0]["value"] if r["guard"] == "rsclip"} == ours
    for other in ranks[1:]:   # the ranks agree: the same decisions, each its own partition equal to its reference
        assert [(r["profile"], r["precision"], r["equal"], r["skipped"]) for r in other["value"]] == \
               [(r["profile"], r["precision"], r["equal"], r["skipped"]) for r in ranks[0]["value"]]


def _plan(profile: str, *sets: str):
    return guard_plan(load_config(None, [f"profile={profile}", *sets]), load_profile(profile))


def test_who_skips_and_clips_follows_the_optimizer_deepspeed_builds():
    table = {("zero2", "precision=bf16"): ("rsclip", "rsclip"), ("zero1", "precision=bf16"): ("rsclip", "rsclip"),
             ("zero2_offload", "precision=bf16"): ("rsclip", "rsclip"),
             ("zero2", "precision=bf16", "bf16.master_weights=bf16"): ("rsclip", "rsclip"),
             ("zero2", "precision=bf16", "bf16.check_grad_overflow=true"): ("deepspeed", "deepspeed"),
             ("zero1", "precision=bf16", "bf16.grad_accum_dtype=fp32"): ("deepspeed", "deepspeed"),   # BF16_Optimizer
             ("zero1", "precision=fp32"): ("rsclip", "rsclip"), ("zero2", "precision=amp_bf16"): ("rsclip", "rsclip"),
             ("zero2_offload", "precision=fp32"): ("deepspeed", "rsclip"),
             ("zero2", "precision=fp16"): ("deepspeed", "deepspeed"), ("zero3", "precision=bf16"): ("deepspeed", "deepspeed"),
             ("zero3_offload", "precision=amp_bf16"): ("deepspeed", "deepspeed")}
    for (profile, *sets), owners in table.items():
        plan = _plan(profile, *sets)
        assert (plan.skips, plan.clips) == owners, (profile, sets)
        # rsclip_ds computes the norm at ZeRO-1/2 without offload wherever it skips there
        zero12 = profile in ("zero1", "zero2") and owners == ("rsclip", "rsclip")
        assert plan.norm == ("rsclip" if zero12 else "deepspeed"), (profile, sets)
    stage0 = dict(check_grad_overflow=False, grad_accum="fp32", offload=False, compute_grad_norm=True, profile="p")
    assert {plan_guard(p, 0, **stage0).skips for p in ("fp32", "amp_bf16", "amp")} == {"rsclip"}
    for precision, fix in (("bf16", "amp_bf16"), ("fp16", "amp")):   # DeepSpeed's FP16_UnfusedOptimizer: refused
        with pytest.raises(ConfigError, match=f"FP16_UnfusedOptimizer.*--set precision={fix}"):
            build_ds_config(load_config(None, ["profile=ddp", f"precision={precision}"]), load_profile("ddp"), 2,
                            on_gpu=False)


def test_deepspeed_clips_only_where_it_guards():
    run = load_config(None, ["profile=zero2", "precision=bf16"])
    assert build_ds_config(run, load_profile("zero2"), 2, on_gpu=False)["gradient_clipping"] == 0.0
    checked = load_config(None, ["profile=zero2", "precision=bf16", "bf16.check_grad_overflow=true"])
    assert build_ds_config(checked, load_profile("zero2"), 2, on_gpu=False)["gradient_clipping"] == 1.0
    zero3 = load_config(None, ["profile=zero3", "precision=bf16"])
    assert build_ds_config(zero3, load_profile("zero3"), 2, on_gpu=False)["gradient_clipping"] == 1.0
    fp16 = load_config(None, ["profile=zero2", "precision=fp16"])
    assert build_ds_config(fp16, load_profile("zero2"), 2, on_gpu=False)["gradient_clipping"] == 1.0


def test_a_profile_without_a_gradient_norm_gets_the_guards_or_is_refused(tmp_path):
    """DeepSpeed computes no norm with compute_grad_norm=false: at ZeRO-1/2 the step guard's own norm is what
    runs anyway (and what rsclip_ds sets); with optimizer offload, which DeepSpeed refuses it for, it is refused."""
    path = tmp_path / "nonorm.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "compute_grad_norm": False}}))
    for precision in ("fp32", "bf16", "amp_bf16"):
        run = load_config(None, [f"profile={path}", f"precision={precision}"])
        plan = guard_plan(run, load_profile(str(path)))
        assert (plan.skips, plan.clips, plan.norm) == ("rsclip", "rsclip", "rsclip")
        ds = build_ds_config(run, load_profile(str(path)), 1, on_gpu=False)
        assert ds["zero_optimization"]["compute_grad_norm"] is False and ds["gradient_clipping"] == 0.0
    assert build_ds_config(load_config(None, ["profile=zero2"]), load_profile("zero2"), 1, on_gpu=False)[
        "zero_optimization"]["compute_grad_norm"] is False   # the shipped profile: rsclip_ds computes it
    offload = tmp_path / "offload_nonorm.json"
    offload.write_text(json.dumps({"zero_optimization": {"stage": 2, "compute_grad_norm": False,
                                                         "offload_optimizer": {"device": "cpu"}}}))
    run = load_config(None, [f"profile={offload}", "precision=bf16"])
    with pytest.raises(ConfigError, match="compute_grad_norm=false with optimizer offload"):
        build_ds_config(run, load_profile(str(offload)), 1, on_gpu=False)


def _poison_master(engine) -> None:
    """What a step that escaped every check would leave: an inf in this rank's fp32 master partition."""
    from rsclip_ds.finite import optimizer_tensors

    master = next(t for n, t in optimizer_tensors(engine) if "master" in n)
    master.data.view(-1)[0] = math.inf


def _train(rank, out, tokenizer, steps, *sets, hooks=()):
    from rsclip_ds.model import preset_bundle
    from rsclip_ds.assembly import Trainer

    run = load_config(None, ["profile=zero2", "precision=bf16", f"steps={steps}", "optim.warmup_steps=1",
                             f"batch.micro_batch_size={MICRO}",
                             f"output_dir={out}", "checkpoint.every=2", "distributed.threads_per_rank=1",
                             "logging.progress=plain", *sets])
    batches = iter(nonfinite.batches(rank, len(tokenizer), None) * 2)
    with Trainer(run, model=preset_bundle("tiny", tokenizer, 0), loader=batches, hooks=hooks) as trainer:
        return trainer.train()


def _refusals(rank, world, out, tokenizer):
    """Three refusals on 2 ranks: a save of forced non-finite weights (rank 1's master, before step 4's save),
    a resume of a checkpoint an older rsclip_ds wrote with them, and their export."""
    from rsclip_ds.checkpoint import META, MANIFEST, export_hf, read_pointer
    from rsclip_ds.finite import NonFiniteWeights
    from rsclip_ds.runtime.distributed import init_distributed
    from rsclip_ds.runtime.rank_errors import failure_of

    init_distributed()
    said = {}
    poison = lambda step, engine: _poison_master(engine) if step == 4 and rank == 1 else None   # noqa: E731
    try:
        _train(rank, out / "forced", tokenizer, 4, hooks=(poison,))
    except NonFiniteWeights as err:
        said["save"] = (str(err), failure_of(err).code, read_pointer(out / "forced" / "checkpoints"),
                        (out / "forced" / "checkpoints" / "step00000004").exists())
    # an older rsclip_ds's checkpoint of inf weights: saved unchecked, no manifest, no weights_finite
    _train(rank, out / "old", tokenizer, 4)
    torch.distributed.barrier()
    tag = out / "old" / "checkpoints" / "step00000004"
    if rank == 0:
        for f in tag.glob("*optim_states.pt"):
            state = torch.load(f, weights_only=False)
            state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0].data.view(-1)[0] = math.inf
            torch.save(state, f)
        (tag / MANIFEST).unlink()
        meta = json.loads((tag / META).read_text())
        del meta["weights_finite"]
        (tag / META).write_text(json.dumps(meta))
    torch.distributed.barrier()
    try:
        _train(rank, out / "old", tokenizer, 6, "checkpoint.resume=step00000004")
    except NonFiniteWeights as err:
        said["resume"] = str(err)
    if rank == 0:
        for name, path in (("export", tag), ("export_good", tag.parent / "step00000002")):
            try:
                export_hf(path, out / name)
                said[name] = "written"
            except NonFiniteWeights as err:
                said[name] = f"{err} | folder written: {(out / name).exists()}"
    return said


@pytest.mark.slow
def test_nonfinite_weights_are_never_saved_resumed_or_exported(tmp_path, tiny_tokenizer):
    ranks = run_ranks(_refusals, 2, tmp_path, tmp_path, tiny_tokenizer, launcher_env=True, timeout=600)
    for r in ranks:
        assert "value" in r, r.get("traceback")
    for said in (r["value"] for r in ranks):   # every rank refuses the save with one message, exit code 8
        message, code, pointer, written = said["save"]
        assert code == 8 and pointer == "step00000002" and not written
        assert message.startswith("not saving checkpoint step00000004: the weights or optimizer states are not "
                                  "finite (rank 1: 1 tensor(s), e.g. optimizer master 0). The resume point stays "
                                  "step00000002")
        assert said["resume"].startswith("not resuming from step00000004:")
        assert "The newest checkpoint whose save tested its weights is step00000002: --resume step00000002" \
            in said["resume"]
    said = ranks[0]["value"]
    assert said["export"].startswith(f"not exporting {tmp_path}/old/checkpoints/step00000004: ")
    assert said["export"].endswith(f"rsclip-ds export {tmp_path}/old/checkpoints/step00000002 ... "
                                   "| folder written: False")
    assert said["export_good"] == "written"

"""One resolved run (issue 45, rsclip_ds/resolve.py): the Trainer, `rsclip-ds plan` and `show-config --resolved`
get the same record from the same config, world and device, and the record is what the run prints and saves."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rsclip_ds.assembly import check_run
from rsclip_ds.cli import main
from rsclip_ds.config import ConfigError, load_config
from rsclip_ds.planning.planner import Budget, resolve_row, row_config
from rsclip_ds.profiles import load_profile
from rsclip_ds.resolve import GPU, Device, World, deepspeed_config, resolve

GiB = 2**30


@pytest.mark.parametrize("profile,precision,gpus,per_node", [
    ("ddp", "auto", 1, 1), ("zero2", "auto", 8, 8), ("zero1", "bf16", 4, 4), ("zero3", "amp_bf16", 16, 8),
    ("zero2_offload", "fp32", 2, 2)])
def test_the_planner_and_the_trainer_resolve_the_same_run(profile, precision, gpus, per_node):
    run = row_config(precision).model_copy(update={"profile": profile})
    _, refused, planned = resolve_row(run, load_profile(profile), Budget(per_node, gpus // per_node, 80 * GiB))
    assert refused == "" and planned is not None
    trained = check_run(run, shards=False, world=World(gpus, per_node), device=GPU)
    assert trained == planned and trained.to_dict() == planned.to_dict()
    assert deepspeed_config(trained) == deepspeed_config(planned)
    # the record says what DeepSpeed gets: the stage, the precision's sections, the batch
    ds = deepspeed_config(trained)
    assert ds["zero_optimization"]["stage"] == trained.zero.stage == load_profile(profile).stage
    assert ds["train_batch_size"] == trained.batch.global_batch
    assert ds["bf16"]["enabled"] == (trained.precision.name == "bf16")
    assert ("torch_autocast" in ds) == trained.precision.name.startswith("amp")


def test_a_refused_row_is_refused_with_the_runs_message():
    run = row_config("bf16").model_copy(update={"profile": "ddp"})
    precision, refused, planned = resolve_row(run, load_profile("ddp"), Budget(8, 1, 80 * GiB))
    assert (precision, planned) == ("bf16", None) and "FP16_UnfusedOptimizer" in refused
    with pytest.raises(ConfigError, match="precision=bf16 at stage 0 .*Use --set precision=amp_bf16"):
        check_run(run, shards=False, world=World(8, 8), device=GPU)


def test_show_config_resolved_prints_the_start_up_lines_and_the_record(capsys, tmp_path):
    sets = ["--set", "profile=zero1", "--set", "batch.micro_batch_size=4",
            "--set", "batch.gradient_accumulation_steps=2"]
    assert main(["show-config", "--resolved", "--world", "8", "--per-node", "4", "--gpu", *sets]) == 0
    out = capsys.readouterr().out
    lines, record = out.split("\n\n", 1)
    here = replace(GPU, cores=Device.current().cores)   # --gpu: GPUs with bf16, this machine's cores
    want = resolve(load_config(None, sets[1::2]), load_profile("zero1"), World(8, 4), here)
    assert json.loads(record) == want.to_dict() and want.to_dict()["batch"] == {
        "micro": 4, "accumulation": 2, "world": 8, "global": 64, "accumulation_mode": "global"}
    assert lines.splitlines()[0].startswith("profile zero1 (ZeRO-1: shards the optimizer states) | precision bf16 "
                                            "(auto: bf16 under ZeRO-1")
    record = json.loads(record)
    assert record["world"] == {"size": 8, "local_size": 4} and record["device"]["kind"] == "cuda"
    assert main(["show-config", "--resolved", "--world", "2", "--out", str(tmp_path / "r.json"), *sets]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["batch"]["global"] == 16   # 4 x 2 x 2 ranks
    assert main(["show-config", "--world", "2"]) == 2   # a ConfigError: the message, exit 2
    assert "--world/--per-node/--gpu need --resolved" in capsys.readouterr().err

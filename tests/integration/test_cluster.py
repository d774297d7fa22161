"""launch/cluster.sh on this machine (a one-node hostfile 'localhost slots=2'), then
`rsclip-ds eval` on the run's checkpoint with 2 ranks, `rsclip-ds export`, and `rsclip-ds eval`
on the exported folder in one process: the same numbers."""

from __future__ import annotations

import json
import sys

import pytest

from rsclip_ds.data.synthetic import make_synthetic
from rsclip_ds.data.tokenizer import iter_captions, train_tokenizer

from tests.integration.helpers import BASE_OVERRIDES, ROOT, deepspeed_cmd, free_port, run_checked

pytestmark = pytest.mark.slow
STEPS = 6


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    # 33 held-out images: the 2 eval ranks get uneven shares (17 / 16)
    index = make_synthetic(tmp / "data", num_train=512, num_val=33, shard_size=128, seed=0,
                           progress=False, eval_layout=True)
    train_tokenizer(iter_captions([str(tmp / "data" / s["url"]) for s in index["train"]]),
                    tmp / "tok", vocab_size=300)
    (tmp / "hostfile").write_text("# one node, two CPU ranks\nlocalhost slots=2\n")
    (tmp / "env").write_text("# comments and blank lines are stripped for the launcher\n\nRSCLIP_MARK=1\n")
    out = tmp / "run"
    sets = BASE_OVERRIDES + [f"steps={STEPS}", "optim.warmup_steps=1", f"output_dir={out}",
                             f"data.train_shards={index['train_pattern']}", f"model.tokenizer={tmp / 'tok'}"]
    cmd = ["bash", str(ROOT / "launch/cluster.sh"), "--hostfile", str(tmp / "hostfile"),
           "--config", str(ROOT / "configs/tiny_demo.yaml"), "--profile", "zero3",
           "--master-port", str(free_port()), "--env-file", str(tmp / "env")]
    proc = run_checked(cmd + [a for s in sets for a in ("--set", s)], timeout=600)
    return tmp, index, out, proc


def test_cluster_script_trains_on_a_hostfile(cluster_run):
    _, _, out, proc = cluster_run
    assert "--hostfile" in proc.stderr and "profile=zero3" in proc.stderr   # the command it ran
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["zero_stage"] == 3
    assert summary["optimizer_steps"] == STEPS and len(summary["losses"]) == STEPS


def test_cluster_script_rejects_bad_arguments(tmp_path):
    import subprocess

    proc = subprocess.run(["bash", str(ROOT / "launch/cluster.sh"), "--hostfile", str(tmp_path / "none"),
                           "--config", "x.yaml"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "hostfile not found" in proc.stderr


def test_eval_checkpoint_two_ranks_equals_exported_folder(cluster_run):
    tmp, index, out, _ = cluster_run
    data = ["--zero-shot", index["zero_shot_dir"], "--retrieval", index["retrieval_json"], "--batch-size", "8"]
    run_checked(deepspeed_cmd() + ["--num_gpus", "2", "--master_port", str(free_port()), "--module",
                                   "rsclip_ds", "eval", "--checkpoint", str(out)] + data, timeout=600)
    tag = f"step{STEPS:08d}"
    from_ckpt = json.loads((out / "eval" / f"{tag}.json").read_text())
    assert from_ckpt["step"] == STEPS
    assert from_ckpt["zero_shot"]["num_images"] == 33 and from_ckpt["retrieval"]["num_texts"] == 33 * 4
    run_checked([sys.executable, "-m", "rsclip_ds", "export", str(out), str(tmp / "export")], timeout=300)
    run_checked([sys.executable, "-m", "rsclip_ds", "eval", "--model", str(tmp / "export"),
                 "--out", str(tmp / "folder.json")] + data, timeout=300)
    from_folder = json.loads((tmp / "folder.json").read_text())
    compared = []
    for group in ("zero_shot", "retrieval"):
        for key, value in from_ckpt[group].items():
            if isinstance(value, float):
                assert from_folder[group][key] == pytest.approx(value, abs=1e-6), (group, key)
                compared.append(f"{group}/{key}")
    assert {"zero_shot/top1", "retrieval/t2i_R@1", "retrieval/i2t_R@1"} <= set(compared), compared
    assert from_folder["zero_shot"]["per_class"] == pytest.approx(from_ckpt["zero_shot"]["per_class"])

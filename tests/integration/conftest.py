"""Real launches: the `deepspeed` launcher starting CPU ranks over gloo, as users launch."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rsclip_ds.data.synthetic import make_synthetic
from rsclip_ds.data.tokenizer import iter_captions, train_tokenizer

ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = ROOT / "configs" / "tiny_demo.yaml"
# Shorter than the demo; every launch test starts from these and adds its own --set.
BASE_OVERRIDES = ["steps=30", "precision=fp32", "batch.micro_batch_size=16", "optim.warmup_steps=3",
                  "logging.log_every=5", "data.num_workers=1", "logging.progress=plain"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env() -> dict[str, str]:
    # PYTHONPATH: the ranks import the tree under test, whatever an editable install points at
    env = dict(os.environ, DS_ACCELERATOR="cpu", DEEPSPEED_TIMEOUT="3", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def deepspeed_cmd() -> list[str]:
    exe = shutil.which("deepspeed")
    return [exe] if exe else [sys.executable, "-m", "deepspeed.launcher.runner"]


@pytest.fixture(scope="session")
def launch_data(tmp_path_factory):
    """8 train shards of 128 samples at 64 px, and a tokenizer trained on their captions."""
    out = tmp_path_factory.mktemp("launch_data")
    index = make_synthetic(out, num_train=1024, num_val=64, shard_size=128, image_size=64, seed=0,
                           progress=False)
    urls = [str(out / s["url"]) for s in index["train"]]
    train_tokenizer(iter_captions(urls), out / "tokenizer", vocab_size=500, max_length=64)
    return {"shards": index["train_pattern"], "tokenizer": str(out / "tokenizer")}


def train_args(data: dict, out_dir: Path, overrides: list[str]) -> list[str]:
    sets = BASE_OVERRIDES + [f"output_dir={out_dir}", f"data.train_shards={data['shards']}",
                             f"model.tokenizer={data['tokenizer']}"] + list(overrides)
    return ["--module", "rsclip_ds", "train", "--config", str(DEMO_CONFIG)] + \
        [a for s in sets for a in ("--set", s)]


def run_checked(cmd: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)}\nexit {proc.returncode}\n--- output tail ---\n"
                    f"{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


@pytest.fixture
def launch(launch_data, tmp_path):
    """launch(*overrides, nproc=2) -> summary dict of a `deepspeed --num_gpus N` run."""
    def _launch(*overrides: str, nproc: int = 2, name: str = "run") -> dict:
        out, port = tmp_path / name, free_port()
        cmd = deepspeed_cmd() + ["--num_gpus", str(nproc), "--master_port", str(port)]
        run_checked(cmd + train_args(launch_data, out, list(overrides)))
        # DeepSpeed's CPU all-reduce buffers (64 MiB per rank) must not outlive the run
        leaked = list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
        assert not leaked, f"shared-memory buffers left behind: {leaked}"
        return json.loads((out / "summary.json").read_text())
    return _launch

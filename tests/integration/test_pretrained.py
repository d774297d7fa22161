"""Fine-tuning from a folder of the published Git-RSCLIP shape (16-bit safetensors, SentencePiece
tokenizer; tests/published_like.py) on 2 CPU ranks, one launch per ZeRO stage / precision
(pretrained_worker.py):

- ZeRO-3 builds the model partitioned (each rank holds half the parameters right after the
  build) and its engine's embeddings equal transformers' SiglipModel on the same inputs;
- every stage starts from fp32 master weights equal to the folder's weights, bit for bit, also
  under bf16 (DeepSpeed alone would round them to bf16) -- and under fp16 where the CPU has it;
- the short fine-tune trains (finite losses) and the summary names the model's source;
- the ZeRO-1 run names the model by hub id, read from a Hugging Face cache (HF_HUB_OFFLINE=1,
  the launch tests' environment): the per-node fetch-then-read path under the launcher.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from tests.integration.helpers import ROOT, deepspeed_cmd, free_port, launch_env
from tests.published_like import COMMIT, write_hf_cache

pytestmark = pytest.mark.slow
WORKER = ROOT / "tests" / "integration" / "pretrained_worker.py"


def _fp16_supported() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


@pytest.fixture(scope="module")
def hub_cache(published_folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_cache")
    write_hf_cache(root, "lcybuaa/Git-RSCLIP", published_folder)
    return root


@pytest.fixture(scope="module")
def runs(published_folder, published_data, hub_cache, tmp_path_factory):
    """profile/precision -> (result.json, embeddings) of one launch each, run on first use.
    zero1 names the model by hub id (the cache holds the same folder)."""
    cache = {}

    def get(profile: str, precision: str):
        if (profile, precision) not in cache:
            out = tmp_path_factory.mktemp(f"{profile}_{precision}")
            hub = ["--set", "model.pretrained=lcybuaa/Git-RSCLIP"] if profile == "zero1" else []
            cmd = deepspeed_cmd() + ["--num_gpus", "2", "--master_port", str(free_port()), str(WORKER),
                                     "--folder", str(published_folder), "--shards", published_data["train"],
                                     "--out", str(out),
                                     "--set", f"profile={profile}", "--set", f"precision={precision}", *hub]
            proc = subprocess.run(cmd, cwd=ROOT, env={**launch_env(), "HF_HUB_CACHE": str(hub_cache)},
                                  capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                pytest.fail(f"{' '.join(cmd)}\nexit {proc.returncode}\n{(proc.stdout + proc.stderr)[-6000:]}")
            cache[profile, precision] = (json.loads((out / "result.json").read_text()),
                                         torch.load(out / "embeddings.pt"))
        return cache[profile, precision]
    return get


def _reference_embeddings(folder, probe):
    from transformers import SiglipModel

    model = SiglipModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        image = model.get_image_features(pixel_values=probe["pixels"]).pooler_output
        text = model.get_text_features(input_ids=probe["ids"]).pooler_output
    return torch.nn.functional.normalize(image, dim=-1), torch.nn.functional.normalize(text, dim=-1)


def _check_training(result, folder, precision):
    # weight decay on the matrices, none on vectors (ZeRO-3's flat partitions judged by their real shape)
    decayed = [g for g in result["groups"] if g["weight_decay"] > 0]
    assert decayed and all(g["matrices"] == g["elements"] for g in decayed)
    assert all(g["matrices"] == 0 for g in result["groups"] if g["weight_decay"] == 0)
    summary = result["summary"]
    if summary["profile"] == "zero1":
        assert summary["model"] == f"lcybuaa/Git-RSCLIP@{COMMIT[:12]} (hub)", summary["model"]
        assert summary["model_source"]["kind"] == "hub" and summary["model_source"]["commit"] == COMMIT
    else:
        assert summary["model"] == f"{folder} (folder)" and summary["model_source"]["kind"] == "folder"
    assert summary["precision"] == precision and len(summary["losses"]) == 4
    assert all(math.isfinite(v) for v in summary["losses"])


def test_zero3_builds_partitioned_and_embeds_as_transformers(runs, published_folder):
    folder = published_folder
    result, probe = runs("zero3", "fp32")
    n = result["parameters"]
    assert len(result["held_per_rank"]) == 2
    assert all(held <= 0.55 * n for held in result["held_per_rank"]), (result["held_per_rank"], n)
    assert sum(result["held_per_rank"]) >= n
    assert result["master_vs_folder"] == 0.0
    ref_image, ref_text = _reference_embeddings(folder, probe)
    torch.testing.assert_close(probe["image"], ref_image, atol=1e-5, rtol=0)
    torch.testing.assert_close(probe["text"], ref_text, atol=1e-5, rtol=0)
    _check_training(result, folder, "fp32")


@pytest.mark.parametrize("profile,precision", [("zero1", "bf16"), ("zero2", "bf16"), ("zero2", "fp16")])
def test_16bit_runs_start_from_exact_fp32_masters(runs, published_folder, profile, precision):
    folder = published_folder
    if precision == "fp16" and not _fp16_supported():
        pytest.skip("fp16 is not supported by this CPU (torch.ops.mkldnn._is_mkldnn_fp16_supported)")
    result, probe = runs(profile, precision)
    assert result["held_per_rank"] == [result["parameters"]] * 2   # ZeRO-1/2 keep whole parameters
    assert result["master_vs_folder"] == 0.0
    ref_image, ref_text = _reference_embeddings(folder, probe)   # the 16-bit forward: close, not equal
    torch.testing.assert_close(probe["image"], ref_image, atol=3e-2, rtol=0)
    torch.testing.assert_close(probe["text"], ref_text, atol=3e-2, rtol=0)
    _check_training(result, folder, precision)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

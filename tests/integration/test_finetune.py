"""Fine-tuning controls on 2 CPU ranks under ZeRO 1, 2 and 3 (one launch each, finetune_worker.py),
from a folder of the published Git-RSCLIP shape:

    zero1  image tower locked but its last block; per-tower LRs, text layer decay, logit LR
    zero2  LoRA on the image tower (attention + MLP); text tower locked
    zero3  LoRA on the text tower; image tower locked; trained at 48 px (the folder's is 32); bf16

Each checks: exactly the trainable parameters changed, the locked ones are bit-identical; the
optimizer holds state for the trainable elements only (+ DeepSpeed's alignment padding); the
optimizer's groups carry the expected peak learning rates and follow one schedule; the export
(LoRA merged) gives the engine's embeddings, at the trained image size.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from rsclip_ds.checkpoint import export_hf
from rsclip_ds.config import ModelConfig
from rsclip_ds.model import build_model
from tests.integration.helpers import ROOT, deepspeed_cmd, free_port, run_checked
from tests.published_like import IMAGE_SIZE

pytestmark = pytest.mark.slow
WORKER = ROOT / "tests" / "integration" / "finetune_worker.py"
LR = 5e-3   # the worker's optim.lr
RUNS = {
    "zero1": ["finetune.lock_image=true", "finetune.lock_image_unlocked_layers=1", "optim.image_lr=1e-3",
              "optim.text_layer_decay=0.5", "optim.logit_lr=1e-2"],
    "zero2": ["finetune.lora.towers=[image]", "finetune.lora.mlp=true", "finetune.lock_text=true"],
    "zero3": ["finetune.lora.towers=[text]", "finetune.lock_image=true", "finetune.image_size=48", "precision=bf16"],
}


@pytest.fixture(scope="module")
def runs(published_folder, published_data, tmp_path_factory):
    cache = {}

    def get(profile: str):
        if profile not in cache:
            out = tmp_path_factory.mktemp(profile)
            sets = [a for s in [f"profile={profile}", *RUNS[profile]] for a in ("--set", s)]
            run_checked(deepspeed_cmd() + ["--num_gpus", "2", "--master_port", str(free_port()), str(WORKER),
                                           "--folder", str(published_folder), "--shards", published_data["train"],
                                           "--out", str(out), *sets],
                        timeout=600)
            cache[profile] = out, json.loads((out / "result.json").read_text()), torch.load(out / "embeddings.pt")
        return cache[profile]
    return get


def _expected_trainable(name: str, profile: str) -> bool:
    if name in ("logit_scale", "logit_bias"):
        return True
    if profile == "zero1":
        if name.startswith("vision_model."):
            return any(k in name for k in ("encoder.layers.1.", "post_layernorm", "vision_model.head."))
        return True
    lora_tower, locked = ("vision_model.", "text_model.") if profile == "zero2" else ("text_model.", "vision_model.")
    if name.startswith(locked):
        return False
    return ".lora_A." in name or ".lora_B." in name


@pytest.mark.parametrize("profile", list(RUNS))
def test_only_trainable_parameters_change(runs, profile):
    _, result, _ = runs(profile)
    names = result["changed"] + result["unchanged"]
    want = {n for n in names if _expected_trainable(n, profile)}
    assert set(result["trainable"]) == want
    assert set(result["changed"]) == want      # locked ones bit-identical, every trainable one moved
    if profile != "zero1":
        assert any(".lora_B." in n for n in want) and not any(".base_layer." in n for n in want)


@pytest.mark.parametrize("profile", list(RUNS))
def test_optimizer_state_and_groups_cover_the_trainable_elements_only(runs, profile):
    _, result, _ = runs(profile)
    trainable = result["trainable_elements"]
    assert sum(g["elements"] for g in result["groups"]) == trainable
    assert trainable <= result["state_elements"] <= trainable + 2 * 16 * len(result["groups"])  # alignment
    for group in result["groups"]:   # decay on matrices only (under ZeRO-3 too, where tensors are flat)
        assert group["matrices"] == (group["elements"] if group["weight_decay"] > 0 else 0), group
    assert any(g["weight_decay"] > 0 and g["elements"] for g in result["groups"])
    ratios = {round(g["last_lr"] / g["peak_lr"], 9) for g in result["groups"] if g["elements"]}
    assert len(ratios) == 1 and 0 < ratios.pop() < 1   # one schedule, mid-way (cosine to 0.5 x peak)
    if profile == "zero1":
        peaks = {round(g["peak_lr"], 9) for g in result["groups"] if g["elements"]}
        # image 1e-3; text 5e-3 x 0.5^(3 - layer) for layers 0..3; logit 1e-2
        assert peaks == {1e-3, 6.25e-4, 1.25e-3, 2.5e-3, 5e-3, 1e-2}
    else:
        assert {round(g["peak_lr"], 9) for g in result["groups"]} == {LR}


@pytest.mark.parametrize("profile", list(RUNS))
def test_the_export_gives_the_engines_embeddings(runs, profile, tmp_path):
    from transformers import SiglipModel

    out, result, probe = runs(profile)
    exported = export_hf(out, tmp_path / "export")
    model = SiglipModel.from_pretrained(str(exported), dtype=torch.float32).eval()
    with torch.no_grad():
        image = torch.nn.functional.normalize(model.get_image_features(pixel_values=probe["pixels"]).pooler_output, dim=-1)
        text = torch.nn.functional.normalize(model.get_text_features(input_ids=probe["ids"]).pooler_output, dim=-1)
    atol = 3e-2 if "precision=bf16" in RUNS[profile] else 1e-5   # the engine's forward in bf16
    torch.testing.assert_close(image, probe["image"], atol=atol, rtol=0)
    torch.testing.assert_close(text, probe["text"], atol=atol, rtol=0)
    size = 48 if profile == "zero3" else IMAGE_SIZE
    assert result["image_size"] == size and model.config.vision_config.image_size == size
    assert build_model(ModelConfig(pretrained=str(exported)), seed=0).image_size == size   # evaluation's size
    assert (exported / "adapter" / "adapter_config.json").is_file() == (profile != "zero1")


def test_eval_of_a_lora_checkpoint_equals_eval_of_its_export(runs, published_data, tmp_path):
    """`rsclip-ds eval --checkpoint` merges the adapters as the export does: same metrics."""
    out, _, _ = runs("zero2")
    exported = export_hf(out, tmp_path / "export")
    results = {}
    for name, source in (("checkpoint", ["--checkpoint", str(out)]), ("model", ["--model", str(exported)])):
        run_checked([sys.executable, "-m", "rsclip_ds", "eval", *source, "--zero-shot", published_data["classes"],
                     "--retrieval", published_data["captions"], "--out", str(tmp_path / f"{name}.json")], timeout=300)
        results[name] = json.loads((tmp_path / f"{name}.json").read_text())
    for group in ("zero_shot", "retrieval"):
        for key, value in results["model"][group].items():
            if isinstance(value, float):
                assert results["checkpoint"][group][key] == pytest.approx(value, abs=1e-6), (group, key)

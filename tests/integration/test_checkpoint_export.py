"""Export: a ZeRO-3 run's checkpoint -> Hugging Face folder -> `AutoModel.from_pretrained` gives
the engine's own embeddings; a new run starts from the folder (the fine-tuning path).

Run as a script under the launcher, this file is the worker that trains and records the
engine's embeddings of a fixed probe batch after the last step:

    deepspeed --num_gpus 2 tests/integration/test_checkpoint_export.py --embeddings E.pt --config C --set ...
"""

from __future__ import annotations

import argparse
import json
import sys

import pytest
import torch
import torch.nn.functional as F

PROBE = 4   # probe batch size


def probe_batch(image_size: int, length: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    pixels = torch.randn(PROBE, 3, image_size, image_size, generator=g)   # (P,3,H,W)
    ids = torch.randint(3, vocab, (PROBE, length), generator=g)           # (P,L)
    return pixels, ids


def _worker(argv: list[str]) -> None:
    """Train with a hook that embeds the probe batch through the engine after the last step."""
    import torch.distributed as dist

    from rsclip_ds.cli import strip_local_rank
    from rsclip_ds.config import load_config
    from rsclip_ds.assembly import Trainer

    p = argparse.ArgumentParser()
    p.add_argument("--embeddings", required=True)
    p.add_argument("--config")
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args(strip_local_rank(argv))
    run = load_config(args.config, args.set)

    def hook(step, engine):
        if step != run.steps:
            return None
        config = engine.module.config
        pixels, ids = probe_batch(config.vision_config.image_size, config.text_config.max_position_embeddings,
                                  config.text_config.vocab_size)
        engine.eval()
        with torch.no_grad():   # through forward(): ZeRO-3 gathers the parameters there
            image, text, _, _ = engine(pixels, ids)
        engine.train()
        if dist.get_rank() == 0:
            torch.save({"pixels": pixels, "ids": ids, "image": image, "text": text}, args.embeddings)
        return {"probe_image_norm": float(image.norm(dim=-1).mean())}

    with Trainer(run, hooks=[hook]) as trainer:
        trainer.train()


if __name__ == "__main__":
    _worker(sys.argv[1:])
    sys.exit(0)


from rsclip_ds.cli import main   # noqa: E402
from tests.integration.helpers import DEMO_CONFIG, deepspeed_cmd, free_port, run_checked, train_args  # noqa: E402

pytestmark = pytest.mark.slow


def test_export_loads_with_automodel_gives_the_engine_embeddings_and_starts_a_run(launch_data, tmp_path):
    from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

    out, emb = tmp_path / "run", tmp_path / "engine_embeddings.pt"
    sets = ["profile=zero3", "steps=8", "optim.warmup_steps=2"]
    args = train_args(launch_data, out, sets)[5:]   # drop "--module rsclip_ds train --config X"
    cmd = deepspeed_cmd() + ["--num_gpus", "2", "--master_port", str(free_port()), __file__,
                             "--embeddings", str(emb), "--config", str(DEMO_CONFIG)] + args
    run_checked(cmd)
    src = json.loads((out / "summary.json").read_text())
    assert src["zero_stage"] == 3 and src["evals"][-1]["step"] == 8   # the hook's metrics are kept

    engine = torch.load(emb, weights_only=True)
    for dtype, atol in (("fp32", 1e-5), ("bf16", 3e-2)):
        hf = tmp_path / f"hf_{dtype}"
        assert main(["export", str(out), str(hf), "--dtype", dtype]) == 0
        assert (hf / "model.safetensors").is_file()
        assert not [p.name for p in hf.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
        model = AutoModel.from_pretrained(str(hf)).eval()
        assert type(model).__name__ == "SiglipModel"
        assert next(model.parameters()).dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        with torch.no_grad():
            image = model.vision_model(pixel_values=engine["pixels"].to(model.dtype)).pooler_output
            text = model.text_model(input_ids=engine["ids"]).pooler_output
        torch.testing.assert_close(F.normalize(image.float(), dim=-1), engine["image"], atol=atol, rtol=0)
        torch.testing.assert_close(F.normalize(text.float(), dim=-1), engine["text"], atol=atol, rtol=0)

    hf = tmp_path / "hf_fp32"
    caption = "a remote sensing image of a forest next to a river."
    trained_tok = AutoTokenizer.from_pretrained(launch_data["tokenizer"])
    assert AutoTokenizer.from_pretrained(str(hf))(caption)["input_ids"] == trained_tok(caption)["input_ids"]
    proc = AutoImageProcessor.from_pretrained(str(hf))
    assert proc.size == {"height": 64, "width": 64} and list(proc.image_mean) == [0.5, 0.5, 0.5]

    # fine-tuning path: a new run from the exported folder starts where the source run ended
    ft = tmp_path / "finetune"
    run_checked(deepspeed_cmd() + ["--num_gpus", "2", "--master_port", str(free_port())] + train_args(
        launch_data, ft, ["profile=zero2", "steps=3", "optim.warmup_steps=1", f"model.pretrained={hf}",
                          "model.tokenizer=null"]))
    first = json.loads((ft / "summary.json").read_text())["losses"][0]
    # a fresh model starts near 10 (b = -10); the trained one is near its final loss
    assert first < src["losses"][0] - 2.5 and abs(first - src["losses"][-1]) < 1.5, (first, src["losses"])

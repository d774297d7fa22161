"""One SigLIP shape, written for both trainers: a Hugging Face SiglipModel folder for rsclip_ds
(`model.pretrained=<folder>`) and an open_clip model config for open_clip_train
(benchmarks/throughput/openclip_main.py registers it). The two models have the same parameters, tensor for
tensor (count_hf / the open_clip side's count; tests/integration/test_benchmark_openclip.py):

  Hugging Face SiglipModel             open_clip (timm ViT + open_clip TextTransformer)
  vision: conv patch embedding, learned position embedding, no class token, pre-LN blocks,
          post LayerNorm, MAP head     timm vit_*_siglip_*: class_token=False, global_pool='map'
          (probe, attention, LN, MLP)  (AttentionPoolLatent: latent, q/kv/proj, norm, mlp)
  text:   token + position embedding, pre-LN blocks without causal mask, final LayerNorm,
          last token -> head Linear    no_causal_mask, pool_type 'last', proj_bias (a Linear)
  logit scale and bias, shape [1]      init_logit_scale / init_logit_bias (--siglip)
  GELU (tanh), LayerNorm eps 1e-6      act_layer 'gelu_tanh' / act_kwargs approximate='tanh', eps 1e-6

Both read the same tokenizer folder (rsclip_ds's, trained on the shards' captions; open_clip
through its HFTokenizer), so both see the same token ids, padded to `context` tokens.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shape:
    name: str
    width: int          # hidden size of both towers (= the embedding size: SigLIP has no projection)
    depth: int          # encoder layers per tower
    heads: int
    mlp: int            # MLP hidden size (SiglipConfig.intermediate_size)
    patch: int
    image: int          # px
    context: int        # text tokens (max_position_embeddings)
    vocab: int

    @property
    def openclip_name(self) -> str:
        return f"rsclip-bench-{self.name}"

    @property
    def timm_name(self) -> str:
        return "rsclip_bench_vit_" + self.name.replace("-", "_")


SHAPES = {
    # the measurement of docs/benchmarks/throughput.md (20.05M parameters; 12.6M of them the token embedding)
    "siglip-20m": Shape("siglip-20m", width=256, depth=4, heads=4, mlp=1024, patch=16, image=128, context=64,
                        vocab=49408),
    # --tiny: seconds per run
    "tiny": Shape("tiny", width=64, depth=2, heads=2, mlp=256, patch=16, image=64, context=16, vocab=1000),
    # benchmarks/gpu/run.py --open-clip: rsclip_ds's git-rsclip-base preset (SigLIP-B/16 at 224 px;
    # open_clip's ViT-B-16-SigLIP with 64 tokens), vocabulary 32,000
    "git-rsclip-base": Shape("git-rsclip-base", width=768, depth=12, heads=12, mlp=3072, patch=16, image=224,
                             context=64, vocab=32000),
}


# --------------------------------------------------------------------------- rsclip_ds side

def siglip_config(shape: Shape, tokenizer):
    """transformers.SiglipConfig of the shape; special ids from the tokenizer (as rsclip_ds's presets)."""
    from transformers import SiglipConfig

    tower = dict(hidden_size=shape.width, intermediate_size=shape.mlp, num_hidden_layers=shape.depth,
                 num_attention_heads=shape.heads)
    text = dict(tower, max_position_embeddings=shape.context, vocab_size=shape.vocab,
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)
    return SiglipConfig(text_config=text, vision_config=dict(tower, image_size=shape.image, patch_size=shape.patch))


def write_hf_folder(shape: Shape, tokenizer_dir: Path, out: Path, seed: int = 0) -> int:
    """A SiglipModel folder (seeded random weights, the tokenizer, an image processor with
    mean/std 0.5) that `model.pretrained=<out>` loads -> its parameter count. Reused when present."""
    from rsclip_ds.model import load_tokenizer, new_dual_encoder, save_pretrained

    tokenizer = load_tokenizer(tokenizer_dir)
    if len(tokenizer) > shape.vocab:
        raise ValueError(f"the tokenizer's {len(tokenizer)} ids do not fit the shape's vocabulary {shape.vocab}")
    model = new_dual_encoder(siglip_config(shape, tokenizer), "siglip", seed)
    if not (out / "model.safetensors").is_file():
        out.mkdir(parents=True, exist_ok=True)
        save_pretrained(model, tokenizer, out)
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- open_clip side

def openclip_config(shape: Shape, tokenizer_dir: Path) -> dict:
    """The open_clip model config (the layout of open_clip's ViT-B-16-SigLIP.json)."""
    return {
        "embed_dim": shape.width,
        "init_logit_bias": -10,
        "custom_text": True,
        "vision_cfg": {"image_size": shape.image, "timm_model_name": shape.timm_name,
                       "timm_model_pretrained": False, "timm_pool": "map", "timm_proj": "none"},
        "text_cfg": {"context_length": shape.context, "vocab_size": shape.vocab,
                     "hf_tokenizer_name": str(Path(tokenizer_dir).resolve()),
                     "width": shape.width, "heads": shape.heads, "layers": shape.depth,
                     "mlp_ratio": shape.mlp / shape.width, "no_causal_mask": True, "proj_bias": True,
                     "pool_type": "last", "norm_kwargs": {"eps": 1e-6}, "act_kwargs": {"approximate": "tanh"}},
    }   # image mean/std 0.5 (SigLIP's) go to the trainer as --image-mean / --image-std


def timm_spec(shape: Shape) -> dict:
    """NAME.timm.json: timm's SigLIP ViT entry point with this shape (benchmarks/throughput/openclip_main.py)."""
    return {"timm_model_name": shape.timm_name, "base": "vit_base_patch16_siglip_224",
            "overrides": {"embed_dim": shape.width, "depth": shape.depth, "num_heads": shape.heads,
                          "mlp_ratio": shape.mlp / shape.width, "patch_size": shape.patch,
                          "img_size": shape.image, "act_layer": "gelu_tanh"}}


def write_openclip_dir(shape: Shape, tokenizer_dir: Path, out: Path) -> Path:
    """DIR for openclip_main.py --model-dir: NAME.json + NAME.timm.json (+ shape.json, for the record)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{shape.openclip_name}.json").write_text(json.dumps(openclip_config(shape, tokenizer_dir), indent=2))
    (out / f"{shape.openclip_name}.timm.json").write_text(json.dumps(timm_spec(shape), indent=2))
    (out / "shape.json").write_text(json.dumps(asdict(shape), indent=2))
    return out

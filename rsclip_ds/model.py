"""The dual encoder: Hugging Face SigLIP towers plus a learnable logit scale and bias.

`DualEncoder` holds the towers under the same attribute names as `transformers.SiglipModel`,
so its state dict *is* a SiglipModel state dict: export is `SiglipModel.load_state_dict`.
`logit_scale` / `logit_bias` keep SiglipModel's shape [1]: DeepSpeed 0.19.8 crashes on 0-dim
parameters (`self.dim() cannot be 0 to view Float as Byte`), and CLIPModel's 0-dim scale is
the reason we do not use CLIPModel for the 'clip' loss.

Patch dropout (`apply_patch_dropout`, config `model.patch_dropout`) is a forward hook on the
vision embeddings; its section at the end of this module explains it.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rsclip_ds.config import ConfigError, ModelConfig
from rsclip_ds.hub import ModelSource, resolve_source

log = logging.getLogger("rsclip_ds")

# Shapes follow the published checkpoints: Git-RSCLIP = SigLIP-L/16 at 256 px,
# Git-RSCLIP-base = SigLIP-B/16 at 224 px; both use 64 text tokens and image mean/std 0.5.
PRESETS: dict[str, dict[str, Any]] = {
    "git-rsclip-large": {
        "text": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                     num_attention_heads=16, max_position_embeddings=64, vocab_size=32000),
        "vision": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                       num_attention_heads=16, image_size=256, patch_size=16),
    },
    "git-rsclip-base": {
        "text": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                     num_attention_heads=12, max_position_embeddings=64, vocab_size=32000),
        "vision": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                       num_attention_heads=12, image_size=224, patch_size=16),
    },
    "tiny": {
        "text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, max_position_embeddings=48, vocab_size=1000),
        "vision": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, image_size=64, patch_size=8),
    },
}
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
# Initial temperature / bias. SigLIP: t' = log 10, b = -10 (Zhai et al. 2023, sec. 3.2);
# CLIP: t = 1/0.07 (Radford et al. 2021), no bias.
LOGIT_INIT = {"siglip": (math.log(10.0), -10.0), "clip": (math.log(1 / 0.07), 0.0)}


@torch.compiler.assume_constant_result
def _pixel_affine(mean: tuple[float, ...], std: tuple[float, ...]) -> tuple[list[float], list[float]]:
    """normalize_pixels' per-channel (scales, shifts), each rounded to float32. A constant of the
    model's mean and std for torch.compile (runtime/compilation.py): `.tolist()` of a float tensor would
    break the graph at the start of every forward (eager: a plain call)."""
    std_t, mean_t = torch.tensor(std, dtype=torch.float32), torch.tensor(mean, dtype=torch.float32)
    return (1.0 / (255.0 * std_t)).tolist(), (-mean_t / std_t).tolist()


def normalize_pixels(pixels: torch.Tensor, mean, std, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 RGB (B, 3, S, S), any strides -> contiguous ``dtype`` (B, 3, S, S), ``(x / 255 - mean) / std``.

    Computed as ``x * (1 / (255 std)) + (-mean / std)`` in float32 -- two roundings, the constants
    rounded to float32 first -- then cast: bit for bit the numbers of the numpy reference
    (``data.transforms.Normalize``, which the loader ran on the CPU before) in every precision
    (tests/unit/test_pixels.py checks all 256 values per channel). The float32 intermediate costs
    4 bytes per pixel on the device for the moment of the cast (96 MiB for 128 x 256 px).
    The per-channel constants go in as Python scalars: a (3,) tensor built on a GPU would be a
    host-to-device copy, which waits for the stream, in every forward."""
    scales, shifts = _pixel_affine(tuple(mean), tuple(std))   # float32 values
    # uint8 made contiguous first: casting the channels-last view straight to a contiguous
    # float32 took 2.4x as long on this CPU (600 ms against 250 ms for 128 x 256 px)
    out = pixels.contiguous().to(torch.float32)                              # (B, 3, S, S) f32
    for c, (scale, shift) in enumerate(zip(scales, shifts)):
        out[:, c].mul_(scale).add_(shift)
    return out.to(dtype)


class DualEncoder(nn.Module):
    """Image tower + text tower -> L2-normalised embeddings, logit scale (log) and bias.

    ``pixel_values`` may be uint8 RGB (what the loader and evaluation send: a quarter of the
    bytes of float32 through shared memory and to the device); the model normalises them with
    ``image_mean`` / ``image_std`` in its vision tower's dtype (normalize_pixels). Float pixels
    are taken as already normalised and pass unchanged (benchmarks, transformers' image
    processor). ``image_mean`` / ``image_std`` are plain attributes, not buffers: the state
    dict stays a SiglipModel state dict and DeepSpeed sees no extra tensors. The ModelBundle
    sets them (ModelBundle.__post_init__); SigLIP's 0.5 / 0.5 until then."""

    base_model_prefix = "siglip"   # as SiglipModel's: peft's LoRA injection reads it from models with a config

    def __init__(self, siglip: nn.Module):
        super().__init__()
        self.config = siglip.config
        self.vision_model = siglip.vision_model   # SiglipVisionModel
        self.text_model = siglip.text_model       # SiglipTextModel
        self.logit_scale = siglip.logit_scale     # (1,) log temperature
        self.logit_bias = siglip.logit_bias       # (1,)
        self.image_mean: tuple[float, ...] = IMAGE_MEAN
        self.image_std: tuple[float, ...] = IMAGE_STD

    def vision_dtype(self) -> torch.dtype:
        """The patch embedding's dtype, which transformers casts pixels to (under ZeRO-3 the
        partitioned parameter keeps its dtype: nothing is gathered to read it)."""
        return self.vision_model.embeddings.patch_embedding.weight.dtype

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor):
        # Both towers run inside this forward, so ZeRO-3 gathers their parameters here.
        if pixel_values.dtype == torch.uint8:   # (B, 3, S, S) 0..255 -> normalised, on the device
            pixel_values = normalize_pixels(pixel_values, self.image_mean, self.image_std, self.vision_dtype())
        image = self.vision_model(pixel_values=pixel_values).pooler_output   # (B, D)
        text = self.text_model(input_ids=input_ids).pooler_output             # (B, D)
        return F.normalize(image, dim=-1), F.normalize(text, dim=-1), self.logit_scale, self.logit_bias


@dataclass
class ModelBundle:
    """What the trainer and the data loader need to agree on."""
    model: DualEncoder
    tokenizer: Any
    image_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    max_text_length: int
    source: ModelSource | None = None   # where the weights came from (preset, folder, hub id)

    def __post_init__(self):
        # the model normalises uint8 pixels itself: with the bundle's numbers, wherever the bundle was made
        if self.model is not None:
            self.model.image_mean, self.model.image_std = tuple(self.image_mean), tuple(self.image_std)

    def num_parameters(self) -> int:
        return sum(getattr(p, "ds_numel", p.numel()) for p in self.model.parameters())   # ZeRO-3: whole size


def preset_config(preset: str, tokenizer=None):
    """The preset's SiglipConfig; with a tokenizer, its vocabulary size and special ids."""
    from transformers import SiglipConfig

    spec = PRESETS[preset]
    # SigLIP's own tokenizer: pad = eos = 1, no bos (SiglipTextConfig's 49406/49407 are CLIP's)
    text = dict(spec["text"], pad_token_id=1, bos_token_id=None, eos_token_id=1)
    if tokenizer is not None:
        text.update(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return SiglipConfig(text_config=text, vision_config=dict(spec["vision"]))


def load_tokenizer(path: Path):
    """A tokenizer folder: ours (tokenizer.json) or a SigLIP SentencePiece one (spiece.model)."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise ConfigError(f"tokenizer folder not found: {path} (train one with "
                          f"`rsclip-ds train-tokenizer --shards ... --out {path}`)")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except ImportError as err:   # SiglipTokenizer without sentencepiece / protobuf
        missing = [m for m in ("sentencepiece", "protobuf") if m.lower() in str(err).lower()] or \
            ["sentencepiece", "protobuf"]
        raise ConfigError(f"the tokenizer in {path} needs {' and '.join(missing)}: "
                          f"pip install {' '.join(missing)} (rsclip_ds installs both; this environment "
                          f"lacks them). Original error: {err}") from None


def _set_logits(model: DualEncoder, loss: str) -> None:
    """The loss's initial temperature and bias; under ZeRO-3 on rank 0's gathered copy."""
    scale, bias = LOGIT_INIT[loss]
    params = [model.logit_scale, model.logit_bias]
    with maybe_gathered(params, modifier_rank=0), torch.no_grad():
        model.logit_scale.fill_(scale)
        model.logit_bias.fill_(bias)


def maybe_gathered(params, modifier_rank: int | None = None):
    """deepspeed.zero.GatheredParameters for ZeRO-3 partitioned parameters, else nothing."""
    import contextlib

    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


@contextmanager
def maybe_zero3_init(ds_config: dict | None):
    """Under ZeRO-3, models built inside are partitioned as they are built: transformers'
    DeepSpeed integration runs `from_pretrained` and `_from_config` inside
    `deepspeed.zero.Init`, so each rank holds only its 1/W of the parameters (and rank 0 alone
    reads the checkpoint), instead of every rank building the full fp32 model first (4 bytes per
    parameter per rank). Yields whether it is active."""
    if not ds_config or ds_config.get("zero_optimization", {}).get("stage") != 3:
        yield False
        return
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    keep_alive = HfDeepSpeedConfig(ds_config)   # transformers holds only a weak reference
    try:
        yield True
    finally:
        del keep_alive
        unset_hf_deepspeed_config()


def build_model(cfg: ModelConfig, seed: int, loss: str = "siglip", *, source: ModelSource | None = None,
                ds_config: dict | None = None) -> ModelBundle:
    """From a preset (random init, seeded) or a pretrained folder / hub id; `loss` picks the
    logit scale/bias initialisation (and freezes the bias for 'clip'). ``source``: the
    already-resolved pretrained source (the Trainer fetches hub ids once per node);
    ``ds_config``: under ZeRO-3 a pretrained model is loaded partitioned (maybe_zero3_init).

    A preset is built whole on every rank, whatever the profile: inside zero.Init transformers
    draws the random initialisation in another order, so the same seed would give ZeRO-3 runs
    another starting model than ZeRO-1/2 runs (measured: max difference 0.47 on `tiny`). Whole,
    git-rsclip-large costs 2.6 GB of host memory per rank for the moments before the engine
    partitions it; preset_bundle(ds_config=...) builds partitioned where that matters more."""
    if cfg.pretrained is not None:
        return _load_pretrained(cfg, loss, source or resolve_source(cfg), ds_config)
    if cfg.tokenizer is None:
        raise ConfigError("model.tokenizer is required for a from-scratch run: train one with "
                          "`rsclip-ds train-tokenizer --shards DATA --out TOKDIR` and pass "
                          "--set model.tokenizer=TOKDIR (or set model.pretrained)")
    return preset_bundle(cfg.preset, load_tokenizer(cfg.tokenizer), seed, loss=loss)


def preset_bundle(preset: str, tokenizer, seed: int = 0, *, loss: str = "siglip", ds_config: dict | None = None,
                  own_vocabulary: bool = False) -> ModelBundle:
    """A preset's ModelBundle with a ready tokenizer. ``own_vocabulary=True`` keeps the preset's
    vocabulary size (32,000 for the real presets; the model `rsclip-ds plan` counts) instead of
    the tokenizer's: for benchmarks that feed their own token ids."""
    model = new_dual_encoder(preset_config(preset, None if own_vocabulary else tokenizer), loss, seed,
                             ds_config=ds_config)
    return _bundle(model, tokenizer, loss, IMAGE_MEAN, IMAGE_STD, ModelSource("preset", preset))


def new_dual_encoder(config, loss: str = "siglip", seed: int = 0, *, ds_config: dict | None = None) -> DualEncoder:
    """A randomly initialised (seeded) DualEncoder from a SiglipConfig (partitioned under a
    ZeRO-3 ``ds_config``)."""
    from transformers import SiglipModel

    torch.manual_seed(seed)
    with maybe_zero3_init(ds_config) as zero3:
        siglip = SiglipModel._from_config(config) if zero3 else SiglipModel(config)
    model = DualEncoder(siglip)
    _set_logits(model, loss)
    if loss == "clip":
        model.logit_bias.requires_grad_(False)
    return model


def _load_pretrained(cfg: ModelConfig, loss: str, source: ModelSource, ds_config: dict | None) -> ModelBundle:
    from transformers import SiglipImageProcessorPil, SiglipModel

    folder = Path(source.folder)
    # fp32 whatever the file holds (Git-RSCLIP ships 16-bit weights; transformers 5 would keep
    # them 16-bit): the engine makes its 16-bit copies itself, the optimizer needs fp32 masters.
    with maybe_zero3_init(ds_config):
        siglip = SiglipModel.from_pretrained(str(folder), dtype=torch.float32)
    # from_pretrained hands the model over in eval mode, and a module in eval mode silently skips
    # transformers' gradient checkpointing and our patch dropout (both check `.training`): in
    # training mode like a preset's fresh model; evaluation switches to eval() itself
    model = DualEncoder(siglip).train()
    tokenizer = load_tokenizer(cfg.tokenizer or folder)
    mean, std = IMAGE_MEAN, IMAGE_STD
    if (folder / "preprocessor_config.json").is_file():
        proc = SiglipImageProcessorPil.from_pretrained(str(folder))
        mean, std = tuple(proc.image_mean), tuple(proc.image_std)
    if loss == "clip":
        _set_logits(model, "clip")   # a SigLIP checkpoint's scale/bias mean nothing to softmax
    return _bundle(model, tokenizer, loss, mean, std, source)


def _bundle(model: DualEncoder, tokenizer, loss: str, mean, std, source: ModelSource) -> ModelBundle:
    if loss == "clip":
        model.logit_bias.requires_grad_(False)   # softmax is shift-invariant: no gradient
    vc, tc = model.config.vision_config, model.config.text_config
    return ModelBundle(model, tokenizer, vc.image_size, tuple(mean), tuple(std), tc.max_position_embeddings,
                       source)


def apply_activation_checkpointing(model: DualEncoder) -> None:
    """Recompute every encoder layer of both towers in backward.

    Reentrant checkpointing, on purpose: with the non-reentrant form, ZeRO-3's parameter-fetch
    trace breaks at the end of backward ("tracing error ... expected the next 2 parameters ...
    logit_bias, logit_scale", deepspeed 0.19.8). Reentrant needs the layer inputs to require
    grad, which they do here: both come out of trainable embeddings."""
    for tower in (model.vision_model, model.text_model):
        tower.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})


def save_pretrained(model: DualEncoder, tokenizer, out_dir: Path, mean=IMAGE_MEAN, std=IMAGE_STD) -> None:
    """Write a Hugging Face folder (model, tokenizer, image processor) from a DualEncoder."""
    from transformers import SiglipImageProcessorPil, SiglipModel

    siglip = SiglipModel(model.config)
    siglip.load_state_dict(model.state_dict())
    siglip.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    size = model.config.vision_config.image_size
    SiglipImageProcessorPil(size={"height": size, "width": size}, image_mean=list(mean),
                            image_std=list(std)).save_pretrained(str(out_dir))


# --------------------------------------------------------------------------- patch dropout
# Patch dropout (FLIP, Li et al. 2023): train the image tower on a random subset of its patches.
#
# `apply_patch_dropout(model, p)` puts a forward hook on the model's own vision embeddings
# (transformers' SiglipVisionEmbeddings has no option for it; the class is left alone): in
# training forward passes the hook keeps ``kept_tokens(N, p)`` of the N patch tokens of every
# image -- a random subset per image, the same count for all so the batch stays a dense
# (B, K, D) tensor -- after the position embeddings were added (kept tokens keep their
# positions) and before the encoder. SigLIP's attention-pooling head then pools over the K kept
# tokens (its one probe query attends to any number of keys). In eval mode (evaluation,
# `model.eval()`) nothing is dropped.
#
# The subset is drawn from torch's generator of the embeddings' device (the CPU's, or the current
# CUDA device's), the generators 'global' accumulation saves before its cached pass and restores
# before the replay (train.global_optimizer_step): both passes keep the same patches.
#
# `PatchDropoutSwitch` is a train-loop hook that turns it off for the last N optimizer steps
# (the unmasked phase FLIP ends with; open_clip's `--force-patch-dropout 0`).


def kept_tokens(num_patches: int, p: float) -> int:
    """Patches kept per image at drop fraction ``p``: round((1 - p) N), at least 1."""
    return max(1, round((1.0 - p) * num_patches))


class PatchDropout:
    """The hook's state: the fraction ``p`` and whether it is on (the switch turns it off).
    Not a module: it holds no tensors, and the state dict stays a SiglipModel state dict."""

    def __init__(self, p: float):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"patch dropout {p}: a fraction of patches to drop, 0 <= p < 1")
        self.p, self.enabled = p, True
        self.handle = None

    def __call__(self, module: nn.Module, args, embeddings: torch.Tensor) -> torch.Tensor | None:
        """Forward hook of SiglipVisionEmbeddings: (B, N, D) -> (B, K, D) kept tokens."""
        if not (module.training and self.enabled and self.p > 0):
            return None   # the output unchanged
        batch, n, dim = embeddings.shape
        keep = self.draw(batch, n, embeddings.device)                                 # (B, K)
        return embeddings.gather(1, keep.unsqueeze(-1).expand(-1, -1, dim))           # (B, K, D)

    @torch.compiler.disable
    def draw(self, batch: int, n: int, device: torch.device) -> torch.Tensor:
        """(B, K) indices of the kept patches: the K largest of B x N uniform draws (a uniformly
        random K-subset per image, as open_clip's PatchDropout draws it). Eager under torch.compile
        (runtime/compilation.py): inductor would draw from its own generator, so the masks would differ
        from eager's and 'global' accumulation's replay would rest on two compiled graphs drawing
        alike; eager, they come from the generator the replay restores."""
        scores = torch.rand(batch, n, device=device)                                   # (B, N)
        return scores.topk(kept_tokens(n, self.p), dim=1).indices                      # (B, K)


def apply_patch_dropout(model: nn.Module, p: float) -> PatchDropout | None:
    """Drop fraction ``p`` of the image patches in ``model``'s training forward passes (a
    DualEncoder or anything with ``.vision_model.embeddings``). p = 0 changes nothing (no hook:
    the forward stays bit for bit the model's own). Returns the hook's state, also kept as
    ``model.patch_dropout`` for the switch; applying again replaces the previous hook."""
    previous = getattr(model, "patch_dropout", None)
    if previous is not None and previous.handle is not None:
        previous.handle.remove()
    if p == 0:
        model.patch_dropout = None
        return None
    dropout = PatchDropout(p)
    dropout.handle = model.vision_model.embeddings.register_forward_hook(dropout)
    model.patch_dropout = dropout
    return dropout


class PatchDropoutSwitch:
    """Train-loop hook (train.train's ``hooks``): after optimizer step ``step`` it turns patch
    dropout off once ``step >= steps - off_last_steps``, so steps ``steps - N + 1 .. steps`` run
    unmasked. Call it with the resumed step before training (the loop runs hooks at step 0 of a
    fresh run only). Returns nothing: the loop would log a dict as an evaluation."""

    def __init__(self, dropout: PatchDropout, steps: int, off_last_steps: int, rank: int = 0):
        self.dropout, self.off_at, self.rank = dropout, steps - off_last_steps, rank
        if rank == 0:
            log.info("patch dropout %.2f in training passes%s", dropout.p,
                     f", off after step {self.off_at}" if off_last_steps else "")

    def __call__(self, step: int, engine=None) -> None:
        if self.dropout.enabled and step >= self.off_at:
            self.dropout.enabled = False
            if self.rank == 0:
                log.info("patch dropout %.2f off after step %d: steps %d.. run on every patch",
                         self.dropout.p, step, step + 1)

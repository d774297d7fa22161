"""benchmarks/gpu/run.py's variants and twins. A variant: one case measured again with a feature on, as
config overrides on the same run (the same model, batch, profile and precision):

  base           nothing added (the case as the grid measures it)
  patch_dropout  model.patch_dropout=0.5 (FLIP: half the image tokens; rsclip_ds/model.py)
  compile        compile.enabled=true (torch.compile of the model)
  distill        distill.teacher=<folder> distill.weight=1.0: a teacher of git-rsclip-large's shape with
                 random weights, written once per command (write_teacher); the time of its forward
                 is part of every step

Variants other than base run on one case only (VARIANT_CASE: git-rsclip-base, ZeRO-2, no
activation checkpointing, the preset's micro-batch, the profile's first precision), so the default
command adds three cases to the grid's eight (~45 s each, compile's first step longer).

A twin (TWINS): the plain PyTorch loop of benchmarks/twin.py on a preset's model and batch, eager
or with every encoder layer compiled, one per preset, micro-batch and compute dtype
(twin_precision: bf16 and amp_bf16 both compute in bf16, and the twin's recipe -- fp32 weights
under autocast -- is one for both); pair_with_twins reads each of our cases against the twins of
its compute dtype (ours / twin samples/s: 1.0 is the floor's speed).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness import synthetic_data
from rsclip_ds.precision import compute_dtype

VARIANTS = ("base", "patch_dropout", "compile", "distill")
TWINS = ("eager", "compiled")
# our variants that do the twin's work (the same model, batch and loss): patch dropout halves the
# image tokens and distillation adds a teacher, so those are read against base, not the twin
SAME_WORK_AS_TWIN = ("base", "compile")
TEACHER_PRESET = "git-rsclip-large"
# (preset, profile, activation checkpointing) of the case the non-base variants run on
VARIANT_CASE = ("git-rsclip-base", "zero2", False)


def twin_precision(precision: str) -> str:
    """The twin's precision for one of ours: its compute dtype (amp_bf16 -> bf16, bf16 -> bf16, fp32 ->
    fp32), the one autocast setting that tells twins apart (benchmarks.twin.PlainLoop)."""
    return compute_dtype(precision)


def variant_overrides(variant: str, teacher: str | None = None) -> list[str]:
    """The `--set` overrides a variant adds to its case's run."""
    if variant == "base":
        return []
    if variant == "patch_dropout":
        return ["model.patch_dropout=0.5"]
    if variant == "compile":
        return ["compile.enabled=true"]
    if variant == "distill":
        if not teacher:
            raise ValueError("the distill variant needs a teacher folder (write_teacher)")
        return [f"distill.teacher={teacher}", "distill.weight=1.0"]
    raise ValueError(f"unknown variant {variant!r}: one of {', '.join(VARIANTS)}")


def variant_case(preset: str, profile: str, checkpointing: bool, first_preset: str) -> bool:
    """Whether a grid case also runs the non-base variants: VARIANT_CASE, or, when the grid does
    not hold git-rsclip-base (a CPU smoke test: --model tiny), its first preset's ZeRO-2 case
    without checkpointing."""
    want = VARIANT_CASE[0] if VARIANT_CASE[0] == first_preset else first_preset
    return (preset, profile, checkpointing) == (want, *VARIANT_CASE[1:])


def write_teacher(out: Path, preset: str = TEACHER_PRESET, tokenizer_dir: Path | None = None) -> Path:
    """A Hugging Face folder of `preset`'s shape with seeded random weights and a tokenizer:
    what `distill.teacher=<folder>` loads. The tokenizer is the given one, or one trained here on
    a few synthetic captions (ids below every preset's vocabulary). Reused when present."""
    from rsclip_ds.model import load_tokenizer, preset_bundle, save_pretrained

    if (out / "model.safetensors").is_file():
        return out
    if tokenizer_dir is None:   # a few synthetic captions' tokenizer
        tokenizer_dir = synthetic_data(out.parent, num_train=64, num_val=1, shard_size=64, image_size=32)["tokenizer"]
    tokenizer = load_tokenizer(tokenizer_dir)
    bundle = preset_bundle(preset, tokenizer, seed=1, own_vocabulary=True)
    out.mkdir(parents=True, exist_ok=True)
    save_pretrained(bundle.model, tokenizer, out)
    return out


def pair_with_base(rows: list[dict]) -> list[dict]:
    """Each ok variant row with its ok base twin (same preset, profile, precision, checkpointing,
    micro, the tensor batch): variant / base samples/s and peak memory."""
    key = lambda r: (r["preset"], r["profile"], r.get("precision", "bf16"), r["checkpointing"], r["micro"])
    base = {key(r): r for r in rows if r.get("ok") and r.get("data", "tensor") == "tensor"
            and r.get("variant", "base") == "base" and not r.get("twin")}
    pairs = []
    for r in rows:
        twin = base.get(key(r)) if r.get("ok") and r.get("variant", "base") != "base" else None
        if twin:
            mem = (r["peak_memory_bytes"] / twin["peak_memory_bytes"]
                   if r.get("peak_memory_bytes") and twin.get("peak_memory_bytes") else None)
            pairs.append({"case": twin["case"], "variant": r["variant"], "base_samples_per_s": twin["samples_per_s"],
                          "variant_samples_per_s": r["samples_per_s"],
                          "variant_over_base": r["samples_per_s"] / twin["samples_per_s"],
                          "peak_memory_ratio": mem, "first_loss": r.get("first_loss"),
                          "base_first_loss": twin.get("first_loss")})
    return pairs


def teacher_batch(teacher: str, micro: int, device, generator) -> dict:
    """The distill variant's tensor batch for the teacher, beside the student's: uint8 pixels at the
    teacher's image size and token ids below its vocabulary (what the loader's second view carries:
    `teacher_pixel_values`, `teacher_input_ids`), from the teacher folder's config.json."""
    import json

    import torch

    spec = json.loads((Path(teacher) / "config.json").read_text())
    size = spec["vision_config"]["image_size"]
    text = spec["text_config"]
    length, vocab = text.get("max_position_embeddings", 64), text["vocab_size"]
    return {"teacher_pixel_values": torch.randint(0, 256, (micro, 3, size, size), device=device, generator=generator,
                                                  dtype=torch.uint8),                              # (B,3,T,T)
            "teacher_input_ids": torch.randint(0, vocab, (micro, length), device=device, generator=generator)}  # (B,L_t)


def pair_with_twins(rows: list[dict]) -> list[dict]:
    """Each ok row of ours on the tensor batch doing the twin's work (SAME_WORK_AS_TWIN; any
    profile and precision, with or without checkpointing) with the ok twins of its preset,
    micro-batch and compute dtype (twin_precision): our samples/s over each twin's, beside both
    MFUs. A twin that failed or was skipped gives None."""
    key = lambda r: (r["preset"], r["micro"], twin_precision(r.get("precision", "bf16")))
    twins = {(key(r), r["twin"]): r for r in rows if r.get("ok") and r.get("twin")}
    pairs = []
    for r in rows:
        if (not r.get("ok") or r.get("twin") or r.get("data", "tensor") != "tensor"
                or r.get("variant", "base") not in SAME_WORK_AS_TWIN):
            continue
        pair = {"case": r["case"], "variant": r.get("variant", "base"), "precision": r.get("precision", "bf16"),
                "samples_per_s": r["samples_per_s"], "mfu": r.get("mfu")}
        for name in TWINS:
            twin = twins.get((key(r), name))
            pair.update({f"twin_{name}_samples_per_s": twin["samples_per_s"] if twin else None,
                         f"twin_{name}_mfu": twin.get("mfu") if twin else None,
                         f"over_twin_{name}": r["samples_per_s"] / twin["samples_per_s"] if twin else None})
        if any(pair[f"over_twin_{name}"] is not None for name in TWINS):
            pairs.append(pair)
    return pairs

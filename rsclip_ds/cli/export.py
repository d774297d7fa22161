"""`rsclip-ds export`: a training checkpoint -> a Hugging Face folder (safetensors)."""

from __future__ import annotations

from pathlib import Path

from rsclip_ds.config import ConfigError


def register(sub) -> None:
    p = sub.add_parser("export", help="write a Hugging Face folder (safetensors) from a checkpoint")
    p.add_argument("checkpoint", help="run output_dir, its checkpoints/ folder, or a step######## folder")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="weight dtype of model.safetensors (default fp32; the published Git-RSCLIP is 16-bit)")
    p.set_defaults(handler=run)


def run(args) -> int:
    import sys

    from rsclip_ds.checkpoint import export_hf
    from rsclip_ds.finite import NonFiniteWeights

    try:
        out = export_hf(args.checkpoint, args.out_dir, dtype=args.dtype)
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from None
    except NonFiniteWeights as err:   # nothing written (docs/reference/exit-codes.md)
        print(f"rsclip-ds: NonFiniteWeights: {err}", file=sys.stderr)
        return err.exit_code
    print(f"Hugging Face folder written to {out} ({args.dtype}, safetensors); load it with "
          f"transformers.AutoModel.from_pretrained('{out}') or train from it with --set model.pretrained={out}")
    return 0

"""open_clip's own trainer, `open_clip_train.main`, with the benchmark's model registered. Runs with
the open_clip environment's Python (benchmarks/throughput/openclip_env.sh), never rsclip_ds's; imports
nothing of rsclip_ds. benchmarks/throughput/openclip.py launches it:

    VENV/bin/python -m torch.distributed.run --nproc_per_node 2 benchmarks/throughput/openclip_main.py \
        --model-dir DIR --model NAME --siglip --train-data ... (open_clip_train's own flags)
    VENV/bin/python -m benchmarks.throughput.openclip_main --model-dir DIR --count-params NAME

DIR holds NAME.json, an open_clip model config (registered with `open_clip.add_model_config`,
open_clip's way to add a model), and NAME.timm.json. open_clip's SigLIP configs (ViT-B-16-SigLIP)
take their vision tower from timm by name (`vit_base_patch16_siglip_224`: a ViT without class
token, pooled by multihead attention -- MAP -- as Hugging Face's SiglipVisionModel); timm has no
name for other sizes, so NAME.timm.json's "timm_model_name" is registered with timm as that same
entry point with the width, depth, heads and image size of its "overrides". Nothing else
changes: the remaining arguments go to `open_clip_train.main.main` as they are (--openclip-logs
DIR as its --logs DIR).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(model_dir: Path) -> None:
    import open_clip
    from timm.models import register_model
    from timm.models import vision_transformer as vit

    for spec_file in sorted(model_dir.glob("*.timm.json")):
        spec = json.loads(spec_file.read_text())
        base = getattr(vit, spec["base"])   # timm's own entry point, e.g. vit_base_patch16_siglip_224

        def entry(pretrained: bool = False, _base=base, _over=spec["overrides"], **kwargs):
            return _base(pretrained=pretrained, **dict(_over, **kwargs))

        entry.__name__ = spec["timm_model_name"]   # register_model keys on the function's name
        entry.__module__ = vit.__name__
        register_model(entry)
    open_clip.add_model_config(model_dir)


def count_params(name: str) -> dict:
    """The model open_clip_train builds for --model NAME --siglip (init_logit_bias given, so the
    logit bias exists as in training) -> parameter counts, and this environment's versions."""
    import numpy as np
    import open_clip
    import timm
    import torch
    import webdataset

    model = open_clip.create_model(name, init_logit_scale=np.log(10), init_logit_bias=-10)
    count = lambda module: sum(p.numel() for p in module.parameters())
    versions = {"open_clip": open_clip.__version__, "torch": torch.__version__, "timm": timm.__version__,
                "webdataset": webdataset.__version__}
    return {"parameters": count(model), "vision": count(model.visual), "text": count(model.text),
            "logit": model.logit_scale.numel() + model.logit_bias.numel(), "versions": versions}


def main(argv: list[str]) -> int:
    # no abbreviations: "--model NAME" (open_clip's) must not be taken for our --model-dir
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False, allow_abbrev=False)
    parser.add_argument("--model-dir", type=Path, required=True, help="NAME.json + NAME.timm.json")
    parser.add_argument("--count-params", metavar="NAME", help="print the model's parameter counts as JSON")
    # open_clip's --logs, renamed: torchrun's parser sees the script's arguments too and rejects
    # '--logs' as an ambiguous prefix of its own --logs-specs
    parser.add_argument("--openclip-logs", metavar="DIR", help="passed to open_clip_train as --logs")
    ours, rest = parser.parse_known_args(argv)
    if ours.openclip_logs is not None:
        rest += ["--logs", ours.openclip_logs]
    register(ours.model_dir)
    if ours.count_params:
        print(json.dumps(count_params(ours.count_params)))
        return 0
    from open_clip_train.main import main as open_clip_main

    return open_clip_main(rest) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`rsclip-ds show-config` and `rsclip-ds profiles`: what can be set, and the ZeRO strategies."""

from __future__ import annotations

import json

from rsclip_ds.cli.train import with_config
from rsclip_ds.config import describe, load_config


def register(sub) -> None:
    with_config(sub.add_parser("show-config", help="print the resolved config with every key's "
                               "description")).set_defaults(handler=show_config)
    sub.add_parser("profiles", help="list ds_profiles/").set_defaults(handler=profiles)


def show_config(args) -> int:
    from rich.console import Console
    from rich.table import Table

    resolved = json.loads(load_config(args.config, args.set).model_dump_json())
    table = Table(title="run config (defaults < file < --set)")
    for col in ("key", "value", "description"):
        table.add_column(col)
    for key, _default, desc in describe():
        value = resolved
        for part in key.split("."):
            value = value[part]
        table.add_row(key, json.dumps(value), desc)
    Console().print(table)
    return 0


def profiles(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from rsclip_ds.profiles import available_profiles, load_profile

    table = Table(title="ds_profiles")
    for col in ("profile", "stage", "offload", "act. ckpt", "per node", "needs"):
        table.add_column(col, no_wrap=True)   # the names whole on a narrow terminal; the text wraps
    table.add_column("what it is for")
    for name in available_profiles():
        p = load_profile(name)
        offload = "+".join(k for k, on in (("opt", p.offload_optimizer), ("param", p.offload_param)) if on)
        table.add_row(name, str(p.stage), offload or "-", "on" if p.activation_checkpointing else "off",
                      "hpZ" if p.hpz else "-", "CUDA" if p.cuda_only else "-", p.description)
    Console().print(table)
    return 0

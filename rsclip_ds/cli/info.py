"""`rsclip-ds show-config`, `rsclip-ds commands` and `rsclip-ds profiles`: what can be set, how
to call each command, and the ZeRO strategies.

`show-config --markdown` and `commands --markdown` write the reference pages docs/reference/config.md
and docs/reference/cli.md from the same sources as the console tables (the pydantic schema walk
`rsclip_ds.config.describe`, the argparse parsers); tests/unit/test_reference_docs.py checks that
the committed pages equal a fresh render.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

from rsclip_ds.cli.train import with_config
from rsclip_ds.config import ConfigError, RunConfig, describe, load_config

CONFIG_PAGE = "docs/reference/config.md"
CLI_PAGE = "docs/reference/cli.md"


def register(sub) -> None:
    p = with_config(sub.add_parser("show-config", help="print the resolved config with every key's description"))
    p.add_argument("--markdown", action="store_true", help=f"write the reference of every key and its default "
                   f"as markdown instead ({CONFIG_PAGE})")
    p.add_argument("--resolved", action="store_true",
                   help="print what the run would decide instead (rsclip_ds.resolve: batch, precision and its dtypes, "
                        "ZeRO, step guard, threads, workers...): the start-up lines, then resolved.json")
    p.add_argument("--world", type=int, help="with --resolved: this many ranks (default: the launcher's, else 1)")
    p.add_argument("--per-node", type=int, help="with --resolved: ranks per node (default: all of --world)")
    p.add_argument("--gpu", action="store_true", help="with --resolved: for GPUs with bf16, as `rsclip-ds plan` "
                                                      "plans (default: this machine's accelerator)")
    p.add_argument("--out", type=Path, help="with --markdown or --resolved: write to this file instead of stdout")
    p.set_defaults(handler=show_config)
    p = sub.add_parser("commands", help="list every command and flag")
    p.add_argument("--markdown", action="store_true", help=f"write them as markdown instead ({CLI_PAGE})")
    p.add_argument("--out", type=Path, help="with --markdown: write to this file instead of stdout")
    p.set_defaults(handler=commands)
    sub.add_parser("profiles", help="list ds_profiles/").set_defaults(handler=profiles)


def show_config(args) -> int:
    if not args.resolved and (args.world or args.per_node or args.gpu):
        raise ConfigError("show-config --world/--per-node/--gpu need --resolved (they say where the run would resolve)")
    if args.resolved:
        return _show_resolved(args)
    if args.markdown:
        if args.config or args.set:
            raise ConfigError("show-config --markdown writes the reference of the defaults; drop --config/--set, "
                              "or drop --markdown to see the values they resolve to")
        return _write(config_markdown(), args.out)
    if args.out:
        raise ConfigError("show-config --out needs --markdown (the table goes to the terminal)")
    from rich.console import Console
    from rich.table import Table

    resolved = json.loads(load_config(args.config, args.set).model_dump_json())
    table = Table(title="run config (defaults < file < --set)")
    for col in ("key", "value", "description"):
        table.add_column(col)
    for key, _default, description, _field in describe():
        value = resolved
        for part in key.split("."):
            value = value[part]
        table.add_row(key, json.dumps(value), description)
    Console().print(table)
    return 0


def _show_resolved(args) -> int:
    """The record resolve() makes for this config on `--world` ranks (the launcher's by default) and this
    machine's accelerator or, with --gpu, GPUs: the run's start-up lines, then its resolved.json."""
    from rsclip_ds.profiles import load_profile
    from rsclip_ds.resolve import GPU, Device, World, resolve

    if args.markdown:
        raise ConfigError("show-config: --resolved and --markdown are two views; pick one")
    run = load_config(args.config, args.set)
    world = World.from_env()
    if args.world:
        world = World(args.world, args.per_node or args.world)
    elif args.per_node:
        world = World(world.size, args.per_node)
    here = Device.current()
    r = resolve(run, load_profile(run.profile), world, replace(GPU, cores=here.cores) if args.gpu else here)
    record = json.dumps(r.to_dict(), indent=2) + "\n"
    if args.out is not None:
        return _write(record, args.out)
    print("\n".join(r.lines()) + "\n")
    sys.stdout.write(record)
    return 0


def commands(args) -> int:
    from rsclip_ds.cli import build_parser

    if args.markdown:
        return _write(cli_markdown(build_parser()), args.out)
    if args.out:
        raise ConfigError("commands --out needs --markdown (the table goes to the terminal)")
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rsclip-ds commands (rsclip-ds COMMAND --help for one)")
    for col in ("command", "argument", "help"):
        table.add_column(col)
    for name, parser, _help in _subcommands(build_parser()):
        for action in _arguments(parser):
            table.add_row(name, _flag_text(action), _help_text(parser, action))
    Console().print(table)
    return 0


def _write(text: str, out: Path | None) -> int:
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        print(f"wrote {out}", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- markdown

_BASIC = {bool: "bool", int: "int", float: "float", str: "str", Path: "path"}


def type_text(ann: Any, metadata: list | tuple = ()) -> str:
    """What a field accepts, in words: "int >= 1", "'exact' | 'resampled'", "float in [0, 1]",
    "'auto' or int >= 0", "[float, float] or null" (its annotation, bounds and Literal values)."""
    origin, args = get_origin(ann), get_args(ann)
    if origin is Annotated:
        return type_text(args[0], [*metadata, *(m for a in args[1:] for m in getattr(a, "metadata", [a]))])
    if origin is Literal:
        return " | ".join(f"'{a}'" if isinstance(a, str) else json.dumps(a) for a in args)
    if origin is Union:
        parts = [type_text(a, metadata) for a in args if a is not type(None)]
        return " or ".join(parts + (["null"] if type(None) in args else []))
    if origin is tuple:
        return "[" + ", ".join(type_text(a) for a in args) + "]"
    if origin is list:
        item = type_text(args[0])
        return f"list of ({item})" if " | " in item or " or " in item else f"list of {item}"
    return _bounded(_BASIC.get(ann, getattr(ann, "__name__", str(ann))), metadata)


def _bounded(name: str, metadata) -> str:
    """"int >= 1", "float > 0", "float in [0, 1)" from annotated_types' Ge / Gt / Le / Lt."""
    lo = next(((f"[{m.ge}", ">=", m.ge) for m in metadata if hasattr(m, "ge")), None) or \
        next(((f"({m.gt}", ">", m.gt) for m in metadata if hasattr(m, "gt")), None)
    hi = next(((f"{m.le}]", "<=", m.le) for m in metadata if hasattr(m, "le")), None) or \
        next(((f"{m.lt})", "<", m.lt) for m in metadata if hasattr(m, "lt")), None)
    if lo and hi:
        return f"{name} in {lo[0]}, {hi[0]}"
    bound = lo or hi
    return f"{name} {bound[1]} {bound[2]}" if bound else name


def md_cell(text: str) -> str:
    """Text for a GFM table cell: `|` escaped everywhere (code spans too), and outside code spans
    the characters that would turn into emphasis or an HTML tag (`*`, `<`, `_` at a word edge)."""
    parts = text.replace("\n", " ").split("`")
    for i in range(0, len(parts), 2):   # the even parts are outside backticks
        p = parts[i].replace("\\", "\\\\").replace("*", "\\*").replace("<", "&lt;")
        parts[i] = re.sub(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])", r"\\_", p)
    return "`".join(parts).replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{text}`".replace("|", "\\|")


def config_markdown(schema: type[BaseModel] = RunConfig) -> str:
    """docs/reference/config.md: one section per top-level part of the tree, one row per key."""
    rows = describe(schema)
    sections: dict[str, list] = {}
    for row in rows:
        sections.setdefault(row[0].split(".")[0] if "." in row[0] else "", []).append(row)
    out = ["# Run config reference", "",
           f"*Generated from the schema in `rsclip_ds/config.py` by "
           f"`rsclip-ds show-config --markdown --out {CONFIG_PAGE}`: edit the field descriptions there, "
           f"not this page.*", "",
           "A run config is one tree: the defaults below, then a YAML or JSON file (`--config FILE`, "
           "nested as the keys' dots say), then `--set KEY=VALUE` overrides in the order given (the value is "
           "read as YAML: `8`, `1e-4`, `true`, `null`, `[image,text]`). An unknown key or a value outside "
           "what the *type* column allows stops the run before any process starts, naming the key. "
           "`rsclip-ds show-config --config FILE --set ...` prints the values a run would use.", "",
           f"{len(rows)} keys in {len(sections)} sections: "
           + ", ".join(f"[{name or 'top level'}](#{name or 'top-level'})" for name in sections) + ".", ""]
    for name, section_rows in sections.items():
        out += [f"## {name or 'top level'}", ""]
        if name:
            out += [md_cell(schema.model_fields[name].description or ""), ""]
            nested = [f"`{key}.*`: {md_cell(desc)}" for key, desc in _subsections(schema, name)]
            out += nested + [""] if nested else []
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        out += [f"| `{key}` | {_code(type_text(field.annotation, field.metadata))} | {_code(default)} | "
                f"{md_cell(description)} |" for key, default, description, field in section_rows]
        out.append("")
    return "\n".join(out)


def _subsections(schema: type[BaseModel], name: str) -> list[tuple[str, str]]:
    """(dotted key, description) of the sections nested in top-level section `name` (finetune.lora)."""
    found, todo = [], [(name, schema.model_fields[name].annotation)]
    while todo:
        prefix, cls = todo.pop(0)
        for field_name, field in cls.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                found.append((f"{prefix}.{field_name}", field.description or ""))
                todo.append((f"{prefix}.{field_name}", ann))
    return found


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """(name, parser, one-line help) per sub-command, in registration order."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
    return [(name, sub, helps.get(name, "")) for name, sub in action.choices.items()]


def _arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]


def _metavar(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.metavar is not None:
        word = action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    elif action.choices is not None:
        word = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        word = action.dest.upper() if action.option_strings else action.dest
    return {"?": f"[{word}]", "*": f"[{word} ...]", "+": f"{word} [{word} ...]"}.get(action.nargs, word)


def _flag_text(action: argparse.Action) -> str:
    """`--gpus-per-node, --gpus N`, or a positional's name."""
    return " ".join(filter(None, (", ".join(action.option_strings), _metavar(action)))) or action.dest


def _help_text(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help with argparse's %-expansion applied; '(required)' or the default where it says none."""
    text = (action.help or "") % {**vars(action), "prog": parser.prog} if action.help else ""
    if action.required and action.option_strings:
        text += " (required)"
    elif action.option_strings and not (action.default is None or action.default is False or action.default == []
                                        or action.default == argparse.SUPPRESS) and "default" not in text:
        text += f" (default {action.default})"
    return text.strip()


def _usage(parser: argparse.ArgumentParser) -> str:
    """`rsclip-ds plan --gpus-per-node N --gpu-mem GPU_MEM ... [options]`: what must be given."""
    grouped = {id(a) for g in parser._mutually_exclusive_groups for a in g._group_actions}
    words = [parser.prog]
    for action in _arguments(parser):
        if not action.option_strings:
            words.append(_metavar(action))
        elif action.required and id(action) not in grouped:
            words.append(f"{action.option_strings[0]} {_metavar(action)}".strip())
    for group in parser._mutually_exclusive_groups:
        alts = [f"{a.option_strings[0]} {_metavar(a)}".strip() for a in group._group_actions]
        words.append(("({})" if group.required else "[{}]").format(" | ".join(alts)))
    if any(a.option_strings and not a.required and id(a) not in grouped for a in _arguments(parser)):
        words.append("[options]")
    return " ".join(words)


def cli_markdown(parser: argparse.ArgumentParser) -> str:
    """docs/reference/cli.md: per sub-command its usage, description and a table of its arguments."""
    subs = _subcommands(parser)
    out = ["# Command reference", "",
           f"*Generated from the argparse parsers in `rsclip_ds/cli/` by "
           f"`rsclip-ds commands --markdown --out {CLI_PAGE}`: edit the help texts there, not this page.*", "",
           "`rsclip-ds COMMAND` and `python -m rsclip_ds COMMAND` are the same program; under the DeepSpeed "
           "launcher it is `deepspeed [launcher flags] --module rsclip_ds COMMAND ...` (the launcher's "
           "`--local_rank` is accepted and ignored). A bad config key or value exits with code 2 "
           "([exit codes](exit-codes.md)); the run config keys are in [config.md](config.md).", "",
           "Commands: " + ", ".join(f"[{name}](#{name})" for name, _, _ in subs) + ".", ""]
    for name, sub, help_line in subs:
        out += [f"## {name}", "", f"```text\n{_usage(sub)}\n```", "", md_cell(_first_paragraph(sub, help_line)), ""]
        args = _arguments(sub)
        if args:
            out += ["| argument | help |", "|---|---|"]
            out += [f"| {_code(_flag_text(a))} | {md_cell(_help_text(sub, a))} |" for a in args]
            out.append("")
    return "\n".join(out)


def _first_paragraph(sub: argparse.ArgumentParser, help_line: str) -> str:
    text = (sub.description or help_line or "").strip()
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") or not text else ".")


# --------------------------------------------------------------------------- profiles

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

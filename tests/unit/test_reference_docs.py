"""docs/reference/config.md and cli.md are renders of the schema and the parsers, and stay so."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rsclip_ds.cli import build_parser, main
from rsclip_ds.cli.info import CLI_PAGE, CONFIG_PAGE, _subcommands, cli_markdown, config_markdown, md_cell
from rsclip_ds.config import RunConfig, describe

ROOT = Path(__file__).resolve().parents[2]
MAX_DOC_BYTES = 30_000   # the docs' size limit: one page a reader can hold


def _table_rows(page: str) -> list[list[str]]:
    """The cells of every table body row (pipes escaped as \\| stay inside their cell)."""
    rows = []
    for line in page.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])])
    return [r for r in rows if r[0] not in ("key", "argument")]


@pytest.mark.parametrize("page, render, command", [
    (CONFIG_PAGE, config_markdown, f"rsclip-ds show-config --markdown --out {CONFIG_PAGE}"),
    (CLI_PAGE, lambda: cli_markdown(build_parser()), f"rsclip-ds commands --markdown --out {CLI_PAGE}"),
])
def test_committed_page_is_the_fresh_render(page, render, command):
    committed = (ROOT / page).read_text()
    fresh = render()
    assert committed == fresh, f"{page} is out of date with the code: regenerate it with `{command}`"
    assert command in committed.splitlines()[2], "the page's header names the command that makes it"
    assert len(fresh.encode()) < MAX_DOC_BYTES, f"{page} is {len(fresh.encode())} bytes; split it"


def test_config_page_has_every_key_once_with_its_type_and_default():
    rows = {r[0].strip("`"): r for r in _table_rows(config_markdown())}
    keys = [key for key, *_ in describe()]
    assert len(keys) > 80 and sorted(rows) == sorted(keys)   # every key of the schema, nothing else
    assert all(len(r) == 4 for r in rows.values()), "a cell's | was not escaped"
    defaults = json.loads(RunConfig().model_dump_json())
    for key, (_, _type, default, _desc) in rows.items():
        value = defaults
        for part in key.split("."):
            value = value[part]
        assert json.loads(default.strip("`")) == value, key   # the default a run really gets


@pytest.mark.parametrize("key, allowed", [
    ("steps", "int >= 1"),
    ("precision", "'auto' \\| 'fp32' \\| 'bf16' \\| 'fp16' \\| 'amp_bf16' \\| 'amp'"),
    ("data.num_workers", "'auto' or int >= 0"),
    ("data.epoch_batches", "int >= 1 or null"),
    ("data.random_resized_crop", "[float, float] or null"),
    ("optim.min_lr_ratio", "float in [0, 1]"),
    ("optim.image_layer_decay", "float in (0, 1]"),
    ("finetune.lora.dropout", "float in [0, 1)"),
    ("finetune.lora.towers", "list of ('image' \\| 'text')"),
    ("eval.zero_shot_dir", "path or null"),
])
def test_config_page_types_say_what_is_allowed(key, allowed):
    rows = {r[0].strip("`"): r for r in _table_rows(config_markdown())}
    assert rows[key][1] == f"`{allowed}`"


def test_a_key_added_to_the_schema_appears_in_its_section():
    from pydantic import Field

    from rsclip_ds.config import BatchConfig

    class WiderBatch(BatchConfig):
        new_knob: int = Field(3, ge=2, description="A knob | with a pipe.")

    class WiderRun(RunConfig):
        batch: WiderBatch = Field(default_factory=WiderBatch, description="Batch arithmetic.")

    page = config_markdown(WiderRun)
    section = page.split("\n## batch\n", 1)[1].split("\n## ", 1)[0]
    assert "| `batch.new_knob` | `int >= 2` | `3` | A knob \\| with a pipe. |" in section
    assert "batch.new_knob" not in config_markdown()


def test_cli_page_has_every_command_and_flag():
    page = cli_markdown(build_parser())
    for name, sub, _help in _subcommands(build_parser()):
        assert f"\n## {name}\n" in page
        section = page.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert flag in section, f"{name}: {flag} missing"
    assert "`--gpus-per-node, --gpus GPUS` | GPUs per node (required) |" in page
    assert ("rsclip-ds make-shards --out OUT (--karpathy KARPATHY | --table TABLE | --folder FOLDER | "
            "--hf-dataset FOLDER_OR_ID) [options]") in page


def test_show_config_markdown_writes_the_page(tmp_path, capsys):
    assert main(["show-config", "--markdown"]) == 0
    assert capsys.readouterr().out == config_markdown()
    assert main(["show-config", "--markdown", "--out", str(tmp_path / "c.md")]) == 0
    assert (tmp_path / "c.md").read_text() == config_markdown()
    assert main(["commands", "--markdown", "--out", str(tmp_path / "cli.md")]) == 0
    assert (tmp_path / "cli.md").read_text() == cli_markdown(build_parser())


def test_show_config_markdown_refuses_overrides(capsys):
    assert main(["show-config", "--markdown", "--set", "steps=5"]) == 2
    assert "drop --config/--set" in capsys.readouterr().err
    assert main(["show-config", "--out", "x.md"]) == 2
    assert "--out needs --markdown" in capsys.readouterr().err


@pytest.mark.parametrize("text, cell", [
    ("a|b", "a\\|b"),
    ("`a|b` and a_b", "`a\\|b` and a_b"),              # code spans keep their text
    ("2**this", "2\\*\\*this"),                         # not bold
    ("replaced-<UTC time>", "replaced-&lt;UTC time>"),  # not an HTML tag that would vanish
    ("img2dataset's *_stats.json", "img2dataset's \\*\\_stats.json"),
])
def test_md_cell_escapes_what_markdown_would_eat(text, cell):
    assert md_cell(text) == cell

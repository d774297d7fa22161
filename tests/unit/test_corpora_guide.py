"""docs/guides/corpora.md: every command in a fenced block parses with the real parser, and
every repository file it names exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from rsclip_ds.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "corpora.md"


def _commands() -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", GUIDE.read_text(), re.S)
    return [shlex.split(cmd) for block in blocks for cmd in block.replace("\\\n", " ").splitlines() if cmd.strip()]


def test_every_guide_command_parses_and_names_existing_files():
    commands = _commands()
    assert len(commands) >= 7
    for argv in commands:
        assert argv[0] == "rsclip-ds", argv
        args = build_parser().parse_args(argv[1:])
        if getattr(args, "config", None):
            assert (ROOT / args.config).is_file(), argv
    for name in re.findall(r"`((?:benchmarks|configs|rsclip_ds)/[\w/.]+\.(?:py|yaml))`", GUIDE.read_text()):
        assert (ROOT / name).is_file(), name

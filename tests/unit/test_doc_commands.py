"""Every command the docs show parses with the parser that will read it, and names files that exist.

What counts as a command (the collector's rule; docs keep to it):

- Files: README.md, ds_profiles/README.md and docs/**/*.md.
- Fenced code blocks whose info string is empty or bash / sh / shell / console / zsh. Program
  output goes in a ```text block (or any other info string) and is never read. In a ```console
  block only the lines after a `$ ` prompt are commands.
- In such a block, a line (a trailing `\\` joins the next line to it) is split like a shell would:
  quotes, `# comments` dropped, `&&` / `||` / `;` separate commands, and a command ends at a pipe
  or a redirection (`|`, `>`, `2>&1`, `&`). Leading `VAR=value` environment assignments, a `$ `
  prompt and the loop keywords `do` / `then` / `else` are dropped. What is left is a command
  when its first word is one of: `rsclip-ds`; `python -m rsclip_ds`; `deepspeed`; `python -m
  benchmarks.X.Y`; `python X.py`, `bash X.sh`, `sh X.sh` or `sbatch X`; or a repository path such
  as `launch/cluster.sh` (a path ending in .sh / .sbatch / .py: `rsclip_ds/  the library` in a
  tree listing is not a command); `python -c CODE` that mentions rsclip_ds or benchmarks.
  Anything else (pip, tail, cp, hf, for ...) is not ours and not checked. A line that starts
  with `--set` is a list of overrides shown to add to a train command.
- In a markdown table with a column headed "command" (ds_profiles/README.md's), each `code span`
  of that column that has a flag (a word starting with `-`); a bare `rsclip-ds eval` there names
  a command rather than showing one.

What is checked, per command:

- `rsclip-ds ARGS` / `python -m rsclip_ds ARGS` parse with `rsclip_ds.cli.build_parser()`.
- `deepspeed FLAGS ...`: FLAGS parse with DeepSpeed's own launcher parser
  (`deepspeed.launcher.runner.parse_args`, which is how it reads them; DeepSpeed has no `-m`,
  so `deepspeed -m` fails here as it fails there). With `--module rsclip_ds` the rest parses
  with ours, with `--module benchmarks.X.Y` as below; the `--local_rank=0` the launcher appends is
  appended here too.
- `python -m benchmarks.X.Y ARGS`: benchmarks/X/Y.py exists and ARGS parse with the script's own
  `parse_args(argv)` (what its `main(argv)` reads its flags with), so nothing is measured.
- A repository shell script (`bash X.sh`, `sbatch X`, `launch/cluster.sh ...`): every `--flag`
  given is one of the `--flag)` patterns of its case statement (slurm.sbatch hands its flags on
  to cluster.sh, so they are cluster.sh's).
- `python -c CODE`: CODE compiles and the names it imports from rsclip_ds / benchmarks exist.
- Every `--set KEY=VALUE` (or `--set=KEY=VALUE`): KEY is a config key (`rsclip_ds.config.describe`),
  and unless a value is a placeholder all the command's overrides, on top of its `--config` file
  when that is a repository file, validate through `rsclip_ds.config.load_config`. `--profile NAME`
  and `--set profile=NAME` name a file of ds_profiles/.
- An argument (or the value of `--flag=value` / `key=value`) that starts with a repository folder
  (configs/ launch/ ds_profiles/ benchmarks/ tests/ rsclip_ds/ docs/) must exist, or X.example
  beside it (the template the user copies to X, as launch/deepspeed_env.example); a glob must
  match; `a[_b|_c].json` must exist in every form. An output (`--out`, `--output_dir`,
  `--write-config`) need not exist yet, but its folder must. Scripts run by `bash`, `sbatch` or
  by path must exist. `[--flag value]` (usage notation for an optional part) is read without
  the brackets, so the optional flags are checked too.
- A ```yaml block whose top-level keys include a run config section is a run config: it
  validates through `load_config` (with placeholders in it, it must at least name only real keys).
- Placeholders are not paths: anything with `<...>`, `$VAR`, `...`, an all-capitals word such as
  `CFG`, `VENV_DIR`, `N` (optionally followed by `/...`), or a file named my* / mine*
  (`my.yaml`, `ds_profiles/mine.json`, `runs/my_run`). They only need to parse: argparse may
  reject a placeholder as the value of a typed flag (`--gpus N`), and that is not counted as a
  failure. Other paths outside those folders (`run.yaml`, `hostfile`, `runs/...`, `data/...`)
  are the user's files, so they are not checked for existence either; a profile given as a path
  (`--set profile=path/to/mine.json`) likewise.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import glob
import importlib
import importlib.util
import io
import re
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console", "zsh"}
REPO_DIRS = ("configs/", "launch/", "ds_profiles/", "benchmarks/", "tests/", "rsclip_ds/", "docs/")
OUTPUT_FLAGS = {"--out", "--output", "--output_dir", "--output-dir", "--write-config"}
COMMAND_FLOOR = 60   # the docs show 150-250 while they are rewritten: far fewer means the collector broke
SCRIPT_SUFFIXES = (".sh", ".sbatch", ".py")   # a repository path run as a command (a folder is a tree listing)
SEPARATORS = {"&&", "||", ";"}
CUTS = {"|", "&", ">", ">>", "<", "2>", "2>>", "&>", "2>&1", "1>&2", "|&"}


@dataclass(frozen=True)
class Command:
    where: str          # "docs/guides/data.md:11", the line the command starts on
    words: tuple[str, ...]
    problem: str = ""   # set when the line could not even be split

    def __str__(self) -> str:
        return shlex.join(self.words) if self.words else self.problem


# --------------------------------------------------------------------------- collecting

def doc_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "ds_profiles" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def split_shell(text: str) -> list[list[str]]:
    """One shell line -> its commands as word lists: comments dropped, split at && || ;, each cut
    at its first pipe or redirection, leading VAR=value / prompt / loop keywords dropped."""
    lexer = shlex.shlex(text, posix=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    commands, words, cut = [], [], False
    for word in lexer:
        ends = word.endswith(";") and word not in SEPARATORS
        word = word[:-1] if ends else word
        if word in SEPARATORS:
            commands.append(words)
            words, cut = [], False
        elif word in CUTS or re.fullmatch(r"\d?>>?.*|&>.*", word):
            cut = True
        elif not cut and word:
            words.append(word)
        if ends:
            commands.append(words)
            words, cut = [], False
    commands.append(words)
    out = []
    for words in commands:
        while words and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]) or words[0] in ("$", "do", "then", "else")):
            words = words[1:]
        if words:
            out.append(words)
    return out


def is_command(words: list[str]) -> bool:
    first = words[0]
    if first in ("rsclip-ds", "deepspeed") or first.startswith("--set"):
        return True
    if first in ("python", "python3") and len(words) > 2 and words[1] == "-m":
        return words[2] == "rsclip_ds" or words[2].startswith("benchmarks.")
    if first in ("python", "python3") and len(words) > 2 and words[1] == "-c":
        return bool(re.search(r"\b(?:rsclip_ds|benchmarks)\b", words[2]))
    if first in ("python", "python3", "bash", "sh", "sbatch") and len(words) > 1:
        return words[1].removeprefix("./").startswith(REPO_DIRS)   # `bash X.sh`: ours when X is in the repository
    return first.removeprefix("./").startswith(REPO_DIRS) and first.endswith(SCRIPT_SUFFIXES)


def commands_in(text: str, name: str) -> list[Command]:
    """The commands in one markdown text (see the module docstring for the rule)."""
    lines, found = text.splitlines(), []
    fence, info, i = None, "", 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"\s*(`{3,}|~{3,})\s*([^`\s]*)", line)
        if fence is None and m:
            fence, info = m.group(1), m.group(2).lower()
        elif fence is not None and line.strip().startswith(fence) and not line.strip()[len(fence):].strip():
            fence = None
        elif fence is not None and info in SHELL_BLOCKS:
            start, joined = i + 1, line
            while joined.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                joined = joined.rstrip()[:-1] + " " + lines[i]
            found += _commands_of_line(joined, f"{name}:{start}", console=info == "console")
        elif fence is None and line.lstrip().startswith("|"):
            found += _table_commands(lines, i, name)
        i += 1
    return found


def _commands_of_line(line: str, where: str, console: bool) -> list[Command]:
    text = line.strip()
    if console:
        if not text.startswith("$ "):
            return []
        text = text[2:]
    try:
        pieces = split_shell(text)
    except ValueError as err:   # an unbalanced quote: a command only if it starts like one
        first = text.split()[:3]
        return [Command(where, (), f"cannot split {text!r}: {err}")] if first and is_command(first) else []
    return [Command(where, tuple(words)) for words in pieces if is_command(words)]


def _cells(row: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def _table_commands(lines: list[str], i: int, name: str) -> list[Command]:
    """At a table's header row: the code spans of its "command" column, one command each."""
    if i + 1 >= len(lines) or not re.fullmatch(r"\s*\|?[\s:|-]+\|?\s*", lines[i + 1]) or \
            (i > 0 and lines[i - 1].lstrip().startswith("|")):
        return []
    header = [c.lower() for c in _cells(lines[i])]
    if "command" not in header:
        return []
    col, found = header.index("command"), []
    for j in range(i + 2, len(lines)):
        if not lines[j].lstrip().startswith("|"):
            break
        cells = _cells(lines[j])
        for span in re.findall(r"`([^`]+)`", cells[col] if col < len(cells) else ""):
            if re.search(r"(?:^|\s)-", span):
                found += _commands_of_line(span, f"{name}:{j + 1}", console=False)
    return found


def collect() -> list[Command]:
    found = []
    for path in doc_files():
        if path.is_file():
            found += commands_in(path.read_text(), str(path.relative_to(ROOT)))
    return found


# --------------------------------------------------------------------------- checking

def is_placeholder(text: str) -> bool:
    """`<folder>`, `$p`, `...`, `a[_b|_c]`, or an all-capitals word (`CFG`, `N`, `VENV/bin/python`)."""
    return bool(re.search(r"<[^>]*>|\$|\.\.\.|\[[^\]]*\|[^\]]*\]|(?:^|/)(?:my|mine)(?:[._-][^/]*)?$", text)) \
        or bool(re.fullmatch(r"[A-Z][A-Z0-9_]*(?:/.*)?", text))


def _path_forms(text: str) -> list[str]:
    """`a[_b|_c].json` -> a.json, a_b.json, a_c.json (the docs' way of naming several files)."""
    m = re.search(r"\[([^\[\]]*)\]", text)
    if not m or "|" not in m.group(1):
        return [text]
    return [f for alt in ["", *m.group(1).split("|")] for f in _path_forms(text[:m.start()] + alt + text[m.end():])]


def check_repo_paths(words: tuple[str, ...]) -> list[str]:
    problems = []
    for k, word in enumerate(words):
        value = word.split("=", 1)[1] if "=" in word else word
        flag = word.split("=", 1)[0] if word.startswith("--") and "=" in word else (words[k - 1] if k else "")
        value = value.removeprefix("./")
        if not value.startswith(REPO_DIRS) or (is_placeholder(value) and not _path_forms(value)[1:]):
            continue
        for form in _path_forms(value):
            target = ROOT / form
            if flag in OUTPUT_FLAGS:
                if not target.parent.is_dir():
                    problems.append(f"{form}: its folder {target.parent.relative_to(ROOT)}/ is not in the repository")
            elif any(c in form for c in "*?") and not glob.glob(str(target)):
                problems.append(f"{form}: matches no file of the repository")
            elif not any(c in form for c in "*?") and not target.exists() and \
                    not target.with_name(target.name + ".example").exists():
                problems.append(f"{form}: no such file in the repository")
    return problems


def _sets(words: tuple[str, ...]) -> list[str]:
    out = []
    for k, word in enumerate(words):
        if word == "--set" and k + 1 < len(words):
            out.append(words[k + 1])
        elif word.startswith("--set="):
            out.append(word.removeprefix("--set="))
    return out


def _option(words: tuple[str, ...], flag: str) -> str | None:
    for k, word in enumerate(words):
        if word == flag and k + 1 < len(words):
            return words[k + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


@functools.lru_cache(maxsize=1)
def config_keys() -> frozenset[str]:
    from rsclip_ds.config import describe

    return frozenset(key for key, *_ in describe())


def _profile_problem(name: str) -> list[str]:
    """A profile name must be a ds_profiles/ file; a path is the user's (check_repo_paths sees it)."""
    if is_placeholder(name) or "/" in name or name.endswith(".json") or (ROOT / "ds_profiles" / f"{name}.json").is_file():
        return []
    return [f"profile {name!r}: no ds_profiles/{name}.json"]


def check_overrides(words: tuple[str, ...]) -> list[str]:
    """--set keys exist; the overrides (with a repository --config file) validate; profiles exist."""
    from rsclip_ds.config import ConfigError, load_config

    sets, problems = _sets(words), []
    for item in sets:
        key, sep, value = item.partition("=")
        if is_placeholder(key):
            continue
        if not sep:
            problems.append(f"--set {item!r}: not KEY=VALUE")
        elif key not in config_keys():
            problems.append(f"--set {key}: not a config key (`rsclip-ds show-config` lists them)")
        elif key == "profile":
            problems += _profile_problem(value)
    config = _option(words, "--config")
    config_path = ROOT / config if config and config.startswith(REPO_DIRS) and (ROOT / config).is_file() else None
    if sets and not problems:
        try:
            load_config(config_path, sets)
        except ConfigError as err:   # a placeholder value (N, $k, ...) may be why: then not the docs' fault
            if not any(is_placeholder(item) or is_placeholder(item.partition("=")[2]) for item in sets):
                problems.append(f"the overrides do not validate: {err}")
    profile = _option(words, "--profile")
    if profile is not None:
        problems += _profile_problem(profile)
    return problems


def _parse_error(run, argv: list[str]) -> str:
    """'' when run(argv) parses; else argparse's message, unless it only rejects a placeholder."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            run(argv)
    except SystemExit as exc:
        if exc.code in (0, None):   # --help
            return ""
        message = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {exc.code}"
        rejected = re.findall(r"(?:invalid .*? value|invalid choice): '([^']*)'", message)
        unknown = message.split("unrecognized arguments:", 1)[1].split() if "unrecognized arguments:" in message else []
        if (rejected or unknown) and all(is_placeholder(v) for v in rejected + unknown):
            return ""
        return message
    return ""


@functools.lru_cache(maxsize=1)
def rsclip_parser() -> argparse.ArgumentParser:
    from rsclip_ds.cli import build_parser

    return build_parser()


def check_rsclip(args: list[str]) -> list[str]:
    from rsclip_ds.cli import strip_local_rank

    problem = _parse_error(lambda argv: rsclip_parser().parse_args(strip_local_rank(argv)), args)
    return [f"rsclip-ds: {problem}"] if problem else []


def check_benchmark(module: str, args: list[str]) -> list[str]:
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.is_file():
        return [f"{module}: no {path.relative_to(ROOT)}"]
    try:
        mod = importlib.import_module(module)
    except Exception as err:   # noqa: BLE001 - the doc's module does not import: say why
        return [f"{module}: import fails: {type(err).__name__}: {err}"]
    if not hasattr(mod, "parse_args"):
        return [f"{module}: has no parse_args(argv), the flags its main(argv) reads"]
    problem = _parse_error(mod.parse_args, args)
    return [f"{module}: {problem}"] if problem else []


def check_deepspeed(args: list[str]) -> list[str]:
    from deepspeed.launcher.runner import parse_args

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            launch = parse_args(args)
    except SystemExit:
        return [f"deepspeed launcher: {err.getvalue().strip().splitlines()[-1]}"]
    problems = []
    if launch.hostfile and launch.hostfile.startswith(REPO_DIRS) and not (ROOT / launch.hostfile).is_file():
        problems.append(f"--hostfile {launch.hostfile}: no such file in the repository")
    rest = list(launch.user_args) + ([] if launch.no_local_rank else ["--local_rank=0"])
    if not launch.module:
        if launch.user_script.startswith(REPO_DIRS) and not (ROOT / launch.user_script).is_file():
            problems.append(f"{launch.user_script}: no such script in the repository")
        return problems
    if launch.user_script == "rsclip_ds":
        return problems + check_rsclip(rest)
    if launch.user_script.startswith("benchmarks."):
        return problems + check_benchmark(launch.user_script, rest)
    return problems + [f"--module {launch.user_script}: neither rsclip_ds nor a benchmarks module"]


def unbracket(words: tuple[str, ...]) -> tuple[str, ...]:
    """`[--split-column subset --split train]` -> the words without the usage brackets."""
    out, depth = [], 0
    for word in words:
        if word.startswith("[-"):
            word, depth = word[1:], depth + 1
        if depth and word.endswith("]") and word.count("]") > word.count("["):
            word, depth = word[:-1], depth - 1
        out.append(word)
    return tuple(out)


def script_flags(script: Path) -> set[str]:
    """The flags a repository shell script takes: the `--flag)` patterns of its case statement;
    for a script without one that hands "$@" on to another launch/ script, that script's."""
    text = script.read_text() if script.is_file() else ""
    flags = {f for alts in re.findall(r"^\s*(--[\w-]+(?:\|--[\w-]+)*)\)", text, re.M) for f in alts.split("|")}
    if not flags and '"$@"' in text:
        for other in set(re.findall(r"\blaunch/[\w-]+\.sh\b", text)) - {str(script.relative_to(ROOT))}:
            flags |= script_flags(ROOT / other)
    return flags


def check_script_flags(script: str, args: list[str]) -> list[str]:
    flags = script_flags(ROOT / script.removeprefix("./"))
    unknown = [a.split("=")[0] for a in args if a.startswith("--") and flags and a.split("=")[0] not in flags]
    return [f"{script} takes no {flag} (it takes {', '.join(sorted(flags))})" for flag in unknown]


def check_python_c(code: str) -> list[str]:
    """`python -c CODE`: CODE compiles, and what it imports from rsclip_ds / benchmarks exists."""
    try:
        tree = ast.parse(code)
    except SyntaxError as err:
        return [f"python -c: {err}"]
    problems = []
    for node in ast.walk(tree):
        names = [(a.name, None) for a in node.names] if isinstance(node, ast.Import) else \
            [(node.module, a.name) for a in node.names] if isinstance(node, ast.ImportFrom) and node.module else []
        for module, name in names:
            if module.split(".")[0] not in ("rsclip_ds", "benchmarks"):
                continue
            try:
                mod = importlib.import_module(module)
            except ImportError as err:
                problems.append(f"python -c: import {module}: {err}")
                continue
            if name and not hasattr(mod, name) and \
                    not (hasattr(mod, "__path__") and importlib.util.find_spec(f"{module}.{name}")):
                problems.append(f"python -c: {module} has no {name}")
    return problems


def check_command(words: tuple[str, ...]) -> list[str]:
    """Every problem of one command; [] when it is right."""
    words = unbracket(words)
    first, rest = words[0], list(words[1:])
    problems = check_repo_paths(words) + check_overrides(words)
    if first == "rsclip-ds":
        problems += check_rsclip(rest)
    elif first in ("python", "python3") and rest[0] == "-m":
        module, args = rest[1], rest[2:]
        problems += check_rsclip(args) if module == "rsclip_ds" else check_benchmark(module, args)
    elif first in ("python", "python3") and rest[0] == "-c":
        problems += check_python_c(rest[1])
    elif first == "deepspeed":
        problems += check_deepspeed(rest)
    elif first in ("bash", "sh", "sbatch") or first.endswith((".sh", ".sbatch")):
        script, args = (rest[0], rest[1:]) if first in ("bash", "sh", "sbatch") else (first, rest)
        problems += check_script_flags(script, args)
    return problems   # a `--set` line, `python X.py`: the checks above are all


# --------------------------------------------------------------------------- the tests

COMMANDS = collect()


def _ids(commands: list[Command]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for c in commands:
        seen[c.where] = seen.get(c.where, 0) + 1
        out.append(c.where if seen[c.where] == 1 else f"{c.where}#{seen[c.where]}")
    return out


def test_the_collector_finds_the_docs_commands(record_property):
    kinds: dict[str, int] = {}
    for c in COMMANDS:
        kind = c.words[0] if c.words else "unsplittable"
        if kind.startswith("python"):   # python -m rsclip_ds / -m benchmarks / -c
            kind = f"python -m {c.words[2].split('.')[0]}" if c.words[1] == "-m" else f"python {c.words[1]}"
        kinds[kind] = kinds.get(kind, 0) + 1
    record_property("doc_commands", len(COMMANDS))
    print(f"{len(COMMANDS)} commands in {len(doc_files())} files: {kinds}")
    assert len(COMMANDS) >= COMMAND_FLOOR, f"only {len(COMMANDS)} commands found in the docs: {kinds}"
    assert kinds.get("rsclip-ds", 0) and kinds.get("deepspeed", 0), kinds


@pytest.mark.parametrize("command", COMMANDS, ids=_ids(COMMANDS))
def test_doc_command(command):
    problems = [command.problem] if command.problem else check_command(command.words)
    assert not problems, f"{command.where}: {command}\n  " + "\n  ".join(problems)


def config_blocks() -> list[tuple[str, str]]:
    """(file:line, text) of every ```yaml block: a run config shown in the docs."""
    found = []
    for path in doc_files():
        lines = path.read_text().splitlines() if path.is_file() else []
        starts = [i for i, line in enumerate(lines) if re.match(r"\s*```\s*ya?ml\s*$", line)]
        for i in starts:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```")), len(lines))
            found.append((f"{path.relative_to(ROOT)}:{i + 2}", textwrap.dedent("\n".join(lines[i + 1:end]))))
    return found


CONFIGS = config_blocks()


@pytest.mark.parametrize("where, text", CONFIGS, ids=[w for w, _ in CONFIGS])
def test_doc_config_block(where, text, tmp_path):
    """A YAML block whose top-level keys are run config sections is a run config: it validates.
    Other YAML (a DeepSpeed or SLURM snippet) is left alone; a block with placeholders is read as
    the keys it shows only."""
    import yaml

    from rsclip_ds.config import ConfigError, RunConfig, load_config

    tree = yaml.safe_load(text)
    if not isinstance(tree, dict) or not set(tree) & set(RunConfig.model_fields):
        pytest.skip(f"{where}: not a run config")
    (tmp_path / "run.yaml").write_text(text)
    try:
        load_config(tmp_path / "run.yaml")
    except ConfigError as err:
        if not is_placeholder(text):
            pytest.fail(f"{where}: this run config does not validate:\n{err}")
        unknown = [line for line in str(err).splitlines() if "unknown key" in line]
        assert not unknown, f"{where}: keys the config does not have:\n" + "\n".join(unknown)


# --------------------------------------------------------------------------- the collector's rule

SAMPLE = """
Run it:

```bash
DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module rsclip_ds train --config configs/tiny_demo.yaml \\
    --set steps=3   # a comment with 'an apostrophe
pip install -e . && rsclip-ds profiles | head -3 > /tmp/x
for p in zero1 zero2; do rsclip-ds show-config --set profile=$p; done
```

```
rsclip_ds run summary
 profile  │ zero2     (output under a blank info string is read, but no line starts with a command word)
launch/            demo.sh, cluster.sh   (a tree listing: a folder is not a script)
```

```text
rsclip-ds this line is output and is never read
```

```console
$ rsclip-ds show-config
rsclip-ds output after a prompt line
```

| profile | command |
|---|---|
| `zero1` | `rsclip-ds show-config --set profile=zero1` |
| `zero2` | `rsclip-ds eval` names a command, it shows none |
"""


def test_collector_rule_on_a_sample():
    found = commands_in(SAMPLE, "sample.md")
    assert [(c.where, c.words) for c in found] == [
        ("sample.md:5", ("deepspeed", "--num_gpus", "2", "--module", "rsclip_ds", "train", "--config",
                         "configs/tiny_demo.yaml", "--set", "steps=3")),
        ("sample.md:7", ("rsclip-ds", "profiles")),
        ("sample.md:8", ("rsclip-ds", "show-config", "--set", "profile=$p")),
        ("sample.md:22", ("rsclip-ds", "show-config")),
        ("sample.md:28", ("rsclip-ds", "show-config", "--set", "profile=zero1")),
    ]


@pytest.mark.parametrize("line, expected", [
    ("rsclip-ds train --config configs/tiny_demo.yaml --set steps=30", []),
    ("rsclip-ds train --config configs/tiny_demo.yaml --set steps=3", ["must be below steps (3)"]),   # file + --set
    ("rsclip-ds train --bogus", ["unrecognized arguments: --bogus"]),
    ("rsclip-ds plan --gpus N --gpu-mem 24GiB --global-batch 64", []),                 # placeholder value
    ("rsclip-ds plan --gpus four --gpu-mem 24GiB --global-batch 64", ["invalid int value: 'four'"]),
    ("rsclip-ds train --set batch.micro=8", ["batch.micro: not a config key"]),
    ("rsclip-ds train --set batch.micro_batch_size=0", ["greater than or equal to 1"]),
    ("rsclip-ds train --set profile=zero9", ["no ds_profiles/zero9.json"]),
    ("rsclip-ds train --config configs/nope.yaml", ["configs/nope.yaml: no such file"]),
    ("rsclip-ds train --config CFG --set optim.warmup_steps=N", []),
    ("rsclip-ds eval --checkpoint runs/x ...", []),                                   # "and so on"
    ("rsclip-ds train [--set ...]", []),
    ("deepspeed --num_gpus 2 --module rsclip_ds train --set steps=50", []),
    ("deepspeed --gpus 2 --module rsclip_ds train", ["deepspeed launcher: "]),
    ("deepspeed -m rsclip_ds train", ["deepspeed launcher: "]),
    ("deepspeed --num_gpus 2 --module benchmarks.nope --out /tmp/x.json", ["no benchmarks/nope.py"]),
    ("python -m benchmarks.comms.scaling --out /tmp/s.json --mfu 0.3", []),
    ("python -m benchmarks.comms.scaling --mfu 0.3", ["the following arguments are required: --out"]),
    ("python -m benchmarks.comms.scaling --out /tmp/s.json --bogus", ["unrecognized arguments: --bogus"]),
    ("python -m benchmarks.throughput.openclip --open-clip VENV --tiny --out /tmp/oc.json", []),
    ("python -m benchmarks.throughput.openclip --open-clip VENV --openclip-steps 8 --out /tmp/oc.json",
     ["unrecognized arguments: --openclip-steps"]),                                   # gpu.py's flag, not its
    ("python -m benchmarks.comms.scaling --out benchmarks/nowhere/s.json", ["folder benchmarks/nowhere/"]),
    ("python -m benchmarks.memory.per_rank --combine benchmarks/results/peak/*.json --out /tmp/p.json", []),
    ("python -m benchmarks.memory.per_rank --combine benchmarks/results/peak/q*.json --out /tmp/p.json",
     ["matches no file"]),
    ("bash launch/nope.sh", ["launch/nope.sh: no such file"]),
    ("launch/cluster.sh --hostfile hostfile --config my.yaml --nodes 2", ["launch/cluster.sh takes no --nodes"]),
    ("sbatch launch/slurm.sbatch my.yaml --profile zero1 --dry-run", []),           # cluster.sh's flags
    ("sbatch launch/slurm.sbatch my.yaml --profiles zero1", ["takes no --profiles"]),
    ("python -c 'from rsclip_ds.config import load_config; print(load_config())'", []),
    ("python -c 'from rsclip_ds.config import load_configs'", ["rsclip_ds.config has no load_configs"]),
    ("python -c 'import rsclip_ds.nope'", ["import rsclip_ds.nope"]),
    ("launch/cluster.sh --config my.yaml --env-file launch/deepspeed_env --set steps=20000", []),   # .example
    ("rsclip-ds make-shards --folder d/ [--images /data/root] --out x", []),
    ("rsclip-ds make-shards --folder d/ [--image-dir /data/root] --out x", ["unrecognized arguments: --image-dir"]),
    ("--set finetune.lock_image_unlocked_layers=4", ["needs finetune.lock_image=true"]),
])
def test_the_checks_catch_what_they_should(line, expected):
    (words,) = split_shell(line)
    problems = "\n".join(check_command(tuple(words)))
    for text in expected:
        assert text in problems, f"{line!r}: expected {text!r} among the problems, got {problems!r}"
    if not expected:
        assert problems == "", f"{line!r} should pass: {problems}"


def test_path_forms_expand_the_docs_alternatives():
    assert _path_forms("benchmarks/results/memory_base[_lock_image|_lora].json") == [
        "benchmarks/results/memory_base.json", "benchmarks/results/memory_base_lock_image.json",
        "benchmarks/results/memory_base_lora.json"]
    assert _path_forms("configs/tiny_demo.yaml") == ["configs/tiny_demo.yaml"]


def test_a_doc_config_block_with_a_bad_key_fails(tmp_path):
    with pytest.raises(pytest.fail.Exception, match="batch.micro: unknown key"):
        test_doc_config_block("x.md:2", "batch:\n  micro: 8\n", tmp_path)

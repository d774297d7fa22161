"""Named prompt-template sets for zero-shot classification: the published models' own and ours.

    load_template_set("git-rsclip")      a shipped set by name (TEMPLATE_SETS)
    load_template_set("my_prompts.txt")  a file of your own, same format

A file holds one template per line with a single '{}' for the class phrase; '#' lines and blank
lines are skipped; a '# source: ...' line says where the set comes from. A ``[SET NAME]`` line
starts the templates of that set only (RemoteCLIP prompts EuroSAT and NWPU-RESISC45 with lists of
their own): the lines before the first section are every other set's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from rsclip_ds.config import TEMPLATE_SET_NAMES, ConfigError

# name -> file of rsclip_ds/templates/; the names are config.TEMPLATE_SET_NAMES (eval.templates_set)
TEMPLATE_SETS = {"ours": "remote_sensing.txt", "git-rsclip": "git_rsclip.txt",
                 "remoteclip": "remoteclip.txt", "georsclip": "georsclip.txt"}
assert tuple(TEMPLATE_SETS) == TEMPLATE_SET_NAMES
DEFAULT_SET = "ours"
_SECTION = re.compile(r"^\[(.+)\]$")


@dataclass(frozen=True)
class TemplateSet:
    name: str                                   # "git-rsclip", or the file's path
    templates: tuple[str, ...]                  # for every set without a section of its own
    per_set: dict[str, tuple[str, ...]] = field(default_factory=dict)   # set name -> its own
    source: str = ""                            # the '# source:' line(s)

    def for_set(self, name: str) -> list[str]:
        return list(self.per_set.get(name, self.templates))


def template_file(name: str) -> Path:
    return Path(str(resources.files("rsclip_ds") / "templates" / TEMPLATE_SETS[name]))


def load_template_set(name_or_path: str | Path | None = None) -> TemplateSet:
    """A shipped set by name (default "ours") or a template file (see the module docstring)."""
    key = str(name_or_path) if name_or_path is not None else DEFAULT_SET
    if key in TEMPLATE_SETS:
        return parse_template_file(template_file(key), key)
    path = Path(key)
    if not path.is_file():
        raise ConfigError(f"templates: {key!r} is neither a template set ({', '.join(TEMPLATE_SETS)}) nor a "
                          f"file (one template per line, '{{}}' marks the class phrase)")
    return parse_template_file(path, str(path))


def parse_template_file(path: Path, name: str) -> TemplateSet:
    sections: dict[str | None, list[str]] = {None: []}
    current, sources = None, []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if line.lower().startswith("# source:"):
            sources.append(line.split(":", 1)[1].strip())
        if not line or line.startswith("#"):
            continue
        if (m := _SECTION.match(line)) is not None:
            current = m.group(1).strip()
            sections.setdefault(current, [])
            continue
        if line.count("{}") != 1:
            raise ConfigError(f"{path}:{number}: a template needs exactly one '{{}}' for the class phrase, "
                              f"got {line!r}")
        sections[current].append(line)
    empty = [k or "(before the first section)" for k, v in sections.items() if not v]
    if empty:
        raise ConfigError(f"{path} holds no templates for: {', '.join(empty)}")
    default = tuple(sections.pop(None))
    return TemplateSet(name, default, {k: tuple(v) for k, v in sections.items()}, " ".join(sources))


def zero_shot_templates(templates: Path | None, templates_set: str | None) -> list[str]:
    """The templates of a plain class-folder set: the file eval.templates, else the set
    eval.templates_set (default "ours"); a file's sections are for the suite's named sets."""
    return list(load_template_set(templates if templates is not None else templates_set).templates)

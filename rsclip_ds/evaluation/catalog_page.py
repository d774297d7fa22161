"""docs/reference/eval-sets.md, rendered from the catalog's data files (rsclip_ds/evaluation/sets/):

    python -m rsclip_ds.evaluation.catalog_page --out docs/reference/eval-sets.md

A unit test keeps the committed page equal to this render."""

from __future__ import annotations

import argparse
from pathlib import Path

from rsclip_ds.evaluation.datasets import class_name_from_folder
from rsclip_ds.evaluation.catalog import (MATCH, NAMED_MATCH, OVERRIDES_FORMAT, SetSpec, catalog, folder_key,
                                          published_results)

PAGE = "docs/reference/eval-sets.md"
COMMAND = f"python -m rsclip_ds.evaluation.catalog_page --out {PAGE}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _split(spec: SetSpec) -> str:
    split = spec.split or {}
    if "files" in split:
        return "published list " + " / ".join(f"`{f}`" for f in split["files"]) + " beside the data, else all"
    if "folders" in split:
        return "its `test/` folder, else `train/`"
    if "field" in split:
        return f"the JSON's `{split['field']}` = `{split['value']}`"
    return "all images (none published)"


def _anchor(spec: SetSpec) -> str:
    return folder_key(spec.name)


def _summary() -> list[str]:
    lines = ["| set | task | classes | layout recognised | split scored |", "|---|---|---|---|---|"]
    for spec in catalog():
        layout = "; ".join(f"`{layout}`" for layout in spec.layouts)
        count = len(spec.classes) or "-"
        lines.append(f"| [{spec.name}](#{_anchor(spec)}) | {spec.task} | {count} | {_cell(layout)} | "
                     f"{_cell(_split(spec))} |")
    return lines


def _classes(spec: SetSpec) -> list[str]:
    if not spec.classes:
        json_names = ", ".join(f"`{n}`" for n in spec.caption_json)
        dirs = ", ".join(f"`{d}/`" for d in spec.image_dirs)
        return [f"- Caption JSON: {json_names}; images in {dirs} beside it."]
    differ = {f: p for f, p in spec.classes.items() if p != class_name_from_folder(f)}
    same = [f for f in spec.classes if f not in differ]
    lines = []
    if differ:
        lines += ["", "| folder as released | prompted as |", "|---|---|"]
        lines += [f"| `{_cell(f)}` | {_cell(p)} |" for f, p in differ.items()]
        lines.append("")
    if same:
        lines.append(f"- {'Other folders' if differ else 'Folders'}, prompted by the folder-name rule: "
                     + ", ".join(f"`{f}`" for f in same) + ".")
    return lines


def _set_section(spec: SetSpec) -> list[str]:
    lines = [f"<a id=\"{_anchor(spec)}\"></a>", f"### {spec.name}", "",
             f"- Folder names: {', '.join(f'`{a}`' for a in spec.aliases)}.",
             f"- Protocol: {spec.protocol}",
             f"- Source: <{spec.source}>; data file `rsclip_ds/evaluation/sets/{spec.file}`.",
             f"- Checked: {spec.checked}"]
    if spec.hierarchy:
        lines.append(f"- Hierarchy: {len(spec.hierarchy['level_1'])} level-1 folders "
                     f"({', '.join(spec.hierarchy['level_1'])}), {len(spec.hierarchy['level_2'])} level-2.")
    if spec.groups:
        lines.append("- Category folders: " + ", ".join(f"`{g}`" for g in spec.groups) + ".")
    lines += [f"- {note}" for note in (*spec.notes, *([spec.tiff_note] if spec.tiff_note else []))]
    return lines + _classes(spec) + [""]


def _published() -> list[str]:
    """One table per metric, a row per model, a column per set; [n] names the row's sources."""
    results = published_results()
    sources = list(dict.fromkeys(r.source for r in results))
    lines = []
    for metric in dict.fromkeys(r.metric for r in results):
        rows = [r for r in results if r.metric == metric]
        sets = list(dict.fromkeys(r.set for r in rows))
        lines += [f"{metric}:", "", "| model | " + " | ".join(sets) + " |", "|---" * (len(sets) + 1) + "|"]
        for model in dict.fromkeys(r.model for r in rows):
            mine = {r.set: r for r in rows if r.model == model}
            refs = "".join(f"[{sources.index(s) + 1}]" for s in dict.fromkeys(r.source for r in mine.values()))
            cells = [f"{mine[s].value:g}" + ("" if mine[s].verified else " (not verified)") if s in mine else ""
                     for s in sets]
            lines.append(f"| {model} {refs} | " + " | ".join(cells) + " |")
        lines.append("")
    notes: dict[tuple[str, str], list[str]] = {}
    for r in results:
        if r.note:
            notes.setdefault((r.model, r.note), []).append(r.set)
    lines += [f"- {model} ({', '.join(sets)}): {_cell(note)}" for (model, note), sets in notes.items()] + [""]
    return lines + [f"[{i}] {_cell(s)}" + "  " for i, s in enumerate(sources, 1)]


def render() -> str:
    head = [
        "# Evaluation sets", "",
        f"*Generated from the data files `rsclip_ds/evaluation/sets/*.json` by `{COMMAND}`: edit those "
        "files, not this page.*", "",
        "The standard remote-sensing sets the suite recognises under a root folder, as their releases "
        "lay them out. A folder is a set when its class folders (the folders holding images, up to three "
        "levels down) are the set's release folders, compared ignoring case, spaces, `_`, `-` and `&`: "
        f"at least {MATCH:.0%} of the set's classes present and {MATCH:.0%} of the folder's class folders "
        f"the set's ({NAMED_MATCH:.0%} of the classes under one of the set's folder names). Each class "
        "is prompted with the phrase below, not its folder name. A published test split is applied when "
        "its list lies beside the data (in the set's folder or above it); otherwise the whole set is "
        "scored, and the results say which.", "",
        f"Class folders of a set not listed here are prompted by the folder-name rule (`denseResidential` "
        f"-> \"dense residential\"), with a warning for a name that is not made of known words. An "
        f"overrides JSON, `{OVERRIDES_FORMAT}`, sets the phrase of any class of any set and wins over this "
        "catalog.", "",
        "## The sets", "", *_summary(), ""]
    body = [line for spec in catalog() for line in _set_section(spec)]
    tail = ["## Published numbers", "",
            "Zero-shot top-1 as fractions, retrieval mean recall in percent, as published.", "", *_published()]
    return "\n".join(head + body + tail).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render docs/reference/eval-sets.md from the catalog.")
    parser.add_argument("--out", type=Path, default=Path(PAGE), help="where to write the page")
    args = parser.parse_args(argv)
    args.out.write_text(render())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

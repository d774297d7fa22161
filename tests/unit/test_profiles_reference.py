"""docs/reference/profiles.md's key x profile table says what ds_profiles/*.json hold, cell by cell.

The table is written by hand (its notation is for readers: 5e7, "cpu, pinned", "per node"), so this
reads every cell back and compares it with the JSON: a profile edited without its page fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rsclip_ds.profiles import PROFILE_DIR, available_profiles

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "profiles.md"


def _table() -> tuple[list[str], dict[str, list[str]]]:
    """(profile names of the header, {key: cells}) of the table between the profile-keys markers."""
    text = PAGE.read_text()
    block = re.search(r"<!-- profile-keys -->\n(.*?)\n<!-- /profile-keys -->", text, re.S)
    assert block, f"{PAGE}: no <!-- profile-keys --> table"
    lines = [line for line in block.group(1).splitlines() if line.startswith("|")]
    header = [c.strip().strip("`") for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1:]
    return header[1:], rows


def cell(value) -> str:
    """A JSON value in the table's notation."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "local_world_size":
        return "per node"
    if isinstance(value, dict) and set(value) == {"device", "pin_memory"}:
        return value["device"] + (", pinned" if value["pin_memory"] else "")
    if isinstance(value, dict) and set(value) == {"classes"}:   # leaf_module: the classes' own names
        return ", ".join(c.rsplit(".", 1)[-1] for c in value["classes"])
    if isinstance(value, int) and value >= 10_000:
        exponent = len(str(value)) - 1
        mantissa, rest = divmod(value, 10 ** exponent)
        assert rest == 0, f"{value} has no short form in the table's notation"
        return f"{mantissa}e{exponent}"
    return json.dumps(value)


def _keys(profile: dict) -> dict:
    keys = dict(profile.get("zero_optimization", {}))
    keys["rsclip.activation_checkpointing"] = profile.get("rsclip", {}).get("activation_checkpointing", False)
    return keys


def test_the_table_has_every_profile_and_every_key():
    names, rows = _table()
    assert sorted(names) == available_profiles()
    used = set().union(*(_keys(json.loads((PROFILE_DIR / f"{n}.json").read_text())) for n in names))
    assert used == set(rows), f"keys in the JSONs but not the table: {sorted(used - set(rows))}; " \
                              f"in the table only: {sorted(set(rows) - used)}"


@pytest.mark.parametrize("name", available_profiles())
def test_every_cell_equals_the_json(name):
    names, rows = _table()
    keys = _keys(json.loads((PROFILE_DIR / f"{name}.json").read_text()))
    column = names.index(name)
    wrong = {key: (cells[column], cell(keys.get(key))) for key, cells in rows.items()
             if cells[column] != cell(keys.get(key))}
    assert not wrong, f"{PAGE.name}, column {name}: (page, JSON) {wrong}"


def test_the_notation_reads_back():
    assert [cell(v) for v in (50_000_000, 100_000, 0, True, None, "local_world_size")] == \
        ["5e7", "1e5", "0", "true", "-", "per node"]
    assert cell({"device": "cpu", "pin_memory": True}) == "cpu, pinned"

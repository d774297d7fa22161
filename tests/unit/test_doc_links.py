"""Every relative link in README.md, ds_profiles/README.md and docs/ reaches a file that exists, and
its #anchor a heading (GitHub's slug) or an explicit <a id> of that file; docs stay under 30 KB."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "ds_profiles" / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
MAX_DOC_BYTES = 30_000


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())   # [text](url) -> text
    text = re.sub(r"[^\w\- ]", "", text.replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    seen: dict[str, int] = {}
    out = set(re.findall(r'<a id="([^"]+)"', text))
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)   # a link written inside a code span is an example, not a link
    return [a or b for a, b in LINK.findall(text)]


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):   # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading or <a id> '{anchor}' in {dest.name})")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_stay_readable(page):
    limit = 12_000 if page == ROOT / "README.md" else MAX_DOC_BYTES
    assert page.stat().st_size <= limit, f"{page.relative_to(ROOT)} is {page.stat().st_size} bytes (limit {limit})"


def test_the_checker_catches_a_broken_link_and_anchor(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("# A title, with `code`\n\n[ok](#a-title-with-code) [bad](#nope) [gone](b.md) "
                    "[web](https://example.org)\n\n```\n[in a block](c.md)\n```\n")
    assert slug("A title, with `code`") == "a-title-with-code"
    assert links(page) == ["#a-title-with-code", "#nope", "b.md", "https://example.org"]
    assert broken_links(page) == ["#nope (no heading or <a id> 'nope' in a.md)", "b.md (no such file)"]

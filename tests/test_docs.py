"""The pages in docs/ that the code and the README point to exist, and so do the sections they
name (``docs/math.md#token-space-exactly``): a renamed heading must not leave dead pointers."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
POINTER = re.compile(r"docs/([a-z_]+\.md)(?:#([a-z0-9-]+))?")
SEARCHED = ("compatlas", "scripts", "workflow", "tests", "benchmarks", "config")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in page.read_text().splitlines():
        if m := re.match(r"^#{1,6} (.+)$", line):
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower().replace("`", ""))
            out.add(text.replace(" ", "-"))
    return out


def pointers() -> list[tuple[Path, str, str | None]]:
    files = [REPO / "README.md"] + [p for d in SEARCHED for p in (REPO / d).rglob("*")
                                    if p.is_file() and p.suffix in (".py", ".smk", ".yaml", ".md")]
    return [(f, m.group(1), m.group(2)) for f in files for m in POINTER.finditer(f.read_text())]


def test_docs_pointers_name_existing_pages_and_sections():
    found = pointers()
    assert found, "no pointer into docs/ found: the search is broken"
    dead = []
    for f, page, anchor in found:
        path = REPO / "docs" / page
        if not path.is_file() or (anchor and anchor not in anchors(path)):
            dead.append(f"{f.relative_to(REPO)}: docs/{page}" + (f"#{anchor}" if anchor else ""))
    assert not dead, dead


def test_math_page_contents_links_resolve():
    page = REPO / "docs" / "math.md"
    links = re.findall(r"\]\(#([a-z0-9-]+)\)", page.read_text())
    assert links and not set(links) - anchors(page), set(links) - anchors(page)

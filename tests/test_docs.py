"""The pages in docs/ that the code and the README point to exist, and so do the sections they
name (``docs/math.md#token-space-exactly``): a renamed heading must not leave dead pointers. Every
link of every page (README.md, docs/*.md, benchmarks/README.md) resolves, and the README stays a
front door that links every docs page."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
POINTER = re.compile(r"docs/([a-z_]+\.md)(?:#([a-z0-9-]+))?")
SEARCHED = ("compatlas", "scripts", "workflow", "tests", "benchmarks", "config", "profiles", "docs")
LINK = re.compile(r"\]\(([^)\s]+)\)")


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


def pages() -> list[Path]:
    return [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_every_link_of_every_page_resolves():
    """Relative links (``[x](statistics.md#metrics)``, ``(#metrics)``, ``(../benchmarks/README.md)``,
    images) name a file that exists and, into a Markdown page, a heading it has."""
    assert len(pages()) >= 10, [p.name for p in pages()]
    dead, n = [], 0
    for page in pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+:", target):  # http:, mailto:: not ours to check offline
                continue
            n += 1
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
                dead.append(f"{page.relative_to(REPO)}: {target}")
    assert n > 20, n  # the pages link each other: a broken regex would find none
    assert not dead, dead


def test_math_page_contents_links_resolve():
    page = REPO / "docs" / "math.md"
    links = re.findall(r"\]\(#([a-z0-9-]+)\)", page.read_text())
    assert links and not set(links) - anchors(page), set(links) - anchors(page)


def test_readme_is_a_front_door():
    """At most about 150 lines: what it is, a picture of the report, the two commands, one query,
    and a link to every docs page (the rest lives there)."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150, len(text.splitlines())
    assert "bash envs/setup.sh && .venv/bin/snakemake --cores 2" in text
    assert "bash envs/setup.sh && .venv/bin/python -m pytest -q" in text
    assert re.search(r"compatlas query \"\s*SELECT", text)
    shot = re.search(r"!\[[^]]*\]\((docs/[^)]+\.png)\)", text)
    assert shot, "no screenshot of the report"
    png = REPO / shot.group(1)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 300_000
    unlinked = [p.name for p in (REPO / "docs").glob("*.md") if f"(docs/{p.name})" not in text]
    assert not unlinked, unlinked


def test_every_column_of_the_atlas_is_documented():
    """Every column of every shard view, of ``models``, ``function_agreement`` and ``function_bootstrap`` (``compatlas.tables``)
    is named in backticks in docs/schema.md (or, for edge attribution's, docs/edge_attribution.md):
    schema.md's ``head_scores`` had left out ``model`` and ``checkpoint``."""
    from compatlas import tables

    documented = set(re.findall(r"`([a-z_0-9]+)`", (REPO / "docs" / "schema.md").read_text()
                                + (REPO / "docs" / "edge_attribution.md").read_text()))
    schemas = {**tables.SHARD_VIEWS, "models": tables.MODELS_SCHEMA,
               "function_bootstrap": {c: t for c, t in tables.FUNCTION_BOOTSTRAP_SCHEMA.items() if not c.endswith("_boot")}}
    missing = {v: sorted(set(s) - documented) for v, s in schemas.items() if set(s) - documented}
    agreement = set(tables.FUNCTION_AGREEMENT_SCHEMA) - documented - {
        f"{n}{e}" for n in ("auroc_top", "spearman_abs", "spearman_unbiased", "auroc_significant") for e in ("_lo", "_hi")}
    assert not missing and not agreement and "latest" in documented, (missing, agreement)

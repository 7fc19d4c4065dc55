"""The package's shape: no module over 400 lines; no import cycle between its modules (an import
inside a function counts: it is how a cycle hides); stage subpackages that import only the
stages they build on (docs/architecture.md); a top level that is the shared bottom."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "compatlas"
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, known: set[str]) -> set[str]:
    """The compatlas modules a file imports anywhere in it; ``from compatlas.report import queries``
    is an import of ``compatlas.report.queries`` when that is a module."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in known:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            out |= subs or {node.module}
    return out - {module_name(path)}


def graph() -> dict[str, set[str]]:
    files = sorted(PKG.rglob("*.py"))
    known = {module_name(f) for f in files}
    return {module_name(f): imports(f, known) for f in files}


def test_no_module_is_over_400_lines():
    long = {module_name(f): n for f in PKG.rglob("*.py") if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_no_import_cycle():
    g = graph()
    assert g["compatlas.models.loading"] >= {"compatlas.models.hub", "compatlas.models.streaming"}  # the walk sees lazy imports too
    cycles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for n in sorted(g.get(m, ())):
            if state.get(n) == "open":
                cycles.append(path[path.index(n):] + [n] if n in path else [m, n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_the_configuration_flows_one_way():
    """plan resolves a config and calls the checks; config knows only the schema, the checks only
    what they read (checkpoints, sources): neither reaches back into the plan."""
    g = graph()
    assert not {m for m in g["compatlas.plan.config"] if m.startswith("compatlas.")}, g["compatlas.plan.config"]
    assert "compatlas.plan.build" not in g["compatlas.plan.model_checks"] | g["compatlas.plan.checkpoints"] | g["compatlas.models.sources"]
    assert {"compatlas.plan.config", "compatlas.plan.model_checks", "compatlas.plan.checkpoints"} <= g["compatlas.plan.build"]


# Each stage subpackage and the stages it may import (besides itself and the shared bottom: the
# top-level modules). The order of the pipeline: models, then plan / behaviour, composition (its
# activation statistics are forward passes), audits of the metrics, function, the atlas (which
# reads shards, not models), the report. ``compatlas.cli`` is the front door and may import any.
STAGES: dict[str, set[str]] = {
    "models": set(),
    "plan": {"models"},
    "behaviour": {"models"},
    "composition": {"models", "behaviour"},
    "audits": {"models", "composition"},
    "function": {"models", "behaviour"},
    "atlas": set(),
    "report": {"atlas", "function", "behaviour"},
}
TOP_LEVEL_MAX = 12


def stage_of(module: str) -> str | None:
    """The stage subpackage of a module, None for a top-level (shared bottom) one."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else None


def wrong_way(g: dict[str, set[str]]) -> list[str]:
    """Every import that runs against STAGES: a bottom module importing a stage, or a stage
    importing one it does not build on."""
    bad = []
    for m, deps in g.items():
        if m in ("compatlas.cli", "compatlas"):
            continue
        here = stage_of(m)
        for d in deps:
            there = stage_of(d)
            if there is None or there == here:
                continue
            if here is None or there not in STAGES[here]:
                bad.append(f"{m} imports {d}: {here or 'the shared bottom'} does not build on {there}")
    return sorted(bad)


def test_imports_run_one_way_between_stages():
    g = graph()
    assert {stage_of(m) for m in g} - {None} == set(STAGES), "a stage subpackage is missing or not declared"
    assert wrong_way(g) == []
    # the check sees a back-arrow: the atlas reaching into the models, the bottom into a stage
    g["compatlas.atlas.database"] = g["compatlas.atlas.database"] | {"compatlas.models.loading"}
    g["compatlas.vocab"] = {"compatlas.report.page"}
    assert wrong_way(g) == ["compatlas.atlas.database imports compatlas.models.loading: atlas does not build on models",
                            "compatlas.vocab imports compatlas.report.page: the shared bottom does not build on report"]


def test_the_top_level_is_the_shared_bottom():
    """At most TOP_LEVEL_MAX modules at the top of compatlas/; the rest live in their stage."""
    top = sorted(p.stem for p in PKG.glob("*.py"))
    assert len(top) <= TOP_LEVEL_MAX, top

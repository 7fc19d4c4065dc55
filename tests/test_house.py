"""The package's shape: no module over 400 lines, and no import cycle between its modules (an
import inside a function counts: it is how a cycle hides)."""

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
    assert g["compatlas.loading"] >= {"compatlas.hub", "compatlas.streaming"}  # the walk sees lazy imports too
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
    assert not {m for m in g["compatlas.config"] if m.startswith("compatlas.")}, g["compatlas.config"]
    assert "compatlas.plan" not in g["compatlas.model_checks"] | g["compatlas.checkpoints"] | g["compatlas.sources"]
    assert {"compatlas.config", "compatlas.model_checks", "compatlas.checkpoints"} <= g["compatlas.plan"]

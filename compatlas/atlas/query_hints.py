"""What ``compatlas query`` says beside an answer: how many rows it has, and which value a WHERE
compares a closed-set column with (model, metric, space, comp) that the atlas does not hold, with
the values it does. An empty answer to ``model = 'smollm2'`` (a misspelt name) and to a real model
with no such rows must not look alike."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from compatlas.vocab import COMPS, METRICS, SPACES

CLOSED: dict[str, tuple[str, ...]] = {"metric": METRICS, "space": SPACES, "comp": COMPS}
"""The closed sets a query can name; ``model`` is the atlas's own (its ``models`` table)."""

_EQUALS = re.compile(r"\b(model|metric|space|comp)\s*=\s*'((?:[^']|'')*)'", re.IGNORECASE)
_IN = re.compile(r"\b(model|metric|space|comp)\s+IN\s*\(([^)]*)\)", re.IGNORECASE)
_QUOTED = re.compile(r"'((?:[^']|'')*)'")


def compared_values(sql: str) -> list[tuple[str, str]]:
    """(column, value) for each ``column = 'value'`` and ``column IN ('a', 'b')`` of the closed-set
    columns in ``sql``, in order of appearance."""
    found = [(m.start(), m.group(1).lower(), m.group(2).replace("''", "'")) for m in _EQUALS.finditer(sql)]
    for m in _IN.finditer(sql):
        found += [(m.start(), m.group(1).lower(), v.replace("''", "'")) for v in _QUOTED.findall(m.group(2))]
    return [(col, value) for _, col, value in sorted(found)]


def unknown_values(sql: str, models: Sequence[str], closed: Mapping[str, Sequence[str]] = CLOSED) -> list[str]:
    """One line per compared value the atlas cannot hold, naming the values it does."""
    known = {"model": tuple(models), **closed}
    lines, seen = [], set()
    for col, value in compared_values(sql):
        if value in known[col] or (col, value) in seen:
            continue
        seen.add((col, value))
        where = "in this atlas" if col == "model" or closed is not CLOSED else "a value of this atlas's vocabulary"
        have = ", ".join(known[col]) or "none"
        lines.append(f"{col} {value!r} is not {where}; it has: {have}")
    return lines


_PARTITION = re.compile(r"(?:^|/)(metric|space)=([^/]+)")


def atlas_vocabulary(shard_paths: Sequence[str], reference_rows: Sequence[tuple[str, str]] = ()) -> dict[str, tuple[str, ...]]:
    """The metric, space and comp values an atlas holds: its shards' ``metric=`` and ``space=``
    partitions, and the (metric, space) of the reference rows its derived tables add beside them
    (the oracles: ``oracle_scale`` / ``oracle_depth`` in ``space = 'oracle'``). A closed set's value
    the atlas lacks (``pattern_output`` in the default run) is then named as missing from it too."""
    found: dict[str, dict[str, None]] = {"metric": {}, "space": {}}
    for path in shard_paths:
        for col, value in _PARTITION.findall(path):
            found[col][value] = None
    for metric, space in reference_rows:
        found["metric"][metric] = None
        found["space"][space] = None
    order: dict[str, tuple[str, ...]] = {"metric": METRICS, "space": SPACES}

    def place(col: str, value: str) -> tuple[int, str]:  # the vocabulary's order first, then what else the atlas has
        return (order[col].index(value) if value in order[col] else len(order[col]), value)

    return {"metric": tuple(sorted(found["metric"], key=lambda v: place("metric", v))),
            "space": tuple(sorted(found["space"], key=lambda v: place("space", v))), "comp": COMPS}


def row_count(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"

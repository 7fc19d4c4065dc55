"""The figures README.md and the docs quote from the default run, checked against a default-run
atlas: the README's query returns the rows its prose describes, and the trained model's edge
attribution in docs/edge_attribution.md (its top exact K edge, the methods against exact
patching) is the atlas's. Figures from other runs (the H200 run over 4096 sequences) say the
command and date that made them instead.

Needs the atlas of ``.venv/bin/snakemake --cores 2`` on ``config/config.yaml`` (about 14 minutes):
``results/atlas.duckdb`` of this checkout, or ``COMPATLAS_DEFAULT_RUN`` naming another. Not in the
default suite (the run is too long for it):

    .venv/bin/python -m pytest -m default_run tests/test_default_run_figures.py
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from compatlas.atlas import connect

pytestmark = pytest.mark.default_run
REPO = Path(__file__).resolve().parents[1]
CLI = re.compile(r'compatlas query\s+"(.*?)"', re.S)


@pytest.fixture(scope="module")
def atlas(request):
    if "default_run" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("needs the default run's atlas (14 minutes on 2 cores): "
                    "pytest -m default_run tests/test_default_run_figures.py")
    path = Path(os.environ.get("COMPATLAS_DEFAULT_RUN", REPO / "results" / "atlas.duckdb"))
    if not path.exists():
        pytest.fail(f"no atlas at {path}: run `.venv/bin/snakemake --cores 2` first, or set COMPATLAS_DEFAULT_RUN")
    con = connect(path)
    zoo = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    want = set(zoo.get("models", {})) | set(zoo.get("training", {}))
    have = {r[0] for r in con.execute("SELECT DISTINCT model FROM models").fetchall()}
    if have != want:
        pytest.fail(f"{path} is not the default run's atlas: models {sorted(have)}, config/config.yaml's {sorted(want)}")
    yield con
    con.close()


def section(doc: str, heading: str) -> str:
    text = (REPO / doc).read_text(encoding="utf-8")
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def head(layer: int, h: int) -> str:
    return f"{layer}.{h}"


def test_the_readme_query_returns_the_circuit_it_describes(atlas):
    part = section("README.md", "## One query")
    (sql,) = CLI.findall(part)
    rows = atlas.execute(sql).fetchall()
    assert len(rows) == 10, rows
    pairs = [(head(r[0], r[1]), head(r[2], r[3])) for r in rows]
    # "The first six rows are SmolLM2's induction circuit: its previous-token head 16.0 into the induction
    # heads 17.3 to 17.5 and 18.6 to 18.8"
    m = re.search(r"first (\w+) rows are SmolLM2's induction circuit: its previous-token head (\d+)\.(\d+) into the "
                  r"induction\s+heads (\d+)\.(\d+) to \d+\.(\d+) and (\d+)\.(\d+) to \d+\.(\d+)", part)
    assert m, part
    n = {"four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8}[m.group(1)]
    writer = f"{m.group(2)}.{m.group(3)}"
    readers = {head(int(m.group(4)), h) for h in range(int(m.group(5)), int(m.group(6)) + 1)} | \
              {head(int(m.group(7)), h) for h in range(int(m.group(8)), int(m.group(9)) + 1)}
    assert {w for w, _ in pairs[:n]} == {writer} and {r for _, r in pairs[:n]} == readers, pairs
    # "then 17.8, a weaker previous-token head (score 0.33, under the report's 0.4 cut), into 18.6 to 18.8"
    m = re.search(r"then (\d+)\.(\d+), a weaker previous-token head \(score ([0-9.]+), under the report's ([0-9.]+) "
                  r"cut\), into (\d+)\.(\d+) to \d+\.(\d+)", part)
    assert m, part
    weak = f"{m.group(1)}.{m.group(2)}"
    then = {head(int(m.group(5)), h) for h in range(int(m.group(6)), int(m.group(7)) + 1)}
    assert [w for w, _ in pairs[n:n + len(then)]] == [weak] * len(then) and {r for _, r in pairs[n:n + len(then)]} == then
    (score,) = atlas.execute("""SELECT prev_token_mean FROM head_scores WHERE model = 'smollm2-135m' AND latest
                                AND layer = ? AND head = ?""", [int(m.group(1)), int(m.group(2))]).fetchone()
    assert f"{score:.2f}" == m.group(3) and score < float(m.group(4)), score
    cut = yaml.safe_load((REPO / "config" / "config.yaml").read_text()).get("induction", {}).get("prev_token_threshold", 0.4)
    assert float(m.group(4)) == cut
    # every row is beyond chance, strongest first, as the query's WHERE and ORDER BY say
    assert all(r[6] <= 0.05 for r in rows) and [r[5] for r in rows] == sorted(r[5] for r in rows)


def test_the_trained_models_top_exact_k_edge_is_the_docs(atlas):
    """docs/edge_attribution.md: "The K edge 0.0 -> 1.0 ... is the top K edge by exact patching
    (-2.32 +- 0.11 ...; next 0.1 -> 1.0, -2.05 ...)" at the trained model's last checkpoint."""
    part = section("docs/edge_attribution.md", "## What it shows on the default zoo")
    m = re.search(r"The K edge (\d)\.(\d) -> (\d)\.(\d) \(a previous-token head into the strongest\s+induction head\) is "
                  r"the top K edge by\s+exact patching \((-?[0-9.]+) \+- ([0-9.]+) in mean log-probability of the induced "
                  r"tokens; next (\d)\.(\d) -> (\d)\.(\d),\s+(-?[0-9.]+)", part)
    assert m, part[:2000]
    rows = atlas.execute("""SELECT writer_layer, writer_head, reader_layer, reader_head, exact, exact_stderr
                            FROM edge_attribution WHERE model = 'induction-2l' AND latest AND comp = 'K' AND method = 'eap'
                            ORDER BY exact""").fetchall()
    top, second = rows[0], rows[1]
    assert tuple(map(int, m.group(1, 2, 3, 4))) == top[:4], (m.group(0), top)
    assert (m.group(5), m.group(6)) == (f"{top[4]:.2f}", f"{top[5]:.2f}"), (m.group(0), top)
    assert tuple(map(int, m.group(7, 8, 9, 10))) == second[:4] and m.group(11) == f"{second[4]:.2f}", (m.group(0), second)


def test_the_methods_against_exact_patching_table_is_the_atlas(atlas):
    """The table of eap_vs_exact's Spearman per method x comp for the trained model."""
    part = section("docs/edge_attribution.md", "## What it shows on the default zoo")
    table = re.search(r"\| method \| K \| Q \| V \|\n\|[-| ]+\|\n((?:\|.*\|\n)+)", part)
    assert table, part[:2000]
    doc = {}
    for line in table.group(1).strip().splitlines():
        method, *vals = [c.strip().strip("*`") for c in line.strip("|").split("|")]
        doc[method] = dict(zip("KQV", vals, strict=True))
    got = {(m, c): s for m, c, s in atlas.execute("""SELECT method, comp, spearman FROM eap_vs_exact
                                                      WHERE model = 'induction-2l' AND latest""").fetchall()}
    assert set(doc) == {m for m, _ in got}
    for method, per in doc.items():
        for comp, v in per.items():
            assert v == f"{got[(method, comp)]:.1f}", (method, comp, v, got[(method, comp)])


def test_the_circuit_edge_over_training_table_is_the_atlas(atlas):
    """docs/edge_attribution.md's table of the circuit edge 0.0 -> 1.0 K at each checkpoint: its exact
    patching, each method's attribution, its frobenius and subspace K composition (residual) and the
    head scores, each to the digits printed."""
    part = section("docs/edge_attribution.md", "## What it shows on the default zoo")
    table = re.search(r"\| step \| exact \|.*\n\|[-| ]+\|\n((?:\|.*\|\n)+)", part)
    assert table, part[:2000]
    edge = "writer_layer = 0 AND writer_head = 0 AND reader_layer = 1 AND reader_head = 0"
    rows = table.group(1).strip().splitlines()
    assert len(rows) == atlas.execute("SELECT count(*) FROM checkpoints WHERE model = 'induction-2l'").fetchone()[0]
    for line in rows:
        step, *doc = [float(c) for c in line.strip("|").split("|")]
        (ckpt,) = atlas.execute("SELECT checkpoint FROM checkpoints WHERE model = 'induction-2l' AND checkpoint_step = ?",
                                [int(step)]).fetchone()
        at = dict(atlas.execute(f"SELECT method, score FROM edge_attribution WHERE model = 'induction-2l' AND checkpoint = ? "
                                f"AND comp = 'K' AND {edge}", [ckpt]).fetchall())
        (exact,) = atlas.execute(f"SELECT any_value(exact) FROM edge_attribution WHERE model = 'induction-2l' AND "
                                 f"checkpoint = ? AND comp = 'K' AND {edge}", [ckpt]).fetchone()
        comp = dict(atlas.execute(f"SELECT metric, score FROM composition WHERE model = 'induction-2l' AND checkpoint = ? "
                                  f"AND comp = 'K' AND space = 'residual' AND {edge}", [ckpt]).fetchall())
        heads = dict(atlas.execute("SELECT layer, CASE WHEN layer = 0 THEN prev_token_mean ELSE induction_mean END "
                                   "FROM head_scores WHERE model = 'induction-2l' AND checkpoint = ? AND head = 0",
                                   [ckpt]).fetchall())
        got = [exact, at["eap_attn"], at["eap_ig"], at["eap"], comp["frobenius"], comp["subspace"], heads[0], heads[1]]
        digits = [2, 2, 2, 2, 3, 3, 2, 2]
        for d, g, n in zip(doc, got, digits, strict=True):
            assert abs(d - g) <= 0.5 * 10**-n + 1e-9, (step, doc, [round(x, n) for x, n in zip(got, digits, strict=True)])

"""The figures README.md and the docs quote from the default run, checked against a default-run
atlas: the README's query returns the rows its prose describes, and the trained model's edge
attribution in docs/edge_attribution.md (its top exact K edge, the methods against exact
patching) is the atlas's. Figures from other runs (the H200 run over 4096 sequences) say the
command and date that made them instead.

Needs the atlas of ``.venv/bin/snakemake --cores 2`` on ``config/config.yaml`` (about 6 minutes):
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


def atlas_path() -> Path:
    return Path(os.environ.get("COMPATLAS_DEFAULT_RUN", REPO / "results" / "atlas.duckdb"))


@pytest.fixture(scope="module")
def atlas(request):
    if "default_run" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("needs the default run's atlas (about 6 minutes on 2 cores): "
                    "pytest -m default_run tests/test_default_run_figures.py")
    path = atlas_path()
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


def training_kernels(atlas) -> str:
    """The CPU kernels the default run's trained model was trained on (its loss shards' provenance)."""
    from compatlas.storage import read_provenance

    del atlas  # the shards lie beside the atlas's file
    shards = sorted((atlas_path().parent / "train" / "induction-2l").glob("*/loss.parquet"))
    assert shards, f"no training loss shards beside {atlas_path()}"
    kernels = {read_provenance(p).get("cpu_kernels", "not recorded") for p in shards}
    assert len(kernels) == 1, kernels
    return kernels.pop()


def pinned(atlas) -> bool:
    """Trained on the pinned kernels (compatlas.runtime.PINNED_CPU_KERNELS): seed 0's bits."""
    return training_kernels(atlas) == "aten=AVX2 mkl_cbwr=AVX2"


def needs_seed_zero_bits(atlas) -> None:
    if not pinned(atlas):
        pytest.skip(f"the trained model ran on CPU kernels {training_kernels(atlas)!r}, not the pinned AVX2 ones (a CPU "
                    "without AVX2, or not x86-64): seed 0's digits do not apply to it; "
                    "test_the_trained_model_lies_within_the_six_seeds checks it against their spread instead")


def seed_table() -> dict[str, dict[str, str]]:
    """docs/behaviour.md's six-seed table: figure label -> its cells by column name."""
    part = section("docs/behaviour.md", "### The trained model over six seeds")
    table = re.search(r"(\| figure \|.*\|)\n\|[-|]+\|\n((?:\|.*\|\n)+)", part)
    assert table, part[:2000]
    cols = [c.strip() for c in table.group(1).strip("|").split("|")]
    return {cells[0]: dict(zip(cols, cells, strict=True))
            for line in table.group(2).strip().splitlines()
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}


def head(layer: int, h: int) -> str:
    return f"{layer}.{h}"


def close(doc: str, value: float, slack: float = 0.0) -> bool:
    """A figure printed as ``doc`` is ``value`` rounded, give or take ``slack`` (float kernels that
    differ across CPUs move a fixed model's figures in their last bits, not by a printed digit)."""
    digits = len(doc.split(".")[1]) if "." in doc else 0
    return abs(float(doc) - value) <= 0.5 * 10**-digits + slack + 1e-9


def test_the_readme_query_returns_the_circuit_it_describes(atlas):
    part = section("README.md", "## One query")
    (sql,) = CLI.findall(part)
    rows = atlas.execute(sql).fetchall()
    assert len(rows) == 10, rows
    pairs = [(head(r[0], r[1]), head(r[2], r[3])) for r in rows]
    # "The first six rows are SmolLM2's induction circuit: its previous-token head 16.0 into the query
    # heads 17.3 to 17.5 and 18.6 to 18.8"
    m = re.search(r"first (\w+) rows are SmolLM2's induction circuit: its previous-token head (\d+)\.(\d+) into the query"
                  r"\s+heads (\d+)\.(\d+) to \d+\.(\d+) and (\d+)\.(\d+) to \d+\.(\d+)", part)
    assert m, part
    n = {"four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8}[m.group(1)]
    writer = f"{m.group(2)}.{m.group(3)}"
    readers = {head(int(m.group(4)), h) for h in range(int(m.group(5)), int(m.group(6)) + 1)} | \
              {head(int(m.group(7)), h) for h in range(int(m.group(8)), int(m.group(9)) + 1)}
    assert {w for w, _ in pairs[:n]} == {writer} and {r for _, r in pairs[:n]} == readers, pairs
    # "Five of them are induction heads (induction scores 0.51 to 0.86); 18.8 is not (0.00)"
    m = re.search(r"(\w+) of them are induction heads \(induction scores ([0-9.]+) to ([0-9.]+)\);\s+(\d+)\.(\d+) is not "
                  r"\(([0-9.]+)\)", part)
    assert m, part
    scores = {head(l, h): s for l, h, s in atlas.execute(
        "SELECT layer, head, induction_mean FROM head_scores WHERE model = 'smollm2-135m' AND latest").fetchall()}
    cut = yaml.safe_load((REPO / "config" / "config.yaml").read_text()).get("induction", {}).get("induction_threshold", 0.4)
    inducing = sorted(scores[r] for r in readers if scores[r] >= cut)
    assert len(inducing) == {"four": 4, "five": 5, "six": 6}[m.group(1).lower()], (readers, scores)
    assert close(m.group(2), inducing[0], 0.01) and close(m.group(3), inducing[-1], 0.01), (m.group(0), inducing)
    odd = head(int(m.group(4)), int(m.group(5)))
    assert odd in readers and scores[odd] < cut and close(m.group(6), scores[odd], 0.01), (odd, scores[odd])
    # "then 17.8, a weaker previous-token head (score 0.33, under the report's 0.4 cut), into 18.6 to 18.8"
    m = re.search(r"Then (\d+)\.(\d+), a weaker\s+previous-token head \(score ([0-9.]+), under the report's ([0-9.]+) "
                  r"cut\), into (\d+)\.(\d+) to \d+\.(\d+)", part)
    assert m, part
    weak = f"{m.group(1)}.{m.group(2)}"
    then = {head(int(m.group(5)), h) for h in range(int(m.group(6)), int(m.group(7)) + 1)}
    assert [w for w, _ in pairs[n:n + len(then)]] == [weak] * len(then) and {r for _, r in pairs[n:n + len(then)]} == then
    (score,) = atlas.execute("""SELECT prev_token_mean FROM head_scores WHERE model = 'smollm2-135m' AND latest
                                AND layer = ? AND head = ?""", [int(m.group(1)), int(m.group(2))]).fetchone()
    assert close(m.group(3), score, 0.01) and score < float(m.group(4)), score
    prev_cut = yaml.safe_load((REPO / "config" / "config.yaml").read_text()).get("induction", {}).get("prev_token_threshold", 0.4)
    assert float(m.group(4)) == prev_cut
    # every row is beyond chance, strongest first, as the query's WHERE and ORDER BY say
    assert all(r[6] <= 0.05 for r in rows) and [r[5] for r in rows] == sorted(r[5] for r in rows)
    # "All of them share q = 0.0499986, the q of a test at the null's floor: 11 of this cell's 20 discoveries
    # sit at the floor, and with one test fewer there none of those 11 would pass"
    m = re.search(r"share\s+q = ([0-9.]+), the q of a test at the null's floor: (\d+) of this cell's (\d+) discoveries sit at "
                  r"the\s+floor, and with one test fewer there none of those (\d+) would pass", part)
    assert m, part
    floor = atlas.execute("""SELECT q_at_floor, n_at_floor, n_discoveries, set_by_floor FROM discovery_floor
                             WHERE model = 'smollm2-135m' AND latest AND metric = 'frobenius' AND space = 'residual'
                               AND comp = 'K'""").fetchone()
    assert {r[6] for r in rows} == {floor[0]} and f"{floor[0]:.6g}" == m.group(1), (floor, m.group(0))
    assert (int(m.group(2)), int(m.group(3)), int(m.group(4))) == (floor[1], floor[2], floor[1]) and floor[3], floor


def test_smollm2s_head_scores_and_auroc_are_the_docs(atlas):
    """docs/behaviour.md: SmolLM2's previous-token head and induction heads with their scores, and
    composition_vs_behaviour's AUROC ranges per comp."""
    part = section("docs/behaviour.md", "## Induction: behaviour beside the weights")
    m = re.search(r"its head (\d+)\.(\d+)\s+is a previous-token head \(([0-9.]+)\), and its (\w+) strongest induction heads "
                  r"are ([0-9., and]+?) \(([0-9., ]+);", part.replace("\n", " "))
    assert m, part[:3000]
    scores = {(l, h): (p, i) for l, h, p, i in atlas.execute("""SELECT layer, head, prev_token_mean, induction_mean
                                                               FROM head_scores WHERE model = 'smollm2-135m' AND latest""").fetchall()}
    assert close(m.group(3), scores[(int(m.group(1)), int(m.group(2)))][0], 0.01)
    heads = [tuple(map(int, h.split("."))) for h in re.findall(r"\d+\.\d+", m.group(5))]
    quoted = [v.strip() for v in m.group(6).split(",")]
    assert len(heads) == {"four": 4, "five": 5, "six": 6}[m.group(4)]
    strongest = sorted(scores, key=lambda k: -scores[k][1])[:len(heads)]
    assert heads == strongest, (heads, strongest)
    for h, v in zip(heads, quoted, strict=True):
        assert close(v, scores[h][1], 0.01), (h, v, scores[h])
    m = re.search(r"AUROC ([0-9.]+) to ([0-9.]+) for every metric and space \(Q and V composition:\s+([0-9.]+) to ([0-9.]+)\)",
                  part.replace("\n", " "))
    assert m, part[:3000]
    k = atlas.execute("""SELECT min(auroc), max(auroc) FROM composition_vs_behaviour
                         WHERE model = 'smollm2-135m' AND latest AND comp = 'K'""").fetchone()
    qv = atlas.execute("""SELECT min(auroc), max(auroc) FROM composition_vs_behaviour
                          WHERE model = 'smollm2-135m' AND latest AND comp IN ('Q', 'V')""").fetchone()
    for doc, got in zip(m.groups(), (*k, *qv), strict=True):
        assert close(doc, got, 0.01), (m.group(0), k, qv)


def test_a_random_models_attribution_is_below_the_quoted_bound(atlas):
    """docs/statistics.md: "toy-gpt2's largest |K attribution| in the default run is below 1e-5 nats"."""
    part = section("docs/statistics.md", "## Agreement with function")
    m = re.search(r"toy-gpt2's\s+largest \|K attribution\| in the default run is below ([0-9.e-]+) nats", part)
    assert m, part[:3000]
    (top,) = atlas.execute("""SELECT max(abs(score)) FROM edge_attribution
                              WHERE model = 'toy-gpt2' AND latest AND comp = 'K'""").fetchone()
    assert top is not None and top < float(m.group(1)), top


def test_the_trained_model_lies_within_the_six_seeds(atlas):
    """The trained model against docs/behaviour.md's six-seed table (compatlas.report.seed_spread):
    on the pinned kernels it is seed 0, every figure to its printed digits; on others each figure
    lies within the six seeds' range (half a printed digit either side), and what holds in every seed
    holds here."""
    from compatlas.report.seed_spread import FIGURES, run_figures

    table = seed_table()
    got = run_figures(atlas, "induction-2l")
    assert {f.label for f in FIGURES} == set(table), set(table) ^ {f.label for f in FIGURES}
    bits = pinned(atlas)
    for f in FIGURES:
        row, value = table[f.label], got[f.key]
        assert value is not None, f.key
        if bits:
            assert close(row["seed 0"], value), (f.label, row["seed 0"], value)
        elif f.yes_no:
            if row["mean"] == f"{row['seeds']} of {row['seeds']}":
                assert value == 1, (f.label, value)
        else:
            lo, hi = (float(v) for v in row["range"].split(" to "))
            half = 0.5 * 10**-f.digits
            assert lo - half <= value <= hi + half, (f.label, row["range"], value)


def test_the_trained_models_top_exact_k_edge_is_the_docs(atlas):
    """docs/edge_attribution.md: "The K edge 0.0 -> 1.0 ... is the top K edge by exact patching
    (-2.26 +- 0.10 ...; next 0.1 -> 1.0, -1.84 ...)" at the trained model's last checkpoint (seed 0's
    digits: on the pinned kernels)."""
    needs_seed_zero_bits(atlas)
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
    """The table of eap_vs_exact's Spearman per method x comp for the trained model (seed 0's digits)."""
    needs_seed_zero_bits(atlas)
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
    head scores, each to the digits printed (seed 0's: on the pinned kernels)."""
    needs_seed_zero_bits(atlas)
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


def test_the_six_seed_table_is_the_seeds_atlas():
    """docs/behaviour.md's six-seed table is what compatlas.report.seed_spread makes of the seeds'
    atlas (config/training-seeds.yaml: about 12 minutes, not part of the default run)."""
    from compatlas.report.seed_spread import spread_table

    path = Path(os.environ.get("COMPATLAS_SEEDS_RUN", REPO / "results-seeds" / "atlas.duckdb"))
    if not path.exists():
        pytest.skip(f"no seeds atlas at {path}: .venv/bin/snakemake --cores 2 --configfile config/training-seeds.yaml "
                    "(about 12 minutes), or set COMPATLAS_SEEDS_RUN")
    from compatlas.report.seed_spread import run_figures

    con = connect(path)
    runs = [f"induction-2l-s{i}" for i in range(6)]
    made = spread_table({r: run_figures(con, r) for r in runs})
    for i, r in enumerate(runs):
        made = made.replace(f" {r} |", f" seed {i} |")
    doc = section("docs/behaviour.md", "### The trained model over six seeds")
    assert made in doc, made

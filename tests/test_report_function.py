"""The report's composition-against-function parts (compatlas/report/function.py) on a synthetic
atlas with edge attribution (tests/synthetic_atlas.py: the planted K edges carry the task), and
an older atlas without edge attribution, whose pages are drawn as before."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import duckdb
import numpy as np
import polars as pl
import pytest
from scipy import stats
from synthetic_atlas import TRACKING, Spec, as_older_atlas, write_suite

from compatlas.atlas import connect as atlas_connect
from compatlas.function.comp_agreement import (
    CompFunction,
    agreement_tables,
    bootstrap_rows,
    comp_function,
    comp_rows,
    stored_comp_function,
)
from compatlas.report import build_report
from compatlas.report import function as report_function
from compatlas.report import queries as q
from compatlas.report.function import CIRCUIT, OTHER, edge_points, model_function, with_interval
from compatlas.report.page import fmt
from compatlas.tables import FUNCTION_AGREEMENT_SCHEMA, FUNCTION_BOOTSTRAP_SCHEMA
from compatlas.vocab import KERNEL_METRICS

STEPS = [0, 4, 64, 200, 400]
SUITE = [Spec("wide", 6, 4, edges=True), Spec("run", 3, 3, steps=STEPS, edges=True), Spec("plain", 4, 4),
         Spec("noise", 4, 4, edges=True, function=False)]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("function")
    db = write_suite(root, SUITE)
    build_report(db, root / "report", png=False)
    return db, root / "report"


def specs(page: str) -> list[dict]:
    return [json.loads(s.replace("\\u003c", "<"))
            for s in re.findall(r'<script type="application/json" id="spec\d+">(.*?)</script>', page)]


def title(spec: dict) -> str:
    t = spec.get("title", {})
    return t.get("text", "") if isinstance(t, dict) else str(t)


def section(page: str) -> str:
    return page.split("<h2 id='function'>")[1].split("<h2 ")[0]


INTERVAL = r"[-0-9.]+ \[[-0-9.]+, [-0-9.]+\]"


def test_model_page_shows_only_the_measurable_comp_with_intervals_and_names_the_best_cell(report):
    db, out = report
    part = section((out / "model-wide.html").read_text(encoding="utf-8"))
    # Q and V carry only noise (tests/synthetic_atlas.py): said, and left out of the table
    for c in "QV":
        assert re.search(rf"<b>{c}</b>: no function to predict: 0 of its \d+ edges carry an attribution", part), part[:3000]
    body = part.split("<tbody>")[1].split("</tbody>")[0]
    rows = re.findall(r"<tr>(.*?)</tr>", body)
    # metric x space, the two oracles and the function-free prior, K only
    assert len(rows) == len(KERNEL_METRICS) * 2 + 3 and all("<td>K</td>" in r for r in rows)
    assert sum("<td>oracle</td>" in r for r in rows) == 2 and sum("<td>prior</td>" in r for r in rows) == 1
    # noise-aware Spearman and AUROC, and against |attribution| AUROC and Spearman: each with its interval; and
    # but for the oracles (which it is taken beyond), the partial Spearman beyond both oracles with its interval
    assert all(len(re.findall(INTERVAL, r)) == (4 if "<td>oracle</td>" in r else 5) for r in rows)
    # the one cell whose K score follows the K function is the best on the noise-aware statistic, beyond the
    # others' uncertainty, agrees with function and adds to scale and depth (the standard error is the same for
    # every edge here: the scale oracle ranks nothing)
    best = re.search(r"<b>K</b>, noise ceiling [-0-9.]+ \([-0-9.]+ within a layer pair\): best <b>(\w+) × (\w+)</b> \((" + INTERVAL
                     + r")\), beyond every other cell; .*?it agrees with function; [^;<]*; (beats both oracles; )?adds to scale "
                     r"and depth", part)
    assert best and (best.group(1), best.group(2)) == TRACKING, part[:3000]
    # every point figure the bootstrap starts from is the view's (an independent SQL computation)
    con = atlas_connect(db)
    fns = model_function(con, "wide", "final")
    k = fns["K"]
    view = {(m, s_, c): (a, r) for m, s_, c, a, r in con.execute(
        """SELECT metric, space, comp, auroc, spearman FROM composition_vs_function
           WHERE model = 'wide' AND checkpoint = 'final' AND method = ?""", [k.method]).fetchall()}
    assert k.gate.measurable and not fns["Q"].gate.measurable and not fns["V"].gate.measurable
    noise = {(m, s_, c): (a, r) for m, s_, c, a, r in con.execute(
        """SELECT metric, space, comp, auroc_significant, spearman_unbiased FROM composition_vs_function
           WHERE model = 'wide' AND checkpoint = 'final' AND method = ?""", [k.method]).fetchall()}
    assert k.noise is not None and len(k.cells) == len(KERNEL_METRICS) * 2 + 3  # the oracles and the prior too
    for i, (m, s_) in enumerate(k.cells):
        assert (k.agreement.auroc[i], k.agreement.spearman[i]) == pytest.approx(view[(m, s_, "K")], abs=1e-12)
        assert (k.noise.auroc[i], k.noise.spearman[i]) == pytest.approx(noise[(m, s_, "K")], abs=1e-12)
    # EAP against exact patching, one line per method with every comp
    line = re.search(r"<b>eap</b> against exact patching.*?\.</p>", part, flags=re.S).group(0)
    assert all(f"{c} top edge" in line and f"{c} top edge agrees, Spearman" in line for c in "QKV")


def test_the_atlas_holds_the_agreement_and_intervals_the_page_shows(report):
    """function_agreement (computed when the atlas is built) holds, per cell, the figures and 95%
    intervals the page prints: the same bootstrap (the page's CompFunction), and the page's text
    is the table's numbers formatted; each interval holds its point figure; oracles carry no rank."""
    db, out = report
    con = atlas_connect(db)
    k = model_function(con, "wide", "final")["K"]
    table = con.sql("""SELECT * FROM function_agreement WHERE model = 'wide' AND checkpoint = 'final'
                           AND method = ? AND comp = 'K'""", params=[k.method]).pl()
    assert table.height == len(k.cells) and table["measurable"].all() and table["latest"].all()
    part = section((out / "model-wide.html").read_text(encoding="utf-8"))
    for cell in k.cells:
        row = table.filter((pl.col("metric") == cell[0]) & (pl.col("space") == cell[1])).row(0, named=True)
        for name, which, noise in (("spearman_unbiased", "spearman", True), ("auroc_significant", "auroc", True),
                                   ("auroc_top", "auroc", False), ("spearman_abs", "spearman", False)):
            lo, hi = k.interval(cell, which, noise=noise)
            assert (row[f"{name}_lo"], row[f"{name}_hi"]) == pytest.approx((lo, hi), abs=1e-12), (cell, name)
            assert row[f"{name}_lo"] - 1e-12 <= row[name] <= row[f"{name}_hi"] + 1e-12, (cell, name, row)
            assert with_interval(row[name], (row[f"{name}_lo"], row[f"{name}_hi"])) in part, (cell, name)
        oracle = cell[1] in ("oracle", "prior")  # the reference rows: no rank among the cells
        assert (row["best_noise_aware"] is None) == oracle and (row["beats_scale"] is None) == oracle
    assert table.filter(pl.col("best_noise_aware"))[["metric", "space"]].row(0) == TRACKING
    # the comps with no function are there too, saying why, with no figures
    dead = con.execute("""SELECT DISTINCT comp, why_not, spearman_unbiased FROM function_agreement
                          WHERE model = 'wide' AND NOT measurable""").fetchall()
    assert {c for c, _, _ in dead} == {"Q", "V"} and all(w and s is None for _, w, s in dead)


def test_the_partial_spearman_beyond_both_oracles_is_the_ranks_regressed_out(report):
    """What a score adds beyond both oracles, two ways in the atlas (composition_vs_function's SQL, from
    the pairwise rank correlations; function_agreement's, by weighted least squares inside the
    bootstrap), against a third computed here from the edges: scipy's ranks of the score, of the
    unbiased function (half_a x half_b) and of the two oracles (the edge's standard error; its layer
    pair's mean |attribution|), both oracles regressed out by numpy's least squares, the Pearson
    correlation of what is left. The prior row (nearer layers first) is scored the same way."""
    db, _ = report
    con = atlas_connect(db)
    k = model_function(con, "wide", "final")["K"]
    edges = con.sql("""SELECT writer_layer, writer_head, reader_layer, reader_kv_head AS unit, any_value(score) AS attribution,
                              any_value(score_stderr) AS stderr, any_value(score_half_a * score_half_b) AS fn,
                              list(reader_head) AS heads
                       FROM edge_attribution WHERE model = 'wide' AND checkpoint = 'final' AND method = ? AND comp = 'K'
                       GROUP BY ALL ORDER BY ALL""", params=[k.method]).pl()
    edges = edges.with_columns(depth=pl.col("attribution").abs().mean().over("writer_layer", "reader_layer"))
    comp = con.sql("""SELECT metric, space, writer_layer, writer_head, reader_layer, reader_head, score FROM composition
                      WHERE model = 'wide' AND checkpoint = 'final' AND comp = 'K'""").pl()
    units = edges.explode("heads").rename({"heads": "reader_head"}).select("writer_layer", "writer_head", "reader_layer",
                                                                            "unit", "reader_head")
    best = (comp.join(units, on=["writer_layer", "writer_head", "reader_layer", "reader_head"])
            .group_by("metric", "space", "writer_layer", "writer_head", "reader_layer", "unit").agg(pl.col("score").max()))
    rank = stats.rankdata
    design = np.column_stack([np.ones(edges.height), rank(edges["stderr"]), rank(edges["depth"])])
    left = lambda y: y - design @ np.linalg.lstsq(design, y, rcond=None)[0]  # noqa: E731
    fn_left = left(rank(edges["fn"]))
    keys = ["writer_layer", "writer_head", "reader_layer", "unit"]
    cvf = {(r["metric"], r["space"]): r for r in con.sql(
        "SELECT * FROM composition_vs_function WHERE model = 'wide' AND checkpoint = 'final' AND method = ? AND comp = 'K'",
        params=[k.method]).pl().iter_rows(named=True)}
    table = {(r["metric"], r["space"]): r for r in con.sql(
        "SELECT * FROM function_agreement WHERE model = 'wide' AND checkpoint = 'final' AND method = ? AND comp = 'K'",
        params=[k.method]).pl().iter_rows(named=True)}
    checked = 0
    for cell in k.cells:
        if cell[1] == "oracle":
            assert cvf[cell]["partial_unbiased"] is None and table[cell]["partial_unbiased"] is None, cell
            continue
        if cell == ("prior_distance", "prior"):
            score = (edges["writer_layer"] - edges["reader_layer"]).cast(pl.Float64).to_numpy()
        else:
            score = edges.join(best.filter((pl.col("metric") == cell[0]) & (pl.col("space") == cell[1])), on=keys,
                               how="left")["score"].to_numpy()
        want = stats.pearsonr(left(rank(score)), fn_left)[0]
        assert cvf[cell]["partial_unbiased"] == pytest.approx(want, abs=1e-9), cell
        assert table[cell]["partial_unbiased"] == pytest.approx(want, abs=1e-9), cell
        lo, hi = table[cell]["partial_unbiased_lo"], table[cell]["partial_unbiased_hi"]
        assert lo <= want <= hi and table[cell]["adds_to_oracles"] == (lo > 0), (cell, lo, want, hi)
        oracles_r2 = 1 - (fn_left ** 2).sum() / ((rank(edges["fn"]) - rank(edges["fn"]).mean()) ** 2).sum()
        assert cvf[cell]["added_r2"] == pytest.approx(want**2 * (1 - oracles_r2), abs=1e-9), cell
        checked += 1
    assert checked == len(k.cells) - 2
    # the planted K function (tests/synthetic_atlas.py) is carried by the tracking cell beyond both oracles
    assert table[TRACKING]["adds_to_oracles"] and table[TRACKING]["agrees"], table[TRACKING]


def test_a_model_without_function_gets_no_agreement_figure(report):
    _, out = report
    page = (out / "model-noise.html").read_text(encoding="utf-8")
    part = section(page)
    assert "<b>No function to predict</b>" in part
    assert all(re.search(rf"<b>{c}</b>: no function to predict: 0 of its \d+ edges", part) for c in "QKV")
    assert "<table" not in part and "Agreement with function" not in part and "best <b>" not in part
    assert not [s for s in specs(page) if "against function" in title(s)]  # no scatter


def test_scatter_marks_the_circuit_edge(report):
    _, out = report
    page = (out / "model-run.html").read_text(encoding="utf-8")
    scatter = next(s for s in specs(page) if "K-composition against function" in title(s))
    rows = [r for d in scatter["datasets"].values() for r in d]
    circ = [r for r in rows if r["kind"] == CIRCUIT]
    # previous-token head L0.H1 into the induction head L2.H0 (head scores), attribution -(0.05 + 2 f) at the last step
    assert [r["edge"] for r in circ] == ["L0.H1 → L2.H0"]
    assert circ[0]["fn"] == pytest.approx(max(r["fn"] for r in rows))
    assert len(rows) == 3 * 3 * 3  # every causal K edge of 3 layers x 3 heads, once
    # it draws the cell the section crowns for K (the one whose score follows the function), not the page's lead
    crowned = re.search(r"<b>K</b>, noise ceiling .*?best <b>(\w+) × (\w+)</b>", section(page)).groups()
    assert crowned == TRACKING and f"({TRACKING[0]}, {TRACKING[1]} space)" in json.dumps(scatter, ensure_ascii=False)


def test_the_edge_exact_patching_ranks_first_over_training_with_every_method(report):
    db, out = report
    page = (out / "model-run.html").read_text(encoding="utf-8")
    fig = next(s for s in specs(page) if "over training: function and composition" in title(s))
    con = atlas_connect(db)
    # the edge: the largest |exact patching| at the last checkpoint, found here in SQL
    top = con.execute("""SELECT writer_layer, writer_head, reader_layer, reader_head FROM edge_attribution
                         WHERE model = 'run' AND checkpoint = 'step400' AND comp = 'K' ORDER BY abs(exact) DESC LIMIT 1""").fetchone()
    assert f"L{top[0]}.H{top[1]} → L{top[2]}.H{top[3]}" in title(fig)
    rows = [r for d in fig["datasets"].values() for r in d]
    assert {r["series"] for r in rows if "series" in r} == {"exact patching", "eap", "eap_ig"}
    for series, col in (("eap", "e.score"), ("eap_ig", "e.score"), ("exact patching", "e.exact")):
        got = sorted((r["step"], r["value"]) for r in rows if r.get("series") == series)
        method = "eap" if series == "exact patching" else series
        want = con.execute(f"""SELECT c.checkpoint_step, {col} FROM edge_attribution e JOIN checkpoints c USING (model, checkpoint)
                               WHERE model = 'run' AND method = ? AND comp = 'K' AND writer_layer = ? AND writer_head = ?
                               AND reader_layer = ? AND reader_head = ? ORDER BY 1""", [method, *top]).fetchall()
        assert [s for s, _ in got] == STEPS and np.allclose([a for _, a in got], [a for _, a in want]), series
    exact = sorted((r["step"], r["value"]) for r in rows if r.get("series") == "exact patching")
    assert exact[-1][1] < exact[0][1] - 1  # the function forms: the edge's exact patching falls by about 2
    # the composition panel: the metric x space whose score follows |exact patching| best over the steps
    comp = con.execute("""SELECT metric, space, c.checkpoint_step, score FROM composition JOIN checkpoints c USING (model, checkpoint)
                          WHERE model = 'run' AND comp = 'K' AND writer_layer = ? AND writer_head = ? AND reader_layer = ?
                          AND reader_head = ?""", list(top)).fetchall()
    fn = dict(exact)
    rho = {}
    for m, s_ in {(m, s_) for m, s_, _, _ in comp}:
        pts = sorted((st, sc) for mm, ss, st, sc in comp if (mm, ss) == (m, s_))
        rho[(m, s_)] = stats.spearmanr([sc for _, sc in pts], [abs(fn[st]) for st, _ in pts]).statistic
    caption = re.search(r"Composition panel: <b>(\w+) × (\w+)</b>.*?\(Spearman ([0-9.]+) over 5 checkpoints", page)
    assert caption and rho[(caption.group(1), caption.group(2))] == pytest.approx(max(rho.values()))
    assert float(caption.group(3)) == pytest.approx(max(rho.values()), abs=5e-3)


def test_overview_ranks_only_models_with_function_with_intervals(report):
    db, out = report
    part = section((out / "index.html").read_text(encoding="utf-8"))
    con = atlas_connect(db)
    rows = con.execute("""SELECT metric, space, model, spearman_unbiased FROM composition_vs_function
                          WHERE latest AND method = 'eap' AND comp = 'K' AND space <> 'oracle'""").fetchall()
    assert {r[2] for r in rows} == {"wide", "run", "noise"}  # "plain" has no edge attribution
    # "noise" is left out, and says why
    assert re.search(r"<li>noise: 0 of its \d+ edges carry an attribution distinguishable from zero", part)
    means: dict[tuple[str, str], list[float]] = {}
    for m, s_, model, a in rows:
        if model != "noise":
            means.setdefault((m, s_), []).append(a)
    got = re.search(r"Agrees best across models, over 2 models \((?:wide, run|run, wide)\): <b>(\w+) × (\w+)</b> \(mean Spearman "
                    r"([0-9.]+) \[([0-9.]+), ([0-9.]+)\]\), beyond the uncertainty of every other cell; scale oracle "
                    + INTERVAL + ", depth oracle " + INTERVAL + ", prior " + INTERVAL + "; it agrees with function; "
                    r"beyond the function-free prior; beats both oracles; adds to scale and depth", part)
    assert got and (got.group(1), got.group(2)) == TRACKING, part[:3000]
    assert float(got.group(3)) == pytest.approx(np.mean(means[TRACKING]), abs=5e-3)
    assert float(got.group(4)) <= float(got.group(3)) <= float(got.group(5))
    table_rows = re.findall(r"<tr>(.*?)</tr>", part.split("<tbody>")[1])
    assert len(table_rows) == len(means) + 2 and all(len(re.findall(INTERVAL, r)) == 4 for r in table_rows)  # + the oracles
    # beside each mean: the within-layer-pair mean (the view's, each model by its page's method, averaged here in SQL)
    fns = {m: model_function(con, m, c)["K"] for m, c in (("wide", "final"), ("run", "step400"))}
    within = dict(((m, s_), v) for m, s_, v in con.execute(
        """SELECT metric, space, avg(spearman_unbiased_within_layer_pair) FROM composition_vs_function
           WHERE latest AND comp = 'K' AND ((model = 'wide' AND method = ?) OR (model = 'run' AND method = ?))
           GROUP BY ALL""", [fns["wide"].method, fns["run"].method]).fetchall())
    for r in table_rows:
        cells = re.findall(r"<td>(.*?)</td>", r)
        if cells[1] != "oracle":
            assert cells[5] == fmt(within[(cells[0], cells[1])]), (cells, within[(cells[0], cells[1])])
    # the samples behind the ranking, and what a blank rank means
    for m, f in fns.items():
        assert (f"{m} ({f.method}): {f.gate.n_edges:,} K edges, {f.n_significant:,} with attribution beyond zero (q ≤ FDR), "
                f"top of the function {f.gate.n_top:,} edges") in part
    assert "blank, beaten by the best" in part
    plain = (out / "model-plain.html").read_text(encoding="utf-8")
    assert "No edge attribution for this model" in section(plain)


def test_an_atlas_without_edge_attribution_draws_its_pages_as_before(report, tmp_path):
    """An older atlas (no edge_attribution, composition_vs_function, eap_vs_exact views): no
    function section, and every other part of each page the same."""
    db, out = report
    old = tmp_path / db.name
    shutil.copytree(db.parent, tmp_path, dirs_exist_ok=True)
    con = as_older_atlas(old)
    for v in ("eap_vs_exact", "composition_vs_function", "edge_attribution"):
        con.execute(f"DROP {'TABLE' if v == 'composition_vs_function' else 'VIEW'} {v}")  # the one materialised
    con.close()
    build_report(old, tmp_path / "old", png=False)

    def strip(text: str) -> str:  # the footer's time and the specs' generated names differ between builds
        text = re.sub(r"<h2 id='function'>.*?(?=<h2 |<footer>)", "", text, flags=re.S)
        text = text.replace(" <a href='#function'>function</a>", "")  # the section's link in the page's menu
        text = re.sub(r"<script type=\"application/json\".*?</script>", "", text, flags=re.S)
        text = re.sub(r'data-spec="spec\d+"', "", text)
        return text.split("<footer>")[0]

    for name in ("index.html", "model-run.html", "model-wide.html", "model-plain.html", "model-noise.html"):
        page = (tmp_path / "old" / name).read_text(encoding="utf-8")
        assert "id='function'" not in page and "against function" not in page
        new = (out / name).read_text(encoding="utf-8")
        assert strip(page) == strip(new), name
        assert [norm(s) for s in specs(page)] == [norm(s) for s in specs(new) if "function" not in title(s)], name


def same_comp_function(a: CompFunction, b: CompFunction) -> bool:
    """Every field of two CompFunctions equal, array for array (NaN where NaN)."""
    def parts(f: CompFunction) -> list:
        return [getattr(x, k) if x is not None else None for x, ks in
                ((f.agreement, ("auroc", "spearman", "auroc_boot", "spearman_boot")),
                 (f.noise, ("auroc", "spearman", "auroc_boot", "spearman_boot")),
                 (f.partial, ("partial", "added_r2", "controls_r2", "partial_boot"))) for k in ks]
    same = [(x is None and y is None) or (x is not None and y is not None and np.array_equal(x, y, equal_nan=True))
            for x, y in zip(parts(a), parts(b))]
    return all(same) and (a.comp, a.method, a.gate, a.cells, a.n_significant) == (b.comp, b.method, b.gate, b.cells,
                                                                                    b.n_significant)


def test_the_report_reads_the_bootstrap_the_atlas_stored(report, tmp_path, monkeypatch):
    """The report reads each comp's agreement back from the atlas (function_bootstrap, and
    function_agreement's gate) instead of bootstrapping it again: the same CompFunction, array for
    array, as comp_function computes from the edges, for every comp, method and checkpoint; and an
    atlas built before function_bootstrap, whose report bootstraps again, gets the same pages."""
    db, _ = report
    con = atlas_connect(db)
    compared = measurable = 0
    for model, checkpoint, method in con.execute("SELECT DISTINCT model, checkpoint, method FROM composition_vs_function"
                                                 " ORDER BY ALL").fetchall():
        for comp in "QKV":
            stored = stored_comp_function(con, model, checkpoint, method, comp)
            computed = comp_function(con, model, checkpoint, method, comp, 0.05)
            assert (stored is None) == (computed is None), (model, checkpoint, method, comp)
            if stored is not None and computed is not None:
                assert same_comp_function(stored, computed), (model, checkpoint, method, comp)
                compared += 1
                measurable += stored.noise is not None and stored.partial is not None
    assert compared and measurable  # the planted K edges carry the task (tests/synthetic_atlas.py)
    con.close()
    old = tmp_path / "older" / db.name
    shutil.copytree(db.parent, old.parent)
    con = as_older_atlas(old)
    con.execute("DROP TABLE function_bootstrap")
    con.close()
    # both builds show the same method per comp: 'run' V's two Spearmans equal but for their last bits tie (edge_methods)
    def no_bootstrap(*args: object) -> None:
        raise AssertionError("the report bootstrapped a comp the atlas had stored")

    with monkeypatch.context() as m:
        m.setattr(report_function, "comp_function", no_bootstrap)
        build_report(db, tmp_path / "stored", png=False)
    build_report(old, tmp_path / "again", png=False)
    pages = sorted((tmp_path / "stored").glob("*.html"))
    assert len(pages) == len(SUITE) + 1
    for page in pages:
        drawn, again = page.read_text(encoding="utf-8"), (tmp_path / "again" / page.name).read_text(encoding="utf-8")
        assert "Which metric x space agrees with function" in drawn or page.name != "index.html"
        # the footer's time and the specs' generated names differ between builds; the data, in no order (norm)
        assert strip_build(again) == strip_build(drawn), page.name
        assert [norm(s) for s in specs(again)] == [norm(s) for s in specs(drawn)], page.name


def strip_build(text: str) -> str:
    text = re.sub(r"<script type=\"application/json\".*?</script>", "", text, flags=re.S)
    return re.sub(r'data-spec="spec\d+"', "", text).split("<footer>")[0]


def norm(spec: dict) -> tuple[str, list[str]]:
    """A spec's title and its data rows, in no order (DuckDB returns some rows in any order, and the
    circuit view numbers its edges in that order)."""
    return title(spec), sorted(json.dumps({k: v for k, v in r.items() if k != "eid"}, sort_keys=True)
                        for d in spec.get("datasets", {}).values() for r in d)


def test_a_kv_group_is_one_edge_with_its_largest_score():
    """Grouped-query attention: a K edge into a KV group is one point, as composition_vs_function
    counts it; its composition the largest of the group's query heads, a circuit edge when the
    writer is a previous-token head and any query head of the group an induction head."""
    df = pl.DataFrame({"writer_layer": [0, 0, 0, 0], "writer_head": [1, 1, 0, 0], "reader_layer": [1, 1, 1, 1],
                       "reader_head": [0, 1, 0, 1], "reader_kv_head": [0, 0, 0, 0],
                       "attribution": [-2.0, -2.0, 0.1, 0.1], "attribution_stderr": 0.1, "score": [0.2, 0.5, 0.3, 0.1]})
    prev = pl.DataFrame({"layer": [0], "head": [1]})
    ind = pl.DataFrame({"layer": [1], "head": [1]})
    pts = edge_points(df, prev, ind, grouped=True).sort("edge")
    assert pts["edge"].to_list() == ["L0.H0 → L1.KV0", "L0.H1 → L1.KV0"]
    assert pts["score"].to_list() == [0.3, 0.5] and pts["fn"].to_list() == [0.1, 2.0]
    assert pts["kind"].to_list() == [OTHER, CIRCUIT]
    per_head = edge_points(df, prev, ind, grouped=False)
    assert per_head.height == 4 and per_head.filter(pl.col("kind") == CIRCUIT)["edge"].to_list() == ["L0.H1 → L1.H1"]


def test_each_comp_shows_the_method_exact_patching_supports():
    """Per comp, the method that agrees best with exact patching: its top edge first, then its
    Spearman; EAP on ties and without exact patching."""
    con = duckdb.connect()
    con.execute("CREATE TABLE composition_vs_function AS SELECT * FROM (VALUES ('m', 'c', 'eap', 0.5), ('m', 'c', 'eap_attn', 0.5),"
                " ('m', 'c', 'eap_ig', 0.5)) t(model, checkpoint, method, auroc)")
    assert q.edge_methods(con, "m", "c") == {"Q": "eap", "K": "eap", "V": "eap"}  # no exact patching: EAP
    rows = [("eap", "K", False, 0.9), ("eap_attn", "K", True, 0.5), ("eap_ig", "K", True, 0.4),
            ("eap", "Q", True, -0.8), ("eap_attn", "Q", True, 1.0), ("eap_ig", "Q", False, 1.0),
            ("eap", "V", False, 0.2), ("eap_attn", "V", False, 0.2), ("eap_ig", "V", False, None)]
    con.execute("CREATE TABLE eap_vs_exact (model VARCHAR, checkpoint VARCHAR, method VARCHAR, comp VARCHAR, "
                "top_edge_agrees BOOLEAN, spearman DOUBLE)")
    con.executemany("INSERT INTO eap_vs_exact VALUES ('m', 'c', ?, ?, ?, ?)", rows)
    # K: the top edge outranks a higher Spearman; Q: both agree, the higher Spearman; V: a tie, EAP
    assert q.edge_methods(con, "m", "c") == {"Q": "eap_attn", "K": "eap_attn", "V": "eap"}
    assert q.edge_methods(con, "other", "c") is None
    # Spearmans equal but for the last bits (DuckDB's summation order) tie: EAP's order, not the noise, decides
    con.execute("UPDATE eap_vs_exact SET spearman = 0.2 + 3e-16 WHERE method = 'eap_attn' AND comp = 'V'")
    assert con.execute("SELECT spearman > 0.2 FROM eap_vs_exact WHERE method = 'eap_attn' AND comp = 'V'").fetchone()[0]
    assert q.edge_methods(con, "m", "c")["V"] == "eap"
    con.execute("UPDATE eap_vs_exact SET spearman = 0.2 + 1e-9 WHERE method = 'eap_attn' AND comp = 'V'")
    assert q.edge_methods(con, "m", "c")["V"] == "eap_attn"  # a real difference still counts


def test_circuit_edge_rank_is_the_top_exact_edges_rank_among_its_readers_edges(report):
    """circuit_edge_rank: the K edge of largest |exact| at the model's last checkpoint, and at every
    checkpoint its rank by composition (largest first) among the K edges into its reader, computed
    here again from the composition and edge_attribution views."""
    db, _ = report
    con = atlas_connect(db)
    got = con.sql("SELECT * FROM circuit_edge_rank WHERE model = 'run'").pl()
    last = con.execute("SELECT checkpoint FROM checkpoints WHERE model = 'run' AND latest").fetchall()[0][0]
    e = con.sql("""SELECT writer_layer, writer_head, reader_layer, reader_kv_head, exact FROM edge_attribution
                   WHERE model = 'run' AND checkpoint = ? AND comp = 'K' AND exact IS NOT NULL""", params=[last]).pl()
    top = e.sort(pl.col("exact").abs(), descending=True).row(0, named=True)
    comp = con.sql("SELECT checkpoint, metric, space, writer_layer, writer_head, reader_layer, reader_head, score "
                   "FROM composition WHERE model = 'run' AND comp = 'K'").pl()
    group = con.execute("SELECT n_heads // coalesce(n_kv_heads, n_heads) FROM models WHERE model = 'run' LIMIT 1").fetchall()[0][0]
    units = (comp.with_columns(unit=pl.col("reader_head") // group)
             .group_by("checkpoint", "metric", "space", "writer_layer", "writer_head", "reader_layer", "unit")
             .agg(pl.col("score").max()))
    mine = units.filter((pl.col("reader_layer") == top["reader_layer"]) & (pl.col("unit") == top["reader_kv_head"]))
    checked = 0
    for (ck, metric, space), g in mine.group_by("checkpoint", "metric", "space"):
        edge = g.filter((pl.col("writer_layer") == top["writer_layer"]) & (pl.col("writer_head") == top["writer_head"]))
        want = 1 + int((g["score"] > edge["score"].item()).sum())
        row = got.filter((pl.col("checkpoint") == ck) & (pl.col("metric") == metric) & (pl.col("space") == space))
        assert row.height == 1 and row["rank"].item() == want and row["n_edges"].item() == g.height, (ck, metric, space)
        assert (row["writer_layer"].item(), row["writer_head"].item()) == (top["writer_layer"], top["writer_head"])
        assert row["exact_last"].item() == pytest.approx(top["exact"])
        checked += 1
    assert checked == got.height > 0


def test_the_bootstraps_on_threads_give_the_tables_of_one_comp_after_another(report):
    """agreement_tables with its bootstraps on several threads, and its model x checkpoint x method
    read from edge_attribution (composition_vs_function is being stored meanwhile): the rows, to the
    bit, of every comp of composition_vs_function bootstrapped one after another (comp_function),
    as the atlas stored them."""
    db, _ = report
    con = atlas_connect(db)
    agreement: list[dict] = []
    replicates: list[dict] = []
    for model, checkpoint, method in con.execute("SELECT DISTINCT model, checkpoint, method FROM composition_vs_function"
                                                 " ORDER BY ALL").fetchall():
        for comp in "QKV":
            if (f := comp_function(con, model, checkpoint, method, comp, 0.05)) is not None:
                agreement += comp_rows(model, checkpoint, f)
                replicates += bootstrap_rows(model, checkpoint, f)
    one_by_one = {"function_agreement": pl.DataFrame(agreement, schema=FUNCTION_AGREEMENT_SCHEMA),
                  "function_bootstrap": pl.DataFrame(replicates, schema=FUNCTION_BOOTSTRAP_SCHEMA)}
    assert one_by_one["function_bootstrap"].height >= 2 * len(SUITE)  # several comps measurable: several jobs at once
    for workers in (1, 3):
        tables = agreement_tables(con, 0.05, workers=workers)
        for name, frame in one_by_one.items():
            assert tables[name].equals(frame), (workers, name)
            stored = con.sql(f"SELECT * EXCLUDE (latest) FROM {name}").pl()
            assert stored.sort(stored.columns[:6]).equals(frame.sort(frame.columns[:6])), name
    con.close()

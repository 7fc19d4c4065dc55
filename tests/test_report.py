"""The report: an overview page and a page per model from a synthetic atlas with a planted
circuit (tests/synthetic_atlas.py), and from a bare atlas without calibration or behaviour."""

from __future__ import annotations

import json
import re
from pathlib import Path

import duckdb
import numpy as np
import polars as pl
import pytest
from synthetic_atlas import Spec, as_older_atlas, write_suite

from compatlas.atlas import connect as atlas_connect
from compatlas.report import build_report
from compatlas.report.heatmaps import heatmap_found, heatmap_rows, score_scale
from compatlas.report.page import fmt, page_specs, step
from compatlas.vocab import KERNEL_METRICS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SUITE = [Spec("toy-a", 4, 4), Spec("org/run", 3, 3, steps=[0, 1, 4, 16, 64, 100, 200]), Spec("solo", 1, 2)]


def assert_offline(text: str) -> None:
    assert "https://cdn" not in text
    assert not re.search(r"<script[^>]*\ssrc\s*=", text, flags=re.I), "external script found"
    assert not re.search(r"""(src|href)\s*=\s*["']https?:""", text), "link to the network found"


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> tuple[Path, Path, list[Path]]:
    root = tmp_path_factory.mktemp("suite")
    db = write_suite(root, SUITE)
    out = root / "report"
    return db, out, build_report(db, out, config={"metrics": ["frobenius"], "models": {"toy-a": {}}}, png=False)


def test_overview_and_a_page_per_model(suite):
    _, out, written = suite
    assert {p.name for p in written} == {"index.html", "model-toy-a.html", "model-org-run.html", "model-solo.html"}
    index = (out / "index.html").read_text(encoding="utf-8")
    for page in ("model-toy-a.html", "model-org-run.html", "model-solo.html"):
        assert f"href='{page}'" in index
        assert_offline((out / page).read_text(encoding="utf-8"))
    assert_offline(index)
    assert "vegaEmbed" in index
    # one row per model (not per checkpoint): the series is "7 (steps 0–200)"
    models = index.split("<h2 id='models'>")[1].split("</table>")[0]
    assert models.count("<a href='model-org-run.html'>") == 1 and "7 (steps 0–200)" in models
    # the planted circuit leads: toy-a's strongest K discovery is previous-token head L0.H1 into L2.H0 or L3.H0
    row = models.split("<a href='model-toy-a.html'>")[1].split("</tr>")[0]
    assert re.search(r"K \d+: L0\.H1 → L[23]\.H0", row), row
    assert "L0.H1 (0.90)" in row  # its previous-token head
    assert "Report drawn" in index and "frobenius" in index.split("<footer>")[1]


def test_model_page_sections(suite):
    _, out, _ = suite
    run = (out / "model-org-run.html").read_text(encoding="utf-8")
    for section in ("The circuit", "Every head pair", "Over training", "Induction behaviour", "Head scores and ablation",
                    "Audits", "the circuit forming over training"):
        assert section in run, section
    assert "Formation step <b>" in run
    toy = (out / "model-toy-a.html").read_text(encoding="utf-8")
    assert "Over training" not in toy  # one checkpoint: no trajectory
    solo = (out / "model-solo.html").read_text(encoding="utf-8")
    assert "one-layer model" in solo


def test_checkpoints_order_by_step_and_latest_is_one_where(suite):
    db, _, _ = suite
    con = atlas_connect(db)
    order = [r[0] for r in con.execute("SELECT checkpoint FROM checkpoints WHERE model = 'org/run' "
                                       "ORDER BY checkpoint_step").fetchall()]
    assert order == ["step0", "step1", "step4", "step16", "step64", "step100", "step200"]
    assert sorted(con.execute("SELECT model, checkpoint FROM checkpoints WHERE latest").fetchall()) == [
        ("org/run", "step200"), ("solo", "final"), ("toy-a", "final")]
    n_last = con.execute("SELECT count(*) FROM composition WHERE model = 'org/run' AND checkpoint = 'step200'").fetchone()
    assert con.execute("SELECT count(*) FROM composition_z WHERE model = 'org/run' AND latest").fetchone() == n_last
    assert con.execute("SELECT DISTINCT checkpoint_step FROM discoveries WHERE model = 'org/run' AND latest").fetchall() == [(200,)]


def test_the_small_run_shows_no_spearman(suite):
    _, out, _ = suite
    run = (out / "model-org-run.html").read_text(encoding="utf-8")
    table = run.split("Does composition find the induction heads?")[1].split("</table>")[0]
    cells = re.findall(r"<tr><td>frobenius</td><td>residual</td>(.*?)</tr>", table)[0]
    values = re.findall(r"<td>(.*?)</td>", cells)
    assert values[0] == "6" and values[5:8] == ["–", "–", "–"]  # 6 readers: the atlas gives no AUROC nor Spearman


def test_heatmap_rows_decode_to_the_pairs():
    """Each compact row decodes (reader = r0 + index) back to the pair's score, null, z, p and q;
    the q it decodes to is on the same side of the false discovery rate as the exact q, however
    close to it (0.0499986 was stored as -log10 q = 1.30, read back as 0.0501)."""
    rng = np.random.default_rng(0)
    rows = [(c, wl, wh, rl, rh) for c in "QK" for wl in range(3) for rl in range(wl + 1, 3) for wh in range(2) for rh in range(2)]
    df = pl.DataFrame(rows, schema=["comp", "writer_layer", "writer_head", "reader_layer", "reader_head"], orient="row")
    q = 10 ** -rng.uniform(0, 4, df.height)
    q[:6] = [0.0499986, 0.05, 0.0500014, 0.049, 0.0501, 0.04999999]
    df = df.with_columns(score=pl.Series(rng.uniform(0, 1, df.height)), baseline_spectrum_mean=0.2,
                         baseline_spectrum_std=0.05, p_value=pl.Series(10 ** -rng.uniform(0, 6, df.height)),
                         q_value=pl.Series(q), n_null=50)
    H = 2
    decoded = {}
    k = score_scale(df)
    assert k == 1e3  # scores in [0, 1): three digits
    for r in heatmap_rows(df, H, 0.05):
        for i, s in enumerate(r["s"]):
            if s is not None:
                decoded[(r["c"], r["w"], r["r0"] + i)] = (s / k, r["m"][i] / k, r["z"][i] / 10, 10 ** (-r["lp"][i] / 100),
                                                          10 ** (-r["lq"][i] / 100))
    assert len(decoded) == df.height
    for x in df.iter_rows(named=True):
        s, m, z, p, q = decoded[(x["comp"], x["writer_layer"] * H + x["writer_head"], x["reader_layer"] * H + x["reader_head"])]
        assert abs(s - x["score"]) <= 5e-4 and abs(m - 0.2) < 1e-9
        assert abs(z - (x["score"] - 0.2) / 0.05) <= 0.05
        assert abs(np.log10(p / x["p_value"])) <= 0.005 and abs(np.log10(q / x["q_value"])) <= 0.01
        assert (q <= 0.05) == (x["q_value"] <= 0.05), (x["q_value"], q)
    found = heatmap_found(df, H, 0.05)  # the discoveries, decided on the exact q
    assert sorted((f["c"], f["w"], f["r"], f["q"]) for f in found) == sorted(
        (x["comp"], x["writer_layer"] * H + x["writer_head"], x["reader_layer"] * H + x["reader_head"], x["q_value"])
        for x in df.iter_rows(named=True) if x["q_value"] <= 0.05)
    # a magnitude's scores (tens, in its own units) keep three significant digits, not five
    assert score_scale(df.with_columns(pl.col("score") * 100)) == 10


def test_numbers_for_reading():
    assert fmt(0.123456) == "0.123" and fmt(12.3456) == "12.3" and fmt(1234567) == "1,234,567"
    assert fmt(0.000123) == "1.23e-04" and fmt(None) == "–" and fmt(True) == "yes"
    assert step(349.6) == "350" and step(None) == "–"


def test_pngs_only_for_the_figures_on_the_pages(tmp_path):
    db = write_suite(tmp_path, [Spec("small", 2, 2)], metrics=("frobenius",), spaces=("residual",))
    written = build_report(db, tmp_path / "report")
    pngs = {p.name for p in written if p.suffix == ".png"}
    page = (tmp_path / "report" / "model-small.html").read_text(encoding="utf-8")
    linked = set(re.findall(r'<a href="([^"]+\.png)">PNG</a>', page))
    index = (tmp_path / "report" / "index.html").read_text(encoding="utf-8")
    linked |= set(re.findall(r'<a href="([^"]+\.png)">PNG</a>', index))
    assert pngs == linked and page.count('class="fig"') + index.count('class="fig"') == len(pngs)
    assert {"small__circuit.png", "small__heatmap.png", "small__head_scores.png"} <= pngs
    for p in pngs:
        assert (tmp_path / "report" / p).read_bytes()[:8] == PNG_MAGIC
    assert set(written) == set((tmp_path / "report").iterdir())


def test_bare_atlas_without_calibration_or_behaviour(tmp_path):
    """An atlas with only models and composition: the pages say what is missing and still draw."""
    con = duckdb.connect(str(tmp_path / "atlas.duckdb"))
    con.execute("""CREATE TABLE models AS SELECT 'bare' AS model, 'final' AS checkpoint, 'gpt2' AS architecture,
                   3 AS n_layers, 2 AS n_heads, 2 AS n_kv_heads, 32 AS d_model, 16 AS d_head, 100 AS d_vocab""")
    con.execute("""CREATE TABLE composition AS SELECT 'bare' AS model, 'final' AS checkpoint, 'none' AS processing,
                   'residual' AS space, 'frobenius' AS metric, c AS comp, wl AS writer_layer, wh AS writer_head,
                   rl AS reader_layer, rh AS reader_head, (0.2 + 0.01 * wh)::DOUBLE AS score, 0.1::DOUBLE AS baseline_gaussian_mean,
                   0.02::DOUBLE AS baseline_gaussian_std, 0.15::DOUBLE AS baseline_spectrum_mean, 0.03::DOUBLE AS baseline_spectrum_std
                   FROM (VALUES ('Q'), ('K'), ('V')) t(c), range(3) a(wl), range(3) b(rl), range(2) x(wh), range(2) y(rh)
                   WHERE wl < rl""")
    con.close()
    written = build_report(tmp_path / "atlas.duckdb", tmp_path / "report", png=False)
    page = (tmp_path / "report" / "model-bare.html").read_text(encoding="utf-8")
    assert "no calibration" in page and "No induction sweep" in page and "No invariance audit" in page
    assert len(written) == 2


def test_empty_atlas(tmp_path):
    duckdb.connect(str(tmp_path / "atlas.duckdb")).close()
    written = build_report(tmp_path / "atlas.duckdb", tmp_path / "report", png=False)
    assert [p.name for p in written] == ["index.html"]
    text = written[0].read_text(encoding="utf-8")
    assert "No results" in text
    assert_offline(text)


def test_induction_tokens_without_near_b_columns(tmp_path):
    """An atlas whose induction_tokens predates the nearby-B columns: the powers are drawn, the
    B vs nearby-B figure is replaced by a note naming the missing columns."""
    db = write_suite(tmp_path, [Spec("m", 2, 2)], metrics=("frobenius",), spaces=("residual",))
    con = as_older_atlas(db)
    shard = tmp_path / "induction_tokens" / "m__final.parquet"
    con.execute("CREATE OR REPLACE VIEW induction_tokens AS SELECT * EXCLUDE (near_b_mean, near_b_stderr) "
                f"FROM read_parquet('{shard}')")
    con.close()
    build_report(db, tmp_path / "report", png=False)
    page = (tmp_path / "report" / "model-m.html").read_text(encoding="utf-8")
    assert "A power and B power" in page and "is B's neighbourhood copied too?" not in page
    assert "induction_tokens lacks near_b_mean, near_b_stderr" in page


def test_a_model_too_small_to_calibrate_is_told_so():
    """With N null pairs the smallest p is 1/(N+1); when that is above the FDR, no pair can be a
    discovery whatever its score (the trained 2-layer, 2-head model: N = 8, p >= 0.111)."""
    from compatlas.report.model import _too_small

    small = pl.DataFrame({"pairs": [4, 4], "n_null": [8, 8]})
    assert "1/9 = 0.111" in _too_small(small, 0.05)
    assert _too_small(small, 0.2) == ""
    assert _too_small(pl.DataFrame({"pairs": [35235], "n_null": [37395]}), 0.05) == ""


def test_step_axis_is_logarithmic_only_for_log_spaced_checkpoints():
    """Pythia-like series (1, 2, 4, ... then linear) need a log axis to show their early steps;
    evenly spaced ones (the default training run: every 100 steps) would crowd into its right end."""
    from compatlas.report.training import log_axis, step_x

    assert log_axis(pl.Series([0, 1, 4, 16, 64, 100, 200, 800]))
    assert log_axis(pl.Series([0, 1000, 143000]))
    assert not log_axis(pl.Series([0, 100, 200, 300, 800]))
    assert not log_axis(pl.Series([0, 10, 20]))
    assert not log_axis(pl.Series([0]))
    assert step_x(800, True).to_dict()["scale"]["type"] == "symlog"
    assert "type" not in step_x(800, False).to_dict()["scale"]


def test_atlas_with_composition_but_no_calibration_shards(tmp_path):
    """An older atlas or a partial run: composition, behaviour and audits, but no calibration
    shard for any model. Every page draws and says the calibration is missing."""
    from compatlas.atlas import build_atlas

    write_suite(tmp_path, [Spec("deep", 6, 3), Spec("run", 2, 2, steps=[0, 100, 200])])
    shards = {v: sorted((tmp_path / v).glob("*.parquet")) for v in
              ("composition", "head_scores", "induction_tokens", "invariance", "metric_audit", "training_loss")}
    db = tmp_path / "partial" / "atlas.duckdb"
    build_atlas(db, shards, sorted((tmp_path / "meta").glob("*.json")))
    assert atlas_connect(db).sql("SELECT count(*) FROM composition_z WHERE p_value IS NOT NULL").fetchall() == [(0,)]
    written = build_report(db, tmp_path / "report", png=False)
    assert {p.name for p in written} == {"index.html", "model-deep.html", "model-run.html"}
    for page in ("model-deep.html", "model-run.html"):
        assert "no calibration" in (tmp_path / "report" / page).read_text(encoding="utf-8")


def test_gqa_rows_of_one_finding_are_one_row():
    """A key head's finding repeated for the three query heads that share it (identical score, p
    and q) is one row naming the three readers; a different finding stays its own row."""
    from compatlas.report.findings import findings, readers_cell

    row = dict(comp="K", writer_layer=16, writer_head=0, reader_layer=17, score=0.31, p_value=2.8e-5, q_value=0.048,
               baseline_spectrum_mean=0.1, z_spectrum=120.0, metric="subspace", space="token")
    edges = pl.DataFrame([row | {"reader_head": h} for h in (3, 4, 5)]
                         + [row | {"reader_head": 6, "score": 0.2, "p_value": 1e-4, "q_value": 0.049}])
    f = findings(edges, group=3)
    assert f.height == 2 and f["readers"].to_list() == [[3, 4, 5], [6]]
    assert readers_cell(17, [3, 4, 5]) == "L17.H3, H4, H5"
    assert findings(edges, group=1).height == 4  # without GQA each query head is its own finding


def test_the_null_floor_is_explained_with_its_numbers():
    """k tests beyond all N null pairs, m tests: chance puts m/(N+1) there, the q of those at the
    floor is about that over k; those the tail model puts further out get a p below the floor,
    and the note says so (it said no p could go below 1/(N+1), beside tables of p below it)."""
    from compatlas.report.findings import floor_note, why_none

    floor = pl.DataFrame({"comp": ["K"], "m": [35235], "n_null": [35235], "k": [20], "q_k": [0.0499], "k_tail": [0],
                          "p_min": [1 / 35236]})
    text = floor_note(floor, 0.05)
    assert "1/(N+1) = 1/35,236 = 2.84e-05" in text and "20 of the 35,235 tests" in text
    assert "m/(N+1) = 1.00" in text and "1.00/20 = 0.049999" in text and "largest q among the 20: 0.0499" in text
    assert "20 of them sit at the floor" in text and "tail model to give" not in text
    assert "the p of every pair below the null's largest score" in text and "generalised Pareto" in text
    tail = floor_note(floor.with_columns(k=pl.lit(6), k_tail=pl.lit(6), p_min=pl.lit(3.1e-9)), 0.05)
    assert "6 lie far enough beyond the null's largest score for its tail model to give a p below the floor " \
           "(down to 3.10e-09)" in tail and "sit at the floor" not in tail
    both = floor_note(floor.with_columns(k=pl.lit(7), k_tail=pl.lit(1)), 0.05)
    assert "6 of them sit at the floor" in both and "1 lies far enough" in both
    assert floor_note(floor.with_columns(k=pl.lit(0)), 0.05) == ""
    small = pl.DataFrame({"pairs": [4], "n_null": [4]})
    assert why_none(small, 0.05) == ("none possible: its null has 4 pairs, so the smallest p is 1/5 = 0.200, "
                                     "above the false discovery rate 0.05")
    assert why_none(pl.DataFrame({"pairs": [4], "n_null": [None]}), 0.05).startswith("not calibrated")
    assert why_none(pl.DataFrame({"pairs": [35235], "n_null": [35235]}), 0.05) is None


def test_the_floor_note_counts_what_the_atlas_holds(tmp_path):
    """On a page: the note's numbers per comp are the calibration's, the tests beyond every null
    pair split into those at the floor and those the tail model puts below it."""
    from compatlas.report import queries as q
    from compatlas.report.findings import floor_note, floor_summary

    db = write_suite(tmp_path, [Spec("m", 6, 3)], metrics=("frobenius",), spaces=("residual",))
    con = atlas_connect(db)
    floor = floor_summary(con, "m", "final", 1)
    cal = con.execute("""SELECT comp, count(*), max(n_null), count_if(p_value < 1.0 / (n_null + 1) * (1 - 1e-9)),
                                count_if(p_value <= 1.0 / (n_null + 1) * (1 + 1e-9)) FROM calibration
                         WHERE model = 'm' GROUP BY comp""").fetchall()
    got = {r["comp"]: (r["m"], r["n_null"], r["k_tail"], r["k"]) for r in floor.iter_rows(named=True)}
    assert got == {c: (m, n, t, k) for c, m, n, t, k in cal}
    text = floor_note(floor, q.fdr(con))
    k_tail = got["K"][2]
    assert k_tail and f"{k_tail} lie far enough beyond the null's largest score" in text  # the planted pairs, p = 1e-6


def test_circuit_edges_curve_around_the_heads_between():
    """Each edge starts at its writer and ends at its reader; halfway along it is half a head to
    the side of the straight line (a quadratic Bezier through a control point one head aside).
    The curve is drawn by Vega from the edge's one row (``CURVE_X``, ``CURVE_Y``), evaluated here."""
    from types import SimpleNamespace

    from compatlas.report.circuit import CURVE_POINTS, CURVE_X, CURVE_Y, edge_rows

    e = pl.DataFrame({"metric": ["frobenius"] * 2, "space": ["residual"] * 2, "writer_layer": [0, 2], "writer_head": [1, 3],
                      "reader_layer": [5, 6], "reader_head": [1, 0], "comp": ["V", "K"], "score": [0.5, 0.6],
                      "baseline_spectrum_mean": 0.1, "z_spectrum": 3.0, "n_null": 99, "p_value": 0.01, "q_value": 0.04})
    rows = edge_rows(e)
    assert rows.height == 2 and rows["combo"].to_list() == ["frobenius · residual"] * 2 and set(rows["kind"]) == {"discovery"}

    def at(r: dict, t: float) -> tuple[float, float]:
        d = SimpleNamespace(**r, t=t)
        return eval(CURVE_X, {"pow": pow, "datum": d}), eval(CURVE_Y, {"pow": pow, "datum": d})

    for r, (x0, y0, x1, y1) in zip(rows.iter_rows(named=True), [(1, 0, 1, 5), (3, 2, 0, 6)]):
        assert at(r, 0) == (x0, y0) and at(r, 1) == (x1, y1)
        mx, my = at(r, 0.5)
        assert abs(abs(mx - (x0 + x1) / 2) - 0.5) < 1e-12 and my == (y0 + y1) / 2
    assert CURVE_POINTS == 9


def test_pages_mark_discoveries_list_every_combo_and_explain_small_models(tmp_path):
    """The heatmap outlines its discoveries; the circuit has a panel per comp and a menu with every
    metric x space and its count (none left out for having no discoveries); a model whose null is
    too small for any discovery says so on the index instead of 'recall 0'; no diverging scale
    sets a domainMid (Vega warns when it lies outside the data)."""
    db = write_suite(tmp_path, [Spec("deep", 6, 3), Spec("tiny", 2, 2, steps=[0, 100, 200, 300, 400])])
    con = as_older_atlas(db)
    cal = sorted(str(p) for p in (tmp_path / "calibration").glob("*.parquet"))
    con.execute("CREATE OR REPLACE VIEW calibration AS SELECT * REPLACE ("
                "CASE WHEN model = 'tiny' THEN 4 ELSE n_null END AS n_null, "
                "CASE WHEN model = 'tiny' THEN greatest(p_value, 0.2) ELSE p_value END AS p_value, "
                "CASE WHEN model = 'tiny' THEN greatest(q_value, 0.2) ELSE q_value END AS q_value) "
                f"FROM read_parquet({cal!r})")
    con.close()
    build_report(db, tmp_path / "report", png=False)
    index = (tmp_path / "report" / "index.html").read_text(encoding="utf-8")
    tiny_row = index.split("<h2 id='finds'>")[1].split("<a href='model-tiny.html#behaviour'>tiny</a>")[1].split("</tr>")[0]
    assert "smallest p is 1/5 = 0.200" in tiny_row and "recall 0" not in tiny_row and "#training" in tiny_row
    across = [r for spec in page_specs(index).values() for d in spec.get("datasets", {}).values() for r in d]
    assert across and not [r for r in across if r.get("model") == "tiny"]  # nor a row of zeros in the figures across models
    tiny = (tmp_path / "report" / "model-tiny.html").read_text(encoding="utf-8")
    assert "Its recall of 0 is not the method missing the circuit" in tiny
    deep = (tmp_path / "report" / "model-deep.html").read_text(encoding="utf-8")
    def js(s: str) -> str:  # as the page's spec JSON spells a string (page.spec_json)
        return json.dumps(s)[1:-1].replace("<", "\\u003c")

    assert js("Cyan squares: the discoveries (q <= 0.05).") in deep
    # the squares read their own dataset, decided on the exact q: no filter of a rounded q
    (heat,) = [x for x in page_specs(deep).values() if "heatmap" in x.get("datasets", {})]
    assert "datum.q <=" not in json.dumps(heat) and heat["datasets"]["heatmap_found"]
    assert next(x for x in heat["layer"] if x.get("name") == "discoveries")["data"] == {"name": "heatmap_found"}
    for combo in ("frobenius · residual", "svd_bound · token", "subspace · token"):
        assert js(f"{combo} (") in deep, combo
    assert '"text":"K-composition"' in deep and '"text":"Q-composition"' in deep
    for page in (tmp_path / "report").glob("*.html"):
        # as a key of a spec's scale (the inlined Vega code names it too, as a case label)
        assert not re.search(r'[{,]"domainMid":-?[0-9]', page.read_text(encoding="utf-8")), page.name


def test_training_figure_legend_draws_the_dash_and_every_panel_names_its_axis(suite):
    _, out, _ = suite
    run = (out / "model-org-run.html").read_text(encoding="utf-8")
    # the dash drawn in the legend (as points it showed two identical dots; a stroke symbol without fill drew nothing)
    assert re.search(r'"strokeDash":\{"field":"space","legend":\{[^}]*"symbolFillColor":"#333"[^}]*"symbolType":"stroke"', run)
    assert run.count('"title":"training step"') >= 4  # loss, heads, strength, composition panels
    assert "tracks the formation</b> (" in run  # one line per comp, not a sentence


def test_the_page_opens_on_the_cell_with_most_circuit_edges():
    """The lead rule on hand-made counts (SmolLM2's, last checkpoint): frobenius x residual and
    svd_bound x residual both have 9 K discoveries from a previous-token head into an induction
    head; 9 of 20 beats 9 of 29. More such edges beat a larger share; where none has any, the
    metric audit's lead; a full tie goes to the audit's lead, then to the usual order."""
    from compatlas.report.circuit import lead_cell

    audit = ("subspace", "token")
    counts = pl.DataFrame({"metric": ["subspace", "frobenius", "svd_bound", "frobenius", "subspace"],
                           "space": ["token", "residual", "residual", "activation", "activation"],
                           "k": [0, 20, 29, 26, 0], "circuit": [0, 9, 9, 0, 0]})
    assert lead_cell(counts, audit) == ("frobenius", "residual")
    more = counts.with_columns(circuit=pl.when(pl.col("metric") == "svd_bound").then(10).otherwise(pl.col("circuit")))
    assert lead_cell(more, audit) == ("svd_bound", "residual")
    assert lead_cell(counts.with_columns(circuit=pl.lit(0)), audit) == audit  # SmolLM2's page opened here before
    assert lead_cell(counts.clear(), audit) == audit
    tie = pl.DataFrame({"metric": ["svd_bound", "subspace", "frobenius"], "space": ["token", "token", "token"],
                        "k": [4, 4, 4], "circuit": [2, 2, 2]})
    assert lead_cell(tie, audit) == audit
    assert lead_cell(tie.filter(pl.col("metric") != "subspace"), audit) == ("frobenius", "token")


def test_circuit_counts_count_a_shared_kv_test_once():
    """A K test of a key/value head is one test for its query heads (as the discoveries count
    it), so a circuit edge into three query heads of one key head is one of the cell's k."""
    from compatlas.report.circuit import circuit_counts

    summary = pl.DataFrame({"metric": ["frobenius"] * 2 + ["subspace"], "space": ["residual"] * 2 + ["token"],
                            "comp": ["K", "V", "K"], "discoveries": [5, 7, 3]})
    edges = pl.DataFrame({"metric": ["frobenius"] * 4, "space": ["residual"] * 4,
                          "test": ["(16, 0, 17, -2)"] * 3 + ["(16, 0, 18, 6)"]})
    got = {(r["metric"], r["space"]): (r["k"], r["circuit"]) for r in circuit_counts(edges, summary).iter_rows(named=True)}
    assert got == {("frobenius", "residual"): (5, 2), ("subspace", "token"): (3, 0)}


def test_the_k_circuit_in_a_line():
    from compatlas.report.overview import compact_circuit, runs

    assert runs([5, 3, 4, 7]) == "H3–5, H7" and runs([2]) == "H2"
    e = pl.DataFrame([(16, 0, 17, h) for h in (3, 4, 5)] + [(16, 0, 18, 6), (16, 0, 18, 7), (22, 1, 23, 2),
                                                            (22, 1, 23, 7), (19, 3, 20, 6)],
                     schema=["writer_layer", "writer_head", "reader_layer", "reader_head"], orient="row")
    assert compact_circuit(e) == "L16.H0 → L17.H3–5, L18.H6–7; L22.H1 → L23.H2, H7; L19.H3 → L20.H6"
    assert compact_circuit(e, writers_max=1) == "L16.H0 → L17.H3–5, L18.H6–7; +3 more"


def test_the_footer_names_a_trained_model_once():
    from compatlas.report.overview import footer

    text = footer({"models": {"smollm2-135m": {}, "induction-2l": {}}, "training": {"induction-2l": {}}}, [])
    assert "Config (models: smollm2-135m, induction-2l)" in text


def test_an_empty_panel_says_why():
    from compatlas.report.circuit import empty_panels
    from compatlas.report.queries import EDGE_MAX

    e = pl.DataFrame({"combo": ["frobenius · residual"] * 2, "comp": ["K", "K"]})
    found = {("frobenius · residual", "K"): 2, ("frobenius · residual", "V"): 400}
    got = {(r["combo"], r["comp"]): r["text"].replace("\n", " ") for r in
           empty_panels(e, ["frobenius · residual"], ["Q", "K", "V"], found, False).iter_rows(named=True)}
    assert got == {("frobenius · residual", "Q"): "no discoveries in Q for this metric · space",
                   ("frobenius · residual", "V"): f"400 discoveries in V, none among the {EDGE_MAX} drawn "
                                                  "(smallest q, all comps)"}
    cand = empty_panels(e.clear(), ["subspace · token"], ["V"], {}, True)
    assert cand["text"].to_list() == ["no pair drawn\nin V for this\nmetric · space"]


def test_long_captions_are_wrapped_to_the_figure_box():
    from compatlas.report.page import CHAR_EM, wrap

    line = "Rows: writer head; columns: reader head in a later layer. " * 8
    out = wrap([line.strip(), "short"], px=600, font_px=10)
    assert " ".join(out) == line.strip() + " short" and out[-1] == "short"
    assert all(len(x) * CHAR_EM * 10 <= 600 for x in out) and len(out) > 2


def test_a_circuit_in_another_cell_leads_every_part_of_the_page(tmp_path):
    """The planted K circuit only in frobenius x residual, more K discoveries (none the circuit)
    elsewhere: the page's menu, heatmap and the index name that cell and the circuit; a table per
    metric x space, only the lead's shown; with no discoveries, the smallest-p pairs per comp."""
    from compatlas.report import queries as q

    db = write_suite(tmp_path, [Spec("aside", 6, 3, circuit_in=("frobenius", "residual"))])
    build_report(db, tmp_path / "report", png=False)
    page = (tmp_path / "report" / "model-aside.html").read_text(encoding="utf-8")
    assert "The menu opens on <b>frobenius · residual</b>, by the rule" in page
    assert "Here 2 of its 2 K discoveries are such edges." in page
    assert json.dumps("aside @ final: frobenius, residual space") in page  # the heatmap's title
    tables = re.findall(r"<div data-combo='([^']*)'( hidden)?>", page)
    assert len(tables) == len(KERNEL_METRICS) * 2 and [c for c, hidden in tables if not hidden] == ["frobenius · residual"]
    shown = page.split("<div data-combo='frobenius · residual'>")[1].split("<div data-combo=")[0]
    assert "<td>L0.H1</td><td>L4.H0</td>" in shown and "<td>L0.H1</td><td>L5.H0</td>" in shown
    index = (tmp_path / "report" / "index.html").read_text(encoding="utf-8")
    row = index.split("<h2 id='models'>")[1].split("<a href='model-aside.html'>")[1].split("</tr>")[0]
    assert "<b>K circuit</b>: L0.H1 → L4.H0, L5.H0" in row and "(frobenius, residual space: the most K" in row

    con = atlas_connect(db)
    top = q.strongest(con, "aside", "final")
    per = top.group_by("metric", "space", "comp").len()
    assert per.height == len(KERNEL_METRICS) * 2 * 3 and (per["len"] == q.STRONGEST_PER_COMP).all()


def test_the_smallest_p_pairs_are_per_comp_and_per_test(tmp_path):
    """Without discoveries the circuit draws the STRONGEST_PER_COMP smallest-p tests per metric x
    space x comp; a key/value head's test (its query heads' rows share one p) counts once and
    comes with all its rows."""
    from compatlas.report import queries as q

    db = write_suite(tmp_path, [Spec("g", 3, 4)], metrics=("frobenius",), spaces=("residual",))
    con = as_older_atlas(db)
    cal = sorted(str(p) for p in (tmp_path / "calibration").glob("*.parquet"))
    # K and V tested per key/value head of 2 query heads, as in a grouped-query model: one p per test
    kv = "comp IN ('K', 'V')"
    con.execute(f"""CREATE OR REPLACE VIEW calibration AS SELECT * REPLACE (
                      CASE WHEN {kv} THEN 'kv_head' ELSE test_unit END AS test_unit,
                      CASE WHEN {kv} THEN reader_head // 2 ELSE reader_kv_head END AS reader_kv_head,
                      CASE WHEN {kv} THEN min(p_value) OVER (PARTITION BY comp, writer_layer, writer_head, reader_layer,
                                                             reader_head // 2) ELSE p_value END AS p_value)
                    FROM read_parquet({cal!r})""")
    con.close()
    top = q.strongest(atlas_connect(db), "g", "final")
    tests = top.with_columns(kv=pl.when(pl.col("test_unit") == "kv_head").then(pl.col("reader_head") // 2)
                             .otherwise(pl.col("reader_head")))
    per = tests.group_by("comp").agg(rows=pl.len(), tests=pl.struct("writer_layer", "writer_head", "reader_layer", "kv")
                                     .n_unique())
    got = {r["comp"]: (r["rows"], r["tests"]) for r in per.iter_rows(named=True)}
    n = q.STRONGEST_PER_COMP
    assert got == {"Q": (n, n), "K": (2 * n, n), "V": (2 * n, n)}


def _circuit_rows(page: str) -> list[dict]:
    """The circuit's edges (circuit.edge_rows) as the page carries them: one dataset, a row per curve."""
    (spec,) = [s for s in page_specs(page).values() if "the circuit its weights show" in json.dumps(s.get("title"))]
    return next(d for d in spec["datasets"].values() if d and "kind" in d[0])


def test_discoveries_just_below_the_fdr_are_drawn(tmp_path):
    """Every discovery at q = 0.0499986 (the SmolLM2 circuit's q, just under 0.05): the heatmap's
    squares are exactly the discoveries view's rows of its metric x space, per comp, and their
    cells' tooltips decode to a q at most 0.05; the circuit draws the view's rows of every metric x
    space. Stored as round(-log10 q * 100) = 130 they decoded to 0.0501, and a q <= 0.05 filter drew none."""
    db = write_suite(tmp_path, [Spec("near", 6, 3, n_kv_heads=3)], metrics=("frobenius", "subspace"), spaces=("residual",))
    con = as_older_atlas(db)
    cal = sorted(str(p) for p in (tmp_path / "calibration").glob("*.parquet"))
    con.execute("CREATE OR REPLACE VIEW calibration AS SELECT * REPLACE (CASE WHEN q_value <= 0.05 THEN 0.0499986 "
                f"ELSE q_value END AS q_value) FROM read_parquet({cal!r})")
    con.close()
    build_report(db, tmp_path / "report", png=False)
    page = (tmp_path / "report" / "model-near.html").read_text(encoding="utf-8")
    con = atlas_connect(db)
    view = con.execute("""SELECT metric, space, comp, writer_layer, writer_head, reader_layer, reader_head FROM discoveries
                          WHERE model = 'near' AND latest""").fetchall()
    assert len(view) >= 4 and con.execute("SELECT max(q_value) FROM discoveries").fetchone()[0] == 0.0499986
    (heat,) = [s for s in page_specs(page).values() if "heatmap" in s.get("datasets", {})]
    metric, space = re.search(r": (\w+), (\w+) space", heat["title"]["text"]).groups()
    H = 3
    drawn = {(f["c"], f["w"], f["r"]) for f in heat["datasets"]["heatmap_found"]}
    assert drawn == {(c, wl * H + wh, rl * H + rh) for m, s, c, wl, wh, rl, rh in view if (m, s) == (metric, space)}
    assert {f["q"] for f in heat["datasets"]["heatmap_found"]} == {0.0499986}
    for row in heat["datasets"]["heatmap"]:  # the tooltip's q of those cells: on the discoveries' side of 0.05
        for i, lq in enumerate(row["lq"]):
            if (row["c"], row["w"], row["r0"] + i) in drawn:
                assert 10 ** (-lq / 100) <= 0.05
    curves = {(r["combo"], r["comp"], r["wl"], r["wh"], r["rl"], r["rh"]) for r in _circuit_rows(page) if r["kind"] == "discovery"}
    assert curves == {(f"{m} · {s}", c, wl, wh, rl, rh) for m, s, c, wl, wh, rl, rh in view}


def test_the_index_counts_every_discovery_and_what_chance_allows(tmp_path):
    """A random model's one (false) discovery in a cell other than its lead is counted on the
    index as the discoveries view holds it, with how many false ones the rate allows; a model
    with discoveries gets how many of them are expected false."""
    db = write_suite(tmp_path, [Spec("rnd", 4, 4, planted=False, stray=("frobenius", "token", "Q")), Spec("real", 6, 3)],
                     metrics=("frobenius", "subspace"), spaces=("residual", "token"))
    build_report(db, tmp_path / "report", png=False)
    index = (tmp_path / "report" / "index.html").read_text(encoding="utf-8")
    models = index.split("<h2 id='models'>")[1].split("</table>")[0]
    rnd = models.split("<a href='model-rnd.html'>")[1].split("</tr>")[0]
    real = models.split("<a href='model-real.html'>")[1].split("</tr>")[0]
    con = atlas_connect(db)

    def found(model: str) -> dict[str, int]:
        return dict(con.execute("""SELECT comp, count(*) FROM discoveries WHERE model = ? AND latest
                                   AND reader_head = test_reader_heads[1] GROUP BY comp""", [model]).fetchall())

    assert found("rnd") == {"Q": 1}
    assert "In all 4 metric · spaces: Q 1 (frobenius · token), K 0, V 0." in rnd
    assert ("Random init: no pair composes, so this one is a false discovery; at q &lt;= 0.05 each of its 12 families "
            "(metric · space · comp) holds one with a chance of at most 0.05, so at most about 12 x 0.05 = 0.600 of them "
            "are expected to hold one by chance.") in rnd
    n = found("real")
    assert f"In all 4 metric · spaces: Q {n.get('Q', 0)}" in real and f"K {n['K']} (in " in real
    total = sum(n.values())
    assert f"about 0.05 x {total} = {fmt(0.05 * total)} of these {total} discoveries are expected to be false" in real


def test_a_magnitude_shows_its_largest_scores_not_empty_panels(tmp_path):
    """contribution (a magnitude, no discoveries: its heavy-tailed null) draws its 10 largest
    tests per comp, said so in the menu and the tables, and the index gives its top-n recall,
    not a recall of 0 for having no discoveries."""
    from compatlas.report.queries import STRONGEST_PER_COMP

    db = write_suite(tmp_path, [Spec("mag", 6, 3)], metrics=("frobenius", "contribution"), spaces=("residual",))
    build_report(db, tmp_path / "report", png=False)
    page = (tmp_path / "report" / "model-mag.html").read_text(encoding="utf-8")
    con = atlas_connect(db)
    assert con.execute("SELECT count(*) FROM discoveries WHERE metric = 'contribution'").fetchone() == (0,)
    rows = [r for r in _circuit_rows(page) if r["combo"] == "contribution · residual"]
    assert {r["kind"] for r in rows} == {"largest score (a magnitude)"}
    top = con.execute("""SELECT comp, writer_layer, writer_head, reader_layer, reader_head FROM composition
                         WHERE model = 'mag' AND metric = 'contribution'
                         QUALIFY row_number() OVER (PARTITION BY comp ORDER BY score DESC, writer_layer, writer_head,
                                                    reader_layer, reader_head) <= ?""", [STRONGEST_PER_COMP]).fetchall()
    assert {(r["comp"], r["wl"], r["wh"], r["rl"], r["rh"]) for r in rows} == set(top)
    assert json.dumps("contribution · residual (a magnitude: its largest scores, not discoveries; 0 discoveries)")[1:-1] in page
    assert "<b>contribution is a magnitude: its largest scores, not discoveries</b>" in page
    assert "Largest scores: contribution, residual space" in page
    index = (tmp_path / "report" / "index.html").read_text(encoding="utf-8")
    finds = index.split("<h2 id='finds'>")[1].split("</table>")[0]
    row = finds.split("contribution · residual")[1].split("</tr>")[0]
    assert "top-2 recall 1.00" in row and "recall 0" not in row  # the two planted induction heads lead its scores


def test_legends_are_drawn_from_the_picked_cells_own_scores(tmp_path):
    """The circuit's width legend takes its domain from the picked metric x space's own edges (a
    magnitude's scores, in tens, set the legend of 0.3-0.9 scores to 20-140), with labels of as
    many digits as they need; a 2-layer model's heatmap labels each head and parts its cells."""
    db = write_suite(tmp_path, [Spec("two", 2, 2), Spec("six", 6, 3)], metrics=("frobenius", "contribution"),
                     spaces=("residual",))
    build_report(db, tmp_path / "report", png=False)
    page = (tmp_path / "report" / "model-six.html").read_text(encoding="utf-8")
    (spec,) = [s for s in page_specs(page).values() if "the circuit its weights show" in json.dumps(s.get("title"))]
    rows = _circuit_rows(page)
    widths = [lay["encoding"]["strokeWidth"] for panel in spec["hconcat"] for lay in panel["layer"]
              if "strokeWidth" in lay.get("encoding", {})]
    assert len(widths) == 3
    expr = widths[0]["scale"]["domain"]["expr"]
    ranges = json.loads(re.search(r"\? (\{.*?\})\[combo\]", expr).group(1))
    for combo in ("frobenius · residual", "contribution · residual"):
        scores = [r["score"] for r in rows if r["combo"] == combo]
        assert ranges[combo] == [min(scores), max(scores)]
    assert ranges["contribution · residual"][0] > 10 > 1 > ranges["frobenius · residual"][1]
    assert widths[0]["legend"]["labelExpr"] == "format(datum.value, '.6~g')"
    two = (tmp_path / "report" / "model-two.html").read_text(encoding="utf-8")
    (heat,) = [s for s in page_specs(two).values() if "heatmap" in s.get("datasets", {})]
    rect = heat["layer"][0]
    assert rect["mark"]["strokeWidth"] == 1 and "'.H'" in rect["encoding"]["x"]["axis"]["labelExpr"]
    assert rect["encoding"]["x"]["axis"]["values"] == [2.5, 3.5] and rect["encoding"]["y"]["axis"]["values"] == [0.5, 1.5]


def test_curves_over_training_come_in_one_order_whatever_duckdb_returns():
    """pair_curves and head_scores_over_training sort on every key, not on step alone: rows that
    tie on step, here stored in reverse, come out in the same order every build (the training
    chart's data had differed between two builds of one atlas)."""
    from compatlas.report import queries as q

    con = duckdb.connect()
    cells = [(c, m, s, comp) for c in ("step100", "step0") for m in ("svd_bound", "frobenius")
             for s in ("token", "residual") for comp in ("V", "Q")]
    con.execute("CREATE TABLE composition (model VARCHAR, checkpoint VARCHAR, metric VARCHAR, space VARCHAR, comp VARCHAR, "
                "writer_layer INT, writer_head INT, reader_layer INT, reader_head INT, score DOUBLE)")
    con.executemany("INSERT INTO composition VALUES ('m', ?, ?, ?, ?, 0, 1, 1, 0, ?)",
                    [[*cell, float(i)] for i, cell in enumerate(cells)])
    con.execute("CREATE TABLE head_scores (model VARCHAR, checkpoint VARCHAR, layer INT, head INT, induction_mean DOUBLE)")
    con.executemany("INSERT INTO head_scores VALUES ('m', ?, ?, ?, 0.5)",
                    [[c, layer, head] for c in ("step100", "step0") for layer in (1, 0) for head in (1, 0)])
    steps = pl.DataFrame({"checkpoint": ["step0", "step100"], "checkpoint_step": [0, 100]})
    curves = q.pair_curves(con, "m", ((1, 0), (0, 1)), steps)
    assert curves.height == len(cells)
    assert curves.select("step", "metric", "space", "comp").rows() == sorted(curves.select("step", "metric", "space", "comp").rows())
    heads = q.head_scores_over_training(con, "m", steps)
    assert heads.select("step", "layer", "head").rows() == sorted(heads.select("step", "layer", "head").rows())


def test_png_workers_draw_without_importing_the_report(tmp_path):
    """A PNG worker runs png.py by its path: it draws with vl-convert and imports neither the report
    package nor altair, DuckDB or scipy (1.2 s of CPU per worker, beside the pages on a 2-core machine)."""
    import subprocess
    import sys

    from compatlas.report import png

    spec = json.dumps({"mark": "point", "data": {"values": [{"a": 1}, {"a": 2}]},
                       "encoding": {"x": {"field": "a", "type": "quantitative"}}})
    pool = png.PngPool(1)
    try:
        pool.submit(spec, tmp_path / "a.png")
        pool.wait()
    finally:
        pool.close()
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    code = ("import runpy, sys; from pathlib import Path; runpy.run_path(sys.argv[1])['render_png'](sys.argv[2], Path(sys.argv[3])); "
            "print([m for m in ('compatlas.report', 'altair', 'duckdb', 'scipy') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code, png.__file__, spec, str(tmp_path / "b.png")], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"
    assert (tmp_path / "b.png").read_bytes() == (tmp_path / "a.png").read_bytes()

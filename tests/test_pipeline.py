"""The Snakemake workflow end to end on a tiny config: shards, DuckDB views, incremental
reruns, bad input. Runs real Snakemake subprocesses (about a minute on 2 cores)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import yaml
from conftest import machine_slowdown, tiny_config

from compatlas.atlas import connect
from compatlas.storage import read_provenance

REPO = Path(__file__).resolve().parent.parent
SNAKEMAKE = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--cores", "2", "--nolock"]


def run_snakemake(workdir: Path, config: dict, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    cfg = workdir / "config.yaml"
    cfg.write_text(yaml.safe_dump(config))
    proc = subprocess.run([*SNAKEMAKE, "--directory", str(workdir), "--configfile", str(cfg), *extra],
                          capture_output=True, text=True, timeout=900 * machine_slowdown())
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("pipeline")
    run_snakemake(work, tiny_config())
    return work


def expected_rows(n_layers: int, n_heads: int) -> int:
    """Per metric x comp: every writer layer < reader layer, every head pair."""
    return n_layers * (n_layers - 1) // 2 * n_heads**2


def test_views_hold_every_score(pipeline_run: Path):
    con = connect(pipeline_run / "results" / "atlas.duckdb")
    rows = dict(con.execute("SELECT model, count(*) FROM composition GROUP BY model").fetchall())
    # tiny-gpt2: 3 layers x 2 heads; tiny-llama: 3 layers x 4 heads; 3 metrics x 3 comps x 2 spaces;
    # tiny-trained: 2 layers x 2 heads, 3 checkpoints, residual space only
    assert rows == {"tiny-gpt2": 18 * expected_rows(3, 2), "tiny-llama": 18 * expected_rows(3, 4),
                    "tiny-trained": 3 * 9 * expected_rows(2, 2)}
    assert con.execute("SELECT count(*) FROM composition WHERE writer_layer >= reader_layer").fetchone()[0] == 0
    assert con.execute("SELECT min(score) >= 0 AND max(score) <= 1 + 1e-9 FROM composition").fetchone()[0]
    assert con.execute("SELECT count(*) FROM composition WHERE baseline_spectrum_std IS NULL "
                       "OR baseline_gaussian_mean IS NULL").fetchone()[0] == 0
    models = con.execute("SELECT model, n_layers, n_heads, n_kv_heads, processing, norm_type FROM models "
                         "WHERE checkpoint = 'final' ORDER BY model").fetchall()
    assert models == [("tiny-gpt2", 3, 2, 2, "compat", "LN"), ("tiny-llama", 3, 4, 2, "none", "RMS")]
    # a contract query (strongest K-compositions above their baseline) answered by the views equals
    # the same question put to the shards themselves, read with polars (not DuckDB)
    top = con.execute("""SELECT writer_layer, writer_head, reader_layer, reader_head, score - baseline_spectrum_mean AS adj
                         FROM composition WHERE model = 'tiny-llama' AND metric = 'frobenius' AND comp = 'K'
                         ORDER BY adj DESC LIMIT 10""").fetchall()
    shards = shard_frame(pipeline_run / "results" / "composition")
    want = (shards.filter((pl.col("model") == "tiny-llama") & (pl.col("metric") == "frobenius") & (pl.col("comp") == "K"))
            .with_columns(adj=pl.col("score") - pl.col("baseline_spectrum_mean")).sort("adj", descending=True).head(10)
            .select("writer_layer", "writer_head", "reader_layer", "reader_head", "adj"))
    assert [r[:4] for r in top] == [r[:4] for r in want.rows()]
    assert [r[4] for r in top] == pytest.approx(want["adj"].to_list(), abs=1e-12)


def shard_frame(folder: Path) -> pl.DataFrame:
    """Every Parquet shard under ``folder``, read with polars: the answer the views must give."""
    return pl.concat([pl.read_parquet(p) for p in sorted(folder.rglob("*.parquet"))], how="diagonal_relaxed")


def test_calibration_views(pipeline_run: Path):
    """Every causal pair has a p and q; the null holds exactly the non-causal pairs of distinct heads."""
    con = connect(pipeline_run / "results" / "atlas.duckdb")
    n_causal = con.execute("SELECT count(*) FROM composition").fetchone()[0]
    assert con.execute("SELECT count(*) FROM composition_z WHERE p_value IS NOT NULL AND q_value >= p_value").fetchone()[0] == n_causal
    assert con.execute("SELECT count(*) FROM composition_null WHERE writer_layer < reader_layer "
                       "OR (writer_layer = reader_layer AND writer_head = reader_head)").fetchone()[0] == 0
    # per model x metric x space x comp: null = anti-causal mirror (as many as causal) + same-layer pairs of distinct heads
    for model, n_layers, n_heads, n_kv in con.execute("SELECT model, n_layers, n_heads, n_kv_heads FROM models").fetchall():
        per_cell = con.execute("SELECT count(*) FROM composition_null WHERE model = ? GROUP BY checkpoint, metric, space, comp",
                               [model]).fetchall()
        causal = expected_rows(n_layers, n_heads)
        assert {c for (c,) in per_cell} == {causal + n_layers * n_heads * (n_heads - 1)}, model
        # the default null (composition.null_pairs: mirror) is the anti-causal mirror alone, each
        # test once: a KV head's test (grouped-query subspace K and V) once per KV head
        n_null = con.execute("SELECT DISTINCT test_unit, n_null FROM calibration WHERE model = ?", [model]).fetchall()
        kv = [("kv_head", causal * n_kv // n_heads)] if n_kv < n_heads else []
        assert sorted(n_null) == sorted([("query_head", causal)] + kv), model
    # discoveries are exactly the calibration shards' rows with q <= 0.05, with their shards' scores
    keys = ["model", "checkpoint", "metric", "space", "comp", "writer_layer", "writer_head", "reader_layer", "reader_head"]
    cal = shard_frame(pipeline_run / "results" / "calibration").filter(pl.col("q_value") <= 0.05)
    want = cal.join(shard_frame(pipeline_run / "results" / "composition"), on=keys, how="inner")
    got = con.sql(f"SELECT {', '.join(keys)}, score, p_value, q_value FROM discoveries").pl()
    assert sorted(got.select(keys).rows()) == sorted(want.select(keys).rows())
    joined = got.join(want.select(*keys, pl.col("score").alias("s"), pl.col("q_value").alias("q")), on=keys)
    assert joined.height == got.height and (joined["score"] == joined["s"]).all() and (joined["q_value"] == joined["q"]).all()


def test_audit_views(pipeline_run: Path):
    con = connect(pipeline_run / "results" / "atlas.duckdb")
    inv = con.execute("""SELECT space, transform, min(spearman), max(max_abs_change) FROM invariance
                         WHERE metric = 'frobenius' GROUP BY ALL""").fetchall()
    by = {(s, t): (rho, change) for s, t, rho, change in inv}
    assert len(by) == 2 * 5  # spaces x transform classes
    for t in ("permutation", "orthogonal", "orthogonal_scale", "diagonal", "gl"):
        assert by[("token", t)][1] < 1e-8  # token space survives every class
    assert by[("residual", "orthogonal")][1] < 1e-8
    assert by[("residual", "diagonal")][1] > 1e-3 and by[("residual", "gl")][1] > 1e-3
    # 3 metrics x 2 spaces x 4 axioms; the headline: frobenius fails Axiom 1 (identity -> d^-1/2)
    cells = con.execute("SELECT metric, space, axiom, bool_and(passed) FROM metric_audit GROUP BY ALL").fetchall()
    assert len(cells) == 3 * 2 * 4
    verdict = {(m, s, a): p for m, s, a, p in cells}
    assert not verdict[("frobenius", "residual", "axiom1_full")]
    assert verdict[("subspace", "token", "axiom4_invariant")] and not verdict[("subspace", "residual", "axiom4_invariant")]
    assert con.execute("SELECT token_condition > 1 FROM models WHERE model = 'tiny-gpt2'").fetchone()[0]


def test_behaviour_views(pipeline_run: Path):
    con = connect(pipeline_run / "results" / "atlas.duckdb")
    heads = dict(con.execute("SELECT model, count(*) FROM head_scores GROUP BY model").fetchall())
    assert heads == {"tiny-gpt2": 3 * 2, "tiny-llama": 3 * 4, "tiny-trained": 3 * 2 * 2}  # every head, every checkpoint
    assert con.execute("SELECT count(*) FROM head_scores WHERE ablation_drop IS NULL OR induction_mean IS NULL").fetchone()[0] == 0
    # 6 tokens x 2 roles per model (tests/data/tiny.yaml); random models: no induction
    toks = con.execute("SELECT model, count(*), max(abs(mean)) FROM induction_tokens WHERE checkpoint = 'final' GROUP BY model").fetchall()
    assert {m: n for m, n, _ in toks} == {"tiny-gpt2": 12, "tiny-llama": 12} and all(x < 0.5 for _, _, x in toks)
    assert con.execute("SELECT count(*) FROM induction_summary").fetchone()[0] == (2 + 3) * 2
    assert con.execute("SELECT count(DISTINCT token_text) > 1 FROM induction_tokens").fetchone()[0]
    # one row per model x checkpoint x metric x space x comp
    assert con.execute("SELECT count(*) FROM composition_vs_behaviour").fetchone()[0] == 2 * 3 * 2 * 3 + 3 * 3 * 1 * 3


def test_edge_attribution_views(pipeline_run: Path):
    """Every causal edge per comp in edge_attribution; composition_vs_function's numbers for one
    grouped-query cell recomputed here from the two views it reads (scipy's Spearman and
    Mann-Whitney U, average precision by hand)."""
    import numpy as np
    from scipy.stats import mannwhitneyu, spearmanr

    con = connect(pipeline_run / "results" / "atlas.duckdb")
    rows = dict(con.execute("SELECT model, count(*) FROM edge_attribution WHERE method = 'eap' GROUP BY model").fetchall())
    assert rows == {"tiny-gpt2": 3 * 12, "tiny-llama": 3 * 48, "tiny-trained": 3 * 3 * 4}  # comps x causal pairs (x ckpts)
    assert con.execute("SELECT count(*) FROM edge_attribution WHERE score IS NULL OR score_stderr IS NULL").fetchone()[0] == 0
    # a 2 x 2-head model is patched exactly on every edge; one K/V score per KV head
    assert con.execute("SELECT count(*) FROM edge_attribution WHERE model = 'tiny-trained' AND exact IS NULL").fetchone()[0] == 0
    assert con.execute("""SELECT max(n) FROM (SELECT count(DISTINCT score) AS n FROM edge_attribution
                          WHERE model = 'tiny-llama' AND comp <> 'Q' GROUP BY method, comp, writer_layer, writer_head,
                          reader_layer, reader_kv_head)""").fetchone()[0] == 1
    assert con.execute("SELECT DISTINCT method FROM edge_attribution ORDER BY 1").fetchall() == [("eap",), ("eap_attn",), ("eap_ig",)]
    # tiny-llama's sequences ran as two attribution jobs (induction.edge_attribution.jobs), merged
    edges = pipeline_run / "results" / "edge_attribution" / "model=tiny-llama" / "checkpoint=final" / "edges.parquet"
    shares = sorted((pipeline_run / "results" / "edge_sums" / "model=tiny-llama" / "checkpoint=final").glob("*.parquet"))
    assert read_provenance(edges)["attribution_jobs"] == 2 and [p.name for p in shares] == ["share=0.parquet", "share=1.parquet"]
    assert [read_provenance(p)["sequences_to"] for p in shares] == [256, 512]
    assert not (pipeline_run / "results" / "edge_sums" / "model=tiny-gpt2").exists()  # one job: no shares
    # ... and its exact patching as two jobs over the exact sequences, stacked by a merge that booted no model
    exact = sorted((pipeline_run / "results" / "exact_values" / "model=tiny-llama" / "checkpoint=final").glob("*.parquet"))
    assert [(read_provenance(p)["sequences_from"], read_provenance(p)["sequences_to"]) for p in exact] == [(0, 16), (16, 32)]
    assert read_provenance(edges)["exact_jobs"] == 2 and read_provenance(edges)["kv_group"] == 2
    assert con.execute("SELECT count(*) FROM eap_vs_exact WHERE method = 'eap'").fetchone()[0] == (2 + 3) * 3
    assert con.execute("SELECT count(*) FROM composition_vs_function WHERE method = 'eap' AND space NOT IN ('oracle', 'prior')"
                       ).fetchone()[0] == 2 * 3 * 2 * 3 + 3 * 3 * 1 * 3
    # three reference rows (scale and depth oracles, the distance prior) per model x checkpoint x comp, and it is a table
    assert con.execute("""SELECT metric, count(*) FROM composition_vs_function WHERE method = 'eap' AND space IN ('oracle', 'prior')
                          GROUP BY 1 ORDER BY 1""").fetchall() == [("oracle_depth", 5 * 3), ("oracle_scale", 5 * 3),
                                                                   ("prior_distance", 5 * 3)]
    assert con.execute("SELECT table_type FROM information_schema.tables WHERE table_name = 'composition_vs_function'"
                       ).fetchone()[0] == "BASE TABLE"
    edges = con.execute("""SELECT writer_layer, writer_head, reader_layer, reader_kv_head, any_value(abs(score))
                           FROM edge_attribution WHERE model = 'tiny-llama' AND comp = 'K' AND method = 'eap' GROUP BY ALL
                           ORDER BY 1, 2, 3, 4""").fetchall()
    comp: dict[tuple, float] = {}  # a KV head's edge: the largest score of its group's query heads
    for w, h, r, q, s in con.execute("""SELECT writer_layer, writer_head, reader_layer, reader_head, score FROM composition_z
                                        WHERE model = 'tiny-llama' AND comp = 'K' AND metric = 'frobenius'
                                        AND space = 'residual'""").fetchall():
        comp[(w, h, r, q // 2)] = max(comp.get((w, h, r, q // 2), -np.inf), s)
    fn = np.array([e[4] for e in edges])
    score = np.array([comp[e[:4]] for e in edges])
    order = np.argsort(-fn, kind="stable")
    before = np.concatenate([[0.0], np.cumsum(fn[order])[:-1]])
    top = np.zeros(len(fn), bool)
    top[order[before < 0.5 * fn.sum()]] = True
    by_score = np.argsort(-score, kind="stable")
    hits = np.cumsum(top[by_score])
    ap = np.mean([hits[k] / (k + 1) for k in range(len(fn)) if top[by_score][k]])
    got = con.execute("""SELECT n_edges, n_top, spearman, auroc, average_precision FROM composition_vs_function
                         WHERE model = 'tiny-llama' AND comp = 'K' AND metric = 'frobenius' AND space = 'residual'
                         AND method = 'eap'""").fetchone()
    assert got[:2] == (len(edges), top.sum()) and len(edges) == 3 * 4 * 2  # writer x reader KV head
    u = mannwhitneyu(score[top], score[~top]).statistic / (top.sum() * (~top).sum())
    assert got[2:] == pytest.approx((spearmanr(score, fn).statistic, u, ap), rel=1e-9)
    _check_noise_aware(con, score, comp)


def _check_noise_aware(con, score, comp: dict) -> None:
    """The noise-aware columns of one cell (tiny-llama, K, frobenius x residual, EAP) and of its
    oracle rows, recomputed from edge_attribution's split halves, standard errors and q-values."""
    import numpy as np
    from scipy.stats import spearmanr

    rows = con.execute("""SELECT writer_layer, writer_head, reader_layer, reader_kv_head, any_value(score),
                              any_value(score_stderr), any_value(score_half_a), any_value(score_half_b),
                              any_value(q_value)
                          FROM edge_attribution WHERE model = 'tiny-llama' AND comp = 'K' AND method = 'eap' GROUP BY ALL
                          ORDER BY 1, 2, 3, 4""").fetchall()
    mean, se, a, b, q = (np.array([r[k] for r in rows], dtype=float) for k in range(4, 9))
    assert np.allclose(mean, (a + b) / 2)  # an even number of sequences: the two halves average to the mean
    want = {"spearman_unbiased": spearmanr(score, a * b).statistic, "spearman_t": spearmanr(score, np.abs(mean) / se).statistic,
            "noise_ceiling": spearmanr(np.abs(a), np.abs(b)).statistic, "n_significant": int((q <= 0.05).sum())}
    got = con.execute(f"""SELECT {', '.join(want)} FROM composition_vs_function WHERE model = 'tiny-llama' AND comp = 'K'
                          AND metric = 'frobenius' AND space = 'residual' AND method = 'eap'""").fetchone()
    assert got == pytest.approx(tuple(want.values()), rel=1e-9)
    depth = np.array([np.mean([abs(m) for r2, m in zip(rows, mean) if (r2[0], r2[2]) == (r[0], r[2])]) for r in rows])
    oracle = dict(con.execute("""SELECT metric, spearman FROM composition_vs_function WHERE model = 'tiny-llama'
                                 AND comp = 'K' AND space = 'oracle' AND method = 'eap'""").fetchall())
    assert oracle == pytest.approx({"oracle_scale": spearmanr(se, np.abs(mean)).statistic,
                                    "oracle_depth": spearmanr(depth, np.abs(mean)).statistic}, rel=1e-9)


def test_training_run_is_a_checkpoint_series(pipeline_run: Path):
    con = connect(pipeline_run / "results" / "atlas.duckdb")
    series = con.execute("""SELECT checkpoint, checkpoint_step, checkpoint_tokens, source_kind FROM models
                            WHERE model = 'tiny-trained' ORDER BY checkpoint_step""").fetchall()
    assert series == [("step0", 0, 0, "trained"), ("step10", 10, 1920, "trained"), ("step20", 20, 3840, "trained")]
    loss = con.execute("SELECT count(*), min(step), max(step) FROM training_loss WHERE model = 'tiny-trained'").fetchone()
    assert loss == (20, 1, 20)  # every step logged once, across the three segments
    # the invariance audit runs on each model's last checkpoint only
    assert con.execute("SELECT DISTINCT checkpoint FROM invariance WHERE model = 'tiny-trained'").fetchall() == [("step20",)]
    report = pipeline_run / "results" / "report"
    assert "tiny-trained: the circuit forming over training" in (report / "model-tiny-trained.html").read_text()
    front = (report / "index.html").read_text().split("<h2 id='training'>")[1].split("</table>")[0]  # one line per run
    assert "<td><a href='model-tiny-trained.html#training'>tiny-trained</a></td>" in front


def test_shards_are_hive_partitioned_with_provenance(pipeline_run: Path):
    from compatlas.storage import read_provenance

    shards = sorted((pipeline_run / "results" / "composition").rglob("*.parquet"))
    assert shards[0].name == "block=0.parquet"
    assert len(shards) == 2 * 3 * 2 * 2 + 3 * 3  # models x metrics x spaces x blocks, + the trained checkpoints
    prov = read_provenance(shards[0])
    assert shards[0].parent.parent.parent.parent.name.startswith("model=")
    for key in ("model", "checkpoint", "processing", "metric", "space", "versions", "source_checksum", "weights_sha256"):
        assert prov.get(key) is not None, key
    assert prov["versions"]["transformer-lens"].startswith("4.")


def test_behaviour_shards_record_what_multiplied_their_matrices(pipeline_run: Path):
    """induction.cpu_matmul reaches the jobs that run the model's passes (compatlas.models.cpu_matmul)."""
    from compatlas.models.cpu_matmul import onednn_available
    from compatlas.storage import read_provenance

    results = pipeline_run / "results"
    shards = [*(results / "induction").rglob("heads.parquet"), *(results / "edge_attribution").rglob("*.parquet"),
              *(results / "edge_sums").rglob("*.parquet"), *(results / "exact_values").rglob("*.parquet")]
    assert {s.parts[len(results.parts)] for s in shards} == {"induction", "edge_attribution", "edge_sums", "exact_values"}
    assert {read_provenance(s).get("cpu_matmul") for s in shards} == {"onednn" if onednn_available() else "blas"}


def test_changing_cpu_matmul_plans_only_the_behaviour_jobs(pipeline_run: Path, tmp_path: Path):
    """Composition, its moments and training keep torch's BLAS whatever induction.cpu_matmul says:
    changing it reruns the model's induction and edge attribution jobs, not them."""
    work = tmp_path / "matmul"
    shutil.copytree(pipeline_run, work)
    cfg = tiny_config()
    cfg["models"]["tiny-llama"]["induction"]["cpu_matmul"] = "blas"
    proc = run_snakemake(work, cfg, "-n")
    planned = [line.split("rule ")[1].rstrip(":") for line in proc.stdout.splitlines() + proc.stderr.splitlines()
               if line.strip().startswith(("rule ", "localrule "))]
    assert sorted(planned) == ["all", "atlas", "edge_attribution", "edge_attribution_share", "edge_attribution_share",
                               "exact_patching_share", "exact_patching_share", "induction", "report"], planned


def test_a_second_run_writes_the_same_numbers_bit_for_bit(pipeline_run: Path, tmp_path: Path):
    """Two runs of one config on one machine give the same shards: every row of every Parquet
    shard (composition, nulls, calibration, training losses, head scores, edge attribution...) bit
    for bit. What may differ is only what the shards' metadata records of the run (timings, paths).
    Across machines, docs/behaviour.md#what-can-differ-across-machines says what can move."""
    from polars.testing import assert_frame_equal

    again = tmp_path / "again"
    again.mkdir()
    run_snakemake(again, tiny_config())
    shards = sorted(p.relative_to(again) for p in (again / "results").rglob("*.parquet"))
    assert len(shards) > 50 and any("train" in str(p) for p in shards) and any("edge_attribution" in str(p) for p in shards)
    for rel in shards:
        first, second = pl.read_parquet(pipeline_run / rel), pl.read_parquet(again / rel)
        assert_frame_equal(first, second, check_exact=True), rel


def test_report_is_written(pipeline_run: Path):
    report = pipeline_run / "results" / "report"
    html = (report / "index.html").read_text()
    assert "model-tiny-llama.html" in html and "src=\"http" not in html
    assert "Which metric satisfies which axiom?" in html and "FAIL" in html and "PASS" in html
    assert "How each metric x space finds the induction heads" in html
    page = (report / "model-tiny-llama.html").read_text()
    assert "The circuit" in page and "Induction behaviour" in page
    for fig in ("invariance", "heatmap", "induction_powers", "induction_near_b", "head_scores"):
        assert (report / f"tiny-llama__{fig}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", fig


def test_report_in_chromium(pipeline_run: Path, tmp_path: Path):
    """The run's pages in headless Chromium (tests/browser.py): nothing fetched, no console error,
    every chart drawn, none wider than 1280 px. Screenshots: $COMPATLAS_SCREENSHOTS or tmp_path."""
    from browser import check_report

    shots = Path(os.environ.get("COMPATLAS_SCREENSHOTS") or tmp_path) / "pipeline"
    try:
        problems = check_report(pipeline_run / "results" / "report", shots)
    except RuntimeError as e:  # no Chromium: fail, saying how to install it
        pytest.fail(str(e))
    print(f"screenshots: {shots}")
    assert not problems, "\n".join(problems)


def test_adding_a_model_runs_only_its_jobs(pipeline_run: Path, tmp_path: Path):
    work = tmp_path / "inc"
    # keep .snakemake: without its metadata Snakemake 9 misses new inputs of an existing output
    shutil.copytree(pipeline_run, work)
    assert "Nothing to be done" in run_snakemake(work, tiny_config()).stderr
    before = {p: sha(p) for p in (work / "results").rglob("*.parquet")}
    cfg = tiny_config()
    cfg["models"]["tiny-extra"] = {"blocks": 1, "source": {"kind": "build", "architecture": "gpt2", "n_layers": 2, "n_heads": 2,
                                              "d_head": 8, "d_vocab": 64, "seed": 3}}
    proc = run_snakemake(work, cfg)
    ran = [line.split("rule ")[1].rstrip(":") for line in proc.stderr.splitlines() if line.strip().startswith(("rule ", "localrule "))]
    assert all(sha(p) == h for p, h in before.items()), "old shards were rewritten"
    new = sorted((work / "results" / "composition" / "model=tiny-extra").rglob("*.parquet"))
    assert len(new) == 6  # one block, three metrics, two spaces
    jobs = [line for line in proc.stderr.splitlines() if line.strip().startswith("wildcards:")]
    assert jobs and all("tiny-extra" in j for j in jobs), jobs
    assert ran.count("composition") == 2 and ran.count("invariance") == 1 and ran.count("induction") == 1, ran
    assert ran.count("calibrate") == 1, ran
    assert "metric_audit" not in ran, ran
    con = connect(work / "results" / "atlas.duckdb")
    assert con.execute("SELECT count(*) FROM head_scores WHERE model = 'tiny-extra'").fetchone()[0] == 2 * 2


def test_changing_exact_patching_plans_only_its_jobs(pipeline_run: Path, tmp_path: Path):
    """An exact-patching setting of a model whose edge attribution is split (tiny-llama, jobs 2)
    plans its exact jobs and their merge, then the atlas and the report: not its attribution
    shares (they read no exact_* key) nor its induction job (it reads no edge attribution key)."""
    work = tmp_path / "exact"
    shutil.copytree(pipeline_run, work)
    cfg = tiny_config()
    cfg["models"]["tiny-llama"]["induction"]["edge_attribution"]["exact_sequences"] = 16
    proc = run_snakemake(work, cfg, "-n")
    planned = [line.split("rule ")[1].rstrip(":") for line in proc.stdout.splitlines() + proc.stderr.splitlines()
               if line.strip().startswith(("rule ", "localrule "))]
    assert sorted(planned) == ["all", "atlas", "edge_attribution", "exact_patching_share", "exact_patching_share",
                               "report"], planned


def test_a_fresh_checkout_beside_copied_results_plans_nothing(pipeline_run: Path, tmp_path: Path):
    """Another checkout of the same commit (a teammate's clone, a CI runner: every file's mtime the
    checkout's) beside a copy of finished results, with none of the first checkout's .snakemake
    metadata: nothing to do. Snakemake's `code` trigger compares a script's mtime with its outputs',
    so a checkout newer than the results had rerun every job ("Code has changed since last execution")."""
    checkout = tmp_path / "checkout"
    for name in ("Snakefile", "workflow", "scripts", "config", "profiles", "envs"):
        src = REPO / name
        # copied, not copy2'd: every file as new as a fresh clone's
        if src.is_dir():
            shutil.copytree(src, checkout / name, copy_function=shutil.copy)
        else:
            checkout.mkdir(exist_ok=True)
            shutil.copy(src, checkout / name)
    work = tmp_path / "work"
    shutil.copytree(pipeline_run / "results", work / "results")  # copy2: the results keep their times
    cfg = work / "config.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config()))
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(checkout / "Snakefile"), "--cores", "2",
                           "--directory", str(work), "--configfile", str(cfg), "-n"],
                          capture_output=True, text=True, timeout=300 * machine_slowdown())
    assert proc.returncode == 0 and "Nothing to be done" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]


def test_adding_a_checkpoint_runs_only_its_jobs(pipeline_run: Path, tmp_path: Path):
    work = tmp_path / "ckpt"
    shutil.copytree(pipeline_run, work)
    before = {p: sha(p) for p in (work / "results").rglob("*.parquet") if "invariance" not in p.parts}
    cfg = tiny_config()
    cfg["training"]["tiny-trained"]["steps"] = 30  # the schedule gains step30
    dry = run_snakemake(work, cfg, "--dry-run").stdout
    assert "results/train/tiny-trained/step30/state.pt" in dry  # the new checkpoint's wildcards resolve
    proc = run_snakemake(work, cfg)
    ran = [line.split("rule ")[1].rstrip(":") for line in proc.stderr.splitlines() if line.strip().startswith(("rule ", "localrule "))]
    jobs = [line for line in proc.stderr.splitlines() if line.strip().startswith("wildcards:")]
    assert jobs and all("step30" in j for j in jobs), jobs
    # one segment (20 -> 30), its extraction, its one space's composition (3 metrics), induction, edge attribution,
    # and the audit of the new last checkpoint
    assert sorted(ran) == sorted(["train", "extract", "composition", "calibrate",
                                  "induction", "edge_attribution", "invariance", "atlas", "report", "all"]), ran
    assert all(sha(p) == h for p, h in before.items()), "old shards were rewritten"
    con = connect(work / "results" / "atlas.duckdb")
    assert con.execute("SELECT max(step) FROM training_loss").fetchone()[0] == 30


def test_bad_config_fails_before_any_job(tmp_path: Path):
    cfg = tiny_config()
    cfg["metrics"] = ["frobenius", "nuclear"]
    proc = run_snakemake(tmp_path, cfg, check=False)
    assert proc.returncode != 0
    assert "config error at metrics.1: 'nuclear' is not one of" in proc.stderr + proc.stdout
    assert not (tmp_path / "results").exists()


def test_layer_range_outside_model_is_named(tmp_path: Path):
    cfg = tiny_config()
    cfg["models"]["tiny-gpt2"]["layers"] = [0, 7]
    proc = run_snakemake(tmp_path, cfg, check=False)
    assert proc.returncode != 0
    assert "models.tiny-gpt2.layers: layer 7 is outside the model" in proc.stderr + proc.stdout


def test_corrupt_weight_shard_is_named_and_nothing_downstream_written(pipeline_run: Path, tmp_path: Path):
    work = tmp_path / "corrupt"
    shutil.copytree(pipeline_run, work)
    weights = work / "results" / "weights" / "tiny-llama" / "final" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    shard = (work / "results" / "composition" / "model=tiny-llama" / "checkpoint=final" / "metric=frobenius" / "space=residual"
             / "block=0.parquet")
    shard.unlink()
    proc = run_snakemake(work, tiny_config(), "--keep-going", check=False)
    assert proc.returncode != 0
    log = work / "results" / "logs" / "composition" / "tiny-llama" / "final" / "residual-0.log"
    assert "is corrupt or truncated" in log.read_text() and "weights.safetensors" in log.read_text()
    assert not shard.exists()
    assert not list(shard.parent.glob(".*.tmp"))


def test_lint_is_clean(tmp_path: Path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config()))
    proc = subprocess.run([*SNAKEMAKE, "--lint", "--configfile", str(cfg), "--directory", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Congratulations, your workflow is in a good condition!" in out, out


def test_adding_the_activation_space_and_contribution_runs_only_their_jobs(pipeline_run: Path, tmp_path: Path):
    """Metrics and a space added to a finished run: the moments of the one model that asks for
    the activation space, and the composition jobs (one per model x checkpoint x space x block:
    the new metric is scored beside the old, whose shards come back with the same rows), nothing
    else of the old grid; pattern_output only in the activation space, measured by the moments
    job and cut into blocks by its own rule; the new rows reach the views (score_share, the
    within-layer-pair agreement)."""
    import json

    work = tmp_path / "act"
    shutil.copytree(pipeline_run, work)
    before = {p: pl.read_parquet(p) for p in (work / "results" / "composition").rglob("*.parquet")}
    cfg = tiny_config()
    cfg["metrics"] = [*cfg["metrics"], "contribution", "pattern_output"]
    cfg["models"]["tiny-llama"]["spaces"] = ["residual", "token", "activation"]
    cfg["models"]["tiny-llama"]["activation"] = {"text": {"kind": "induction"}, "chunks": 4, "length": 16}
    proc = run_snakemake(work, cfg)
    ran = [line.split("rule ")[1].rstrip(":") for line in proc.stderr.splitlines() if line.strip().startswith(("rule ", "localrule "))]
    # one job per space: tiny-llama 3 spaces, tiny-gpt2 2, x 2 blocks; tiny-trained 1 space x 3 checkpoints x 1 block;
    # pattern_output's 2 blocks of tiny-llama's activation space
    assert ran.count("moments") == 1 and ran.count("composition") == (3 + 2) * 2 + 3, ran
    assert ran.count("pattern_output") == 2, ran
    assert "induction" not in ran and "edge_attribution" not in ran and "extract" not in ran, ran
    for path, old in before.items():  # the old metrics' rows again (float64: the same to rounding)
        new = pl.read_parquet(path)
        assert new.drop("score", "baseline_spectrum_mean", "baseline_spectrum_std").equals(
            old.drop("score", "baseline_spectrum_mean", "baseline_spectrum_std")), path
        for col in ("score", "baseline_spectrum_mean", "baseline_spectrum_std"):
            np.testing.assert_allclose(new[col].to_numpy(), old[col].to_numpy(), rtol=1e-12, atol=1e-15, err_msg=str(path))
    meta = json.loads((work / "results" / "moments" / "tiny-llama" / "final" / "moments.json").read_text())
    assert meta["text"]["kind"] == "induction" and meta["positions"] == 4 * 15 and meta["model"] == "tiny-llama"
    assert meta["pattern_output_seconds"] >= 0
    con = connect(work / "results" / "atlas.duckdb")
    got = con.execute("""SELECT metric, count(*), count(score_share), count(baseline_gaussian_mean) FROM composition
                         WHERE model = 'tiny-llama' AND space = 'activation' GROUP BY ALL ORDER BY ALL""").fetchall()
    n = 3 * 4 * 4 * 3  # causal layer pairs x writer heads x reader heads x comps
    assert {m: (rows, share, gauss) for m, rows, share, gauss in got} == {
        "contribution": (n, n, 0), "frobenius": (n, 0, n), "pattern_output": (n, n, 0), "subspace": (n, 0, n),
        "svd_bound": (n, 0, n)}
    assert con.execute("SELECT count(*) FROM composition WHERE metric = 'pattern_output' AND space <> 'activation'"
                       ).fetchone() == (0,)
    agree = con.execute("""SELECT comp, n_edges, n_layer_pairs FROM composition_vs_function WHERE model = 'tiny-llama'
                           AND metric = 'contribution' AND space = 'activation' AND method = 'eap' ORDER BY comp""").fetchall()
    assert agree == [("K", 24, 3), ("Q", 48, 3), ("V", 24, 3)]

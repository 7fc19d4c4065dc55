"""The report: a self-contained index.html and one PNG per figure, from synthetic views."""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import numpy as np
import polars as pl
import pytest

from compatlas.report import build_report, figure_stem

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
METRICS = ("frobenius", "svd_bound", "subspace")
COMPS = ("Q", "K", "V")


def model_row(model, checkpoint, n_layers, n_heads, quantized=None) -> dict:
    return {
        "model": model, "checkpoint": checkpoint, "architecture": "gpt2", "n_layers": n_layers,
        "n_heads": n_heads, "n_kv_heads": n_heads, "d_model": 16 * n_heads, "d_head": 16, "d_vocab": 100,
        "norm_type": "LN", "processing": "compat", "quantized": quantized, "source_kind": "build",
        "source_checksum": "0" * 64,
    }  # fmt: skip


def composition_rows(model, checkpoint, n_layers, n_heads, spaces=("residual",), seed=0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for space in spaces:
        for metric in METRICS:
            for comp in COMPS:
                for wl in range(n_layers):
                    for rl in range(wl + 1, n_layers):
                        for wh in range(n_heads):
                            for rh in range(n_heads):
                                rows.append({
                                    "model": model, "checkpoint": checkpoint, "processing": "compat",
                                    "space": space, "metric": metric, "comp": comp,
                                    "writer_layer": wl, "writer_head": wh, "reader_layer": rl, "reader_head": rh,
                                    "score": float(rng.uniform(0.0, 0.4)),
                                    "baseline_gaussian_mean": 0.1, "baseline_gaussian_std": 0.02,
                                    "baseline_spectrum_mean": float(rng.uniform(0.1, 0.15)),
                                    "baseline_spectrum_std": 0.03,
                                })  # fmt: skip
    return rows


COMPOSITION_SCHEMA = {
    "model": pl.Utf8, "checkpoint": pl.Utf8, "processing": pl.Utf8, "space": pl.Utf8, "metric": pl.Utf8,
    "comp": pl.Utf8, "writer_layer": pl.Int32, "writer_head": pl.Int32, "reader_layer": pl.Int32,
    "reader_head": pl.Int32, "score": pl.Float64, "baseline_gaussian_mean": pl.Float64,
    "baseline_gaussian_std": pl.Float64, "baseline_spectrum_mean": pl.Float64, "baseline_spectrum_std": pl.Float64,
}  # fmt: skip
MODELS_SCHEMA = {
    "model": pl.Utf8, "checkpoint": pl.Utf8, "architecture": pl.Utf8, "n_layers": pl.Int32, "n_heads": pl.Int32,
    "n_kv_heads": pl.Int32, "d_model": pl.Int32, "d_head": pl.Int32, "d_vocab": pl.Int32, "norm_type": pl.Utf8,
    "processing": pl.Utf8, "quantized": pl.Boolean, "source_kind": pl.Utf8, "source_checksum": pl.Utf8,
}  # fmt: skip


def make_db(path: Path, models: list[dict], composition: list[dict]) -> Path:
    comp_df = pl.DataFrame(composition, schema=COMPOSITION_SCHEMA)  # noqa: F841 (scanned by duckdb)
    models_df = pl.DataFrame(models, schema=MODELS_SCHEMA)  # noqa: F841
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE composition AS SELECT * FROM comp_df")
    con.execute("CREATE TABLE models AS SELECT * FROM models_df")
    con.close()
    return path


def heatmaps(out: Path) -> list[Path]:
    return sorted(out.glob("*__heatmap.png"))


def assert_offline(text: str) -> None:
    assert "https://cdn" not in text
    assert not re.search(r"<script[^>]*\ssrc\s*=", text, flags=re.I), "external script found"
    assert 'src="http' not in text and "src='http" not in text


@pytest.fixture(scope="module")
def two_models(tmp_path_factory) -> tuple[Path, list[Path]]:
    tmp = tmp_path_factory.mktemp("report")
    models = [
        model_row("tiny-a", "final", 3, 2),
        model_row("tiny-b", "final", 2, 3, quantized=True),
        model_row("solo", "final", 1, 2),  # single layer: no pairs, no figures
    ]
    comp = composition_rows("tiny-a", "final", 3, 2, seed=1) + composition_rows("tiny-b", "final", 2, 3, seed=2)
    db = make_db(tmp / "atlas.duckdb", models, comp)
    out = tmp / "report"
    return out, build_report(db, out)


def test_index_html(two_models):
    out, written = two_models
    index = out / "index.html"
    assert index.exists() and index in written
    text = index.read_text(encoding="utf-8")
    for name in ("tiny-a", "tiny-b", "solo", *METRICS, "Q-composition", "Gaussian null (random factors)",
                 "spectrum-kept null (same singular values, random singular vectors)", "quantization noise"):
        assert name in text, name
    assert "vegaEmbed" in text  # the JavaScript is inlined
    assert_offline(text)


def test_pngs(two_models):
    out, written = two_models
    n_models, n_checkpoints, n_spaces = 2, 1, 1  # "solo" has no pairs, hence no figures
    assert len(heatmaps(out)) == n_models * n_checkpoints * len(METRICS) * n_spaces
    assert len(list(out.glob("*__distribution.png"))) == n_models * n_checkpoints * len(METRICS) * n_spaces
    for model in ("tiny-a", "tiny-b"):
        for metric in METRICS:
            for kind in ("heatmap", "distribution"):
                p = out / f"{figure_stem(model, 'final', metric, 'residual')}__{kind}.png"
                assert p in written
                assert p.read_bytes()[:8] == PNG_MAGIC
    assert set(written) == set(out.iterdir())


def test_several_spaces_and_odd_names(tmp_path):
    models = [model_row("org/tiny-c", "step 10", 2, 2)]
    comp = composition_rows("org/tiny-c", "step 10", 2, 2, spaces=("residual", "token"))
    db = make_db(tmp_path / "atlas.duckdb", models, comp)
    out = tmp_path / "report"
    build_report(db, out)
    names = {p.name for p in heatmaps(out)}
    assert names == {f"org-tiny-c__step-10__{m}__{s}__heatmap.png" for m in METRICS for s in ("residual", "token")}
    assert "org/tiny-c" in (out / "index.html").read_text(encoding="utf-8")


def test_empty_views(tmp_path):
    db = make_db(tmp_path / "atlas.duckdb", [], [])
    written = build_report(db, tmp_path / "report")
    assert written == [tmp_path / "report" / "index.html"]
    text = written[0].read_text(encoding="utf-8")
    assert "No results" in text
    assert_offline(text)

"""One comp's agreement of composition with function, read from the atlas: its edges (a K/V edge
into a KV group is one edge, its composition the largest of the group's query heads'), whether
its function is measurable, and the paired bootstrap of every metric x space and of the two
oracles (``agreement``). The report draws it (``CompFunction``); the atlas keeps the same
figures with their intervals as its ``function_agreement`` table (``agreement_table``), so that
what a page shows can be queried."""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import numpy as np
import polars as pl

from compatlas.function import agreement as ag
from compatlas.tables import FUNCTION_AGREEMENT_SCHEMA, integer
from compatlas.vocab import COMPS, METRICS, SPACES

Con = duckdb.DuckDBPyConnection
ORACLES = (("oracle_scale", "oracle"), ("oracle_depth", "oracle"))  # composition_vs_function's reference rows
SCALE = ORACLES[0]


def cell_order(cells: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Metric x space cells in the usual order (METRICS, then SPACES)."""
    rank: dict[tuple[str, str], int] = {(m, s): i for i, (m, s) in enumerate((m, s) for m in METRICS for s in SPACES)}
    return sorted(cells, key=lambda c: (rank.get(c, len(rank)), c))


def _has(con: Con, view: str, *cols: str) -> bool:
    found = {r[0] for r in con.execute("SELECT column_name FROM duckdb_columns() WHERE table_name = ?", [view]).fetchall()}
    return bool(found) and set(cols) <= found


def function_edges(con: Con, model: str, checkpoint: str, method: str, comp: str) -> pl.DataFrame:
    """Every edge of one comp as composition_vs_function counts it, in the view's tie order: its
    attribution, standard error, split halves, q, sequences, and composition in every metric x space
    (a row per edge x metric x space)."""
    if not _has(con, "edge_attribution", "reader_kv_head", "score_stderr", "n_sequences") or not _has(con, "composition", "score"):
        return pl.DataFrame()
    unit = "reader_head" if comp == "Q" else "reader_kv_head"
    return con.sql(f"""
        WITH e AS (SELECT writer_layer, writer_head, reader_layer, {unit} AS reader_unit, any_value(score) AS attribution,
                          any_value(score_stderr) AS stderr, any_value(n_sequences) AS n_sequences, any_value(score_half_a)
                          AS half_a, any_value(score_half_b) AS half_b, any_value(q_value) AS q_value, list(reader_head) AS heads
                   FROM edge_attribution WHERE model = ? AND checkpoint = ? AND method = ? AND comp = ? GROUP BY ALL),
             u AS (SELECT writer_layer, writer_head, reader_layer, reader_unit, unnest(heads) AS reader_head FROM e),
             c AS (SELECT metric, space, writer_layer, writer_head, reader_layer, reader_head, score FROM composition
                   WHERE model = ? AND checkpoint = ? AND comp = ?)
        SELECT writer_layer, writer_head, reader_layer, reader_unit, any_value(e.attribution) AS attribution,
               any_value(e.stderr) AS stderr, any_value(e.n_sequences) AS n_sequences, any_value(e.half_a) AS half_a,
               any_value(e.half_b) AS half_b, any_value(e.q_value) AS q_value, metric, space, max(score) AS score
        FROM u JOIN c USING (writer_layer, writer_head, reader_layer, reader_head)
        JOIN e USING (writer_layer, writer_head, reader_layer, reader_unit)
        GROUP BY writer_layer, writer_head, reader_layer, reader_unit, metric, space
        ORDER BY writer_layer, writer_head, reader_layer, reader_unit""",
                   params=[model, checkpoint, method, comp, model, checkpoint, comp]).pl()


@dataclass
class CompFunction:
    """One comp of one model x checkpoint: the attribution method, whether its function is
    measurable, and (where it is) the paired bootstrap of every metric x space and of the two
    oracles (``ORACLES``, the last two cells) against it: ``agreement`` against |attribution|,
    ``noise`` on the noise-aware statistics (``agreement.bootstrap_noise_aware``)."""

    comp: str
    method: str
    gate: ag.Measurability
    cells: list[tuple[str, str]]               # (metric, space), the rows of ``agreement``; the oracles last
    agreement: ag.Agreement | None = None      # measurable comps only
    noise: ag.Agreement | None = None          # measurable comps with split halves only
    n_significant: int = 0

    def interval(self, cell: tuple[str, str], which: str, noise: bool = False) -> tuple[float, float] | None:
        a = self.noise if noise else self.agreement
        if a is None or cell not in self.cells:
            return None
        lo, hi = a.interval(which)
        i = self.cells.index(cell)
        return float(lo[i]), float(hi[i])

    def ranking(self) -> tuple[tuple[str, str], list[tuple[str, str]]] | None:
        """(best composition cell by AUROC against |attribution|, the cells tied with it); None where
        not measurable."""
        if self.agreement is None or not np.isfinite(self.agreement.auroc).any():
            return None
        idx = [i for i, c in enumerate(self.cells) if c not in ORACLES]
        best, tied = ag.best_and_ties(self.agreement.auroc[idx], self.agreement.auroc_boot[idx])
        return self.cells[idx[best]], [self.cells[idx[i]] for i in tied]

    def noise_ranking(self) -> tuple[tuple[str, str], list[tuple[str, str]]] | None:
        """(best composition cell by Spearman with the unbiased function estimate, the cells tied
        with it); None without the noise-aware bootstrap."""
        if self.noise is None or not np.isfinite(self.noise.spearman).any():
            return None
        idx = [i for i, c in enumerate(self.cells) if c not in ORACLES]
        best, tied = ag.best_and_ties(self.noise.spearman[idx], self.noise.spearman_boot[idx])
        return self.cells[idx[best]], [self.cells[idx[i]] for i in tied]

    def beats(self, cell: tuple[str, str], oracle: tuple[str, str] = SCALE, which: str = "spearman") -> bool | None:
        """Whether ``cell`` beats ``oracle`` on a noise-aware statistic beyond the paired 95%
        interval of their difference (its lower bound above 0); None without that bootstrap."""
        if self.noise is None or cell not in self.cells or oracle not in self.cells:
            return None
        boot = self.noise.spearman_boot if which == "spearman" else self.noise.auroc_boot
        # an oracle that does not vary (one noise scale for every edge) ranks nothing: it counts as 0
        d = boot[self.cells.index(cell)] - np.nan_to_num(boot[self.cells.index(oracle)], nan=0.0)
        d = d[np.isfinite(d)]
        return bool(len(d)) and float(np.quantile(d, (1 - ag.LEVEL) / 2)) > 0


def comp_function(con: Con, model: str, checkpoint: str, method: str, comp: str,
                  fdr: float | None = None) -> CompFunction | None:
    """``CompFunction`` of one comp from its edges (``function_edges``); None without edges. ``fdr``:
    the cut of an edge's q-value for "significant" (the atlas's, else ``agreement.SIGNAL_FDR``)."""
    df = function_edges(con, model, checkpoint, method, comp)
    if df.is_empty():
        return None
    keys = ["writer_layer", "writer_head", "reader_layer", "reader_unit"]
    edges = df.select(*keys, "attribution", "stderr", "half_a", "half_b", "q_value", "n_sequences").unique(keys).sort(keys)
    cells = cell_order([tuple(r) for r in df.select("metric", "space").unique().iter_rows()])
    n_seq = integer(edges["n_sequences"].max() or 0)
    gate = ag.measurability(edges["attribution"].to_numpy(), edges["stderr"].fill_null(0).to_numpy(), n_seq)
    out = CompFunction(comp, method, gate, cells + list(ORACLES))
    if gate.measurable:
        scores = np.full((len(out.cells), edges.height), np.nan)
        at = {c: i for i, c in enumerate(cells)}
        joined = edges.select(keys).with_row_index("e").join(df, on=keys)
        for (metric, space), g in joined.group_by("metric", "space"):
            scores[at[(metric, space)], g["e"].to_numpy()] = g["score"].to_numpy()
        # the oracles, as composition_vs_function computes them: the edge's standard error; its layer pair's mean |attribution|
        scores[-2] = edges["stderr"].to_numpy()
        scores[-1] = edges.select(pl.col("attribution").abs().mean().over("writer_layer", "reader_layer")).to_series().to_numpy()
        out.agreement = ag.bootstrap(scores, edges["attribution"].to_numpy())
        if edges["half_a"].null_count() == 0 and edges["half_b"].null_count() == 0:
            significant = (edges["q_value"].fill_null(1.0) <= (fdr or ag.SIGNAL_FDR)).to_numpy()
            out.n_significant = int(significant.sum())
            out.noise = ag.bootstrap_noise_aware(scores, edges["half_a"].to_numpy(), edges["half_b"].to_numpy(),
                                                 significant)
    return out


def comp_rows(model: str, checkpoint: str, f: CompFunction) -> list[dict]:
    """``function_agreement``'s rows of one comp: a row per cell (oracles included), its point
    figures with their 95% bootstrap intervals, and where it stands among the cells."""
    ranked, noise_ranked = f.ranking(), f.noise_ranking()
    # each statistic's point figures and interval bounds over every cell, the quantiles taken once
    stats = {name: (a.spearman if which == "spearman" else a.auroc, *a.interval(which))
             for name, a, which in (("auroc_top", f.agreement, "auroc"), ("spearman_abs", f.agreement, "spearman"),
                                    ("spearman_unbiased", f.noise, "spearman"), ("auroc_significant", f.noise, "auroc"))
             if a is not None}
    n_boot = next((a.auroc_boot.shape[1] for a in (f.noise, f.agreement) if a is not None), None)
    rows = []
    for i, cell in enumerate(f.cells):
        row: dict = {"model": model, "checkpoint": checkpoint, "method": f.method, "comp": f.comp, "metric": cell[0],
                     "space": cell[1], "measurable": f.gate.measurable, "why_not": f.gate.why, "n_edges": f.gate.n_edges,
                     "n_significant": f.n_significant if f.noise is not None else None, "n_boot": n_boot}
        for name in ("auroc_top", "spearman_abs", "spearman_unbiased", "auroc_significant"):
            row.update({name: None, f"{name}_lo": None, f"{name}_hi": None})
            if name in stats:
                point, lo, hi = stats[name]
                row.update({name: _finite(point[i]), f"{name}_lo": _finite(lo[i]), f"{name}_hi": _finite(hi[i])})
        oracle = cell in ORACLES
        row["best_noise_aware"] = None if noise_ranked is None or oracle else cell == noise_ranked[0]
        row["tied_noise_aware"] = None if noise_ranked is None or oracle else cell in noise_ranked[1]
        row["best_auroc_top"] = None if ranked is None or oracle else cell == ranked[0]
        row["beats_scale"] = None if oracle else f.beats(cell)
        rows.append(row)
    return rows


def _finite(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def agreement_table(con: Con, fdr: float | None = None) -> pl.DataFrame:
    """``function_agreement``: every model x checkpoint x attribution method x comp of
    composition_vs_function, a row per metric x space and oracle (``comp_rows``); empty without
    edge attribution."""
    rows: list[dict] = []
    if _has(con, "composition_vs_function", "method"):
        for model, checkpoint, method in con.execute("SELECT DISTINCT model, checkpoint, method "
                                                     "FROM composition_vs_function ORDER BY ALL").fetchall():
            for comp in COMPS:
                f = comp_function(con, model, checkpoint, method, comp, fdr)
                if f is not None:
                    rows += comp_rows(model, checkpoint, f)
    return pl.DataFrame(rows, schema=FUNCTION_AGREEMENT_SCHEMA)

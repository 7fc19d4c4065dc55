"""One comp's agreement of composition with function, read from the atlas: its edges (a K/V edge
into a KV group is one edge, its composition the largest of the group's query heads'), whether
its function is measurable, and the paired bootstrap of every metric x space and of the two
oracles (``agreement``). The report draws it (``CompFunction``); the atlas keeps the same
figures with their intervals as its ``function_agreement`` table, so that what a page shows can
be queried, and the bootstrap's replicates as ``function_bootstrap`` (``agreement_tables``), from
which the report reads the comp back (``stored_comp_function``) rather than bootstrapping again."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import duckdb
import numpy as np
import polars as pl

from compatlas.function import agreement as ag
from compatlas.function.partial_agreement import Partial
from compatlas.function.shared_draws import CompDraws, Halves, Result
from compatlas.tables import FUNCTION_AGREEMENT_SCHEMA, FUNCTION_BOOTSTRAP_SCHEMA, integer
from compatlas.vocab import COMPS, METRICS, SPACES

Con = duckdb.DuckDBPyConnection
# composition_vs_function's reference rows, scored on the same edges as every metric x space:
ORACLES = (("oracle_scale", "oracle"), ("oracle_depth", "oracle"))  # from the function measurement itself
SCALE, DEPTH = ORACLES
PRIOR = ("prior_distance", "prior")  # needs no function and no composition: nearer layers first
REFERENCES = (*ORACLES, PRIOR)


def cell_order(cells: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Metric x space cells in the usual order (METRICS, then SPACES)."""
    rank: dict[tuple[str, str], int] = {(m, s): i for i, (m, s) in enumerate((m, s) for m in METRICS for s in SPACES)}
    return sorted(cells, key=lambda c: (rank.get(c, len(rank)), c))


def _has(con: Con, view: str, *cols: str) -> bool:
    found = {r[0] for r in con.execute("SELECT column_name FROM duckdb_columns() WHERE table_name = ?", [view]).fetchall()}
    return bool(found) and set(cols) <= found


def function_edges(con: Con, model: str, checkpoint: str, method: str | None = None, comp: str | None = None) -> pl.DataFrame:
    """Every edge of one method x comp (None: of every one) as composition_vs_function counts it, in
    the view's tie order: its method and comp, attribution, standard error, split halves, q,
    sequences, and composition in every metric x space (a row per edge x metric x space)."""
    if not _has(con, "edge_attribution", "reader_kv_head", "score_stderr", "n_sequences") or not _has(con, "composition", "score"):
        return pl.DataFrame()
    by_method, methods = (" AND method = ?", [method]) if method is not None else ("", [])
    by_comp, comps = (" AND comp = ?", [comp]) if comp is not None else ("", [])
    return con.sql(f"""
        WITH e AS (SELECT method, comp, writer_layer, writer_head, reader_layer,
                          CASE WHEN comp = 'Q' THEN reader_head ELSE reader_kv_head END AS reader_unit,
                          any_value(score) AS attribution, any_value(score_stderr) AS stderr,
                          any_value(n_sequences) AS n_sequences, any_value(score_half_a) AS half_a,
                          any_value(score_half_b) AS half_b, any_value(q_value) AS q_value, list(reader_head) AS heads
                   FROM edge_attribution WHERE model = ? AND checkpoint = ?{by_method}{by_comp} GROUP BY ALL),
             u AS (SELECT method, comp, writer_layer, writer_head, reader_layer, reader_unit, unnest(heads) AS reader_head
                   FROM e),
             c AS (SELECT metric, space, comp, writer_layer, writer_head, reader_layer, reader_head, score FROM composition
                   WHERE model = ? AND checkpoint = ?{by_comp})
        SELECT method, comp, writer_layer, writer_head, reader_layer, reader_unit, any_value(e.attribution) AS attribution,
               any_value(e.stderr) AS stderr, any_value(e.n_sequences) AS n_sequences, any_value(e.half_a) AS half_a,
               any_value(e.half_b) AS half_b, any_value(e.q_value) AS q_value, metric, space, max(score) AS score
        FROM u JOIN c USING (comp, writer_layer, writer_head, reader_layer, reader_head)
        JOIN e USING (method, comp, writer_layer, writer_head, reader_layer, reader_unit)
        GROUP BY method, comp, writer_layer, writer_head, reader_layer, reader_unit, metric, space
        ORDER BY method, comp, writer_layer, writer_head, reader_layer, reader_unit""",
                   params=[model, checkpoint, *methods, *comps, model, checkpoint, *comps]).pl()


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
    partial: Partial | None = None          # the unbiased Spearman beyond both oracles, as ``noise``
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
        idx = [i for i, c in enumerate(self.cells) if c not in REFERENCES]
        best, tied = ag.best_and_ties(self.agreement.auroc[idx], self.agreement.auroc_boot[idx])
        return self.cells[idx[best]], [self.cells[idx[i]] for i in tied]

    def noise_ranking(self) -> tuple[tuple[str, str], list[tuple[str, str]]] | None:
        """(best composition cell by Spearman with the unbiased function estimate, the cells tied
        with it); None without the noise-aware bootstrap."""
        if self.noise is None or not np.isfinite(self.noise.spearman).any():
            return None
        idx = [i for i, c in enumerate(self.cells) if c not in REFERENCES]
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

    def partial_interval(self, cell: tuple[str, str]) -> tuple[float, float] | None:
        if self.partial is None or cell not in self.cells:
            return None
        lo, hi = self.partial.interval()
        i = self.cells.index(cell)
        return float(lo[i]), float(hi[i])

    def tiers(self, cell: tuple[str, str]) -> dict[str, bool | None]:
        """Where a cell stands against function, in the tiers a reader can use (None where this atlas
        cannot say): ``agrees`` (its unbiased Spearman's interval is above 0), ``beyond_prior`` (it
        beats the function-free prior, nearer layers first, beyond the paired interval),
        ``beats_oracles`` (it beats both oracles so), ``adds_to_oracles`` (its partial Spearman beyond
        both oracles has an interval above 0: it carries function neither oracle carries)."""
        iv, piv = self.interval(cell, "spearman", True), self.partial_interval(cell)
        scale, depth = self.beats(cell, SCALE), self.beats(cell, DEPTH)
        return {"agrees": None if iv is None or not np.isfinite(iv[0]) else iv[0] > 0,
                "beyond_prior": self.beats(cell, PRIOR),
                "beats_oracles": None if scale is None or depth is None else scale and depth,
                "adds_to_oracles": None if piv is None or not np.isfinite(piv[0]) else piv[0] > 0}


def verdict(t: dict[str, bool | None]) -> str | None:
    """The tiers a cell reaches, in words (``CompFunction.tiers``); None where none can be told."""
    if all(v is None for v in t.values()):
        return None
    if not t["agrees"]:
        return "does not agree with function"
    said = ["agrees with function"]
    said.append("beyond the function-free prior" if t["beyond_prior"] else "not beyond the function-free prior")
    if t["beats_oracles"]:
        said.append("beats both oracles")
    said.append("adds to scale and depth" if t["adds_to_oracles"] else "adds nothing beyond scale and depth")
    return "; ".join(said)


# a comp's bootstraps: its replicates in parts (calls), put together by ``_fill``
Bootstraps = tuple[CompDraws, list[Callable[[], np.ndarray]]]
# one comp's replicates in this many parts, so that SmolLM2's Q, most of the work, uses every thread
PARTS = 4


def comp_function(con: Con, model: str, checkpoint: str, method: str, comp: str, fdr: float | None = None,
                  every_edge: pl.DataFrame | None = None) -> CompFunction | None:
    """``CompFunction`` of one comp from its edges (``function_edges``); None without edges. ``fdr``:
    the cut of an edge's q-value for "significant" (the atlas's, else ``agreement.SIGNAL_FDR``).
    ``every_edge``: ``function_edges`` of every method and comp of the model x checkpoint, from a
    caller that reads them once for all (one query where there were one per comp)."""
    prepared = comp_bootstraps(comp_edges(con, model, checkpoint, method, comp, every_edge), method, comp, fdr)
    if prepared is None:
        return None
    out, job = prepared
    if job is not None:
        draws, parts = job
        _fill(out, draws.result([part() for part in parts]))
    return out


def comp_edges(con: Con, model: str, checkpoint: str, method: str, comp: str,
               every_edge: pl.DataFrame | None = None) -> pl.DataFrame:
    """``function_edges`` of one method x comp, read or taken from ``every_edge`` (``comp_function``)."""
    if every_edge is None:
        return function_edges(con, model, checkpoint, method, comp)
    if every_edge.is_empty():
        return every_edge
    return every_edge.filter((pl.col("method") == method) & (pl.col("comp") == comp))


def comp_bootstraps(df: pl.DataFrame, method: str, comp: str,
                    fdr: float | None = None) -> tuple[CompFunction, Bootstraps | None] | None:
    """``comp_function`` of one comp's edges ``df``, less its bootstraps, and those (None where not
    measurable): its ``shared_draws.CompDraws`` and its replicates in parts, which read only arrays
    nothing writes, so they can run in any order or at once (``agreement_tables``), with the same draws
    and numbers."""
    if df.is_empty():
        return None
    keys = ["writer_layer", "writer_head", "reader_layer", "reader_unit"]
    edges = df.select(*keys, "attribution", "stderr", "half_a", "half_b", "q_value", "n_sequences").unique(keys).sort(keys)
    cells = cell_order([tuple(r) for r in df.select("metric", "space").unique().iter_rows()])
    n_seq = integer(edges["n_sequences"].max() or 0)
    gate = ag.measurability(edges["attribution"].to_numpy(), edges["stderr"].fill_null(0).to_numpy(), n_seq)
    out = CompFunction(comp, method, gate, cells + list(REFERENCES))
    job: Bootstraps | None = None
    if gate.measurable:
        scores = np.full((len(out.cells), edges.height), np.nan)
        at = {c: i for i, c in enumerate(cells)}
        joined = edges.select(keys).with_row_index("e").join(df, on=keys)
        for (metric, space), g in joined.group_by("metric", "space"):
            scores[at[(metric, space)], g["e"].to_numpy()] = g["score"].to_numpy()
        # the references, as composition_vs_function computes them: the edge's standard error; its layer pair's mean
        # |attribution|; nearer layers first
        ref = {c: out.cells.index(c) for c in REFERENCES}
        scores[ref[SCALE]] = edges["stderr"].to_numpy()
        scores[ref[DEPTH]] = edges.select(pl.col("attribution").abs().mean().over("writer_layer", "reader_layer")).to_series().to_numpy()
        scores[ref[PRIOR]] = (edges["writer_layer"] - edges["reader_layer"]).cast(pl.Float64).to_numpy()
        halves = None
        if edges["half_a"].null_count() == 0 and edges["half_b"].null_count() == 0:
            significant = (edges["q_value"].fill_null(1.0) <= (fdr or ag.SIGNAL_FDR)).to_numpy()
            out.n_significant = int(significant.sum())
            halves = Halves(edges["half_a"].to_numpy(), edges["half_b"].to_numpy(), significant)
        draws = CompDraws(scores, edges["attribution"].to_numpy(), halves, scores[[ref[SCALE], ref[DEPTH]]])
        job = draws, draws.parts(PARTS)
    return out, job


def _fill(out: CompFunction, result: Result) -> None:
    out.agreement, out.noise, out.partial = result


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
    partial_bounds = f.partial.interval() if f.partial is not None else None
    rows = []
    for i, cell in enumerate(f.cells):
        row: dict = {"model": model, "checkpoint": checkpoint, "method": f.method, "comp": f.comp, "metric": cell[0],
                     "space": cell[1], "measurable": f.gate.measurable, "why_not": f.gate.why, "n_edges": f.gate.n_edges,
                     "n_top": f.gate.n_top, "n_signal": f.gate.n_signal, "largest_attribution": f.gate.largest,
                     "n_significant": f.n_significant if f.noise is not None else None, "n_boot": n_boot}
        for name in ("auroc_top", "spearman_abs", "spearman_unbiased", "auroc_significant"):
            row.update({name: None, f"{name}_lo": None, f"{name}_hi": None})
            if name in stats:
                point, lo, hi = stats[name]
                row.update({name: _finite(point[i]), f"{name}_lo": _finite(lo[i]), f"{name}_hi": _finite(hi[i])})
        oracle = cell in REFERENCES
        row["best_noise_aware"] = None if noise_ranked is None or oracle else cell == noise_ranked[0]
        row["tied_noise_aware"] = None if noise_ranked is None or oracle else cell in noise_ranked[1]
        row["best_auroc_top"] = None if ranked is None or oracle else cell == ranked[0]
        row["beats_scale"] = None if oracle else f.beats(cell)
        row["beats_depth"] = None if oracle else f.beats(cell, DEPTH)
        row.update({"partial_unbiased": None, "partial_unbiased_lo": None, "partial_unbiased_hi": None, "added_r2": None})
        if f.partial is not None and partial_bounds is not None:
            lo, hi = partial_bounds
            row.update({"partial_unbiased": _finite(f.partial.partial[i]), "partial_unbiased_lo": _finite(lo[i]),
                        "partial_unbiased_hi": _finite(hi[i]), "added_r2": _finite(f.partial.added_r2[i])})
        tiers = f.tiers(cell) if cell not in ORACLES else dict.fromkeys(("agrees", "beyond_prior", "beats_oracles",
                                                                              "adds_to_oracles"))
        if cell == PRIOR:  # the prior against itself: only whether it agrees, and what it adds
            tiers.update(beyond_prior=None, beats_oracles=None)
        row.update(tiers)
        row["verdict"] = verdict(tiers) if cell not in REFERENCES else None
        rows.append(row)
    return rows


def _finite(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


# function_bootstrap's statistics of the two paired bootstraps: (column, CompFunction's attribute, its figure)
BOOTSTRAPPED = (("auroc_top", "agreement", "auroc"), ("spearman_abs", "agreement", "spearman"),
                ("spearman_unbiased", "noise", "spearman"), ("auroc_significant", "noise", "auroc"))


def bootstrap_rows(model: str, checkpoint: str, f: CompFunction) -> list[dict]:
    """``function_bootstrap``'s rows of one comp: a row per cell (oracles included), each statistic's
    point figure and replicates exactly as ``f`` holds them; none where it has no bootstrap (not measurable)."""
    if f.agreement is None:
        return []
    rows = []
    for i, (metric, space) in enumerate(f.cells):
        row: dict = {"model": model, "checkpoint": checkpoint, "method": f.method, "comp": f.comp, "metric": metric,
                     "space": space}
        for name, attribute, which in BOOTSTRAPPED:
            a: ag.Agreement | None = getattr(f, attribute)
            row[name] = None if a is None else float(getattr(a, which)[i])
            row[f"{name}_boot"] = None if a is None else getattr(a, f"{which}_boot")[i].tolist()
        p = f.partial
        row.update(partial_unbiased=None if p is None else float(p.partial[i]),
                   partial_unbiased_boot=None if p is None else p.partial_boot[i].tolist(),
                   added_r2=None if p is None else float(p.added_r2[i]), controls_r2=None if p is None else p.controls_r2)
        rows.append(row)
    return rows


def stored_comp_function(con: Con, model: str, checkpoint: str, method: str, comp: str) -> CompFunction | None:
    """``comp_function`` as the atlas stored it when it was built: the gate and cells from
    ``function_agreement``, the figures and replicates from ``function_bootstrap`` (the same arrays,
    not bootstrapped again); None where the atlas has no rows for the comp (it has no edges)."""
    key = [model, checkpoint, method, comp]
    where = "WHERE model = ? AND checkpoint = ? AND method = ? AND comp = ?"
    rows = con.execute("SELECT metric, space, why_not, n_edges, n_top, n_signal, largest_attribution, n_significant "
                       f"FROM function_agreement {where}", key).fetchall()
    if not rows:
        return None
    _, _, why, n_edges, n_top, n_signal, largest, n_significant = rows[0]
    cells = cell_order([(m, s) for m, s, *_ in rows if (m, s) not in REFERENCES])
    out = CompFunction(comp, method, ag.Measurability(n_edges, n_top, n_signal, largest, why), cells + list(REFERENCES))
    stored = {(r["metric"], r["space"]): r for r in con.sql(f"SELECT * FROM function_bootstrap {where}",
                                                            params=key).pl().iter_rows(named=True)}
    if not stored:
        return out
    at = [stored[c] for c in out.cells]

    def points(name: str) -> np.ndarray:
        return np.array([r[name] for r in at], dtype=float)

    def replicates(name: str) -> np.ndarray:
        return np.array([r[f"{name}_boot"] for r in at], dtype=float)

    out.agreement = ag.Agreement(auroc=points("auroc_top"), spearman=points("spearman_abs"),
                                 auroc_boot=replicates("auroc_top"), spearman_boot=replicates("spearman_abs"))
    if at[0]["spearman_unbiased_boot"] is not None:  # split halves: the noise-aware bootstrap and the partial
        out.noise = ag.Agreement(auroc=points("auroc_significant"), spearman=points("spearman_unbiased"),
                                 auroc_boot=replicates("auroc_significant"), spearman_boot=replicates("spearman_unbiased"))
        out.partial = Partial(partial=points("partial_unbiased"), added_r2=points("added_r2"),
                                 controls_r2=float(at[0]["controls_r2"]), partial_boot=replicates("partial_unbiased"))
        out.n_significant = int(n_significant)
    return out


def agreement_tables(con: Con, fdr: float | None = None, workers: int = 1) -> dict[str, pl.DataFrame]:
    """``function_agreement`` and ``function_bootstrap``: every model x checkpoint x attribution method x
    comp of composition_vs_function bootstrapped once (``comp_function``), a row per metric x space
    and oracle in each (``comp_rows``, ``bootstrap_rows``); empty without edge attribution. ``fdr``:
    the atlas's q-value cut (``comp_function``). ``workers``: threads the bootstraps run on (numpy
    leaves the interpreter's lock in their array work), each on the draws it has when run alone.
    Reads only the shard views, not composition_vs_function (``build_atlas`` runs it while that
    table is stored): its model x checkpoint x method come from edge_attribution, every one of which
    with an edge that has a composition score is in composition_vs_function (its oracle rows need
    only the edge), and a method x comp without such an edge has no rows."""
    agreement: list[dict] = []
    replicates: list[dict] = []
    if not _has(con, "edge_attribution", "method"):
        return _frames(agreement, replicates)
    done: list[tuple[str, str, CompFunction, tuple[CompDraws, list[Future[np.ndarray]]] | None]] = []
    with ThreadPoolExecutor(max(1, workers)) as pool:
        edges: dict[tuple[str, str], pl.DataFrame] = {}
        for model, checkpoint, method in con.execute(
                "SELECT DISTINCT model, checkpoint, method FROM edge_attribution WHERE model IS NOT NULL "
                "AND checkpoint IS NOT NULL AND method IS NOT NULL ORDER BY ALL").fetchall():
            if (model, checkpoint) not in edges:
                edges = {(model, checkpoint): function_edges(con, model, checkpoint)}  # the one model x checkpoint kept
            for comp in COMPS:
                prepared = comp_bootstraps(comp_edges(con, model, checkpoint, method, comp, edges[(model, checkpoint)]),
                                           method, comp, fdr)
                if prepared is not None:  # its bootstraps start now, while the next comps' edges are read
                    f, job = prepared
                    done.append((model, checkpoint, f, None if job is None else (job[0], [pool.submit(p) for p in job[1]])))
        for model, checkpoint, f, pending in done:
            if pending is not None:
                _fill(f, pending[0].result([future.result() for future in pending[1]]))
            agreement += comp_rows(model, checkpoint, f)
            replicates += bootstrap_rows(model, checkpoint, f)
    return _frames(agreement, replicates)


def _frames(agreement: list[dict], replicates: list[dict]) -> dict[str, pl.DataFrame]:
    return {"function_agreement": pl.DataFrame(agreement, schema=FUNCTION_AGREEMENT_SCHEMA),
            "function_bootstrap": pl.DataFrame(replicates, schema=FUNCTION_BOOTSTRAP_SCHEMA)}

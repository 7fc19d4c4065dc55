"""One model x checkpoint's edge attribution (``compatlas.function.edge_attribution``): the settings of
``induction.edge_attribution`` in, the ``edge_attribution`` table and its provenance out."""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Sequence

import polars as pl
import torch

from compatlas.function.agreement import edge_p_values
from compatlas.function.edge_attribution import (
    Edge,
    InductionTask,
    attribution_scores,
    attribution_work,
    causal_edges,
    exact_scores,
    gradient_rows,
    induction_task,
    mean_stderr,
    n_kv_heads,
)
from compatlas.function.edge_sums import EdgeSums, check_cover, sequence_share
from compatlas.function.exact_sample import exact_sample, top_edges
from compatlas.models.cpu_matmul import cpu_matmul
from compatlas.multiple_testing import bh_q_values
from compatlas.progress import Progress
from compatlas.tables import EDGE_ATTRIBUTION_SCHEMA
from compatlas.vocab import COMPS, EXACT_PATCHING_KEYS, Comp

log = logging.getLogger(__name__)
def _grid(model, values: dict[str, dict[Comp, torch.Tensor]]) -> dict[str, list]:
    """Columns of every causal edge per comp, K/V edges on each query head of their KV group,
    from comp -> [L, H, L, width] tensors (``values`` names the column of each)."""
    L, H = model.cfg.n_layers, model.cfg.n_heads
    g = H // n_kv_heads(model)
    lw, hw, lr, hr = torch.meshgrid(*(torch.arange(n) for n in (L, H, L, H)), indexing="ij")
    keep = lw < lr
    cols: dict[str, list] = {k: [] for k in ("comp", "writer_layer", "writer_head", "reader_layer", "reader_head",
                                             "reader_kv_head", *values)}
    for c in COMPS:
        r = hr if c == "Q" else hr // g
        cols["comp"] += [c] * int(keep.sum())
        for name, t in (("writer_layer", lw), ("writer_head", hw), ("reader_layer", lr), ("reader_head", hr),
                        ("reader_kv_head", hr // g)):
            cols[name] += t[keep].tolist()
        for name, per_comp in values.items():
            cols[name] += per_comp[c][lw, hw, lr, r][keep].tolist()
    return cols


def split_halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The means over the even and over the odd sequences (first axis): two independent estimates
    of the same edge's function, whose product is unbiased for its square (the sequences are drawn
    independently) and whose agreement is the measurement's own reliability (its noise ceiling)."""
    return EdgeSums.of({"K": x}).halves("K")


def _causal(model) -> torch.Tensor:
    """[L, 1, L, 1] True where the writer layer is below the reader layer."""
    L = model.cfg.n_layers
    return (torch.arange(L)[:, None] < torch.arange(L)[None, :])[:, None, :, None]


def edge_tests(model, mean: torch.Tensor, se: torch.Tensor, n_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per edge of one comp ([L, H, L, width]): the t-test p-value of its mean attribution against
    0 and its Benjamini-Hochberg q over the comp's causal edges (each K/V edge once, into its KV
    head: the unit that is patched, not each query head that reads it)."""
    p = torch.from_numpy(edge_p_values(mean.numpy(), se.numpy(), n_sequences))
    causal = _causal(model).expand_as(mean)
    q = torch.full_like(p, math.nan)
    q[causal] = torch.from_numpy(bh_q_values(p[causal].numpy()))
    return p, q


def edge_table(model, sums: dict[str, EdgeSums], exact_edges: Sequence[Edge],
               exact: torch.Tensor, n_random: int | None = None) -> pl.DataFrame:
    """One row per method x causal edge (x query head of a KV group for K/V): the mean score over
    sequences, its standard error, the means over the even and the odd sequences (split halves),
    the t-test's p and q (``edge_tests``), and the exact patching value where measured (else null),
    with ``exact_sample``: ``random`` for the first ``n_random`` of ``exact_edges`` (the stratified
    draw; None: all of them), ``top`` for the rest (``top_edges``). ``sums``: each method's sums
    over the sequences (``EdgeSums``)."""
    L, H = model.cfg.n_layers, model.cfg.n_heads
    width = {"Q": H, "K": n_kv_heads(model), "V": n_kv_heads(model)}
    ex = {c: torch.full((L, H, L, width[c]), math.nan, dtype=torch.float64) for c in COMPS}
    ex_se = {c: t.clone() for c, t in ex.items()}
    kind = {c: t.clone() for c, t in ex.items()}  # 1: the random draw, 2: a top edge added to it
    n_random = len(exact_edges) if n_random is None else n_random
    if len(exact_edges):
        mean, se = mean_stderr(exact.T)
        for i, (e, m, s) in enumerate(zip(exact_edges, mean.tolist(), se.tolist())):
            at = (e.writer_layer, e.writer_head, e.reader_layer, e.reader_index)
            ex[e.comp][at], ex_se[e.comp][at], kind[e.comp][at] = m, s, 1.0 if i < n_random else 2.0
    frames = []
    for method, per in sums.items():
        n_seq = per.n
        cols_of: dict[str, dict[Comp, torch.Tensor]] = {k: {} for k in (
            "score", "score_stderr", "score_half_a", "score_half_b", "p_value", "q_value")}
        for c in COMPS:
            mean, se = per.mean(c), per.stderr(c)
            half_a, half_b = per.halves(c)
            p, q = edge_tests(model, mean, se, n_seq)
            for k, v in zip(cols_of, (mean, se, half_a, half_b, p, q)):
                cols_of[k][c] = v
        cols = _grid(model, {**cols_of, "exact": ex, "exact_stderr": ex_se, "exact_kind": kind})
        n = len(cols["comp"])
        cols["exact_sample"] = [{1.0: "random", 2.0: "top"}.get(k) for k in cols.pop("exact_kind")]
        cols["method"] = [method] * n
        cols["n_sequences"] = [n_seq] * n
        frames.append(pl.DataFrame(cols).with_columns(
            pl.col("exact", "exact_stderr", "score_half_a", "score_half_b", "p_value", "q_value").fill_nan(None)))
    out = pl.concat(frames)
    return out.select([pl.col(k).cast(v) if k in out.columns else pl.lit(None, dtype=v).alias(k) for k, v in EDGE_ATTRIBUTION_SCHEMA.items()
                       if k not in ("model", "checkpoint")])


def composition_grid(model, composition: pl.DataFrame | None) -> dict[Comp, torch.Tensor] | None:
    """A composition shard's scores (``COMPOSITION_SCHEMA`` rows of one metric x space) as comp ->
    [L, H, L, width] per edge: a K/V edge's is the largest of its KV group's query heads' (as
    ``composition_vs_function`` compares them); NaN where the shard has none."""
    if composition is None:
        return None
    L, H = model.cfg.n_layers, model.cfg.n_heads
    g = H // n_kv_heads(model)
    units = composition.filter((pl.col("writer_layer") < L) & (pl.col("reader_layer") < L)).with_columns(
        unit=pl.when(pl.col("comp") == "Q").then(pl.col("reader_head")).otherwise(pl.col("reader_head") // g),
        score=pl.col("score").fill_nan(None)).group_by("comp", "writer_layer", "writer_head", "reader_layer", "unit"
                                                       ).agg(pl.col("score").max())
    out = {}
    for c in COMPS:
        t = torch.full((L, H, L, H if c == "Q" else H // g), math.nan, dtype=torch.float64)
        rows = units.filter(pl.col("comp") == c)
        idx = tuple(torch.tensor(rows[k].to_numpy(), dtype=torch.long)
                    for k in ("writer_layer", "writer_head", "reader_layer", "unit"))
        t[idx] = torch.tensor(rows["score"].fill_null(math.nan).to_numpy(), dtype=torch.float64)
        out[c] = t
    return out


def gradient_batch(model, task: InductionTask, settings: dict) -> int:
    """The sequences an EAP batch holds on ``task`` (its provenance's ``gradient_batch``):
    ``gradient_rows``, at most the task's sequences."""
    return min(len(task.clean), gradient_rows(model, task, settings["batch_size"], settings.get("memory_gb")))


def attribution_sums(model, task: InductionTask, settings: dict, rows: slice | None = None
                     ) -> tuple[dict[str, EdgeSums], dict[str, float]]:
    """Every method of ``settings["methods"]`` for every causal edge over the task's sequences
    ``rows`` (None: all): each method's ``EdgeSums`` and its seconds."""
    rows = slice(0, len(task.clean)) if rows is None else rows
    share = task.share(rows)
    S = len(share.clean)
    sums: dict[str, EdgeSums] = {}
    seconds: dict[str, float] = {}
    for method in settings["methods"]:
        work, unit = attribution_work(model, method, S, settings["steps"])
        tm = time.perf_counter()
        per_sequence = attribution_scores(model, share, method, settings["steps"], settings["batch_size"],
                                          Progress(log, f"edge attribution ({method})", work, unit),
                                          settings.get("memory_gb"))
        sums[method] = EdgeSums.of(per_sequence, rows.start)
        del per_sequence
        seconds[method] = round(time.perf_counter() - tm, 3)
        log.info("%s: %d edges x %d sequences in %.1fs", method, len(causal_edges(model)), S, seconds[method])
    return sums, seconds


def attribute_share(model, tokens, settings: dict, seed: int, job: int, jobs: int
                    ) -> tuple[dict[str, EdgeSums], dict]:
    """Attribution job ``job`` of ``jobs`` (``induction.edge_attribution.jobs``): every method
    over its share of the sequences (``sequence_share``), as sums, and its facts."""
    S = settings["sequences"]
    task = induction_task(tokens, S, settings["length"], seed)
    rows = sequence_share(S, jobs, job)
    sums, seconds = attribution_sums(model, task, settings, rows)
    return sums, {"job": job, "jobs": jobs, "sequences_from": rows.start, "sequences_to": rows.stop,
                  "method_seconds": seconds, "gradient_batch": gradient_batch(model, task, settings)}


def merged_sums(shares: Sequence[tuple[dict[str, EdgeSums], dict]], settings: dict
                ) -> tuple[dict[str, EdgeSums], dict[str, float], int]:
    """The attribution jobs' sums and facts (``attribute_share``) merged: each method's sums over
    every sequence, its seconds over the jobs, and the jobs' EAP batch. Jobs that do not cover the
    sequences once are refused."""
    check_cover(((f["sequences_from"], f["sequences_to"]) for _, f in shares), settings["sequences"], "attribution")
    sums = {m: functools.reduce(EdgeSums.merge, [s[m] for s, _ in shares]) for m in settings["methods"]}
    seconds = {m: round(sum(f["method_seconds"][m] for _, f in shares), 3) for m in settings["methods"]}
    return sums, seconds, shares[0][1]["gradient_batch"]


def draw_exact(model, sums: dict[str, EdgeSums], composition: pl.DataFrame | None, settings: dict, seed: int
               ) -> tuple[list[Edge], int]:
    """The edges exact patching measures: the draw stratified over the first method's |score| and
    over ``composition`` (``exact_sample``), then the top edges beside it (``top_edges``); and how
    many of them the draw gave. It depends on the sums, the composition and the seed only, so every
    job that merges the same sums draws the same sample."""
    first = sums[settings["methods"][0]]
    grid = composition_grid(model, composition)
    edges = causal_edges(model)
    drawn = exact_sample({c: first.mean(c) for c in COMPS}, grid, edges, settings["exact_edges"], seed)
    # beside the draw, what matters: each method's largest |score| and the composition's largest scores
    tops = [{c: per.mean(c).abs() for c in COMPS} for per in sums.values()] + ([grid] if grid is not None else [])
    return drawn + top_edges(tops, edges, settings.get("exact_top", 0), drawn), len(drawn)


def exact_facts(model, settings: dict, composition: pl.DataFrame | None, sample: Sequence[Edge], n_drawn: int,
                exact_sequences: int) -> dict:
    """What an edge attribution shard records of its exact sample."""
    return {"edges": len(causal_edges(model)), "exact_edges": len(sample), "exact_random": n_drawn,
            "exact_top": len(sample) - n_drawn, "exact_sequences": exact_sequences,
            "exact_stratified_by": "|score| of " + settings["methods"][0]
            + ("" if composition is None else " and composition " + "/".join(
                str(composition[k][0]) for k in ("metric", "space") if k in composition.columns and composition.height)),
            "corruption": "every token but BOS resampled"}


def attribute_edges(model, tokens, settings: dict, seed: int = 0, composition: pl.DataFrame | None = None,
                    shares: Sequence[tuple[dict[str, EdgeSums], dict]] = ()) -> tuple[pl.DataFrame, dict]:
    """Every method of ``settings["methods"]`` for every causal edge, and exact patching of the
    sample ``draw_exact`` draws, stratified over the first method's |score| and over
    ``composition`` (one metric x space's composition rows; None: |score| alone), on the first
    ``exact_sequences`` sequences. ``tokens``: a TokenSet. ``shares``: the attribution jobs' sums
    and facts (``attribute_share``), merged here; none: the methods run here, over every sequence."""
    task = induction_task(tokens, settings["sequences"], settings["length"], seed)
    t0 = time.perf_counter()
    if shares:
        sums, seconds, batch = merged_sums(shares, settings)
    else:
        sums, seconds = attribution_sums(model, task, settings)
        batch = gradient_batch(model, task, settings)
    t1 = time.perf_counter()
    sample, n_drawn = draw_exact(model, sums, composition, settings, seed)
    sub = task.first(settings["exact_sequences"])
    exact = exact_scores(model, sub, sample, settings["batch_size"],
                         Progress(log, "exact edge patching", len(sample) * len(sub.clean), "edge x sequence"))
    log.info("exact patching: %d edges x %d sequences in %.1fs", len(sample), len(sub.clean), time.perf_counter() - t1)
    facts = {**exact_facts(model, settings, composition, sample, n_drawn, len(sub.clean)),
             "gradient_batch": batch, "attribution_jobs": max(1, len(shares)),
             "attribution_seconds": round(sum(seconds.values()), 3) if shares else round(t1 - t0, 3),
             "method_seconds": seconds, "exact_seconds": round(time.perf_counter() - t1, 3)}
    return edge_table(model, sums, sample, exact, n_drawn), facts


def boot_for_edges(model_id: str, entry: dict, checkpoint: dict | None, settings: dict, meta_path: str,
                   workdir, device: str = "auto"):
    """Boot one model (x checkpoint) as the induction job does (same devices, dtypes and token
    pool) for edge attribution: the booted model (``induction.boot_for_forward``) and its token
    pool (a TokenSet). ``settings``: the model's ``induction`` section."""
    from compatlas.behaviour.induction import boot_for_forward
    from compatlas.behaviour.tokens import clean_tokens, sample_tokens, token_directions, token_set

    edge = settings["edge_attribution"]
    need = 2 * edge["length"] + 1
    m = boot_for_forward(model_id, entry, checkpoint, settings, meta_path, workdir, device, "edge attribution",
                         lambda n_ctx: f"induction.edge_attribution.length {edge['length']} needs {need}"
                         if need > n_ctx else None)
    clean, _ = clean_tokens(m.bridge.tokenizer, m.W_E, token_directions(m.W_E, m.W_U))
    return m, token_set(m.bridge.tokenizer, sample_tokens(clean, settings["pool"], settings["seed"], "pool"),
                        settings["prepend_bos"])


def record_of(m, settings: dict, **facts) -> dict:
    """An edge attribution shard's provenance: the model's, the settings, how it was booted."""
    from compatlas.tables import provenance

    return provenance(m.meta, processing="none", weight_processing="none (forward passes on the loaded model)",
                      settings=settings["edge_attribution"], dtype=str(m.dtype).removeprefix("torch."),
                      device_map=m.device_map, device=str(m.device),
                      kv_group=m.bridge.cfg.n_heads // n_kv_heads(m.bridge), **facts)


def boot_and_attribute_share(model_id: str, entry: dict, checkpoint: dict | None, settings: dict, meta_path: str,
                             workdir, job: int, jobs: int, device: str = "auto") -> tuple[pl.DataFrame, dict]:
    """Attribution job ``job`` of ``jobs`` on the booted model: its sums as rows of
    ``EDGE_SUMS_SCHEMA`` (every method) and its shard's provenance (the counts per method in ``counts``)."""
    t0 = time.perf_counter()
    m, tokens = boot_for_edges(model_id, entry, checkpoint, settings, meta_path, workdir, device)
    with cpu_matmul(settings["cpu_matmul"], m.device) as matmul:
        sums, facts = attribute_share(m.bridge, tokens, settings["edge_attribution"], settings["seed"], job, jobs)
    frame = pl.concat([s.frame(method) for method, s in sums.items()])
    return frame, record_of(m, settings, counts={k: s.counts() for k, s in sums.items()}, **facts, cpu_matmul=matmul,
                          seconds=round(time.perf_counter() - t0, 3))


def read_share(df: pl.DataFrame, record: dict, model) -> tuple[dict[str, EdgeSums], dict]:
    """An attribution job's shard (``boot_and_attribute_share``) back as ``attribute_edges``' share."""
    L, H, kv = model.cfg.n_layers, model.cfg.n_heads, n_kv_heads(model)
    shapes: dict[Comp, tuple[int, ...]] = {"Q": (L, H, L, H), "K": (L, H, L, kv), "V": (L, H, L, kv)}
    return ({method: EdgeSums.from_frame(df.filter(pl.col("method") == method), counts, shapes)
             for method, counts in record["counts"].items()}, record)


def refuse_other_settings(shards: Sequence[tuple[pl.DataFrame, dict]], want: dict, what: str) -> None:
    """Refuse a job's shard (rows and provenance) computed with settings other than ``want``: it
    would merge silently into wrong figures. ``what`` names the shard in the message."""
    for _, record in shards:
        if record.get("settings") != want:
            raise ValueError(f"{what} (job {record.get('job')}) was computed with the settings "
                             f"{record.get('settings')}, not this run's {want}: delete it and rerun")


def check_share_settings(shares: Sequence[tuple[pl.DataFrame, dict]], settings: dict) -> None:
    """``refuse_other_settings`` for the attribution jobs' shards: this run's settings beside the
    exact-patching ones (``EXACT_PATCHING_KEYS``), which they do not read."""
    attribution = {k: v for k, v in settings["edge_attribution"].items() if k not in EXACT_PATCHING_KEYS}
    refuse_other_settings(shares, attribution, "an attribution share")


def boot_and_attribute_edges(model_id: str, entry: dict, checkpoint: dict | None, settings: dict, meta_path: str,
                             workdir, device: str = "auto", composition: pl.DataFrame | None = None,
                             shares: Sequence[tuple[pl.DataFrame, dict]] = ()) -> tuple[pl.DataFrame, dict]:
    """Boot one model (x checkpoint) and attribute its edges: the ``edge_attribution`` table and
    its shard's provenance. ``settings``: the model's ``induction`` section (``edge_attribution``
    in it); ``composition``: the composition rows exact patching's sample is stratified over
    (``attribute_edges``); ``shares``: the attribution jobs' shards (rows and provenance), if
    the sequences were split over jobs (``induction.edge_attribution.jobs``)."""
    t0 = time.perf_counter()
    check_share_settings(shares, settings)
    m, tokens = boot_for_edges(model_id, entry, checkpoint, settings, meta_path, workdir, device)
    with cpu_matmul(settings["cpu_matmul"], m.device) as matmul:
        table, facts = attribute_edges(m.bridge, tokens, settings["edge_attribution"], settings["seed"], composition,
                                       [read_share(df, record, m.bridge) for df, record in shares])
    label = m.meta.get("checkpoint", "final")
    table = table.with_columns(model=pl.lit(model_id), checkpoint=pl.lit(label)).select(list(EDGE_ATTRIBUTION_SCHEMA))
    return table, record_of(m, settings, **facts, cpu_matmul=matmul, seconds=round(time.perf_counter() - t0, 3))

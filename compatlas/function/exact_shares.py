"""Exact patching split over jobs, beside the attribution split (``induction.edge_attribution.jobs``).

Where the attribution runs as several jobs, exact patching would otherwise be the longest link of a
large model's chain, one job on one core after them (SmolLM2: 4,288 edge x sequence forwards,
about 250 s). So it is split as well, over the exact sequences:

- each exact job merges the attribution jobs' sums (``edge_measure.merged_sums``) and draws the
  sample from them (``edge_measure.draw_exact``). The draw depends on the merged means, the
  composition and the seed only, so every job draws the same edges as one job would;
- it patches that sample on its consecutive share of the first ``exact_sequences`` sequences
  (``exact_rows``) and writes one row per edge x sequence (``EXACT_VALUES_SCHEMA``);
- the edge attribution job then only merges (``merge_exact``). It draws the sample again, checks
  that every exact job patched that sample, stacks their values over the sequences and builds
  the table. It boots no model: the table needs only the model's shape (``ModelShape``, from the
  extraction's metadata), and its provenance is the exact jobs'.

Each edge x sequence is patched exactly as one job patches it; only the batches that hold them
differ, so the values agree with one job's to float rounding.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import polars as pl
import torch

from compatlas.function.edge_attribution import Edge, exact_scores, induction_task
from compatlas.function.edge_measure import (
    boot_for_edges,
    check_share_settings,
    draw_exact,
    edge_table,
    exact_facts,
    merged_sums,
    read_share,
    record_of,
    refuse_other_settings,
)
from compatlas.function.edge_sums import check_cover
from compatlas.models.cpu_matmul import cpu_matmul
from compatlas.progress import Progress
from compatlas.tables import EDGE_ATTRIBUTION_SCHEMA, EXACT_VALUES_SCHEMA

log = logging.getLogger(__name__)

# what an exact job's provenance says of its own share, not of the model or the merged table
SHARE_FACTS = ("job", "jobs", "sequences_from", "sequences_to", "exact_random", "exact_seconds", "seconds")


@dataclass(frozen=True)
class ModelShape:
    """A model's shape as ``model.cfg`` holds it (``cfg`` is the shape itself): all that the edge
    table and the sample's draw read of a model, so that the merge job need not boot one."""

    n_layers: int
    n_heads: int
    n_key_value_heads: int

    @property
    def cfg(self) -> ModelShape:
        return self

    @classmethod
    def of(cls, meta: dict) -> ModelShape:
        """From the extraction's metadata (``meta.json``)."""
        return cls(int(meta["n_layers"]), int(meta["n_heads"]), int(meta.get("n_kv_heads") or meta["n_heads"]))


def exact_rows(sequences: int, jobs: int, job: int) -> slice:
    """Exact job ``job`` of ``jobs``'s consecutive share of the ``sequences`` exact sequences (as
    equal as they divide: the exact figures are means over all of them, no halves to keep)."""
    if not 0 <= job < jobs <= sequences:
        raise ValueError(f"exact job {job} of {jobs} over {sequences} sequences: each job needs one or more")
    return slice(job * sequences // jobs, (job + 1) * sequences // jobs)


def values_frame(sample: Sequence[Edge], exact: torch.Tensor, first: int) -> pl.DataFrame:
    """``exact`` [edges, sequences] as rows of ``EXACT_VALUES_SCHEMA``, the first sequence the task's ``first``-th."""
    E, S = exact.shape
    return pl.DataFrame({
        "edge": [i for i in range(E) for _ in range(S)],
        **{k: [getattr(e, k) for e in sample for _ in range(S)]
           for k in ("comp", "writer_layer", "writer_head", "reader_layer", "reader_index")},
        "sequence": list(range(first, first + S)) * E,
        "exact": exact.reshape(-1).tolist(),
    }, schema=EXACT_VALUES_SCHEMA)


def patch_share(model, tokens, settings: dict, seed: int, composition: pl.DataFrame | None,
                shares: Sequence[tuple[dict, dict]], job: int, jobs: int) -> tuple[pl.DataFrame, dict]:
    """Exact job ``job`` of ``jobs`` (module docstring): the sample's exact values on its share of
    the exact sequences, as rows, and its facts. ``shares``: the attribution jobs' sums and facts."""
    sums, _, _ = merged_sums(shares, settings)
    sample, n_drawn = draw_exact(model, sums, composition, settings, seed)
    task = induction_task(tokens, settings["sequences"], settings["length"], seed).first(settings["exact_sequences"])
    rows = exact_rows(len(task.clean), jobs, job)
    t0 = time.perf_counter()
    n = rows.stop - rows.start
    exact = exact_scores(model, task.share(rows), sample, settings["batch_size"],
                         Progress(log, f"exact edge patching (job {job} of {jobs})", len(sample) * n, "edge x sequence"))
    seconds = round(time.perf_counter() - t0, 3)
    log.info("exact patching: %d edges x %d sequences (%d to %d) in %.1fs", len(sample), n, rows.start, rows.stop, seconds)
    return values_frame(sample, exact, rows.start), {
        "job": job, "jobs": jobs, "sequences_from": rows.start, "sequences_to": rows.stop, "exact_random": n_drawn,
        "exact_seconds": seconds}


def boot_and_patch_share(model_id: str, entry: dict, checkpoint: dict | None, settings: dict, meta_path: str,
                         workdir, job: int, jobs: int, device: str = "auto", composition: pl.DataFrame | None = None,
                         shares: Sequence[tuple[pl.DataFrame, dict]] = ()) -> tuple[pl.DataFrame, dict]:
    """``patch_share`` on the booted model: its rows and its shard's provenance. ``settings``: the
    model's ``induction`` section; ``shares``: the attribution jobs' shards (rows and provenance)."""
    t0 = time.perf_counter()
    check_share_settings(shares, settings)
    m, tokens = boot_for_edges(model_id, entry, checkpoint, settings, meta_path, workdir, device)
    with cpu_matmul(settings["cpu_matmul"], m.device) as matmul:
        frame, facts = patch_share(m.bridge, tokens, settings["edge_attribution"], settings["seed"], composition,
                                   [read_share(df, record, m.bridge) for df, record in shares], job, jobs)
    return frame, record_of(m, settings, **facts, cpu_matmul=matmul, seconds=round(time.perf_counter() - t0, 3))


def stack_exact(sample: Sequence[Edge], parts: Sequence[tuple[pl.DataFrame, dict]], sequences: int) -> torch.Tensor:
    """The exact jobs' values (``patch_share``'s rows and provenance) as one [edges, sequences]
    tensor; refused where a job patched another sample or the jobs do not cover the sequences once."""
    check_cover(((r["sequences_from"], r["sequences_to"]) for _, r in parts), sequences, "exact", "exact sequences")
    want = [(e.comp, e.writer_layer, e.writer_head, e.reader_layer, e.reader_index) for e in sample]
    out = torch.empty(len(sample), sequences, dtype=torch.float64)
    for df, record in parts:
        n = record["sequences_to"] - record["sequences_from"]
        df = df.sort("edge", "sequence")
        edges = df.filter(pl.col("sequence") == record["sequences_from"]).select(
            "comp", "writer_layer", "writer_head", "reader_layer", "reader_index").rows()
        if edges != want or df.height != len(sample) * n:
            raise ValueError(f"exact job {record.get('job')} patched another sample ({len(edges)} edges) than the one "
                             f"the attribution shares draw ({len(want)}): delete its shard and rerun")
        out[:, record["sequences_from"]:record["sequences_to"]] = torch.from_numpy(
            df["exact"].to_numpy().copy()).reshape(len(sample), n)
    return out


def exact_table(model, settings: dict, seed: int, composition: pl.DataFrame | None, shares: Sequence[tuple[dict, dict]],
                parts: Sequence[tuple[pl.DataFrame, dict]]) -> tuple[pl.DataFrame, dict]:
    """The edge table (``edge_measure.edge_table``) and its facts from the attribution jobs' sums
    and facts (``shares``) and the exact jobs' rows and facts (``parts``). ``model``: anything with
    the model's ``cfg`` shape (``ModelShape``)."""
    sums, seconds, batch = merged_sums(shares, settings)
    sample, n_drawn = draw_exact(model, sums, composition, settings, seed)
    n_exact = min(settings["exact_sequences"], settings["sequences"])
    exact = stack_exact(sample, parts, n_exact)
    return edge_table(model, sums, sample, exact, n_drawn), {
        **exact_facts(model, settings, composition, sample, n_drawn, n_exact), "gradient_batch": batch,
        "attribution_jobs": len(shares), "exact_jobs": len(parts), "attribution_seconds": round(sum(seconds.values()), 3),
        "method_seconds": seconds, "exact_seconds": round(sum(r["exact_seconds"] for _, r in parts), 3)}


def merge_exact(model_id: str, meta_path: str, settings: dict, composition: pl.DataFrame | None,
                shares: Sequence[tuple[pl.DataFrame, dict]], parts: Sequence[tuple[pl.DataFrame, dict]]
                ) -> tuple[pl.DataFrame, dict]:
    """The ``edge_attribution`` table and its provenance from the attribution jobs' shards
    (``shares``) and the exact jobs' (``parts``), rows and provenance each, with no model booted:
    the provenance is the exact jobs' (the model's, how it was booted) with the merged facts."""
    t0 = time.perf_counter()
    ea = settings["edge_attribution"]
    check_share_settings(shares, settings)
    refuse_other_settings(parts, ea, "an exact patching share")
    with open(meta_path) as f:
        meta = json.load(f)
    shape = ModelShape.of(meta)
    table, facts = exact_table(shape, ea, settings["seed"], composition,
                               [read_share(df, record, shape) for df, record in shares], parts)
    table = table.with_columns(model=pl.lit(model_id), checkpoint=pl.lit(meta.get("checkpoint", "final")))
    record = {k: v for k, v in parts[0][1].items() if k not in SHARE_FACTS}
    return table.select(list(EDGE_ATTRIBUTION_SCHEMA)), record | facts | {"seconds": round(time.perf_counter() - t0, 3)}

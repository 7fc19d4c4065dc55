"""The composition rule's job, from the weight shard on disk to one causal and one null shard per
metric: what ``scripts/composition.py`` runs and what ``benchmarks/bench_gpu_job.py`` times.

One job is one model x checkpoint x space x block: it reads only the layers its block's pairs
touch (``block_pairs`` and ``null_pairs``: at Llama-2-70B shapes the whole weight shard is 47 GiB,
a layer 0.6 GB), scores every metric at once (``table.score_space``: the metrics share the heads'
factors, the causal and null pairs the GEMMs) and writes each metric's rows as two sealed shards."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import polars as pl

from compatlas.composition.moments import load_moments
from compatlas.composition.scores import block_pairs, null_pairs, touched_layers
from compatlas.composition.table import score_space
from compatlas.models.weights import load_weights
from compatlas.storage import path_key, write_shard
from compatlas.tables import provenance
from compatlas.vocab import Metric, ScoreDtype, Space

log = logging.getLogger(__name__)

Path_ = str | os.PathLike[str]


def composition_job(tensors: Path_, meta: Path_, space: Space, causal: Sequence[Path_], null: Sequence[Path_], *,
                    layers: list[int], blocks: int, block: int, settings: dict, device: str = "auto",
                    dtype: ScoreDtype = "float32", moments: tuple[Path_, Path_] | None = None) -> dict:
    """Score block ``block`` of ``blocks`` of the pairs of ``layers`` (the model's scored layers)
    in ``space`` for the metric each of ``causal`` names (its ``metric=`` folder; ``null[i]`` is
    ``causal[i]``'s null shard) and write them. ``settings`` is the config's ``composition``
    section; ``moments`` the moments file and its metadata (the activation space). Returns the
    job's facts (its provenance, timings included)."""
    metrics: tuple[Metric, ...] = tuple(path_key(p, "metric") for p in causal)  # type: ignore[misc]
    pairs, null_p = block_pairs(layers, blocks, block), null_pairs(layers, blocks, block)
    w = load_weights(tensors, meta, layers=touched_layers(pairs + null_p) or layers[:1])
    log.info("%s/%s %s block %d, %s: %d layer pairs, %d null layer pairs", w.meta.get("model"), w.meta.get("checkpoint"),
             space, block, ", ".join(metrics), len(pairs), len(null_p))
    m = load_moments(*moments) if space == "activation" and moments is not None else None
    tables, facts = score_space(w, metrics, space, pairs + null_p, baseline_samples=settings["baseline_samples"],
                                seed=settings["seed"], device=device, dtype=dtype, max_condition=settings["max_condition"],
                                moments=m)
    is_causal = pl.col("writer_layer") < pl.col("reader_layer")
    for metric, causal_path, null_path in zip(metrics, causal, null, strict=True):
        df = tables[metric]
        record = provenance(w.meta, metric=metric, space=space, block=block, scored_with=list(metrics), **facts)
        write_shard(df.filter(is_causal), causal_path, record | {"layer_pairs": [list(p) for p in pairs]})
        write_shard(df.filter(~is_causal), null_path, record | {"layer_pairs": [list(p) for p in null_p]})
        log.info("%s: wrote %d causal and %d null rows", metric, df.filter(is_causal).height, df.filter(~is_causal).height)
    log.info("scored in %.1fs", facts["seconds"])
    return facts

"""The composition rule's job, from the weight shard on disk to one causal and one null shard per
metric: what ``scripts/composition.py`` runs and what ``benchmarks/bench_gpu_job.py`` times; and
the pattern_output rule's (``scripts/pattern_output.py``), which cuts the moments' scores.

One job is one model x checkpoint x space x block: it reads only the layers its block's pairs
touch (``block_pairs`` and ``null_pairs``: at Llama-2-70B shapes the whole weight shard is 47 GiB,
a layer 0.6 GB) and checks only those bytes against their seals (``load_weights``), scores every
metric at once (``table.score_space``: the metrics share the heads' factors, the causal and null
pairs the GEMMs) and writes each metric's rows as two sealed shards."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import polars as pl

from compatlas.composition.moments import load_moments
from compatlas.composition.scores import block_pairs, null_pairs, touched_layers
from compatlas.composition.table import pattern_output_table, score_space
from compatlas.models.weights import load_meta, load_weights
from compatlas.storage import path_key, write_shard
from compatlas.tables import provenance
from compatlas.vocab import TOKEN_SPACES, Metric, ScoreDtype, Space

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
    # the vocabulary side (W_E, W_U, the token-space factors: 4 GB at 70B) only where the space's basis
    # comes from it: the residual and activation spaces read neither it nor its seals
    w = load_weights(tensors, meta, layers=touched_layers(pairs + null_p) or layers[:1], vocabulary=space in TOKEN_SPACES)
    log.info("%s/%s %s block %d, %s: %d layer pairs, %d null layer pairs", w.meta.get("model"), w.meta.get("checkpoint"),
             space, block, ", ".join(metrics), len(pairs), len(null_p))
    m = load_moments(*moments) if space == "activation" and moments is not None else None
    tables, facts = score_space(w, metrics, space, pairs + null_p, baseline_samples=settings["baseline_samples"],
                                seed=settings["seed"], device=device, dtype=dtype, max_condition=settings["max_condition"],
                                moments=m)
    made_from = {"moments_sha256": m.meta.get("moments_sha256")} if m is not None else {}  # the statistics it scored on
    for metric, causal_path, null_path in zip(metrics, causal, null, strict=True):
        record = provenance(w.meta, metric=metric, space=space, block=block, scored_with=list(metrics), **made_from,
                            **facts)
        write_block(tables[metric], causal_path, null_path, record, pairs, null_p)
    log.info("scored in %.1fs", facts["seconds"])
    return facts


def pattern_output_job(meta: Path_, moments: tuple[Path_, Path_], causal: Path_, null: Path_, *, layers: list[int],
                       blocks: int, block: int) -> None:
    """``pattern_output``'s shards of block ``block`` of ``blocks``: its scores, measured by the
    moments rule on the model's forward pass, cut into the block's rows (``table.pattern_output_table``)."""
    meta_d, m = load_meta(meta), load_moments(*moments)
    pairs, null_p = block_pairs(layers, blocks, block), null_pairs(layers, blocks, block)
    record = provenance(meta_d, metric="pattern_output", space="activation", block=block,
                        pattern_output="the moments rule's forward pass (compatlas.composition.pattern_output)",
                        moments_positions=m.meta.get("positions"), moments_sha256=m.meta.get("moments_sha256"))
    write_block(pattern_output_table(meta_d, pairs + null_p, m), causal, null, record, pairs, null_p)


def write_block(df: pl.DataFrame, causal: Path_, null: Path_, record: dict, pairs: list[tuple[int, int]],
                null_p: list[tuple[int, int]]) -> None:
    """One metric's rows of a block as its two sealed shards: the causal pairs (writer layer <
    reader layer) and the null pairs, each with the provenance ``record`` and its layer pairs."""
    is_causal = pl.col("writer_layer") < pl.col("reader_layer")
    write_shard(df.filter(is_causal), causal, record | {"layer_pairs": [list(p) for p in pairs]})
    write_shard(df.filter(~is_causal), null, record | {"layer_pairs": [list(p) for p in null_p]})
    log.info("%s: wrote %d causal and %d null rows", record["metric"], df.filter(is_causal).height,
             df.filter(~is_causal).height)

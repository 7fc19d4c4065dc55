"""Every table compatlas writes: its columns, their order and types, and the provenance record.

The writers (``composition_table``, ``calibration``, ``invariance``, ``metric_audit``,
``induction``, ``training``) build their frames with these schemas, and the atlas types its
views with the same dicts, so a view never disagrees with its shards and an empty view (no
shards yet) has the right columns. A schema dict's order is the column order of the shards.

Every shard carries a provenance record in its Parquet metadata (``storage.write_shard``),
made by ``provenance`` alone, so all shards answer the same questions the same way: which
model and checkpoint, from which source and weights, processed how, by which library
versions, plus what the writer adds (its metric, space, settings, seconds...).

Imports only polars and the standard library: the atlas and the CLI read these without
loading torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from compatlas.runtime import library_versions

Schema = dict[str, type[pl.DataType]]

# ----------------------------------------------------------------------------- composition

# One row per scored head pair (``composition_table.score_block``): the causal pairs (writer
# layer < reader layer) make the ``composition`` view, the others ``composition_null``.
COMPOSITION_SCHEMA: Schema = {
    "model": pl.Utf8, "checkpoint": pl.Utf8, "processing": pl.Utf8, "space": pl.Utf8, "metric": pl.Utf8,
    "comp": pl.Utf8, "writer_layer": pl.Int32, "writer_head": pl.Int32, "reader_layer": pl.Int32,
    "reader_head": pl.Int32, "score": pl.Float64, "baseline_gaussian_mean": pl.Float64,
    "baseline_gaussian_std": pl.Float64, "baseline_spectrum_mean": pl.Float64, "baseline_spectrum_std": pl.Float64,
    # contribution and pattern_output only: the score over the reader's own logit (Q, K) or output (V) RMS
    "score_share": pl.Float64,
}

# p- and q-values of every causal pair against its null pairs (``calibration.calibrate``), a row
# per reader query head; ``test_unit`` (vocab.TEST_UNITS) says whether its test is that query
# head's or its KV head's (``reader_kv_head``), shared by the query heads of that KV group.
CALIBRATION_SCHEMA: Schema = {
    "model": pl.Utf8, "checkpoint": pl.Utf8, "processing": pl.Utf8, "metric": pl.Utf8, "space": pl.Utf8,
    "comp": pl.Utf8, "writer_layer": pl.Int32, "writer_head": pl.Int32, "reader_layer": pl.Int32,
    "reader_head": pl.Int32, "test_unit": pl.Utf8, "reader_kv_head": pl.Int32, "n_null": pl.Int64,
    "p_value": pl.Float64, "q_value": pl.Float64,
}

# ----------------------------------------------------------------------------- audits

# One row per transform class x metric x space x comp (``invariance.audit``).
INVARIANCE_SCHEMA: Schema = {
    "model": pl.Utf8, "checkpoint": pl.Utf8, "processing": pl.Utf8, "transform": pl.Utf8,
    "metric": pl.Utf8, "space": pl.Utf8, "comp": pl.Utf8, "spearman": pl.Float64,
    "max_abs_change": pl.Float64, "top_k": pl.Int64, "top_k_overlap": pl.Float64,
    "top_k_kept": pl.Boolean, "log10_scale_range": pl.Float64,
}

# One row per metric x space x axiom check (``metric_audit.run_audit``).
METRIC_AUDIT_SCHEMA: Schema = {
    "metric": pl.Utf8, "space": pl.Utf8, "axiom": pl.Utf8, "construction": pl.Utf8, "value": pl.Float64,
    "expected": pl.Float64, "passed": pl.Boolean, "detail": pl.Utf8,
}

# ----------------------------------------------------------------------------- behaviour

# Induction powers per measured token, role and filler setting (``induction.induction_sweep``).
INDUCTION_TOKENS_SCHEMA: Schema = {
    "model": pl.Utf8, "checkpoint": pl.Utf8, "filler_before": pl.Int32, "filler_between": pl.Int32,
    "token_id": pl.Int64, "token_text": pl.Utf8, "role": pl.Utf8, "n": pl.Int64, "mean": pl.Float64,
    "std": pl.Float64, "stderr": pl.Float64, "near_b_id": pl.Int64, "near_b_cosine": pl.Float64,
    "near_b_mean": pl.Float64, "near_b_stderr": pl.Float64, "random_mean": pl.Float64, "random_stderr": pl.Float64,
}

# Attention scores and ablation drop per head (``induction.head_attention_scores`` joined
# with ``induction.ablation_effects``).
HEAD_SCORES_SCHEMA: Schema = {
    "model": pl.Utf8, "checkpoint": pl.Utf8, "layer": pl.Int32, "head": pl.Int32,
    "prev_token_mean": pl.Float64, "prev_token_std": pl.Float64, "duplicate_mean": pl.Float64,
    "duplicate_std": pl.Float64, "induction_mean": pl.Float64, "induction_std": pl.Float64,
    "n_sequences": pl.Int64, "ablation": pl.Utf8, "ablation_method": pl.Utf8, "ablation_sequences": pl.Int64,
    "ablation_drop": pl.Float64, "ablation_drop_stderr": pl.Float64, "clean_strength": pl.Float64,
}

# The effect of every causal writer -> reader edge per comp on the induction task
# (``edge_measure.attribute_edges``): one row per method x edge (K/V edges of a KV group on each
# of its query heads, ``reader_kv_head``), ``exact`` where edge patching measured it. The split
# halves (means over the even and the odd sequences) and the per-edge t-test (p, and q over the
# comp's edges) make the measurement's own noise queryable (docs/edge_attribution.md).
EDGE_ATTRIBUTION_SCHEMA: Schema = {
    "model": pl.Utf8, "checkpoint": pl.Utf8, "comp": pl.Utf8, "writer_layer": pl.Int32, "writer_head": pl.Int32,
    "reader_layer": pl.Int32, "reader_head": pl.Int32, "reader_kv_head": pl.Int32, "method": pl.Utf8,
    "score": pl.Float64, "score_stderr": pl.Float64, "score_half_a": pl.Float64, "score_half_b": pl.Float64,
    "p_value": pl.Float64, "q_value": pl.Float64, "exact": pl.Float64, "exact_stderr": pl.Float64,
    "n_sequences": pl.Int64, "exact_sample": pl.Utf8,
}

# An attribution job's share of the sequences, summed per edge (``function.edge_sums.EdgeSums``):
# every entry of a method x comp's [writer layer, writer head, reader layer, reader head] tensor,
# flattened to ``index``; not a view (the edge attribution job merges the shares into its table).
EDGE_SUMS_SCHEMA: Schema = {
    "method": pl.Utf8, "comp": pl.Utf8, "index": pl.Int64, "total": pl.Float64, "m2": pl.Float64,
    "even": pl.Float64, "odd": pl.Float64,
}

# An exact-patching job's share of the exact sequences (``function.exact_shares``): the patched
# value M(edge patched) - M(clean) of every edge of the sample (``edge``: its place in the sample)
# on each of the job's sequences (``sequence``: its index in the task); not a view (the edge
# attribution job stacks the shares into its table's ``exact`` and ``exact_stderr``).
EXACT_VALUES_SCHEMA: Schema = {
    "edge": pl.Int32, "comp": pl.Utf8, "writer_layer": pl.Int32, "writer_head": pl.Int32, "reader_layer": pl.Int32,
    "reader_index": pl.Int32, "sequence": pl.Int64, "exact": pl.Float64,
}

# The loss of every step of the pipeline's own training runs (``training.train_segment``).
TRAINING_LOSS_SCHEMA: Schema = {"model": pl.Utf8, "step": pl.Int64, "tokens": pl.Int64, "loss": pl.Float64}

# ----------------------------------------------------------------------------- the atlas

# The atlas's views over shards: view name -> the schema of its shards.
SHARD_VIEWS: dict[str, Schema] = {
    "composition": COMPOSITION_SCHEMA, "composition_null": COMPOSITION_SCHEMA, "calibration": CALIBRATION_SCHEMA,
    "invariance": INVARIANCE_SCHEMA, "metric_audit": METRIC_AUDIT_SCHEMA,
    "induction_tokens": INDUCTION_TOKENS_SCHEMA, "head_scores": HEAD_SCORES_SCHEMA,
    "edge_attribution": EDGE_ATTRIBUTION_SCHEMA, "training_loss": TRAINING_LOSS_SCHEMA,
}

# The columns of a shard that must hold a number: NaN or inf there comes from non-finite inputs,
# never from the measurement, so ``storage.write_shard`` refuses to seal such a shard (NaN shards
# had been sealed from a model with one NaN weight, and only the report failed, naming no file).
# The other float columns may be NaN where a statistic is undefined (a standard deviation or a
# t-test of one sequence, a rank correlation of constant scores, an audit's expected value) or NULL
# where a metric has no such figure (a magnitude's Gaussian baseline). A composition score too: a
# head whose weights are all zero has a normalised score of 0/0 (and its p-value follows); NaN
# weights never get that far (extraction refuses them, naming the tensor).
MUST_BE_FINITE: dict[str, tuple[str, ...]] = {
    "head_scores": ("prev_token_mean", "duplicate_mean", "induction_mean", "ablation_drop"),
    "induction_tokens": ("mean",), "edge_attribution": ("score",), "training_loss": ("loss",),
}


def nonfinite_counts(df: pl.DataFrame) -> dict[str, int]:
    """Column -> how many NaN or infinite values, over the ``MUST_BE_FINITE`` columns of the view
    whose schema ``df`` has (none for a frame of no view's schema)."""
    views = [v for v, schema in SHARD_VIEWS.items() if set(df.columns) == set(schema)]
    cols = {c for v in views for c in MUST_BE_FINITE.get(v, ())}
    counts = {c: int((~df[c].is_finite()).fill_null(False).sum()) for c in sorted(cols)}
    return {c: n for c, n in counts.items() if n}


# The atlas's ``models`` table: one row per model x checkpoint, from the extraction's metadata
# (``versions`` and ``norm_gains`` as JSON text).
MODELS_SCHEMA: Schema = {
    "model": pl.Utf8, "checkpoint": pl.Utf8, "checkpoint_step": pl.Int64, "checkpoint_tokens": pl.Int64,
    "architecture": pl.Utf8, "hf_architecture": pl.Utf8, "n_layers": pl.Int64, "n_heads": pl.Int64,
    "n_kv_heads": pl.Int64, "d_model": pl.Int64, "d_head": pl.Int64, "d_vocab": pl.Int64, "norm_type": pl.Utf8,
    "tied_embeddings": pl.Boolean, "has_unembed": pl.Boolean, "token_condition": pl.Float64,
    "token_norm_condition": pl.Float64, "processing": pl.Utf8, "quantized": pl.Boolean, "source_kind": pl.Utf8,
    "source_name": pl.Utf8, "source_path": pl.Utf8, "source_revision": pl.Utf8, "source_commit": pl.Utf8,
    "source_checksum": pl.Utf8, "weights_sha256": pl.Utf8, "norm_gains": pl.Utf8, "versions": pl.Utf8,
}

# The atlas's ``function_agreement`` table (``function.comp_agreement.agreement_tables``, computed
# when the atlas is built): per model x checkpoint x attribution method x comp x metric x space (and
# the two oracles, space ``oracle``), the agreement of composition with function the report shows,
# each figure with its 95% paired-bootstrap interval (``_lo``, ``_hi``; ``n_boot`` replicates). The
# gate's counts (``n_edges``, ``n_top``, ``n_signal``, ``largest_attribution``): the comp's, on each row.
FUNCTION_AGREEMENT_SCHEMA: Schema = {
    "model": pl.Utf8, "checkpoint": pl.Utf8, "method": pl.Utf8, "comp": pl.Utf8, "metric": pl.Utf8, "space": pl.Utf8,
    "measurable": pl.Boolean, "why_not": pl.Utf8, "n_edges": pl.Int64, "n_top": pl.Int64, "n_signal": pl.Int64,
    "largest_attribution": pl.Float64, "n_significant": pl.Int64, "n_boot": pl.Int64,
    **{f"{s}{end}": pl.Float64 for s in ("auroc_top", "spearman_abs", "spearman_unbiased", "auroc_significant")
       for end in ("", "_lo", "_hi")},
    "best_noise_aware": pl.Boolean, "tied_noise_aware": pl.Boolean, "best_auroc_top": pl.Boolean, "beats_scale": pl.Boolean,
    "beats_depth": pl.Boolean, "partial_unbiased": pl.Float64, "partial_unbiased_lo": pl.Float64,
    "partial_unbiased_hi": pl.Float64, "added_r2": pl.Float64, "agrees": pl.Boolean, "beyond_prior": pl.Boolean,
    "beats_oracles": pl.Boolean, "adds_to_oracles": pl.Boolean, "verdict": pl.Utf8,
}

# The atlas's ``function_bootstrap`` table (``function.comp_agreement.bootstrap_rows``, computed with
# ``function_agreement``): per measurable comp x cell, each statistic's point figure as computed (NaN where
# undefined) and its ``n_boot`` paired bootstrap replicates in replicate order, from which the report
# takes its intervals, ties and averages over models (``comp_agreement.stored_comp_function``) without
# bootstrapping again. The statistics of the noise-aware bootstrap are NULL without split halves.
BOOTSTRAP_STATISTICS = ("auroc_top", "spearman_abs", "spearman_unbiased", "auroc_significant", "partial_unbiased")
FUNCTION_BOOTSTRAP_SCHEMA: dict[str, pl.DataType | type[pl.DataType]] = {
    "model": pl.Utf8, "checkpoint": pl.Utf8, "method": pl.Utf8, "comp": pl.Utf8, "metric": pl.Utf8, "space": pl.Utf8,
    **{col: dtype for s in BOOTSTRAP_STATISTICS for col, dtype in ((s, pl.Float64), (f"{s}_boot", pl.List(pl.Float64)))},
    "added_r2": pl.Float64, "controls_r2": pl.Float64,
}

# The atlas's ``excluded_shards`` table: shards left out of their view because they do not open.
EXCLUDED_SHARDS_SCHEMA: Schema = {"view": pl.Utf8, "path": pl.Utf8, "error": pl.Utf8}

# ----------------------------------------------------------------------------- provenance

# What identifies the weights a shard was computed from, copied from the extraction's metadata
# (or from an upstream shard's provenance, which carries the same keys).
MODEL_PROVENANCE = ("model", "checkpoint", "checkpoint_step", "checkpoint_tokens", "processing", "source_kind",
                    "source_revision", "source_commit", "source_checksum", "weights_sha256", "quantized")


def provenance(meta: Mapping[str, Any] | None, **facts: Any) -> dict[str, Any]:
    """The provenance record of a shard: ``MODEL_PROVENANCE`` from ``meta`` (None where it has
    no such key; left out for a shard of no model, ``meta=None``), the library versions of the
    writing process, then ``facts``, the writer's own (they win over ``meta``'s keys)."""
    record = {k: meta.get(k) for k in MODEL_PROVENANCE} if meta is not None else {}
    record["versions"] = library_versions()
    record.update(facts)
    return record


def number(v: object) -> float:
    """A polars aggregate (``Series.max()``, ``.item()``, a row's field) as a float. Polars types
    these as any Python value; a missing one (an empty frame, a null) is an error here rather than
    a NaN that travels on."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"expected a number, got {v!r}")
    return float(v)


def integer(v: object) -> int:
    """``number`` for a count or an index: an int (a float that is whole is accepted)."""
    x = number(v)
    if not x.is_integer():
        raise TypeError(f"expected a whole number, got {v!r}")
    return int(x)

"""A job factors only the layers its block touches; splitting a model into blocks must give
exactly the table of one whole-model job (scores and both nulls)."""

from __future__ import annotations

import polars as pl
import pytest
from conftest import random_weights

from compatlas.composition import block_pairs, layer_pairs
from compatlas.composition_table import score_block
from compatlas.token_space import add_space_factors

KEY = ["comp", "writer_layer", "writer_head", "reader_layer", "reader_head"]


@pytest.mark.parametrize("space", ["residual", "token"])
def test_blocks_equal_one_whole_job(space):
    w = random_weights(0, L=5, H=4, Hkv=2, d=16, dh=4, vocab=80, meta={"norm_type": "RMS"})
    add_space_factors(w)
    layers = list(range(5))
    kw = dict(baseline_samples=8, device="cpu", dtype="float64")
    whole = score_block(w, "svd_bound", space, layer_pairs(layers), **kw)[0].sort(KEY)
    parts = pl.concat([score_block(w, "svd_bound", space, block_pairs(layers, 3, b), **kw)[0] for b in range(3)]).sort(KEY)
    assert parts.height == whole.height == 10 * 3 * 16
    assert parts.select(KEY).equals(whole.select(KEY))
    for col in ("score", "baseline_gaussian_mean", "baseline_spectrum_mean", "baseline_spectrum_std"):
        assert (parts[col] - whole[col]).abs().max() < 1e-12, col


def test_a_job_reading_only_its_layers_scores_the_same(tmp_path):
    """``load_weights(layers=...)`` reads a block's layers from the shard (safetensors slices) and
    the block scores exactly as from the whole model; the per-layer tensors are those layers'."""
    from compatlas.composition import null_pairs, touched_layers
    from compatlas.weights import load_weights, save_weights, shard_n_layers

    w = random_weights(1, L=6, H=4, Hkv=2, d=16, dh=4, vocab=80, ln1=1.0, meta={"norm_type": "RMS"})
    add_space_factors(w)
    save_weights(w, tmp_path / "w.safetensors", tmp_path / "meta.json")
    assert shard_n_layers(tmp_path / "w.safetensors") == 6
    layers, kw = [1, 2, 3, 5], dict(baseline_samples=4, device="cpu", dtype="float64")
    for b in range(3):
        pairs = block_pairs(layers, 3, b) + null_pairs(layers, 3, b)
        touched = touched_layers(pairs)
        part = load_weights(tmp_path / "w.safetensors", tmp_path / "meta.json", layers=touched)
        assert part.layer_ids == tuple(touched) and part.n_layers == len(touched)
        assert part.W_K.equal(w.W_K[touched]) and part.ln1_w.equal(w.ln1_w[touched])
        for space in ("residual", "token"):
            a = score_block(w, "frobenius", space, pairs, **kw)[0].sort(KEY)
            b_ = score_block(part, "frobenius", space, pairs, **kw)[0].sort(KEY)
            assert a.equals(b_), (b, space)
    with pytest.raises(ValueError, match="not in these weights"):
        part.layers([0])

"""A job factors only the layers its block touches; splitting a model into blocks must give
exactly the table of one whole-model job (scores and both nulls)."""

from __future__ import annotations

import polars as pl
import pytest
from conftest import random_weights

from compatlas.composition import block_pairs, layer_pairs
from compatlas.scores import score_block
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

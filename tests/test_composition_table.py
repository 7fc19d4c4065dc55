"""A job factors only the layers its block touches; splitting a model into blocks (tiles of the
layer grid, compatlas/tiles.py) must give exactly the table of one whole-model job (scores and
both nulls)."""

from __future__ import annotations

import polars as pl
import pytest
from conftest import random_weights

from compatlas.composition.scores import block_pairs, layer_pairs, null_pairs
from compatlas.composition.table import score_block
from compatlas.composition.token_space import add_space_factors

KEY = ["comp", "writer_layer", "writer_head", "reader_layer", "reader_head"]


@pytest.mark.parametrize("space", ["residual", "token"])
def test_blocks_equal_one_whole_job(space):
    """Every block count's jobs (tiles of the layer grid, some empty past its 15 tiles) together
    give the one job's causal and null rows."""
    w = random_weights(0, L=5, H=4, Hkv=2, d=16, dh=4, vocab=80, meta={"norm_type": "RMS"})
    add_space_factors(w)
    layers = list(range(5))
    kw = dict(baseline_samples=8, device="cpu", dtype="float64")
    whole = score_block(w, "svd_bound", space, layer_pairs(layers) + null_pairs(layers, 1, 0), **kw)[0].sort(KEY)
    assert whole.height == (10 * 16 + 10 * 16 + 5 * 12) * 3  # causal, mirrored, same-layer (no head with itself)
    for blocks in (3, 7, 17):
        parts = pl.concat([score_block(w, "svd_bound", space, block_pairs(layers, blocks, b) + null_pairs(layers, blocks, b),
                                       **kw)[0] for b in range(blocks)]).sort(KEY)
        assert parts.select(KEY).equals(whole.select(KEY)), blocks
        for col in ("score", "baseline_gaussian_mean", "baseline_spectrum_mean", "baseline_spectrum_std"):
            assert (parts[col] - whole[col]).abs().max() < 1e-12, (blocks, col)


def test_a_job_reading_only_its_layers_scores_the_same(tmp_path):
    """``load_weights(layers=...)`` reads a block's layers from the shard (safetensors slices) and
    the block scores exactly as from the whole model; the per-layer tensors are those layers'."""
    from compatlas.composition.scores import touched_layers
    from compatlas.models.weights import load_weights, save_weights, shard_n_layers

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


@pytest.mark.parametrize("metric", ["frobenius", "svd_bound", "subspace"])
def test_spectrum_null_is_the_score_with_random_singular_vectors(metric):
    """Each row's spectrum null (mean, std) is the pair's score with both heads' singular values
    kept and their singular vectors drawn uniformly at random: checked against explicit random
    frames (QR of Gaussians, not the kernel's Bartlett draw), within Monte Carlo error."""
    import numpy as np
    import torch

    w = random_weights(3, L=3, H=2, Hkv=1, d=10, dh=3, spectrum=0.7, scale=1.0)
    m = 400  # the kernel's draws (the Gaussian null's n x n heads grow with it too)
    table = score_block(w, metric, "residual", [(0, 1), (0, 2)], baseline_samples=m, device="cpu", dtype="float64")[0]
    # each head's spectrum from its dense d x d matrices (not the kernel's factors): writer
    # W_OV = W_V W_O; reader W_Q W_K^T (Q), W_K W_Q^T (K), W_V W_O (V); subspace: rank-many ones
    def spectrum(M: torch.Tensor) -> np.ndarray:
        s = torch.linalg.svdvals(M)[:3].numpy()
        return np.ones(3) if metric == "subspace" else s

    def reader(comp: str, layer: int, h: int) -> torch.Tensor:
        q, k, v, o = w.W_Q[layer, h], w.W_K[layer, 0], w.W_V[layer, 0], w.W_O[layer, h]  # one KV head (Hkv=1)
        return {"Q": q @ k.T, "K": k @ q.T, "V": v @ o}[comp]
    rng = np.random.default_rng(0)
    n = 20000
    B = np.linalg.qr(rng.standard_normal((n, 10, 3)))[0]
    C = np.linalg.qr(rng.standard_normal((n, 10, 3)))[0]
    P2 = (B.transpose(0, 2, 1) @ C) ** 2  # [n, 3, 3] squared overlaps of two random frames
    for row in table.filter(pl.col("writer_head") == 0).iter_rows(named=True):
        s_w = spectrum(w.W_V[0, 0] @ w.W_O[0, row["writer_head"]])
        s_r = spectrum(reader(row["comp"], row["reader_layer"], row["reader_head"]))
        if metric == "subspace":  # indicator spectra; score ||U1^T U2||^2 / min(rank1, rank2)
            scores = np.einsum("i,nij,j->n", s_w, P2, s_r) / min(s_w.sum(), s_r.sum())
        else:
            sq = np.einsum("i,nij,j->n", s_w**2, P2, s_r**2)
            den = (np.linalg.norm(s_w) * np.linalg.norm(s_r) if metric == "frobenius"
                   else np.sqrt(np.sum(np.sort(s_w)[::-1] ** 2 * np.sort(s_r)[::-1] ** 2)))
            scores = np.sqrt(sq) / den
        mean, std = scores.mean(), scores.std()
        se = std * np.sqrt(1 / n + 1 / m)
        assert abs(row["baseline_spectrum_mean"] - mean) < 5 * se, (row, mean)
        assert abs(row["baseline_spectrum_std"] - std) < 5 * std / np.sqrt(2 * m), (row, std)
    assert torch.isfinite(torch.tensor(table["baseline_spectrum_mean"].to_numpy())).all()

"""The extraction's memory-saving paths give what the library calls give: the shard written
tensor by tensor reads back through safetensors' own reader, and the chunked float64 Gram of
W_E (and of its normalised rows) equals the dense product, its factor and spectrum those of QR."""

from __future__ import annotations

import torch
from safetensors import safe_open

from compatlas.composition.token_space import _row_normaliser, embedding_gram, factor_and_spectrum, normalised_embedding
from compatlas.models.weights import AttentionWeights, write_safetensors


def test_write_safetensors_reads_back_through_safetensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"W_Q": torch.randn(2, 3, 5, 4, generator=g), "extra.R": torch.randn(5, 5, generator=g, dtype=torch.float64),
               "bf": torch.randn(7, generator=g).bfloat16(), "empty": torch.zeros(0, 3), "ids": torch.arange(9)}
    write_safetensors(tensors, tmp_path / "x.safetensors")
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(tensors)
        for k, t in tensors.items():
            got = f.get_tensor(k)
            assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)


def test_chunked_gram_factor_and_spectrum_match_dense():
    g = torch.Generator().manual_seed(1)
    W_E = torch.randn(300, 24, generator=g) * torch.logspace(0, 1, 24)  # a spread spectrum
    w = AttentionWeights(W_Q=torch.zeros(1, 1, 24, 4), W_K=torch.zeros(1, 1, 24, 4), W_V=torch.zeros(1, 1, 24, 4),
                         W_O=torch.zeros(1, 1, 4, 24), W_E=W_E, ln1_w=1 + torch.rand(1, 24, generator=g),
                         meta={"norm_type": "LN"})
    for rows, W in ((None, W_E.double()), (_row_normaliser(w), normalised_embedding(w))):
        torch.testing.assert_close(embedding_gram(W_E, rows, chunk=64), W.T @ W, rtol=1e-12, atol=1e-10)
        R, S = factor_and_spectrum(W_E, rows)
        R_qr = torch.linalg.qr(W, mode="r").R
        torch.testing.assert_close(R.abs(), R_qr.abs(), rtol=1e-9, atol=1e-9)  # equal up to row signs
        torch.testing.assert_close(S, torch.linalg.svdvals(W), rtol=1e-9, atol=1e-9)

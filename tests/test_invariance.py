"""The invariance audit (compatlas.audits.invariance): its change of residual basis preserves the
network's function, each transform class has its shape, the comparison and the layer sampling
are right, and token_norm survives exactly the classes row normalisation commutes with."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_weights

from compatlas.audits.invariance import apply_transform, compare, random_transform, sample_layers
from compatlas.vocab import TRANSFORMS

D, DH = 12, 3


@pytest.mark.parametrize("kind", TRANSFORMS)
def test_transform_preserves_attention_and_outputs(kind):
    w = random_weights(0, L=1, H=2, Hkv=2, d=D, dh=DH, vocab=40, unembed=True)
    T = random_transform(kind, D, seed=3)
    wt = apply_transform(w, T)
    x = w.W_E[:5]  # residual rows (embeddings); in the new basis they are x T
    xt = wt.W_E[:5]
    torch.testing.assert_close(xt, x @ T)
    for h in range(2):
        logits = (x @ w.W_Q[0, h]) @ (x @ w.W_K[0, h]).T
        torch.testing.assert_close((xt @ wt.W_Q[0, h]) @ (xt @ wt.W_K[0, h]).T, logits)
        # what the head writes, read out through W_U, is unchanged
        torch.testing.assert_close(xt @ wt.W_V[0, h] @ wt.W_O[0, h] @ wt.W_U, x @ w.W_V[0, h] @ w.W_O[0, h] @ w.W_U)


def test_transform_classes_have_their_shape():
    P = random_transform("permutation", D, 1)
    assert set(P.sum(0).tolist()) == {1.0} and set(P.unique().tolist()) == {0.0, 1.0}
    O = random_transform("orthogonal_scale", D, 1)
    c = (O @ O.T)[0, 0]
    torch.testing.assert_close(O @ O.T, c * torch.eye(D, dtype=torch.float64))
    Dg = random_transform("diagonal", D, 1, log10_range=2.0)
    assert torch.count_nonzero(Dg - torch.diag(torch.diagonal(Dg))) == 0
    assert 1e-2 <= Dg.diagonal().min() and Dg.diagonal().max() <= 1e2


def test_compare_and_sampling():
    before = np.array([0.9, 0.1, 0.5, 0.3])
    out = compare(before, before[::-1].copy(), top_k=2)
    # ranks [4,1,3,2] vs [2,3,1,4]: sum d^2 = 16, rho = 1 - 6*16/(4*15) = -0.6
    assert out["spearman"] == pytest.approx(-0.6) and out["top_k_overlap"] == 0.0 and not out["top_k_kept"]
    assert compare(before, 2 * before, top_k=2)["spearman"] == pytest.approx(1.0)
    assert sample_layers(list(range(30)), 6) == [0, 6, 12, 17, 23, 29]
    assert sample_layers(list(range(4)), 0) == [0, 1, 2, 3] and sample_layers(list(range(4)), 9) == [0, 1, 2, 3]


def test_token_norm_survives_orthogonal_but_not_diagonal():
    """Row normalisation commutes with orthogonal T (and a global scale), not with diagonal T."""
    from compatlas.audits.invariance import audit
    from compatlas.composition.token_space import add_space_factors

    w = random_weights(5, L=3, H=2, Hkv=2, d=D, dh=DH, vocab=60, ln1=0.5, meta={"norm_type": "RMS"})
    add_space_factors(w)  # as extraction does: the stored token_norm factor folds ln1_w
    df = audit(w, ["frobenius"], ["token_norm"], top_k=5)
    change = dict(zip(df["transform"], df["max_abs_change"]))
    for kind in ("permutation", "orthogonal", "orthogonal_scale"):
        assert change[kind] < 1e-10, kind
    assert change["diagonal"] > 1e-3


@pytest.mark.parametrize("Hkv", [4, 2])
def test_metrics_sharing_factors_score_as_each_alone(Hkv):
    """frobenius, svd_bound and contribution from one GEMM per layer and comp: bit for bit each
    metric's own scores (its factors, its own GEMM)."""
    from compatlas.audits.invariance import model_scores, scores_all_metrics
    from compatlas.composition.scores import head_factors

    w = random_weights(1, L=3, H=4, Hkv=Hkv, d=D, dh=DH)
    metrics = ["frobenius", "svd_bound", "subspace", "contribution"]
    got = scores_all_metrics(w, metrics)  # type: ignore[arg-type]
    for m in metrics:
        alone = model_scores(w, m, factors=None if m == "subspace" else head_factors(w, "frobenius"))  # type: ignore[arg-type]
        for c, s in alone.items():
            assert torch.equal(got[m][c], s), (m, c)
    assert not torch.equal(got["frobenius"]["Q"], got["svd_bound"]["Q"])

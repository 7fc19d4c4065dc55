"""Token space: the QR route equals brute force over d_vocab x d_vocab matrices, and the
invariances docs/math.md derives hold (token space survives every GL(n) change of residual basis)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_weights

from compatlas.composition.table import score_block
from compatlas.composition.token_space import embedding_basis, to_space
from compatlas.models.weights import AttentionWeights
from compatlas.vocab import COMPS, KERNEL_METRICS

L, H, HKV, D, DH, VOCAB = 3, 4, 2, 16, 4, 300


# float64 as the default dtype, for this module's tests only (conftest)
pytestmark = pytest.mark.usefixtures("float64_default")


def random_model(seed: int = 0) -> AttentionWeights:
    # uneven column scales in W_E, so token space differs from residual space
    return random_weights(seed, L=L, H=H, Hkv=HKV, d=D, dh=DH, vocab=VOCAB, embed_decades=1.0, unembed=True,
                          embed_first=True, meta={"model": "t", "norm_type": "RMS"})


def brute_token_scores(w: AttentionWeights, metric: str, comp: str, l1: int, l2: int,
                       E: torch.Tensor | None = None) -> torch.Tensor:
    """Scores from the d_vocab x d_vocab token-space matrices: OV -> E OV E^+, QK -> E QK E^T,
    with E = W_E (or the embedding given)."""
    W_K, W_V = w.expanded_kv()
    E = w.W_E if E is None else E
    E_pinv = torch.linalg.pinv(E)
    out = torch.zeros(H, H)
    for h1 in range(H):
        Lt = E @ W_V[l1, h1] @ w.W_O[l1, h1] @ E_pinv
        write_rows = w.W_O[l1, h1] @ E_pinv  # token-space rows the writer can produce
        for h2 in range(H):
            A = {"Q": w.W_Q[l2, h2], "K": W_K[l2, h2], "V": W_V[l2, h2]}[comp]
            Rt = {"Q": E @ w.W_Q[l2, h2] @ W_K[l2, h2].T @ E.T, "K": E @ W_K[l2, h2] @ w.W_Q[l2, h2].T @ E.T,
                  "V": E @ W_V[l2, h2] @ w.W_O[l2, h2] @ E_pinv}[comp]
            if metric == "contribution":
                out[h1, h2] = (Lt @ Rt).norm()
            elif metric == "frobenius":
                out[h1, h2] = (Lt @ Rt).norm() / (Lt.norm() * Rt.norm())
            elif metric == "svd_bound":
                sL, sR = torch.linalg.svdvals(Lt)[:DH], torch.linalg.svdvals(Rt)[:DH]
                out[h1, h2] = (Lt @ Rt).norm() / (sL.pow(2) @ sR.pow(2)).sqrt()
            else:
                U1 = torch.linalg.svd(write_rows.T, full_matrices=False)[0]
                U2 = torch.linalg.svd(E @ A, full_matrices=False)[0]
                out[h1, h2] = (U1.T @ U2).norm() ** 2 / DH
    return out


@pytest.mark.parametrize("metric", KERNEL_METRICS)
def test_token_space_equals_brute_force(metric):
    w = random_model()
    df, facts = score_block(w, metric, "token", [(0, 1), (0, 2), (1, 2)], baseline_samples=4, device="cpu", dtype="float64")
    assert facts["embedding_dropped"] == 0
    for comp in COMPS:
        for l1, l2 in [(0, 1), (1, 2)]:
            got = (df.filter((df["comp"] == comp) & (df["writer_layer"] == l1) & (df["reader_layer"] == l2))
                   .sort(["writer_head", "reader_head"]))
            want = brute_token_scores(w, metric, comp, l1, l2).flatten()
            close(torch.tensor(got["score"].to_numpy()), want, 1e-6)


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Equal to ``tol`` of the scores' scale (1 for the normalised metrics, the largest
    ``contribution`` otherwise: a magnitude's rounding grows with it)."""
    torch.testing.assert_close(got, want, atol=tol * max(1.0, float(want.abs().max())), rtol=0)


def change(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest change between two score tensors, relative to their scale (see ``close``)."""
    return float((a - b).abs().max() / max(1.0, float(a.abs().max())))


def transform(w: AttentionWeights, T: torch.Tensor) -> AttentionWeights:
    """x -> x T: writers and W_E times T on the right, readers T^-1 on the left (norms ignored)."""
    Ti = torch.linalg.inv(T)
    return AttentionWeights(W_Q=Ti @ w.W_Q, W_K=Ti @ w.W_K, W_V=Ti @ w.W_V, W_O=w.W_O @ T, W_E=w.W_E @ T,
                            W_U=Ti @ w.W_U, meta=w.meta)


def scores(w: AttentionWeights, metric: str, space: str) -> torch.Tensor:
    df, _ = score_block(w, metric, space, [(0, 1), (0, 2), (1, 2)], baseline_samples=4, device="cpu", dtype="float64")
    return torch.tensor(df["score"].to_numpy())


def random_T(kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    O = torch.linalg.qr(torch.randn(D, D, generator=g))[0]
    if kind == "orthogonal_scale":
        return 3.7 * O
    if kind == "permutation":
        return torch.eye(D)[torch.randperm(D, generator=g)]
    if kind == "diagonal":
        return torch.diag(torch.logspace(-2, 2, D)[torch.randperm(D, generator=g)])
    O2 = torch.linalg.qr(torch.randn(D, D, generator=g))[0]
    return O @ torch.diag(torch.logspace(-1.5, 1.5, D)) @ O2  # general GL(n)


@pytest.mark.parametrize("metric", KERNEL_METRICS)
@pytest.mark.parametrize("kind", ["permutation", "orthogonal_scale", "diagonal", "gl"])
def test_invariance_classes(metric, kind):
    w = random_model(1)
    wt = transform(w, random_T(kind, 7))
    token_change = change(scores(w, metric, "token"), scores(wt, metric, "token"))
    assert token_change < 1e-8, f"token space must survive {kind}"
    residual_change = change(scores(w, metric, "residual"), scores(wt, metric, "residual"))
    # a normalised score cannot see a scale; a magnitude does (QK -> QK / s^2 under x -> s x O)
    if kind == "permutation" or (kind == "orthogonal_scale" and metric != "contribution"):
        assert residual_change < 1e-10
    else:
        assert residual_change > 1e-2, f"residual {metric} should move under {kind}"


def test_bad_conditioning_drops_directions_and_reports():
    w = random_model()
    W_E = w.W_E.clone()
    W_E[:, -1] = W_E[:, 0] * 1.0 + 1e-12 * W_E[:, -1]  # nearly rank-deficient
    basis = embedding_basis(W_E, max_condition=1e6)
    assert basis.condition > 1e9 and basis.n_dropped == 1
    assert torch.isfinite(basis.R_inv).all() and basis.R.shape == (D - 1, D)
    ws, facts = to_space(AttentionWeights(**{**w.__dict__, "W_E": W_E}), "token")
    assert facts["embedding_dropped"] == 1 and ws.W_O.shape[-1] == D - 1 and torch.isfinite(ws.W_O).all()


@pytest.mark.parametrize("metric", KERNEL_METRICS)
def test_rank_deficient_embedding_equals_pseudo_inverse_brute_force(metric):
    """compat processing centres W_E (rank d - 1): token space is W_E OV W_E^+ exactly."""
    w = random_model(2)
    w.W_E = w.W_E - w.W_E.mean(-1, keepdim=True)
    df, facts = score_block(w, metric, "token", [(0, 1)], baseline_samples=4, device="cpu", dtype="float64")
    assert facts["embedding_dropped"] == 1
    for comp in COMPS:
        got = df.filter(df["comp"] == comp).sort(["writer_head", "reader_head"])
        want = brute_token_scores(w, metric, comp, 0, 1).flatten()
        close(torch.tensor(got["score"].to_numpy()), want, 1e-6)


def test_centred_embedding_and_writers_keep_token_space_invariant():
    """compat processing centres W_E *and* the writers (W_O rows), so no head writes into the
    direction W_E cannot embed: token space stays invariant. (Writers that do write there are
    projected away by W_E^+, and that projection depends on the basis: documented, not claimed.)"""
    w = random_model(3)
    w.W_E = w.W_E - w.W_E.mean(-1, keepdim=True)
    w.W_O = w.W_O - w.W_O.mean(-1, keepdim=True)
    wt = transform(w, random_T("gl", 11))
    for metric in KERNEL_METRICS:
        assert change(scores(w, metric, "token"), scores(wt, metric, "token")) < 1e-8


@pytest.mark.parametrize("norm", ["RMS", "LN"])
@pytest.mark.parametrize("metric", KERNEL_METRICS)
def test_token_norm_equals_brute_force_on_normalised_rows(metric, norm):
    """token_norm is token space of W_E's rows as the first attention norm sees them: each row
    centred (LayerNorm only), divided by its root mean square, times the norm's weight. The rows
    are built here by hand and scored through the d_vocab x d_vocab matrices."""
    base = random_weights(0, L=L, H=H, Hkv=HKV, d=D, dh=DH, vocab=VOCAB, embed_decades=1.0, unembed=True,
                          embed_first=True, ln1=0.3, meta={"model": "t", "norm_type": norm})
    E = base.W_E.clone()
    if norm == "LN":
        E = E - E.mean(1, keepdim=True)
    E = torch.stack([row / (row @ row / D).sqrt() for row in E]) * base.ln1_w[0]
    assert not torch.allclose(E / E.norm(dim=1, keepdim=True), base.W_E / base.W_E.norm(dim=1, keepdim=True))
    df, facts = score_block(base, metric, "token_norm", [(0, 1), (1, 2)], baseline_samples=4, device="cpu",
                            dtype="float64")
    # centred rows span d_model - 1 directions: one is dropped, and E^+ is the pseudo-inverse
    assert facts["embedding_dropped"] == (1 if norm == "LN" else 0)
    for comp in COMPS:
        for l1, l2 in [(0, 1), (1, 2)]:
            got = (df.filter((df["comp"] == comp) & (df["writer_layer"] == l1) & (df["reader_layer"] == l2))
                   .sort(["writer_head", "reader_head"]))
            want = brute_token_scores(base, metric, comp, l1, l2, E=E).flatten()
            close(torch.tensor(got["score"].to_numpy()), want, 1e-6)


def test_small_vocabulary_has_no_token_space_but_extracts():
    from compatlas.composition.token_space import add_space_factors

    w = random_model()
    small = AttentionWeights(**{**w.__dict__, "W_E": w.W_E[: D - 2], "meta": {}, "extras": {}})
    add_space_factors(small)  # must not raise: residual space still works
    assert small.meta["token_condition"] is None and not small.extras
    with pytest.raises(ValueError, match="token space needs d_vocab >= d_model"):
        to_space(small, "token")

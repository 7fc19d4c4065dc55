"""The activation space and the ``contribution`` metric (compatlas.composition.activation_space,
compatlas.composition.moments): the score is the RMS of what the writer actually adds to the reader's logit
or value output in the model's own forward pass, and it survives any invertible change of the
residual basis."""

from __future__ import annotations

import pytest
import torch
from conftest import random_moments, random_weights
from test_composition import _boot_bridge

from compatlas.composition.moments import MOMENT_KEYS, Moments, load_moments, measure_moments, save_moments
from compatlas.composition.table import score_block
from compatlas.models.loading import extract

F64 = torch.float64
B, T = 6, 10  # sequences x tokens of the brute-force sample
PAIRS = [(0, 1), (0, 2), (1, 2)]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A tiny GPT-2 (LayerNorm with biases, b_Q and b_K included) in float64, its raw weights and a sample."""
    model = _boot_bridge("gpt2", tmp_path_factory.mktemp("act"))
    w = extract(model, "none")
    w = w.to("cpu", F64)
    tokens = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(5))
    return model, w, tokens


def _scores(w, moments, comp: str) -> dict[tuple[int, int, int, int], float]:
    df, _ = score_block(w, "contribution", "activation", PAIRS, baseline_samples=4, device="cpu", dtype="float64",
                        moments=moments)
    df = df.filter(df["comp"] == comp)
    return {(r["writer_layer"], r["writer_head"], r["reader_layer"], r["reader_head"]): r["score"]
            for r in df.iter_rows(named=True)}


def _writer_samples(model, tokens, layer: int, head: int, positions: slice) -> torch.Tensor:
    """z of the writer head at the given positions of every sequence: [N, d_head]."""
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n == f"blocks.{layer}.attn.hook_z")
    return cache[f"blocks.{layer}.attn.hook_z"][:, positions, head].reshape(-1, model.cfg.d_head)


def _perturbed(model, tokens, l2: int, pos: int, delta: torch.Tensor, inv_rms: float, read: str) -> torch.Tensor:
    """``read`` at layer l2 with ``delta`` [N, d_model] added to the residual entering l2 at
    position ``pos`` (one copy of the batch per row of delta), the norm's scale there held at
    its mean, as the score's linearisation holds it. delta = 0 gives the reference."""
    N = delta.shape[0]
    x = tokens.repeat_interleave(N, dim=0)
    add = delta.repeat(tokens.shape[0], 1)
    out = {}

    def shift(resid, hook):
        resid = resid.clone()
        resid[:, pos] += add
        return resid

    def hold(scale, hook):
        scale = scale.clone()
        scale[:, pos] = 1.0 / inv_rms
        return scale

    def keep(t, hook):
        out["x"] = t

    model.run_with_hooks(x, fwd_hooks=[(f"blocks.{l2}.hook_resid_pre", shift), (f"blocks.{l2}.ln1.hook_scale", hold),
                                       (read, keep)], stop_at_layer=l2 + 1)
    return out["x"]


@pytest.mark.parametrize("comp", ["K", "Q", "V"])
def test_contribution_equals_the_rms_of_the_forward_pass_change(gpt2, comp):
    """Writer u's output z_j W_O^u, for every measured z_j, is added to the residual stream
    entering reader layer l2 at one position: the reader's attention scores (K: that position's
    key against every later query; Q: the last position's query against every earlier key) or its
    value vector there (V, times W_O^v) change; the RMS of the change over the sample is the score.

    K: BOS-less sequences, the key at position 0, queries and writer outputs at positions >= 1
    (``skip_first``, as the moments of a BOS model are taken). Q: the query at the last position,
    keys and writer outputs at positions 0 .. T-2 (moments of the first T-1 tokens: a causal model's
    activations there do not see the last token)."""
    model, w, tokens = gpt2
    if comp == "Q":
        moments, pos, writer_positions = measure_moments(model, tokens[:, :-1], skip_first=False), T - 1, slice(0, T - 1)
    else:
        moments, pos, writer_positions = measure_moments(model, tokens, skip_first=True), 0, slice(1, T)
    got = _scores(w, moments, comp)
    for l1, l2, u, v in [(0, 1, 0, 0), (0, 2, 1, 3), (1, 2, 2, 1), (0, 1, 3, 2)]:
        z = _writer_samples(model, tokens, l1, u, writer_positions)
        delta = z @ w.W_O[l1, u]  # what the writer adds (b_O is no head's)
        inv_rms = float(moments.inv_rms[l2])
        if comp == "V":
            read = f"blocks.{l2}.attn.v.hook_out"
            base = _perturbed(model, tokens, l2, pos, torch.zeros_like(delta), inv_rms, read)
            moved = _perturbed(model, tokens, l2, pos, delta, inv_rms, read)
            change = (moved - base)[:, pos, v] @ w.W_O[l2, v]  # [B N, d_model]
            want = change.pow(2).sum(-1).mean().sqrt().detach()
        else:
            read = f"blocks.{l2}.attn.hook_attn_scores"
            base = _perturbed(model, tokens, l2, pos, torch.zeros_like(delta), inv_rms, read)
            moved = _perturbed(model, tokens, l2, pos, delta, inv_rms, read)
            d = (moved - base)[:, v]  # [B N, query, key]
            d = d[:, 1:, 0] if comp == "K" else d[:, T - 1, :T - 1]
            want = d.pow(2).mean().sqrt().detach()
        assert got[(l1, u, l2, v)] == pytest.approx(float(want), rel=1e-5), (comp, l1, u, l2, v)
        assert float(want) > 1e-6  # a change there is to be measured


def test_moments_round_trip_and_name_a_corrupt_file(gpt2, tmp_path):
    model, _, tokens = gpt2
    m = measure_moments(model, tokens)
    m.meta = {"positions": m.meta["positions"]}
    save_moments(m, tmp_path / "m.safetensors", tmp_path / "m.json")
    back = load_moments(tmp_path / "m.safetensors", tmp_path / "m.json")
    for k in MOMENT_KEYS:
        torch.testing.assert_close(back.__dict__[k], m.__dict__[k].float().double())
    assert back.attn_scale == m.attn_scale == pytest.approx(model.cfg.d_head ** 0.5)
    raw = bytearray((tmp_path / "m.safetensors").read_bytes())
    raw[-3] ^= 0xFF
    (tmp_path / "m.safetensors").write_bytes(bytes(raw))
    from compatlas.models.weights import CorruptShardError
    with pytest.raises(CorruptShardError, match=r"m\.safetensors"):
        load_moments(tmp_path / "m.safetensors", tmp_path / "m.json")


def test_moments_stop_before_the_unembedding_and_equal_a_full_pass(gpt2, monkeypatch):
    """The pass ends at the unembedding's input (the logits are not needed): every moment is
    bit-for-bit what the whole forward pass gives."""
    import compatlas.composition.moments as moments_mod

    model, _, tokens = gpt2
    calls: list[int] = []
    handle = model.unembed.register_forward_hook(lambda *a: calls.append(1))
    try:
        stopped = measure_moments(model, tokens, batch_size=4)
        assert calls == []
        monkeypatch.setattr(moments_mod, "UNEMBED_IN", "no such hook")  # the whole pass, logits included
        full = measure_moments(model, tokens, batch_size=4)
        assert calls
    finally:
        handle.remove()
    for k in MOMENT_KEYS:
        assert torch.equal(stopped.__dict__[k], full.__dict__[k]), k
    assert stopped.meta == full.meta


def _twin_scores(w, T_: torch.Tensor, m: Moments, metric: str, space: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per comp, the scores of w and of its twin x -> x T (W_O T, T^-1 W_Q, T^-1 W_K, T^-1 W_V),
    both with the same moments: with no norm, the twin computes the same q, k, v and z on every input."""
    Ti = torch.linalg.inv(T_)
    twin = type(w)(W_Q=Ti @ w.W_Q, W_K=Ti @ w.W_K, W_V=Ti @ w.W_V, W_O=w.W_O @ T_, W_E=w.W_E @ T_, meta=w.meta)

    def scores(weights) -> dict[str, torch.Tensor]:
        df, _ = score_block(weights, metric, space, PAIRS, baseline_samples=4, device="cpu", dtype="float64",
                            moments=m if space == "activation" else None)
        df = df.sort("comp", "writer_layer", "writer_head", "reader_layer", "reader_head")
        return {c: torch.tensor(df.filter(df["comp"] == c)["score"].to_numpy()) for c in "QKV"}

    a, b = scores(w), scores(twin)
    return {c: (a[c], b[c]) for c in "QKV"}


def _moved(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / a.abs().max()).max())


def test_contribution_survives_any_invertible_change_of_residual_basis():
    """Q and K: what a writer adds to a logit, a number, is the same in any residual basis; so the
    activation space's contribution is the same for a model with no norm and its GL(n) twin, while
    the weights-only contribution (residual space) and the whitened factors' frobenius are not.
    V: what a writer adds to the reader's output is a residual-stream vector, whose length is the
    basis's: the same under an orthogonal change, scaled by s under x -> s x O (every V edge alike,
    so their order holds), not kept under a general one."""
    L, H, Hkv, d, dh = 3, 4, 2, 12, 3
    w = random_weights(2, L=L, H=H, Hkv=Hkv, d=d, dh=dh, spectrum=0.5, meta={"model": "t", "norm_type": "none"})
    g = torch.Generator().manual_seed(9)
    gl = torch.randn(d, d, generator=g, dtype=F64) @ torch.diag(torch.logspace(-1, 1, d, dtype=F64))
    orthogonal = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=F64)).Q
    m = random_moments(L, H, Hkv, dh, 4)
    act = _twin_scores(w, gl, m, "contribution", "activation")
    residual = _twin_scores(w, gl, m, "contribution", "residual")
    whitened = _twin_scores(w, gl, m, "frobenius", "activation")
    for c in "QK":
        assert _moved(*act[c]) < 1e-9, c
        assert _moved(*residual[c]) > 1e-2 and _moved(*whitened[c]) > 1e-2, c
    assert _moved(*act["V"]) > 1e-2
    a, b = _twin_scores(w, 3.0 * orthogonal, m, "contribution", "activation")["V"]
    torch.testing.assert_close(b, 3.0 * a, rtol=1e-9, atol=0)


def test_share_is_the_score_over_the_readers_own_rms(gpt2):
    """score_share = contribution / the reader's own logit (Q, K) or output (V) RMS on the same
    moments; checked against the moments directly: sqrt(tr(Q_v K_v)) / s, sqrt(tr(V_v W_O W_O^T))."""
    model, w, tokens = gpt2
    m = measure_moments(model, tokens)
    df, _ = score_block(w, "contribution", "activation", PAIRS, baseline_samples=4, device="cpu", dtype="float64",
                        moments=m)
    assert df["baseline_gaussian_mean"].null_count() == df.height  # no Gaussian null for a magnitude
    W_O = w.W_O
    for r in df.filter(df["writer_head"] == 1).iter_rows(named=True):
        l2, v = r["reader_layer"], r["reader_head"]
        if r["comp"] == "V":
            own = torch.trace(m.value[l2, v] @ W_O[l2, v] @ W_O[l2, v].T).sqrt()
        else:
            own = torch.trace(m.query[l2, v] @ m.key[l2, v]).sqrt() / m.attn_scale
        assert r["score_share"] == pytest.approx(r["score"] / float(own), rel=1e-9)

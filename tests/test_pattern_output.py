"""The ``pattern_output`` metric (compatlas.composition.pattern_output): the first-order change of a
reader head's output when a writer's actual output moves its query, key or value input, checked
against forward-mode autodiff of the model's own forward pass on tiny GPT-2, Llama (GQA) and
Gemma-3 (QK-norm, sandwich norms) bridges; its identities; its place in the moments file, the
composition table and the plan."""

from __future__ import annotations

import copy

import polars as pl
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from conftest import tiny_hf_model

from compatlas.composition.moments import load_moments, measure_moments, own_output_rms, save_moments
from compatlas.composition.pattern_output import pattern_output_scores
from compatlas.function.edge_attribution import split_inputs
from compatlas.models.loading import boot
from compatlas.models.small_models import word_tokenizer
from compatlas.vocab import COMPS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V, B, T = 64, 3, 12  # vocabulary, windows, tokens per window (gemma3's sliding window is 16)
FORK = {"Q": "hook_q_input", "K": "hook_k_input", "V": "hook_v_input"}
EDGES = [(0, 1, 1), (0, 2, 2), (1, 3, 2), (2, 0, 1), (1, 1, 1)]  # writer layer, head, reader layer: causal, not, itself


def _boot(arch: str, folder, seed: int = 0):
    torch.manual_seed(seed)
    tiny_hf_model(arch, V).save_pretrained(folder)
    word_tokenizer(V, folder)
    model, _ = boot({"source": {"kind": "local", "path": str(folder)}}, None, folder, dtype=torch.float64)
    return model.eval()


def _tokens(bos: int = 2) -> torch.Tensor:
    """Random windows starting with one BOS-like token (Gemma's pad token 0 embeds to zero: avoided)."""
    t = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(0))
    t[:, 0] = bos
    return t


@pytest.fixture(scope="module", params=["gpt2", "llama-gqa", "gemma3"])
def model(request, tmp_path_factory):
    return request.param, _boot(request.param, tmp_path_factory.mktemp(request.param))


def writer_output(m, tokens: torch.Tensor, lw: int, u: int) -> torch.Tensor:
    """a_u [B, T, d_model]: z_u W_O^u, and where the layer has a post-attention norm, its share of the
    norm's output (the norm's per-channel factor out / in at each position held), read off the
    model's own hooks: no gain or scale of the implementation's is used."""
    names = [f"blocks.{lw}.attn.hook_z", f"blocks.{lw}.ln1_post.hook_in", f"blocks.{lw}.ln1_post.hook_out"]
    _, c = m.run_with_cache(tokens, names_filter=lambda n: n in names)
    a = c[names[0]][:, :, u] @ m.W_O[lw, u]
    if names[1] in c:
        a = a * torch.where(c[names[1]] != 0, c[names[2]] / c[names[1]], 0.0)
    return a.detach()


def reference(m, tokens: torch.Tensor, lw: int, u: int, lr: int, comp: str, start: int = 1) -> torch.Tensor:
    """RMS over windows and positions i >= start of d(z_v W_O^v)/d eps [H], eps a_u added to the
    reader layer's per-head ``comp`` input (every KV head's for K and V) at every position: a
    forward-mode JVP through the bridge's own forward pass."""
    a = writer_output(m, tokens, lw, u)
    got = {}
    with split_inputs(m), fwAD.dual_level():
        def shift(x, hook):
            return x + fwAD.make_dual(torch.zeros_like(x), a[:, :, None, :].expand_as(x).contiguous())

        def keep(z, hook):
            got["dz"] = fwAD.unpack_dual(z).tangent

        m.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{lr}.attn.{FORK[comp]}", shift),
                                            (f"blocks.{lr}.attn.hook_z", keep)], stop_at_layer=lr + 1)
    do = torch.einsum("bihd,hde->bihe", got["dz"], m.W_O[lr].detach())[:, start:]
    return do.pow(2).sum(-1).mean((0, 1)).sqrt()


def test_scores_are_the_jvp_of_the_models_own_forward(model):
    """Every comp, causal and non-causal pairs and a head with itself, against forward-mode
    autodiff of the model (its norms, QK-norm, rotary, softmax and GQA as the bridge runs them),
    in float64, with a writer chunk small enough to split the writers."""
    arch, m = model
    tokens = _tokens()
    got = pattern_output_scores(m, tokens, batch_size=2, skip_first=True, budget=4 * 16 * T * T)
    assert all(s.shape == (3, 4, 3, 4) and s.dtype == torch.float64 for s in got.values())
    for lw, u, lr in EDGES:
        for comp in COMPS:
            want = reference(m, tokens, lw, u, lr, comp)
            assert float(want.min()) > 1e-7, (arch, comp)  # a change to measure
            torch.testing.assert_close(got[comp][lw, u, lr], want, rtol=1e-4, atol=0, msg=f"{arch} {comp} {lw}.{u}->{lr}")


def test_a_post_attention_norms_shares_add_up_to_what_enters_the_stream(tmp_path):
    """Gemma-3's sandwich norm: the writers' a_u, as the scores take them (z_u W_O^u times the
    norm's gain over the per-token rms of the layer's output), add up to the norm's output, what
    the layer adds to the residual stream; the pre-norm z_u W_O^u do not."""
    m = _boot("gemma3", tmp_path)
    _, c = m.run_with_cache(_tokens())
    for layer in range(3):
        z, W_O = c[f"blocks.{layer}.attn.hook_z"], m.W_O[layer].detach()
        gain = 1.0 + m.blocks[layer].ln1_post._original_component.weight.detach()
        share = torch.einsum("bthd,hde->bthe", z, W_O) * gain / c[f"blocks.{layer}.ln1_post.hook_scale"][..., None]
        added = c[f"blocks.{layer}.hook_attn_out"]
        torch.testing.assert_close(share.sum(2), added, rtol=1e-5, atol=1e-6)
        assert (torch.einsum("bthd,hde->bte", z, W_O) - added).abs().max() > 0.1


def test_a_writer_scores_zero_without_output_and_c_times_with_c_times_its_W_O(tmp_path):
    """W_O^u = 0: u scores 0 with every reader. W_O^u times c: with every reader at or below u's
    layer (whose inputs do not depend on u; above it the stream itself changes) u's score is |c|
    times, and c^2 times with itself (u is its own reader: its output is scaled too); every other
    writer's score with reader u of that layer is |c| times, with the other readers unchanged."""
    m = _boot("llama-gqa", tmp_path)
    tokens, lw, u, dh, c = _tokens(), 1, 2, 8, -2.5
    base = pattern_output_scores(m, tokens, batch_size=3)
    o_proj = m.original_model.model.layers[lw].self_attn.o_proj.weight
    saved = o_proj.detach().clone()
    try:
        with torch.no_grad():
            o_proj[:, u * dh:(u + 1) * dh] *= c
        scaled = pattern_output_scores(m, tokens, batch_size=3)
        with torch.no_grad():
            o_proj[:, u * dh:(u + 1) * dh] = 0.0
        zero = pattern_output_scores(m, tokens, batch_size=3)
    finally:
        with torch.no_grad():
            o_proj.copy_(saved)
    others = [h for h in range(4) if h != u]
    for comp in COMPS:
        assert float(base[comp][lw, u].min()) > 1e-6
        assert torch.equal(zero[comp][lw, u], torch.zeros_like(zero[comp][lw, u])), comp
        want = abs(c) * base[comp][lw]  # [writer head, reader layer, reader head]
        want[u, lw, u] *= abs(c)
        want[others, :, :] = base[comp][lw, others]
        want[others, lw, u] *= abs(c)
        torch.testing.assert_close(scaled[comp][lw, :, :lw + 1], want[:, :lw + 1], rtol=1e-9, atol=0, msg=comp)


def test_an_unassumed_form_is_refused_by_name(tmp_path):
    """The first batch checks the forms the linearisation assumes against the model's own hooks:
    told that Gemma's norms have no 1 + w offset, it refuses, naming the norm."""
    m = _boot("gemma3", tmp_path)
    cfg = copy.copy(m.cfg)
    m.cfg.rmsnorm_uses_offset = False
    try:
        with pytest.raises(ValueError, match="layer 0's attention-input norm"):
            pattern_output_scores(m, _tokens(), batch_size=3)
    finally:
        m.cfg.rmsnorm_uses_offset = cfg.rmsnorm_uses_offset


def test_scores_travel_with_the_moments_and_are_sealed(tmp_path):
    """Saved beside the moments (pattern_output_Q/K/V, pattern_output_own) under the same sha256;
    a moments file without them reads back as None."""
    m = _boot("llama-gqa", tmp_path / "model")
    tokens = _tokens()
    mo = measure_moments(m, tokens, skip_first=True)
    mo.meta = {"positions": mo.meta["positions"]}
    save_moments(mo, tmp_path / "plain.safetensors", tmp_path / "plain.json")
    assert load_moments(tmp_path / "plain.safetensors", tmp_path / "plain.json").pattern_output is None
    mo.pattern_output = pattern_output_scores(m, tokens, batch_size=3)
    mo.pattern_output_own = own_output_rms(mo.z, m.W_O.detach())
    save_moments(mo, tmp_path / "m.safetensors", tmp_path / "m.json")
    back = load_moments(tmp_path / "m.safetensors", tmp_path / "m.json")
    assert back.pattern_output is not None and back.pattern_output_own is not None
    for c in COMPS:
        torch.testing.assert_close(back.pattern_output[c], mo.pattern_output[c].float().double())
    # the own output RMS is the reader's z W_O over the same positions
    _, cache = m.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_z"))
    z = cache["blocks.2.attn.hook_z"][:, 1:]
    want = torch.einsum("bthd,hde->bthe", z, m.W_O[2].detach()).pow(2).sum(-1).mean((0, 1)).sqrt()
    torch.testing.assert_close(back.pattern_output_own[2], want.float().double())
    sub = back.layers([1, 2])
    torch.testing.assert_close(sub.pattern_output["K"][1, :, 0], back.pattern_output["K"][2, :, 1])


def test_the_composition_table_reads_the_scores_from_the_moments(tmp_path):
    """score_block for pattern_output x activation emits the moments' scores as composition rows
    (a head never paired with itself), score_share over the reader's own output RMS, both baselines
    null; score_space takes it beside a kernel metric; any other space, or moments without the
    scores, is refused by name."""
    from compatlas.composition.table import score_block, score_space
    from compatlas.models.loading import extract

    m = _boot("llama-gqa", tmp_path)
    tokens = _tokens()
    mo = measure_moments(m, tokens)
    mo.pattern_output = pattern_output_scores(m, tokens, batch_size=3)
    mo.pattern_output_own = own_output_rms(mo.z, m.W_O.detach())
    w = extract(m, "none")
    pairs = [(0, 1), (0, 2), (1, 2), (1, 0), (2, 0), (2, 1), (1, 1)]
    df, _ = score_block(w, "pattern_output", "activation", pairs, moments=mo)
    assert df.height == 3 * (6 * 16 + 12) and set(df["metric"]) == {"pattern_output"}
    assert df.select(pl.col("baseline_gaussian_mean", "baseline_spectrum_mean", "baseline_spectrum_std")
                     .null_count()).row(0) == (df.height,) * 3
    for r in df.iter_rows(named=True):
        key = (r["writer_layer"], r["writer_head"], r["reader_layer"], r["reader_head"])
        assert key[:2] != key[2:]
        assert r["score"] == pytest.approx(float(mo.pattern_output[r["comp"]][key]), rel=1e-12)
        assert r["score_share"] == pytest.approx(r["score"] / float(mo.pattern_output_own[key[2:]]), rel=1e-12)
    both, _ = score_space(w, ("frobenius", "pattern_output"), "activation", pairs, baseline_samples=4, moments=mo)
    assert list(both) == ["frobenius", "pattern_output"] and both["pattern_output"].equals(df)
    assert set(both["frobenius"]["metric"]) == {"frobenius"} and both["frobenius"].height == df.height
    with pytest.raises(ValueError, match="activation space only"):
        score_block(w, "pattern_output", "residual", pairs)
    mo.pattern_output = None
    with pytest.raises(ValueError, match="rerun the moments rule with pattern_output"):
        score_block(w, "pattern_output", "activation", pairs, moments=mo)


def test_the_invariance_audit_leaves_pattern_output_out():
    """A run scoring pattern_output hands its metrics to the invariance audit, which audits weight
    spaces only: pattern_output's rows are not there, and nothing fails."""
    from conftest import random_weights

    from compatlas.audits.invariance import audit

    w = random_weights(0, L=2, H=2, Hkv=2, d=8, dh=2)
    df = audit(w, ["frobenius", "pattern_output"], ["residual", "activation"], transforms=("orthogonal",))
    assert set(df["metric"]) == {"frobenius"} and set(df["space"]) == {"residual"}

"""Induction sweeps, head scores and ablation on a model whose circuit is set by hand:
head 0.0 is an exact previous-token head, head 1.0 an exact induction head (K-composing
with 0.0), heads 0.1 and 1.1 small random noise. Also the log-odds arithmetic by hand, and a
random model, on which strengths must be near zero."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_hf_model

from compatlas.behaviour.block_skip import Skip, block_list
from compatlas.behaviour.induction import (
    NearbyB,
    TokenSet,
    ablation_effects,
    clean_tokens,
    head_attention_scores,
    induction_sequences,
    induction_sweep,
    logodds,
    measure_behaviour,
    nearest_tokens,
    sample_tokens,
    strengths,
)
from compatlas.models.loading import boot
from compatlas.models.small_models import word_tokenizer

V, P = 32, 32                      # vocabulary, positions
TOK, PREV, POS, OUT, SINK = 0, V, 2 * V, 2 * V + P, 3 * V + P
N_HEADS, D_HEAD = 2, 68
D_MODEL = N_HEADS * D_HEAD         # 136 >= 3V + P + 1
SHARP = 30.0                       # attention logit scale of a match
COPY = 4.0                          # what the induction head writes for B: p(B) about 0.75 after the final norm


def _hf_gpt2():
    torch.manual_seed(0)
    return tiny_hf_model("gpt2", V, n_layer=2, n_head=N_HEADS, n_embd=D_MODEL, n_positions=P, tie_word_embeddings=False,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).eval()


def _boot(hf, folder, dtype=torch.float32):
    hf.save_pretrained(folder)
    word_tokenizer(V, folder)
    bridge, _ = boot({"source": {"kind": "local", "path": str(folder)}}, None, folder, dtype=dtype)
    return bridge.eval()


def _one_hot(rows: int, offset: int, scale: float = 1.0) -> torch.Tensor:
    """rows x D_MODEL: row i writes +scale at offset + i and -scale at SINK. Every vector the
    circuit writes sums to zero, so GPT-2's LayerNorm only rescales (no centring shift)."""
    m = torch.zeros(rows, D_MODEL)
    m[torch.arange(rows), offset + torch.arange(rows)] = scale
    m[:, SINK] = -scale
    return m


def induction_model(folder, dtype=torch.float32, sharp: float = SHARP):
    """GPT-2 (LayerNorm, MLPs zeroed) with a hand-set induction circuit, booted through the bridge.

    Subspaces of the residual: TOK (the token), POS (the position), PREV (written by 0.0: the
    previous token), OUT (written by 1.0: read by W_U). 0.0 matches query position i to key
    position i - 1 and copies the key's token into PREV; 1.0 matches query token t to keys
    whose PREV is t and copies the key's token into OUT. ``sharp`` scales the attention logits of
    a match (soft attention for edge attribution: test_edge_attribution)."""
    hf = _hf_gpt2()
    g = torch.Generator().manual_seed(0)
    s = sharp * math.sqrt(D_HEAD)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".ln_" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()
        hf.transformer.wte.weight.copy_(_one_hot(V, TOK))
        hf.transformer.wpe.weight.copy_(_one_hot(P, POS))
        hf.lm_head.weight[:, OUT:OUT + V] = torch.eye(V)
        heads = []
        for block in hf.transformer.h:
            Wq, Wk, Wv = (torch.zeros(D_MODEL, D_MODEL) for _ in range(3))
            Wo = torch.zeros(D_MODEL, D_MODEL)
            heads.append((block, Wq, Wk, Wv, Wo))
        (_b0, Q0, K0, V0, O0), (_b1, Q1, K1, V1, O1) = heads
        for i in range(1, P):
            Q0[POS + i, i - 1] = s
        K0[POS:POS + P, :P] = torch.eye(P)
        V0[TOK:TOK + V, :V] = torch.eye(V)
        O0[:V] = _one_hot(V, PREV)
        Q1[TOK:TOK + V, :V] = s * torch.eye(V)
        K1[PREV:PREV + V, :V] = torch.eye(V)
        V1[TOK:TOK + V, :V] = torch.eye(V)
        O1[:V] = _one_hot(V, OUT, COPY)
        h1 = slice(D_HEAD, 2 * D_HEAD)  # head 1 of each layer: small random weights
        for block, Wq, Wk, Wv, Wo in heads:
            for W in (Wq, Wk, Wv):
                W[:, h1] = 0.02 * torch.randn(D_MODEL, D_HEAD, generator=g)
            noise = 0.02 * torch.randn(D_HEAD, D_MODEL, generator=g)
            Wo[h1] = noise - noise.mean(1, keepdim=True)
            block.attn.c_attn.weight.copy_(torch.cat([Wq, Wk, Wv], 1))  # Conv1D: x @ W
            block.attn.c_proj.weight.copy_(Wo)
    return _boot(hf, folder, dtype)


def random_model(folder):
    return _boot(_hf_gpt2(), folder)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return induction_model(tmp_path_factory.mktemp("induction"))


@pytest.fixture(scope="module")
def rand(tmp_path_factory):
    return random_model(tmp_path_factory.mktemp("random"))


POOL = TokenSet(pool=torch.arange(V))


def _near(model) -> NearbyB:
    return NearbyB(model.W_U.T.detach())


def test_logodds_by_hand():
    p = torch.tensor([0.5, 0.9, 0.1, 0.2], dtype=torch.float64)
    assert torch.allclose(logodds(p.log()), torch.tensor([0.0, math.log(9), -math.log(9), math.log(0.25)],
                                                         dtype=torch.float64), atol=1e-12)
    # strength: p(B) 0.8 after the sequence, 0.2 after the control -> log 4 - log 0.25 = log 16
    p8, p2 = torch.tensor(0.8, dtype=torch.float64), torch.tensor(0.2, dtype=torch.float64)
    assert (logodds(p8.log()) - logodds(p2.log())).item() == pytest.approx(math.log(16))
    # extremes stay finite and monotone
    extreme = logodds(torch.tensor([-1e-30, -100.0], dtype=torch.float64))
    assert torch.isfinite(extreme).all() and extreme[0] > 30 and extreme[1] < -30


@pytest.mark.parametrize("shape, k", [((3, 5, 300), 1), ((7, 300), 2), ((1, 300), 3)])
def test_gathered_logprobs_are_the_whole_tensors_log_softmax_bit_for_bit(monkeypatch, shape, k):
    """A few rows at a time (here 2: LOGPROB_BYTES lowered), the values and their gradient are
    those of one float64 log_softmax over the whole tensor, gathered: the same bits."""
    from compatlas.behaviour import sequences

    monkeypatch.setattr(sequences, "LOGPROB_BYTES", 2 * 8 * 300)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=gen) * 4).requires_grad_(True)
    t = torch.randint(300, (*shape[:-1], k), generator=gen)
    whole = x.double().log_softmax(-1).gather(-1, t)
    rows = sequences.gathered_logprobs(x, t)
    assert torch.equal(rows, whole) and rows.dtype == torch.float64
    assert torch.equal(*(torch.autograd.grad(v.sum(), x)[0] for v in (rows, whole)))


def test_strength_is_logodds_difference_of_the_model_softmax(built):
    gen = torch.Generator().manual_seed(1)
    A, B = torch.tensor([3, 9]), torch.tensor([7, 1])
    seq, ctrl = induction_sequences(gen, POOL, A, B, 10, 10)
    st = strengths(built, seq, ctrl, B[:, None], 8)[:, 0]
    with torch.no_grad():
        for i in range(2):
            p = built(seq[i:i + 1])[0, -1].double().softmax(-1)[B[i]].item()
            q = built(ctrl[i:i + 1])[0, -1].double().softmax(-1)[B[i]].item()
            assert 0.5 < p < 0.999 and q < 0.2  # the built circuit predicts B, the control does not
            assert st[i].item() == pytest.approx(math.log(p / (1 - p)) - math.log(q / (1 - q)), rel=1e-6)


def test_sequences_and_control():
    gen = torch.Generator().manual_seed(0)
    A, B = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    seq, ctrl = induction_sequences(gen, TokenSet(pool=torch.arange(10), bos=31), A, B, 10, 5)
    assert seq.shape == (3, 1 + 10 + 2 + 5 + 1) and (seq[:, 0] == 31).all() and (ctrl[:, 0] == 31).all()
    assert (seq[:, 11] == A).all() and (seq[:, 12] == B).all() and (seq[:, -1] == A).all() and (ctrl[:, -1] == A).all()
    fill = torch.cat([seq[:, 1:11], seq[:, 13:-1]], 1)
    assert not (fill == A[:, None]).any() and not (fill == B[:, None]).any()  # the planted A B is the only one
    assert (seq.sort(1).values == ctrl.sort(1).values).all() and not torch.equal(seq, ctrl)  # a shuffle


def test_sweep_finds_induction_on_the_built_model(built):
    model = built
    ids = torch.arange(8)
    df = induction_sweep(model, ids, POOL, _near(model), sequences=16, seed=0)
    assert df.height == 16 and set(df["role"]) == {"A", "B"}
    # p(B) ~ 0.75 after the sequence and ~0.007 after the control: strength ~ 1.1 - (-4.9)
    assert df["mean"].min() > 3.0
    assert (df["random_mean"].abs() < 1.0).all()  # R is not copied: its log-odds barely move
    assert (df["stderr"] <= df["std"] / 3.99).all()


def test_random_model_strengths_near_zero(rand):
    model = rand
    df = induction_sweep(model, torch.arange(8), POOL, _near(model), sequences=16, seed=0)
    assert abs(df["mean"].mean()) < 0.05 and df["mean"].abs().max() < 0.3


def test_head_scores_find_the_two_heads(built):
    df = head_attention_scores(built, POOL, sequences=32, length=12, seed=0)
    by = {(r["layer"], r["head"]): r for r in df.iter_rows(named=True)}
    assert by[(0, 0)]["prev_token_mean"] > 0.99
    assert max(df["prev_token_mean"]) == by[(0, 0)]["prev_token_mean"]
    # ~0.8: a token repeated inside a half of 12 (vocabulary 32) splits the head between its matches
    assert by[(1, 0)]["induction_mean"] > 0.7
    assert max(r["induction_mean"] for k, r in by.items() if k != (1, 0)) < 0.2
    # no head of this model attends to the earlier copy of its own token
    assert df["duplicate_mean"].max() < 0.2


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_ablating_the_induction_head_removes_the_effect(built, mode):
    model = built
    df = ablation_effects(model, POOL, sequences=16, mode=mode, seed=0, batch_size=32)
    by = {(r["layer"], r["head"]): r["ablation_drop"] for r in df.iter_rows(named=True)}
    clean = df["clean_strength"][0]
    assert clean > 3.0
    for head in ((1, 0), (0, 0)):  # both heads of the circuit are necessary
        assert by[head] > 0.8 * clean, (head, by[head], clean)
    for head in ((0, 1), (1, 1)):
        assert abs(by[head]) < 0.1 * clean


def test_batched_ablation_equals_one_head_at_a_time(built):
    """Ablating the heads of a layer side by side in one batch gives what one pass per head gives."""
    model = built
    side_by_side = ablation_effects(model, POOL, sequences=8, seed=3, batch_size=64)
    one_at_a_time = ablation_effects(model, POOL, sequences=8, seed=3, batch_size=8)
    assert torch.allclose(torch.tensor(side_by_side["ablation_drop"]), torch.tensor(one_at_a_time["ablation_drop"]),
                          atol=1e-6)


def test_measure_end_to_end(built):
    settings = {"pool": 0, "prepend_bos": "auto", "tokens": 4, "token_ids": [], "sequences": 4, "seed": 0,
                "batch_size": 64, "fillers": [[10, 10], [3, 2]], "head_scores": {"sequences": 8, "length": 10},
                "ablation": {"mode": "zero", "sequences": 8}}
    model = built
    tokens, heads, chosen = measure_behaviour(model, None, model.W_U.T.detach(), settings, model.W_E.detach())
    assert tokens.height == 2 * 2 * 4 and set(tokens["filler_before"]) == {10, 3}
    assert tokens["token_text"][0] == f"t{tokens['token_id'][0]}"
    # a seeded sample of the 32 (all clean) tokens, not the first four
    assert tokens["token_id"].unique().sort().to_list() == sample_tokens(torch.arange(V), 4, 0, "measured").tolist()
    assert chosen["clean_tokens"] == V and chosen["pool_tokens"] == V
    b = tokens.filter(tokens["role"] == "B")
    assert b["near_b_cosine"].is_not_null().all() and (b["near_b_id"] != b["token_id"]).all()
    assert heads.height == 4 and heads["ablation_drop"].is_not_null().all()
    assert set(heads["ablation_method"]) == {"exact"} and set(heads["ablation_sequences"]) == {8}


# ----------------------------------------------------------------------------- which tokens (clean tokens)


def test_sample_tokens_is_seeded_and_uniform():
    clean = torch.arange(0, 2000, 2)
    a, b = sample_tokens(clean, 100, 0, "measured"), sample_tokens(clean, 100, 0, "measured")
    assert torch.equal(a, b) and len(a.unique()) == 100 and torch.isin(a, clean).all()
    assert not torch.equal(a, sample_tokens(clean, 100, 1, "measured"))
    assert a.float().mean().item() == pytest.approx(1000, abs=150)  # spread over the vocabulary, not its start
    assert torch.equal(sample_tokens(clean, 0, 0, "pool"), clean) and torch.equal(sample_tokens(clean, 5000, 0, "x"), clean)


def test_clean_tokens_excludes_each_kind(tmp_path):
    """A word-level vocabulary with one token of each excluded kind, each found by its own test."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "alpha", "beta", "<unused0>", "two words", "gamma", "delta", "eps", "zeta", "eta"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<s>")
    fast.add_tokens(["<jupyter_code>"])  # id 10: an added (control) token
    V_ = len(words) + 1
    W_E = torch.randn(V_, 6, generator=torch.Generator().manual_seed(0))
    W_E[7] = W_E[6]                       # eps duplicates delta's embedding row: both excluded
    W_U = torch.randn(V_, 6, generator=torch.Generator().manual_seed(1))
    W_U[9] = W_U[8]                       # eta duplicates zeta's unembedding row
    clean, counts = clean_tokens(fast, W_E, W_U)
    assert clean.tolist() == [1, 2, 5]    # alpha, beta, gamma
    assert counts == {"special": 1, "added": 1, "control": 1, "unreachable": 1, "duplicate": 4}
    # W_E alone: the unembedding's duplicates stay
    assert clean_tokens(fast, W_E)[0].tolist() == [1, 2, 5, 8, 9]
    assert clean_tokens(None, W_E)[0].tolist() == [t for t in range(V_) if t not in (6, 7)]


def test_each_tokens_text_and_encoding_are_the_wrappers(monkeypatch):
    """The backend's one-call decode and encode give, token for token, what the wrapper's
    batch_decode and __call__ give (a byte-level BPE with partial UTF-8 tokens and special and
    added tokens, its backend left truncating and padding); with clean-up on, the wrapper itself."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from compatlas.behaviour import tokens as tokens_mod

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    text = ["the cat sat on the mat", "def f(x): return x ** 2", "naïve café, 東京 ünïcode", "  spaces\tand\nlines"]
    bpe.train_from_iterator(text * 20, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    fast.add_tokens(["<jupyter_code>", " added"])
    ids = list(range(len(fast)))

    def wrapper() -> tuple[list[str], list[list[int]]]:
        texts = fast.batch_decode([[t] for t in ids])
        return texts, fast(texts, add_special_tokens=False).input_ids

    want = wrapper()
    assert any(e != [t] for t, e in zip(ids, want[1]))  # some tokens do not come back: the check means something
    fast._tokenizer.enable_truncation(2)
    fast._tokenizer.enable_padding(length=5)
    decoded = []
    monkeypatch.setattr(fast, "batch_decode", lambda *a, **k: decoded.append(1) or type(fast).batch_decode(fast, *a, **k))
    assert tokens_mod._decode_and_encode(fast, ids) == want and decoded == []  # the backend's path, not the wrapper's
    fast.clean_up_tokenization_spaces = True
    assert tokens_mod._decode_and_encode(fast, ids)[1] == wrapper()[1] and decoded


def test_nearest_token_skips_exact_duplicates_and_reports_cosine():
    e = torch.eye(4)
    rows = torch.stack([e[0], e[0], 0.8 * e[0] + 0.6 * e[1], e[2], e[3], 2 * e[3]])
    ids, cos = nearest_tokens(rows, torch.tensor([0, 1, 2, 3, 4]), exclude=torch.tensor([3]))
    # token 1 is token 0's exact duplicate: token 0's neighbour is 2 (cosine 0.8), not 1 (cosine 1)
    assert ids[:2].tolist() == [2, 2] and cos[:2].tolist() == pytest.approx([0.8, 0.8])
    assert ids[2].item() in (0, 1) and cos[2].item() == pytest.approx(0.8)
    # 5 = 2 x 4 is not an exact duplicate of 4: it is its neighbour, at cosine 1; 3 is excluded
    assert ids[4].item() == 5 and cos[4].item() == pytest.approx(1.0)
    assert ids[3].item() != 3


def test_nearby_b_searches_only_the_tokens_asked_and_agrees_with_a_whole_search():
    rows = torch.randn(40, 6, generator=torch.Generator().manual_seed(0))
    rows[7] = rows[3]  # an exact duplicate is never a neighbour
    exclude = torch.tensor([5])
    ids, cos = nearest_tokens(rows, torch.arange(40), exclude)
    near = NearbyB(rows, exclude)
    near.lookup(torch.tensor([3, 9, 9, 30]))
    assert sorted(near._found) == [3, 9, 30]
    for t in (3, 9, 30, 12):  # 12: searched on first use
        assert near[t][0] == ids[t].item() and near[t][1] == pytest.approx(cos[t].item())
    assert sorted(near._found) == [3, 9, 12, 30]


# ----------------------------------------------------------------------------- ablation: exact, full, attribution


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_exact_ablation_on_cached_stream_equals_full_reruns(built, mode):
    """Heads ablated on the cached residual stream (blocks below the head skipped) drop the
    strength exactly as rerunning the whole model does; several chunks and head groups."""
    full = ablation_effects(built, POOL, sequences=12, mode=mode, method="full", seed=5, batch_size=8)
    exact = ablation_effects(built, POOL, sequences=12, mode=mode, method="exact", seed=5, batch_size=8)
    assert torch.allclose(torch.tensor(exact["ablation_drop"]), torch.tensor(full["ablation_drop"]), atol=1e-6)
    assert torch.allclose(torch.tensor(exact["ablation_drop_stderr"]), torch.tensor(full["ablation_drop_stderr"]),
                          atol=1e-6)


def test_exact_ablation_skips_lower_blocks_on_llama(tmp_path):
    """Rotary, RMSNorm, grouped KV heads: same drops as full reruns, and block 0 runs only in the
    clean pass and its own layer's passes, never for heads of the layers above."""
    model, _ = boot({"source": {"kind": "build", "architecture": "llama", "n_layers": 3, "n_heads": 4, "n_kv_heads": 2,
                                "d_head": 8, "d_vocab": 40, "seed": 0}}, None, tmp_path)
    model.eval()
    pool = TokenSet(pool=torch.arange(1, 40))
    full = ablation_effects(model, pool, sequences=6, method="full", seed=0, batch_size=12)
    calls = []
    layers = block_list(model)
    assert layers is not None and layers[0] is model.blocks[0]
    handle = layers[0].register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0] if a else -1))
    try:
        exact = ablation_effects(model, pool, sequences=6, method="exact", seed=0, batch_size=12)
    finally:
        handle.remove()
    assert torch.allclose(torch.tensor(exact["ablation_drop"]), torch.tensor(full["ablation_drop"]), atol=1e-6)
    # clean strengths (2 passes) + cache passes (2: sequences, controls) + layer 0's head groups (2 x 2 of 2 heads)
    assert len(calls) == 2 + 2 + 4
    assert not any(isinstance(m, Skip) for m in layers)  # the blocks are put back


def test_attribution_is_the_derivative_of_the_exact_drop(built):
    """Attribution patching is first order: its drop for a head is d(strength)/d(scale) when the
    head's z is scaled, taken by central finite differences on the same sequences (exact at
    first order: zeroing z is scale 1 -> 0). Covers the lower head's gradient through the upper one."""
    from compatlas.behaviour.induction import _draw
    from compatlas.runtime import stable_seed

    S, eps = 6, 1e-2
    attr = ablation_effects(built, POOL, sequences=S, method="attribution", seed=2, batch_size=8)
    gen = torch.Generator().manual_seed(stable_seed(2, "ablation", 10, 10))  # the sequences ablation_effects draws
    A = _draw(gen, POOL.pool, (S,))
    B = _draw(gen, POOL.pool, (S,), avoid=(A,))
    seq, ctrl = induction_sequences(gen, POOL, A, B, 10, 10)

    def scaled(layer: int, head: int, factor: float) -> torch.Tensor:
        def scale(z, hook):
            z = z.clone()
            z[:, :, head] *= factor
            return z
        return strengths(built, seq, ctrl, B[:, None], 8, hooks=lambda rows: [(f"blocks.{layer}.attn.hook_z", scale)])

    for layer in range(2):
        for head in range(2):
            slope = ((scaled(layer, head, 1 + eps) - scaled(layer, head, 1 - eps)) / (2 * eps)).mean().item()
            got = attr.filter((attr["layer"] == layer) & (attr["head"] == head))["ablation_drop"].item()
            assert got == pytest.approx(slope, rel=2e-2, abs=1e-2), (layer, head, got, slope)
    # the circuit's heads are the strong cases: the previous-token head's effect runs through the induction head
    assert abs(attr.filter((attr["layer"] == 0) & (attr["head"] == 0))["ablation_drop"].item()) > 3.0


def test_attribution_ranks_the_circuit_on_the_built_model(built):
    """Attribution's estimate of the induction head's drop is large, the noise heads' small beside
    it (under 0.1 in float32; 0.31 when a float64 default dtype leaked in from another module:
    the noise heads' first-order terms are tiny differences of large ones, so bound them relative
    to the circuit)."""
    attr = ablation_effects(built, POOL, sequences=8, method="attribution", seed=0, batch_size=8)
    by = {(r["layer"], r["head"]): r["ablation_drop"] for r in attr.iter_rows(named=True)}
    assert by[(1, 0)] > 2.0 and abs(by[(0, 1)]) < 0.15 * by[(1, 0)] and abs(by[(1, 1)]) < 0.15 * by[(1, 0)]


def test_bfloat16_strengths_agree_with_float32(built, tmp_path):
    """Forward passes in bfloat16 (induction.dtype) give the float32 strengths within 0.25 on a
    model whose strengths are about 6 (bfloat16 keeps 8 bits of mantissa)."""
    half = induction_model(tmp_path, torch.bfloat16)
    assert next(half.parameters()).dtype == torch.bfloat16
    near = _near(built)
    ref = induction_sweep(built, torch.arange(8), POOL, near, sequences=16, seed=0)
    got = induction_sweep(half, torch.arange(8), POOL, near, sequences=16, seed=0)
    assert ref["mean"].min() > 3.0
    assert (got["mean"] - ref["mean"]).abs().max() < 0.25
    assert (got["random_mean"] - ref["random_mean"]).abs().max() < 0.25


def test_progress_is_logged(built, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="compatlas"):  # the sweep and ablation modules log beneath it
        ablation_effects(built, POOL, sequences=4, method="exact", seed=0, batch_size=8)
    assert any("ablation (zero, exact): 32/32 head x sequence passes (100%)" in r.message for r in caplog.records)


def test_attribution_matches_finite_differences_on_llama_in_float64(tmp_path):
    """The same first-order identity on a random Llama (rotary, RMSNorm, grouped KV heads),
    run in float64 (Hugging Face still takes the attention softmax in float32: hence a step of
    1e-2, whose truncation error is O(step^2)): every head, to 1%."""
    from compatlas.behaviour.induction import _draw
    from compatlas.runtime import stable_seed

    model, _ = boot({"source": {"kind": "build", "architecture": "llama", "n_layers": 3, "n_heads": 4, "n_kv_heads": 2,
                                "d_head": 8, "d_vocab": 40, "seed": 0}}, None, tmp_path, dtype=torch.float64)
    model.eval()
    pool = TokenSet(pool=torch.arange(1, 40))
    S, eps = 4, 1e-2
    for mode in ("zero", "mean"):
        attr = ablation_effects(model, pool, sequences=S, mode=mode, method="attribution", seed=1, batch_size=8)
        gen = torch.Generator().manual_seed(stable_seed(1, "ablation", 10, 10))
        A = _draw(gen, pool.pool, (S,))
        B = _draw(gen, pool.pool, (S,), avoid=(A,))
        seq, ctrl = induction_sequences(gen, pool, A, B, 10, 10)
        means = None
        if mode == "mean":
            from compatlas.behaviour.induction import head_z_means
            means = head_z_means(model, torch.cat([seq, ctrl]), 8)

        def moved(layer: int, head: int, t: float) -> torch.Tensor:  # z -> z + t (ablated z - z)
            def move(z, hook):
                z = z.clone()
                target = torch.zeros_like(z[:, :, head]) if means is None else means[layer][head].to(z.dtype)
                z[:, :, head] += t * (target - z[:, :, head])
                return z
            return strengths(model, seq, ctrl, B[:, None], 8, hooks=lambda rows: [(f"blocks.{layer}.attn.hook_z", move)])

        got = torch.tensor(attr.sort("layer", "head")["ablation_drop"].to_list())
        want = torch.tensor([-((moved(layer, head, eps) - moved(layer, head, -eps)) / (2 * eps)).mean().item()
                             for layer in range(3) for head in range(4)])
        assert want.abs().max() > 1e-4  # not a vacuous comparison
        assert torch.allclose(got, want, rtol=1e-2, atol=1e-6), (mode, got, want)

"""Induction sweeps, head scores and ablation on a model whose circuit is set by hand:
head 0.0 is an exact previous-token head, head 1.0 an exact induction head (K-composing
with 0.0), heads 0.1 and 1.1 small random noise. Also the log-odds arithmetic by hand, and a
random model, on which strengths must be near zero."""

from __future__ import annotations

import math

import pytest
import torch

from compatlas.induction import (
    TokenSet, ablation_effects, head_attention_scores, induction_sequences, induction_sweep, logodds, measure,
    nearest_tokens, strengths,
)
from compatlas.loading import boot, word_tokenizer

V, P = 32, 32                      # vocabulary, positions
TOK, PREV, POS, OUT, SINK = 0, V, 2 * V, 2 * V + P, 3 * V + P
N_HEADS, D_HEAD = 2, 68
D_MODEL = N_HEADS * D_HEAD         # 136 >= 3V + P + 1
SHARP = 30.0                       # attention logit scale of a match
COPY = 4.0                          # what the induction head writes for B: p(B) about 0.75 after the final norm


def _hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_head=N_HEADS, n_embd=D_MODEL, vocab_size=V, n_positions=P, tie_word_embeddings=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).eval()


def _boot(hf, folder):
    hf.save_pretrained(folder)
    word_tokenizer(V, folder)
    bridge, _ = boot({"source": {"kind": "local", "path": str(folder)}}, None, folder)
    return bridge


def _one_hot(rows: int, offset: int, scale: float = 1.0) -> torch.Tensor:
    """rows x D_MODEL: row i writes +scale at offset + i and -scale at SINK. Every vector the
    circuit writes sums to zero, so GPT-2's LayerNorm only rescales (no centring shift)."""
    m = torch.zeros(rows, D_MODEL)
    m[torch.arange(rows), offset + torch.arange(rows)] = scale
    m[:, SINK] = -scale
    return m


def induction_model(folder):
    """GPT-2 (LayerNorm, MLPs zeroed) with a hand-set induction circuit, booted through the bridge.

    Subspaces of the residual: TOK (the token), POS (the position), PREV (written by 0.0: the
    previous token), OUT (written by 1.0: read by W_U). 0.0 matches query position i to key
    position i - 1 and copies the key's token into PREV; 1.0 matches query token t to keys
    whose PREV is t and copies the key's token into OUT."""
    hf = _hf_gpt2()
    g = torch.Generator().manual_seed(0)
    s = SHARP * math.sqrt(D_HEAD)
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
        (b0, Q0, K0, V0, O0), (b1, Q1, K1, V1, O1) = heads
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
    return _boot(hf, folder)


def random_model(folder):
    return _boot(_hf_gpt2(), folder)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return induction_model(tmp_path_factory.mktemp("induction"))


@pytest.fixture(scope="module")
def rand(tmp_path_factory):
    return random_model(tmp_path_factory.mktemp("random"))


POOL = TokenSet(pool=torch.arange(V))


def test_logodds_by_hand():
    p = torch.tensor([0.5, 0.9, 0.1, 0.2], dtype=torch.float64)
    assert torch.allclose(logodds(p.log()), torch.tensor([0.0, math.log(9), -math.log(9), math.log(0.25)],
                                                         dtype=torch.float64), atol=1e-12)
    # strength: p(B) 0.8 after the sequence, 0.2 after the control -> log 4 - log 0.25 = log 16
    assert (logodds(torch.tensor(0.8, dtype=torch.float64).log()) - logodds(torch.tensor(0.2, dtype=torch.float64).log())).item() == pytest.approx(math.log(16))
    # extremes stay finite and monotone
    extreme = logodds(torch.tensor([-1e-30, -100.0], dtype=torch.float64))
    assert torch.isfinite(extreme).all() and extreme[0] > 30 and extreme[1] < -30


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
    near = dict(zip(range(V), nearest_tokens(model.W_U.T.detach(), torch.arange(V)).tolist()))
    df = induction_sweep(model, ids, POOL, near, sequences=16, seed=0)
    assert df.height == 16 and set(df["role"]) == {"A", "B"}
    # p(B) ~ 0.75 after the sequence and ~0.007 after the control: strength ~ 1.1 - (-4.9)
    assert df["mean"].min() > 3.0
    assert (df["random_mean"].abs() < 1.0).all()  # R is not copied: its log-odds barely move
    assert (df["stderr"] <= df["std"] / 3.99).all()


def test_random_model_strengths_near_zero(rand):
    model = rand
    near = dict(zip(range(V), nearest_tokens(model.W_U.T.detach(), torch.arange(V)).tolist()))
    df = induction_sweep(model, torch.arange(8), POOL, near, sequences=16, seed=0)
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
    settings = {"pool": V, "prepend_bos": "auto", "tokens": 4, "token_ids": [], "sequences": 4, "seed": 0,
                "batch_size": 64, "fillers": [[10, 10], [3, 2]], "head_scores": {"sequences": 8, "length": 10},
                "ablation": {"mode": "zero", "sequences": 8}}
    model = built
    tokens, heads = measure(model, None, model.W_U.T.detach(), settings)
    assert tokens.height == 2 * 2 * 4 and set(tokens["filler_before"]) == {10, 3}
    assert tokens["token_text"][0] == "t0"
    assert heads.height == 4 and heads["ablation_drop"].is_not_null().all()

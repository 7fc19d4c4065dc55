"""QK-norm and the post-attention (sandwich) norm, checked against the model's own forward
(a tiny Gemma-3 with random norm gains; ``compatlas.models.norm_gains``).

With the gains folded, the extracted factors give the model's normalised queries, keys and
layer outputs up to one positive scalar per token (the RMS the norms divide by): the cosine
between what the factors give and what the model computes is 1. Raw factors do not."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_hf_model

from compatlas.models import streaming
from compatlas.models.norm_gains import fold_layer
from compatlas.models.small_models import word_tokenizer


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    torch.manual_seed(0)
    model = tiny_hf_model("gemma3", 64).eval()
    folder = tmp_path_factory.mktemp("gemma3")
    model.save_pretrained(folder)
    word_tokenizer(64, folder)
    return model, folder


def forward_captures(model, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Layer 1's attention input (after input_layernorm), its q_norm / k_norm outputs, the input
    of o_proj (the heads' z) and the post-attention norm's output."""
    got: dict[str, torch.Tensor] = {}
    layer = model.model.layers[1]

    def keep(name, which="out"):
        def hook(module, args, out):
            got[name] = (args[0] if which == "in" else out).detach()
        return hook

    hooks = [layer.input_layernorm.register_forward_hook(keep("x")),
             layer.self_attn.q_norm.register_forward_hook(keep("q")),
             layer.self_attn.k_norm.register_forward_hook(keep("k")),
             layer.self_attn.o_proj.register_forward_hook(keep("z", "in")),
             layer.post_attention_layernorm.register_forward_hook(keep("out"))]
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    return got


def min_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).min().item()


@pytest.mark.parametrize("mode", ["fold", "raw"])
def test_folded_factors_give_the_models_own_queries_keys_and_outputs(gemma3, mode):
    model, folder = gemma3
    w = streaming.stream_extract(folder, "none", mode)
    assert w.meta["norm_gains"] == ({"q_norm": "folded into W_Q columns", "k_norm": "folded into W_K columns",
                                     "post_attention_norm": "folded into W_O output channels"} if mode == "fold" else
                                    {k: "raw (not folded)" for k in ("q_norm", "k_norm", "post_attention_norm")})
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    got = forward_captures(model, tokens)
    B, T, H, KV, dh = 2, 12, 4, 2, 8
    q = torch.einsum("btm,hmd->bthd", got["x"], w.W_Q[1])  # before RoPE, as q_norm's output is
    k = torch.einsum("btm,hmd->bthd", got["x"], w.W_K[1])
    out = torch.einsum("bthd,hdm->btm", got["z"].view(B, T, H, dh), w.W_O[1])
    cosines = [min_cosine(q, got["q"].transpose(1, 2) if got["q"].shape[1] == H else got["q"]),
               min_cosine(k, got["k"].transpose(1, 2) if got["k"].shape[1] == KV else got["k"]),
               min_cosine(out, got["out"])]
    if mode == "fold":
        assert min(cosines) > 1 - 1e-6, cosines
    else:  # the raw factors point elsewhere (random gains: 1 + w ~ N(1, 1) per channel)
        assert max(cosines) < 0.99, cosines


def test_fold_layer_scales_columns_and_output_channels_by_hand():
    H, d, dh = 2, 3, 2
    t = {"q": torch.ones(H, d, dh), "k": torch.ones(1, d, dh), "v": torch.ones(1, d, dh), "o": torch.ones(H, dh, d)}
    gains = {"q_norm": torch.tensor([1.0, -2.0]), "k_norm": None, "post_attention_norm": torch.tensor([0.0, 1.0, 2.0])}
    out = fold_layer(t, gains, offset=True, mode="fold")  # Gemma: the gain is 1 + w
    assert torch.equal(out["q"][1, 2], torch.tensor([2.0, -1.0]))
    assert torch.equal(out["k"], t["k"]) and torch.equal(out["v"], t["v"])
    assert torch.equal(out["o"][0, 1], torch.tensor([1.0, 2.0, 3.0]))
    # OLMo-2's QK-norm spans every head's channels: one gain per head and channel
    per_head = fold_layer(t, {"q_norm": torch.tensor([1.0, 2.0, 3.0, 4.0])}, offset=False, mode="fold")
    assert torch.equal(per_head["q"][1, 0], torch.tensor([3.0, 4.0]))
    assert fold_layer(t, gains, offset=True, mode="raw")["q"] is t["q"]

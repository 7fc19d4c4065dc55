"""EAP exact through the reader's attention (``eap_attn``): AtP*'s fix for saturated attention
(the "QK fix" of Kramár et al. 2024), applied to Q, K and V edges.

An edge reaches the metric through the reader head's attention: its layer norm, its query, key
or value projection and, for Q and K, a softmax. Where attention is saturated (an induction
head puts nearly all of its weight on one key) the softmax's gradient at the clean input is
near zero, and EAP's first-order estimate misses the edge or gets its sign wrong: on the trained
2-layer model plain EAP gives the four K edges about the same score and ranks the circuit edge
second, while exact patching gives it 1.3 times the next. This method computes the reader
head's output exactly with only that edge patched, and linearises only above it:

    dM(u -> v, comp) ~= sum over heads h that read v's input, positions i, d_head of
                        (z_h'[i] - z_h[i]) * dM/dz_h[i]

``z'`` is the model's own output of the reader layer's heads (``hook_z``): the bridge's forward of
layer l alone, on the clean residual stream entering l, with the query, key or value input of
every head of l shifted by ``a_u(corrupt) - a_u(clean)``; ``dM/dz`` comes from the same clean
backward pass as EAP's gradients. Shifting every head of the layer in one pass is exact, because
heads do not interact before their outputs: head v's z is the one its own edge alone gives. For
a Q or K edge z' - z = (A' - A) v, so the sum is AtP*'s ``(A' - A) . dM/dA`` exactly. K and V:
the g query heads of a KV group all read the group's shifted keys or values and their terms
add: one edge into the KV head, as everywhere in ``compatlas.function.edge_attribution``.

Cost: one attention-layer forward per writer head x reader layer x comp on the task's sequences
(the blocks below skipped, nothing above run): 3 x H x L(L-1)/2 layer forwards, quadratic in
depth, against EAP's 3 whole-model passes. Seconds on the small models; on SmolLM2 (11,745 of
them) it is about 80 times EAP's time on CPU, and there EAP already agrees with exact patching.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress

import torch

from compatlas.behaviour.block_skip import StopForward, block_list, skip_below
from compatlas.vocab import Comp

# Rows (writers x sequences) per pass are capped so that one per-head residual fork
# [rows, T, n_heads, d_model] stays within 2**26 floats (256 MiB in float32).
FORK_BUDGET = 2**26


def _capture_and_stop(store: dict) -> Callable:
    def hook(z, hook):
        store["z"] = z
        raise StopForward  # nothing above the reader layer's hook_z is needed
    return hook


def _shift_every_head(delta: torch.Tensor) -> Callable:
    """A fork hook ([rows, T, heads, d_model]) adding ``delta`` [rows, T, d_model] to every head's input."""
    def hook(x, hook):
        return x + delta[:, :, None, :].to(x.dtype)
    return hook


@torch.no_grad()
def exact_attention_scores(model, tokens: torch.Tensor, delta: torch.Tensor, z: list[torch.Tensor],
                           z_grads: list[torch.Tensor | None], resid: list[torch.Tensor | None], arity: int,
                           comp: Comp, width: int, fork_hook: str,
                           advance: Callable[[int], None] | None = None) -> torch.Tensor:
    """The score of every ``comp`` edge of one batch of ``n`` sequences (module docstring):
    float64 [n, L, H, L, width] (writer layer, writer head, reader layer, reader query head or
    KV head); non-causal entries are 0.

    ``tokens`` [n, T] the clean tokens; ``delta`` [n, L*H, T*d_model] every head's
    a_u(corrupt) - a_u(clean) (heads layer-major); ``z[l]`` [n, T, H, d_head] the clean hook_z
    of layer l and ``z_grads[l]`` dM/dz there; ``resid[l]`` the clean stream
    entering layer l; ``fork_hook`` the per-head input hook of ``comp`` (``hook_q_input``...);
    ``arity``: what a block returns (``compatlas.behaviour.block_skip``)."""
    n, T = tokens.shape
    L, H = model.cfg.n_layers, model.cfg.n_heads
    d_model = delta.shape[-1] // T
    group = H // width if comp != "Q" else 1
    out = torch.zeros(n, L, H, L, width, dtype=torch.float64)
    layers = block_list(model)
    per_pass = max(1, FORK_BUDGET // (n * T * H * d_model))  # the query fork is the widest
    for lr in range(1, L):
        writers = lr * H
        z_grad = z_grads[lr]
        assert z_grad is not None  # None only at layer 0, which has no writer below it
        for w0 in range(0, writers, per_pass):
            k = min(per_pass, writers - w0)
            d = delta[:, w0:w0 + k].transpose(0, 1).reshape(k * n, T, d_model)
            store: dict = {}
            hooks = [(f"blocks.{lr}.attn.{fork_hook}", _shift_every_head(d)),
                     (f"blocks.{lr}.attn.hook_z", _capture_and_stop(store))]
            entering = resid[lr]
            r = entering.repeat(k, 1, 1) if entering is not None else None
            with skip_below(layers, lr, r, arity):
                with suppress(StopForward):
                    model.run_with_hooks(tokens.repeat(k, 1), fwd_hooks=hooks)
            change = (store["z"].float().view(k, n, T, H, -1) - z[lr].float()[None]) * z_grad[None]
            per_head = change.sum((2, 4))  # [k, n, H]
            per_reader = per_head.view(k, n, width, group).sum(-1)
            w = torch.arange(w0, w0 + k)
            out[:, w // H, w % H, lr] = per_reader.transpose(0, 1).double().cpu()
            if advance is not None:
                advance(k * n)
    return out

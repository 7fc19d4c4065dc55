"""The ``pattern_output`` metric: the first-order change of a reader head's *output* when a writer
head's actual output is added to one of its inputs, through its attention pattern (Q, K) or its
values (V), on the model's own text sample (docs/math.md#pattern-output-the-readers-output-through-its-pattern).

Writer u (layer lw, any head), reader query head v (layer lr, any layer: pairs with lw >= lr are
not causal and are computed the same way, for the null; u with itself too). On the moments rule's
windows (positions j = 0..T-1, BOS included):

- ``a_u(j) = z_u(j) W_O^u`` is what u adds to the residual stream at j. With a post-attention
  (sandwich) norm ``n(y) = g_post * y / rms(y)`` over the layer's summed output y, it is u's share of
  what enters the stream, ``a_u(j) = g_post * (z_u(j) W_O^u) / rms(y(j))``, the per-token rms held:
  the heads' shares (and b_O's) add up to the norm's output exactly.
- Moving the reader layer's key input (the residual stream before its attention norm) by
  ``eps a_u`` at every position, queries and values unchanged, changes the logits
  ``s_ij = q_i . k_j / scale`` by ``eps ds_ij`` to first order, the pattern by
  ``dp_ij = p_ij (ds_ij - sum_j' p_ij' ds_ij')`` and v's output by
  ``do_i = sum_j dp_ij v_j W_O^v`` (K). Q: the query input moved instead. V: the value input moved,
  ``do_i = sum_j p_ij dv_j W_O^v``, the pattern fixed. GQA: K and V move v's KV group's key or value.
- ``score(u, v) = sqrt(mean over windows and reader positions i of ||do_i||^2)``, positions
  ``i >= 1`` where the sample starts with BOS (``skip_first``, as the moments), in the units of
  the reader's output ``z_v W_O^v`` (before v's own post-attention norm, if any).

The linearisation is exact (the JVP of the model's own computation), per position j: with
``x_j`` the stream entering the reader's norm, ``sigma_j`` its scale (eps in), ``n_j = P x_j / sigma_j``
(``P`` centres for LayerNorm, else I) and gain ``g``, the norm maps ``delta`` to
``(delta P diag(g) - (delta . n_j) (n_j * g) / d_model) / sigma_j``; then the projection W, then a
QK-norm the same way over d_head (its own scale and gain), then rotary (``x cos + rotate_half(x) sin``
on the first rotary dims), so ``dq_i = R_i N_i (J_i a_u(i)) W_Q``. Batched: ``delta = a_u`` is
``(z_u / rms) (W_O^u diag(g_post))``, so the weights-only ``M_u = W_O^u diag(g_post) P diag(g) W``
([d_head, H d_head]) is made per writer x reader layer and applied to z (d_head wide, not d_model);
the rank-one term needs ``a_u(i) . n_i`` only, one number per writer, reader layer and position.
With ``zbar`` the reader's ``z`` (rows: per query head) and ``R_v^T R_v = W_O^v W_O^vT``:

- Q: ``dz_i = dq_i A_i / scale``, ``A_i = sum_j p_ij k_j^T (v_j - z_i)`` [d_head, d_head], once per
  reader (not per writer), so a writer costs a d_head x d_head product per position;
- K: ``dz_i = sum_j p_ij ds_ij (v_j - z_i)``, ``ds = q dk^T / scale``: two T x T x d_head products
  per writer, every writer of a chunk in one batched product;
- V: ``dz_i = sum_j p_ij dv_j``; and ``||do_i|| = ||dz_i R_v^T||`` in each case.

Before any of it, the first batch checks every assumed form against the model's own hooks (norm,
projection, QK-norm, rotary, logits -> pattern, z, W_O, post-attention norm) and raises naming
the one that differs (ALiBi, logit soft-capping, a whole-layer QK-norm are not handled).

Cost, in multiply-adds: per window ``L^2 H^2 T d_head (3 T + 2 d_head)`` (K: ds and its mixing,
V: the mixing and R_v^T, Q: the d_head x d_head product) plus ``L^2 H T d_head^2 (H + 2 H_kv)`` (the
projections of z) plus ``L H T^2 d_head^2`` (Q's A_i); per batch ``L^2 H d_head^2 d_model (H + 2 H_kv)``
(the folded maps M). Quadratic in depth and window length: SmolLM2-135M (30 layers, 9 / 3 heads,
d_head 64, T 128) is about 0.4 T multiply-adds a window. Measured there (GGUF, float32, batch 8,
ONE CPU thread, as a Snakemake job runs; a shared 2-core machine at load ~6): 8 windows 371 s of
CPU (888 s wall), 32 windows (the default sample) 1201 s of CPU (2184 s wall). Not measured on
a GPU (the same code runs there, on the model's device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from compatlas.progress import Progress
from compatlas.vocab import COMPS, Comp

CHUNK_BUDGET = 2**25  # elements of the largest per-chunk tensor: K's logit changes [b, H, writers, T, T]


def attention_scale(hf_config: Any, d_head: int) -> float:
    """What the model divides q . k by: sqrt(query_pre_attn_scalar) where the config sets one
    (Gemma), else sqrt(d_head)."""
    return math.sqrt(getattr(hf_config, "query_pre_attn_scalar", None) or d_head)


@dataclass
class _Weights:
    """What the linearisation needs of the model, per layer (float, on its device)."""

    W_in: torch.Tensor  # [L, d, F]: W_Q | W_K | W_V of every head, F = (H + 2 Hkv) d_head
    W_O: torch.Tensor  # [L, H, dh, d]
    g1: torch.Tensor  # [L, d] the attention-input norm's gain (1: none)
    b1: torch.Tensor  # [L, d] its bias (0: none)
    gq: torch.Tensor | None  # [L, dh] QK-norm gains (None: no QK-norm)
    gk: torch.Tensor | None
    g_post: torch.Tensor  # [L, d] the post-attention norm's gain (1: none)
    centre: bool  # LayerNorm (centres) or RMSNorm
    scale: float  # the attention scale
    H: int
    Hkv: int


def _hook(model, name: str) -> str:
    if name not in model.hook_dict:
        raise ValueError(f"pattern_output: the bridge has no hook {name}")
    return name


def _gain(module, offset: bool, size: int, dt: torch.dtype, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A norm module's gain (``1 + w`` with Gemma's offset) and bias, or 1 and 0 when absent."""
    inner = getattr(module, "_original_component", module)
    w, b = getattr(inner, "weight", None), getattr(inner, "bias", None)
    g = torch.ones(size, dtype=dt, device=dev) if w is None else w.detach().to(dev, dt) + (1.0 if offset else 0.0)
    return g, torch.zeros(size, dtype=dt, device=dev) if b is None else b.detach().to(dev, dt)


def _weights(model, dt: torch.dtype, dev: torch.device) -> _Weights:
    cfg = model.cfg
    L, d = cfg.n_layers, cfg.d_model
    W_Q, W_K, W_V, W_O = (getattr(model, n).detach().to(dev, dt) for n in ("W_Q", "W_K", "W_V", "W_O"))
    if W_K.ndim == 3:  # one KV head, as some adapters return it
        W_K, W_V = W_K[:, None], W_V[:, None]
    H, Hkv, dh = W_Q.shape[1], W_K.shape[1], W_Q.shape[-1]
    W_in = torch.cat([W.permute(0, 2, 1, 3).reshape(L, d, -1) for W in (W_Q, W_K, W_V)], -1)
    offset = bool(getattr(cfg, "rmsnorm_uses_offset", False))
    blocks = list(model.blocks)
    ln1 = [_gain(b.ln1, offset, d, dt, dev) if hasattr(b, "ln1") else _gain(None, offset, d, dt, dev) for b in blocks]
    post = [_gain(b.ln1_post, offset, d, dt, dev)[0] if hasattr(b, "ln1_post") else torch.ones(d, dtype=dt, device=dev)
            for b in blocks]
    qk: dict[str, torch.Tensor | None] = {}
    for name in ("q_norm", "k_norm"):
        present = [getattr(b.attn, name, None) for b in blocks]
        gains = [_gain(m, offset, dh, dt, dev)[0] if m is not None else None for m in present]
        if any(g is not None and g.numel() != dh for g in gains):
            raise ValueError(f"pattern_output: a {name} over more than one head's d_head channels is not handled")
        qk[name] = torch.stack([g if g is not None else torch.ones(dh, dtype=dt, device=dev) for g in gains]) \
            if any(g is not None for g in gains) else None
    return _Weights(W_in=W_in, W_O=W_O, g1=torch.stack([g for g, _ in ln1]), b1=torch.stack([b for _, b in ln1]),
                    gq=qk["q_norm"], gk=qk["k_norm"], g_post=torch.stack(post),
                    centre=str(getattr(cfg, "normalization_type", "RMS") or "").upper().startswith("LN"),
                    scale=attention_scale(getattr(getattr(model, "original_model", None), "config", None), dh),
                    H=H, Hkv=Hkv)


def _names(model, layer: int) -> dict[str, str]:
    """The hooks a layer's captures come from (those the model has)."""
    a, blk = f"blocks.{layer}.attn", f"blocks.{layer}"
    want = {"x": f"{blk}.ln1.hook_in", "sigma": f"{blk}.ln1.hook_scale", "ln_out": f"{blk}.ln1.hook_out",
            "q_pre": f"{a}.q.hook_out", "k_pre": f"{a}.k.hook_out", "v": f"{a}.v.hook_out",
            "q_sigma": f"{a}.q_norm.hook_scale", "k_sigma": f"{a}.k_norm.hook_scale",
            "q_normed": f"{a}.hook_q_normed", "k_normed": f"{a}.hook_k_normed",
            "q_rot": f"{a}.hook_rot_q", "k_rot": f"{a}.hook_rot_k", "cos": f"{a}.hook_cos", "sin": f"{a}.hook_sin",
            "pattern": f"{a}.hook_pattern", "scores": f"{a}.hook_attn_scores", "z": f"{a}.hook_z",
            "out": f"{blk}.hook_attn_out",
            "post_in": f"{blk}.ln1_post.hook_in", "post_sigma": f"{blk}.ln1_post.hook_scale"}
    names = {k: n for k, n in want.items() if n in model.hook_dict}
    if "x" not in names:
        names["x"] = _hook(model, f"{a}.hook_in")
    for k in ("q_pre", "k_pre", "v", "pattern", "z"):
        _hook(model, want[k])
    return names


CHECK_ONLY = ("ln_out", "out", "post_in", "scores")  # captured for the first batch's checks only


def _capture(model, tokens: torch.Tensor, ct: torch.dtype, check: bool) -> list[dict[str, torch.Tensor]]:
    """One forward pass; per layer the captures in ``ct``, heads last ([b, T, heads, d_head])."""
    L = model.cfg.n_layers
    caps: list[dict[str, torch.Tensor]] = [{} for _ in range(L)]
    hooks = []
    for layer in range(L):
        for key, name in _names(model, layer).items():
            if key in CHECK_ONLY and not check:
                continue
            def keep(x, hook, key=key, layer=layer):
                x = x.detach().to(ct)
                if key in ("q_sigma", "k_sigma", "q_normed", "k_normed"):
                    x = x.transpose(1, 2)  # [b, heads, T, .] -> [b, T, heads, .]
                caps[layer][key] = x[..., 0] if key.endswith("sigma") else x
            hooks.append((name, keep))
    with torch.no_grad():
        model.run_with_hooks(tokens, fwd_hooks=hooks)
    return caps


def _rotate(x: torch.Tensor, c: dict[str, torch.Tensor]) -> torch.Tensor:
    """Rotary on [b, T, ..., dh] (rotate_half convention, the first cos.shape[-1] channels)."""
    if "cos" not in c:
        return x
    cos, sin = c["cos"], c["sin"]
    r = cos.shape[-1]
    shape = (cos.shape[0], cos.shape[1]) + (1,) * (x.ndim - 3) + (r,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    xr, rest = x[..., :r], x[..., r:]
    half = torch.cat([-xr[..., r // 2:], xr[..., :r // 2]], -1)
    return torch.cat([xr * cos + half * sin, rest], -1)


def _input_map(c: dict[str, torch.Tensor], which: str, gain: torch.Tensor | None) -> torch.Tensor | None:
    """The per-position linear map [b | 1, T, heads | 1, dh, dh] from a change of the projected query
    or key (row vector) to the change of the one the logit is made of: QK-norm's Jacobian at the
    model's own point, ``(I - m^T m / dh) diag(g) / sigma`` with ``m = pre / sigma``, then rotary
    (``_rotate`` of the identity's rows). None: the identity (neither)."""
    pre = c[f"{which}_pre"]
    dh = pre.shape[-1]
    eye = torch.eye(dh, dtype=pre.dtype, device=pre.device)
    E = None
    if gain is not None and f"{which}_sigma" in c:
        sigma = c[f"{which}_sigma"][..., None, None]
        m = pre / c[f"{which}_sigma"][..., None]
        E = (eye - m[..., :, None] * m[..., None, :] / dh) * gain / sigma
    if "cos" in c:
        rot = _rotate(eye.expand(1, pre.shape[1], dh, dh), c)[:, :, None]  # row d: the rotation of e_d
        E = rot if E is None else E @ rot
    return E


def _final(c: dict[str, torch.Tensor], which: str) -> torch.Tensor:
    """The query or key the logit is made of: after QK-norm and rotary where the model has them."""
    return c.get(f"{which}_rot", c.get(f"{which}_normed", c[f"{which}_pre"]))


def _check(c: dict[str, torch.Tensor], wt: _Weights, layer: int, n: torch.Tensor, tol: float) -> None:
    """The forms the linearisation assumes against the model's own hooks at one layer."""
    def rel(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
        if not err <= tol:
            raise ValueError(f"pattern_output: layer {layer}'s {what} is not the form the linearisation assumes "
                             f"(relative error {err:.1e} > {tol:.0e})")

    def centred(t: torch.Tensor) -> torch.Tensor:  # biases drop out
        return t - t.mean(1, keepdim=True)

    H, Hkv, dh = wt.H, wt.Hkv, c["v"].shape[-1]
    if "ln_out" in c:
        rel(n * wt.g1[layer] + wt.b1[layer], c["ln_out"], "attention-input norm (LayerNorm / RMSNorm)")
    y = c.get("ln_out", c["x"])
    W_q = wt.W_in[layer, :, :H * dh]
    rel(centred(y) @ W_q, centred(c["q_pre"]).flatten(2), "query projection")
    q, k = c["q_pre"], c["k_pre"]
    if wt.gq is not None and wt.gk is not None:
        rel(wt.gq[layer] * q / c["q_sigma"][..., None], c["q_normed"], "QK-norm")
        rel(wt.gk[layer] * k / c["k_sigma"][..., None], c["k_normed"], "QK-norm")
        q, k = c["q_normed"], c["k_normed"]
    if "q_rot" in c:
        rel(_rotate(q, c), c["q_rot"], "rotary")
        rel(_rotate(k, c), c["k_rot"], "rotary")
    p = c["pattern"]
    logits = torch.einsum("bihd,bjhd->bhij", _final(c, "q"), _final(c, "k").repeat_interleave(H // Hkv, 2)) / wt.scale
    if "scores" in c:  # the logits, then the softmax of the model's own (robust to a low-precision forward)
        rel(logits[p > 0], c["scores"][p > 0], "attention logits (q . k / scale)")
        logits = c["scores"]
    rel(logits.masked_fill(p == 0, float("-inf")).softmax(-1), p, "attention pattern (softmax of the logits)")
    rel(torch.einsum("bhij,bjhd->bihd", p, c["v"].repeat_interleave(H // Hkv, 2)), c["z"], "z (pattern times values)")
    out = torch.einsum("bihd,hde->bie", c["z"], wt.W_O[layer])
    if "post_in" in c:
        rel(centred(out), centred(c["post_in"]), "W_O")
        rel(wt.g_post[layer] * c["post_in"] / c["post_sigma"][..., None], c["out"], "post-attention norm")
    elif "out" in c:
        rel(centred(out), centred(c["out"]), "W_O")


def _normalised(c: dict[str, torch.Tensor], wt: _Weights, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reader norm's ``n = P x / sigma`` [b, T, d] and ``sigma`` [b, T] (0 and 1 without a norm)."""
    if "sigma" not in c:
        return torch.zeros_like(c["x"]), torch.ones_like(c["x"][..., 0])
    x = c["x"] - c["x"].mean(-1, keepdim=True) if wt.centre else c["x"]
    return x / c["sigma"][..., None], c["sigma"]


def _batch(caps: list[dict[str, torch.Tensor]], wt: _Weights, start: int, sums: dict[Comp, torch.Tensor],
           budget: int) -> None:
    """Add one batch's sum over windows and positions i >= start of ||do_i||^2 to ``sums``
    ([writer, reader layer, reader head])."""
    H, Hkv = wt.H, wt.Hkv
    b, T, d = caps[0]["x"].shape
    dh, g, LH = wt.W_O.shape[2], H // Hkv, len(caps) * wt.H
    norms = [_normalised(c, wt, d) for c in caps]
    n_all = torch.stack([n for n, _ in norms])  # [L, b, T, d]
    # writers: a_u = zs_u W_O^u diag(g_post), zs = z / rms of the post-attention norm's input
    zs = torch.stack([c["z"] / c["post_sigma"][..., None, None] if "post_sigma" in c else c["z"] for c in caps], 2)
    zs = zs.reshape(b, T, LH, dh).permute(2, 0, 1, 3).contiguous()  # [LH, b, T, dh]
    WOg = (wt.W_O * wt.g_post[:, None, None, :]).reshape(LH, dh, d)
    # the norm's rank-one term: a_u(i) . n_i / d for every writer and reader layer [LH, b, T, L]
    sdot = torch.cat([torch.einsum("hbtd,lbtd->hbtl", torch.einsum("hbte,hed->hbtd", zs[w:w + H], WOg[w:w + H]), n_all)
                      for w in range(0, LH, H)]) / d
    keep = torch.zeros(T, dtype=zs.dtype, device=zs.device)
    keep[start:] = 1
    chunk = max(1, budget // (b * H * T * T))
    for lr, c in enumerate(caps):
        n, sigma = norms[lr]
        A = wt.g1[lr][:, None] * wt.W_in[lr]
        W_read = A - A.mean(0, keepdim=True) if wt.centre else A  # P diag(g) W: [d, F]
        r = (n * wt.g1[lr]) @ wt.W_in[lr]  # [b, T, F]
        zs_l, sdot_l = zs / sigma[None, :, :, None], sdot[..., lr] / sigma[None]
        q, k, v, z, p = _final(c, "q"), _final(c, "k"), c["v"], c["z"], c["pattern"]
        Rt = torch.linalg.qr(wt.W_O[lr].transpose(-2, -1)).R.transpose(-2, -1).reshape(Hkv, g, dh, dh)  # R_v^T
        pg = p.reshape(b, Hkv, g, T, T)
        # Q: dz_i R^T = dq_i E_i A_i R^T / scale, A_i = sum_j p_ij k_j^T (v_j - z_i): once per reader
        A_i = (torch.einsum("bkgij,bjkde->bikgde", pg, k[..., :, None] * v[..., None, :])
               - torch.einsum("bkgij,bjkd->bikgd", pg, k)[..., None] * z.reshape(b, T, Hkv, g, 1, dh))
        B = (A_i @ Rt / wt.scale).reshape(b, T, H, dh, dh)
        Eq, Ek = _input_map(c, "q", wt.gq[lr] if wt.gq is not None else None), \
            _input_map(c, "k", wt.gk[lr] if wt.gk is not None else None)
        B = B if Eq is None else Eq @ B
        # K: values and z per query head times R^T, a column of ones for sum_j p_ij ds_ij
        vR = v.permute(0, 2, 1, 3)[:, :, None] @ Rt  # [b, Hkv, g, T, dh]
        vR1 = torch.cat([vR, torch.ones_like(vR[..., :1])], -1)
        zR = (z.reshape(b, T, Hkv, g, dh).permute(0, 2, 3, 1, 4) @ Rt)[:, :, :, :, None]  # [b, Hkv, g, T, 1, dh]
        qs = (q.reshape(b, T, Hkv, g, dh).permute(0, 2, 3, 1, 4) / wt.scale).reshape(b, Hkv, g * T, dh)
        for w0 in range(0, LH, chunk):
            w1 = min(w0 + chunk, LH)
            W = w1 - w0
            pre = (zs_l[w0:w1].reshape(W, b * T, dh) @ (WOg[w0:w1] @ W_read)).view(W, b, T, -1)
            pre.addcmul_(sdot_l[w0:w1, :, :, None], r, value=-1)  # [W, b, T, F]
            dq, dk, dv = (t.unflatten(-1, (-1, dh)) for t in pre.split([H * dh, Hkv * dh, Hkv * dh], -1))
            sq_q = (dq.permute(1, 2, 3, 0, 4) @ B).pow(2).sum(-1)  # [b, T, H, W]
            dk = dk.permute(1, 2, 3, 0, 4) if Ek is None else dk.permute(1, 2, 3, 0, 4) @ Ek  # [b, T, Hkv, W, dh]
            ds = (qs @ dk.permute(0, 2, 4, 3, 1).reshape(b, Hkv, dh, W * T)).view(b, Hkv, g, T, W, T)
            ds.mul_(pg[:, :, :, :, None])  # p_ij ds_ij
            out = (ds.view(b, Hkv, g, T * W, T) @ vR1).view(b, Hkv, g, T, W, dh + 1)
            del ds
            x = out[..., :dh].sub_(out[..., dh:] * zR)  # sum_j p_ij ds_ij (v_j - z_i) R^T
            sq_k = x.pow(2).sum(-1)  # [b, Hkv, g, T, W]
            del out, x
            mixed = pg.reshape(b, Hkv, g * T, T) @ dv.permute(1, 3, 2, 0, 4).reshape(b, Hkv, T, W * dh)
            sq_v = (mixed.view(b, Hkv, g, T * W, dh) @ Rt).pow(2).sum(-1).view(b, Hkv, g, T, W)
            parts: dict[Comp, torch.Tensor] = {"Q": torch.einsum("bthw,t->wh", sq_q, keep),
                                               "K": torch.einsum("bkgtw,t->wkg", sq_k, keep).reshape(W, H),
                                               "V": torch.einsum("bkgtw,t->wkg", sq_v, keep).reshape(W, H)}
            for comp, sq in parts.items():
                sums[comp][w0:w1, lr] += sq.double().cpu()


def pattern_output_scores(model, tokens: torch.Tensor, batch_size: int = 8, skip_first: bool = True,
                          progress: Progress | None = None, budget: int = CHUNK_BUDGET) -> dict[Comp, torch.Tensor]:
    """``pattern_output`` of every writer head x reader query head of ``model`` (a booted
    TransformerLens bridge, in eval mode) over ``tokens`` [windows, T]: per comp a float64
    [L, H, L, H] tensor (writer layer, writer head, reader layer, reader head), every ordered pair
    (a head with itself included). ``budget``: elements of the largest tensor of a writer chunk."""
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    dev = next(model.parameters()).device
    mdt = next(model.parameters()).dtype
    ct = torch.float64 if mdt == torch.float64 else torch.float32
    wt = _weights(model, ct, dev)
    start = 1 if skip_first else 0
    sums = {c: torch.zeros(L * H, L, H, dtype=torch.float64) for c in COMPS}
    count = 0
    tol = max(1e-4, 10 * torch.finfo(mdt).eps)
    for i in range(0, len(tokens), batch_size):
        batch = tokens[i:i + batch_size].to(dev)
        caps = _capture(model, batch, ct, check=i == 0)
        if i == 0:
            for layer, c in enumerate(caps):
                _check(c, wt, layer, _normalised(c, wt, cfg.d_model)[0], tol)
        _batch(caps, wt, start, sums, budget)
        count += batch.shape[0] * (batch.shape[1] - start)
        if progress is not None:
            progress.advance(batch.shape[0])
    return {c: (sums[c] / count).sqrt().reshape(L, H, L, H) for c in COMPS}

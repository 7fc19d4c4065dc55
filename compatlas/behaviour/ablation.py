"""Head ablation: the drop in induction strength when one head's output (hook_z) is zeroed or
replaced by its mean. ``exact`` reruns only the blocks from the ablated head's layer up, on the
clean residual stream cached once per batch (block skipping needs the bridge's blocks in the
Hugging Face model's module list, and falls back to whole-model reruns without); ``full`` reruns
the whole model per head (the reference); ``attribution`` estimates every head's drop from one
forward and one backward pass (attribution patching)."""

from __future__ import annotations

import logging
import time

import polars as pl
import torch

from compatlas.behaviour.block_skip import arity_probe, block_list, skip_below
from compatlas.behaviour.sequences import (
    LOGITS_BUDGET,
    Hook,
    TokenSet,
    _device,
    _draw,
    _stats,
    effective_batch,
    gathered_logprobs,
    induction_sequences,
    last_position_hooks,
    logodds,
    strengths,
)
from compatlas.progress import Progress
from compatlas.runtime import stable_seed
from compatlas.tables import HEAD_SCORES_SCHEMA
from compatlas.vocab import ABLATION_METHODS, ABLATION_MODES, AblationMethod, AblationMode

log = logging.getLogger(__name__)


@torch.no_grad()
def head_z_means(model, seqs: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """Mean of each head's z (hook_z) over sequences and positions, per layer [H, d_head]."""
    L = model.cfg.n_layers
    sums: dict[int, torch.Tensor] = {}  # layer -> sum so far
    count = 0

    def grab(layer: int):
        def hook(z, hook):
            s = z.double().sum((0, 1))
            sums[layer] = s if layer not in sums else sums[layer] + s
        return hook

    device = _device(model)
    for s in range(0, len(seqs), batch_size):
        batch = seqs[s:s + batch_size].to(device)
        model.run_with_hooks(batch, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", grab(layer)) for layer in range(L)]
                             + last_position_hooks(model))
        count += batch.shape[0] * batch.shape[1]
    return [sums[layer] / count for layer in range(L)]


def _ablate_hook(layer: int, heads: torch.Tensor, means: list[torch.Tensor] | None) -> Hook:
    """hook_z of ``layer`` with head ``heads[i]`` zeroed (or set to its mean) in batch row i."""
    def ablate(z, hook):  # z: [batch, pos, head, d_head]
        z = z.clone()
        b = torch.arange(len(heads), device=z.device)
        h = heads.to(z.device)
        z[b, :, h] = 0.0 if means is None else means[layer].to(z.device, z.dtype)[h][:, None, :]
        return z
    return (f"blocks.{layer}.attn.hook_z", ablate)


def _full_drops(model, seq, ctrl, target, clean, means, batch_size, progress) -> torch.Tensor:
    """Reference path (the original one): the whole model reruns per ablated head (heads of a
    layer side by side in a batch), every position unembedded."""
    L, H, S = model.cfg.n_layers, model.cfg.n_heads, len(seq)
    per_pass = max(1, min(batch_size, LOGITS_BUDGET // (seq.shape[1] * model.cfg.d_vocab)) // S)
    drop = torch.empty(L, H, S, dtype=torch.float64)
    for layer in range(L):
        for g0 in range(0, H, per_pass):
            group = torch.arange(g0, min(g0 + per_pass, H))
            k = len(group)
            head_of_row = group.repeat_interleave(S)  # the replicated batch: S rows per ablated head

            def hooks(rows: slice, layer=layer, head_of_row=head_of_row) -> list[Hook]:
                return [_ablate_hook(layer, head_of_row[rows], means)]

            ablated = strengths(model, seq.repeat(k, 1), ctrl.repeat(k, 1), target.repeat(k, 1), k * S, hooks,
                                full_logits=True)
            drop[layer, g0:g0 + k] = clean[None, :] - ablated[:, 0].view(k, S)
            if progress is not None:
                progress.advance(k)
    return drop


def _upper_logprobs(model, layers: torch.nn.ModuleList, batch: torch.Tensor, target: torch.Tensor, start: int,
                    resid: torch.Tensor | None, arity: int, hooks: list[Hook]) -> torch.Tensor:
    """log p(target) at the last position when only blocks ``start``.. run, the lower ones replaced
    by ``block_skip.Skip`` (block start - 1 handing on ``resid``, the clean stream entering ``start``)."""
    with skip_below(layers, start, resid, arity):
        logits = model.run_with_hooks(batch, fwd_hooks=hooks + last_position_hooks(model))
    return gathered_logprobs(logits[:, -1], target).cpu()[:, 0]


@torch.no_grad()
def _cached_drops(model, seq, ctrl, target, clean, means, batch_size, progress) -> torch.Tensor:
    """Exact ablation at a fraction of the cost: per batch of sequences, one clean pass caches the
    residual stream entering every block; each head's ablation then reruns only the blocks from
    its layer up, the blocks below replaced by the cached stream. Same drops as _full_drops."""
    layers = block_list(model)
    if layers is None:
        log.warning("no block list to skip through on %s: ablation reruns the whole model per head", type(model).__name__)
        return _full_drops(model, seq, ctrl, target, clean, means, batch_size, progress)
    L, H, S, T = model.cfg.n_layers, model.cfg.n_heads, len(seq), seq.shape[1]
    budget = effective_batch(model, T, batch_size)
    # the cache holds L x rows x T x d_model: keep it within LOGITS_BUDGET floats too
    chunk = max(1, min(S, budget, LOGITS_BUDGET // max(1, L * T * model.cfg.d_model)))
    per_pass = max(1, budget // chunk)  # heads ablated side by side
    device = _device(model)
    logp = {name: torch.empty(L, H, S, dtype=torch.float64) for name in ("seq", "ctrl")}
    for name, X in (("seq", seq), ("ctrl", ctrl)):
        for c0 in range(0, S, chunk):
            rows = slice(c0, min(c0 + chunk, S))
            batch = X[rows].to(device)
            resid: dict[int, torch.Tensor] = {}  # layer -> the clean stream entering it (layers 1..)

            def keep(layer: int):
                def hook(x, hook):
                    resid[layer] = x.detach().clone()
                return hook

            with arity_probe(layers) as arity:
                model.run_with_hooks(batch, fwd_hooks=[(f"blocks.{layer}.hook_in", keep(layer)) for layer in range(1, L)]
                                     + last_position_hooks(model))
            n = batch.shape[0]
            for layer in range(L):
                for g0 in range(0, H, per_pass):
                    group = torch.arange(g0, min(g0 + per_pass, H))
                    k = len(group)
                    r = None if layer == 0 else resid[layer].repeat(k, 1, 1)
                    lp = _upper_logprobs(model, layers, batch.repeat(k, 1), target[rows].repeat(k, 1), layer, r,
                                         arity[0], [_ablate_hook(layer, group.repeat_interleave(n), means)])
                    logp[name][layer, g0:g0 + k, rows] = lp.view(k, n)
                    if progress is not None:
                        progress.advance(k * n)
    return clean[None, None, :] - (logodds(logp["seq"]) - logodds(logp["ctrl"]))


def _attribution_drops(model, seq, ctrl, target, means, batch_size, progress) -> torch.Tensor:
    """Attribution patching: the first-order estimate of every head's drop from one forward and
    one backward pass per batch. With g = d logodds(B) / d z and dz = z_ablated - z per head,
    drop ~ -(g . dz)(sequence) + (g . dz)(control), summed over positions and d_head."""
    L, H, S = model.cfg.n_layers, model.cfg.n_heads, len(seq)
    device = _device(model)
    bs = effective_batch(model, seq.shape[1], batch_size)
    drop = torch.zeros(L, H, S, dtype=torch.float64)
    for X, sign in ((seq, -1.0), (ctrl, 1.0)):
        for s0 in range(0, S, bs):
            rows = slice(s0, min(s0 + bs, S))
            zs: dict[int, torch.Tensor] = {}  # layer -> its z, a leaf of the graph

            def leaf(layer: int):
                def hook(z, hook):
                    # a leaf where no graph reaches z yet (frozen weights); never cut one that does, or
                    # the gradient of a lower head would miss every path through the heads above it
                    zs[layer] = z if z.requires_grad else z.detach().requires_grad_(True)
                    return zs[layer]
                return hook

            with torch.enable_grad():
                logits = model.run_with_hooks(X[rows].to(device), fwd_hooks=[(f"blocks.{layer}.attn.hook_z", leaf(layer))
                                                                              for layer in range(L)]
                                              + last_position_hooks(model))
                lo = logodds(gathered_logprobs(logits[:, -1], target[rows]))
                grads = torch.autograd.grad(lo.sum(), [zs[layer] for layer in range(L)])  # rows are independent: per-row gradients
            for layer in range(L):
                z, g = zs[layer].detach().double(), grads[layer].double()
                dz = -z if means is None else means[layer].to(z.device)[None, None] - z
                drop[layer, :, rows] += sign * (g * dz).sum((1, 3)).T.cpu()
            if progress is not None:
                progress.advance(rows.stop - rows.start)
    return drop


def ablation_effects(model, tokens: TokenSet, *, sequences: int, before: int = 10, between: int = 10,
                     mode: AblationMode = "zero", method: AblationMethod = "exact", seed: int = 0, batch_size: int = 128) -> pl.DataFrame:
    """For every head: mean drop in induction strength of B (clean minus ablated, paired over
    the same S sequences and controls) when the head's z is zeroed (``zero``) or replaced by
    its mean over these sequences and controls (``mean``).

    ``method``: ``exact`` (blocks below the ablated layer run once per batch, _cached_drops),
    ``full`` (the whole model per head, every position unembedded: the original path,
    the reference exact agrees with and is timed against), or ``attribution``
    (a first-order estimate for all heads from one forward and backward pass)."""
    if mode not in ABLATION_MODES:
        raise ValueError(f"ablation mode {mode!r}: choose zero or mean")
    if method not in ABLATION_METHODS:
        raise ValueError(f"ablation method {method!r}: choose from {ABLATION_METHODS}")
    cfg = model.cfg
    L, H, S = cfg.n_layers, cfg.n_heads, sequences
    gen = torch.Generator().manual_seed(stable_seed(seed, "ablation", before, between))
    A = _draw(gen, tokens.pool, (S,))
    B = _draw(gen, tokens.pool, (S,), avoid=(A,))
    seq, ctrl = induction_sequences(gen, tokens, A, B, before, between)
    target = B[:, None]
    clean = strengths(model, seq, ctrl, target, batch_size)[:, 0]
    means = head_z_means(model, torch.cat([seq, ctrl]), batch_size) if mode == "mean" else None
    t0 = time.perf_counter()
    if method == "attribution":
        progress = Progress(log, f"ablation ({mode}, attribution)", 2 * S, "sequences")
        drop = _attribution_drops(model, seq, ctrl, target, means, batch_size, progress)
    elif method == "full":
        drop = _full_drops(model, seq, ctrl, target, clean, means, batch_size,
                           Progress(log, f"ablation ({mode}, full)", L * H, "heads"))
    else:
        drop = _cached_drops(model, seq, ctrl, target, clean, means, batch_size,
                             Progress(log, f"ablation ({mode}, exact)", 2 * L * H * S, "head x sequence passes"))
    log.info("ablation (%s, %s): %d heads x %d sequences in %.1fs", mode, method, L * H, S, time.perf_counter() - t0)
    mean, _, se = _stats(drop)
    return pl.DataFrame({
        "layer": [layer for layer in range(L) for _ in range(H)], "head": [h for _ in range(L) for h in range(H)],
        "ablation": [mode] * (L * H), "ablation_method": [method] * (L * H), "ablation_sequences": [S] * (L * H),
        "ablation_drop": mean.flatten().tolist(),
        "ablation_drop_stderr": se.flatten().tolist(), "clean_strength": [clean.mean().item()] * (L * H),
    }, schema={k: HEAD_SCORES_SCHEMA[k] for k in ("layer", "head", "ablation", "ablation_method", "ablation_sequences",
                                           "ablation_drop", "ablation_drop_stderr", "clean_strength")})

"""Edge attribution: what each writer head -> reader head edge does, per comp Q, K and V.

An edge (u -> v, comp) is writer head u's output ``a_u = z_u W_O[u]`` (per position, before
any bias) as it reaches reader head v's query, key or value input (the residual stream before
v's layer norm). Its effect is measured on the induction task: repeated random tokens
``[bos] r_1..r_T r_1..r_T`` and the metric M = mean log p(r_{i+1}) over the second copy's
positions whose next token is induced (``induction_task``); every score is a change in M, per
sequence, averaged over sequences with its standard error.

- ``exact`` (edge patching, as ACDC): only that edge's contribution to v's input is replaced by
  its value on the corrupted input, ``x_v += a_u(corrupt) - a_u(clean)``, everything else
  clean, and the model is rerun: M(patched) - M(clean).
- ``eap`` (Syed et al. 2023): its first-order estimate for every edge from one clean and one
  corrupted forward and one backward pass per batch,
  ``sum over positions and d_model of (a_u(corrupt) - a_u(clean)) * dM/dx_v^{q|k|v}``
  (gradients on the clean input).
- ``eap_attn``: EAP exact through the reader head's attention, first order above it
  (``compatlas.function.eap_attn``: AtP*'s fix for saturated attention).
- ``eap_ig`` (Hanna et al. 2024, "EAP-IG-inputs"): the same with the gradient averaged over
  ``steps`` inputs interpolated between the corrupted and the clean residual stream entering
  layer 0 (midpoints (k + 1/2) / steps, k = 0..steps-1).

The per-head reader inputs are TransformerLens's split-QKV hooks (``hook_q_input``,
``hook_k_input``, ``hook_v_input``: the residual forked per head before the layer norm),
switched on by ``set_use_split_qkv_input`` for the duration of the measurement only.

Corruption: every token but BOS is resampled independently, so the corrupted input has no
repeat (the induction behaviour is absent) and differs at every position. That reaches all three
comps: an induction head reads its keys (K) and values (V) at the first copy and its query (Q)
at the second. Corrupting only the second copy leaves every key unchanged (K edges get almost
no attribution); only the first copy leaves the query tokens unchanged (Q edges get little).

Grouped-query attention: the g query heads of a KV group share one key and one value input, so
a K or V edge is one edge into the KV head (patching it changes the keys or values of all g
query heads); its score is written on each query head's row (with ``reader_kv_head``), as
composition's ``subspace`` K/V scores are. ``frobenius`` and ``svd_bound`` score K/V per query
head; ``composition_vs_function`` compares a KV head's edge with the largest composition score
of its group's query heads (the edge carries function if any of them uses it).

Limits: the three are first order (exact patching on a sample says how well each holds); only
head -> head edges (not embeddings, MLPs, or the logits); a post-attention ("sandwich") norm
sits between a_u and the residual, so a_u there is the pre-norm output.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import torch

from compatlas.behaviour.block_skip import UNEMBED_IN, StopForward, arity_probe, block_list, skip_below
from compatlas.behaviour.sequences import TokenSet, _draw, gathered_logprobs
from compatlas.function.eap_attn import exact_attention_scores
from compatlas.function.split_forks import shared_forks
from compatlas.progress import Progress
from compatlas.runtime import stable_seed
from compatlas.vocab import COMPS, EDGE_METHODS, Comp, EdgeMethod

log = logging.getLogger(__name__)

FORK_HOOK = {"Q": "hook_q_input", "K": "hook_k_input", "V": "hook_v_input"}
RESID_IN = "blocks.0.hook_resid_pre"
# Rows per forward pass are capped so that the measured positions' logits stay within 2**28
# floats (1 GiB in float32; Gemma's vocabulary is 262k), as the induction job caps its batches.
LOGITS_BUDGET = 2**28


@dataclass(frozen=True)
class InductionTask:
    """``clean`` [S, 2T(+1)] repeated random tokens, ``corrupt`` the same with every token but
    BOS resampled; ``positions`` the second copy's positions whose next token is induced and
    ``targets`` [S, P] those next tokens."""

    clean: torch.Tensor
    corrupt: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor

    def first(self, n: int) -> InductionTask:
        """The task on its first ``n`` sequences (all of them where there are fewer)."""
        return self.share(slice(0, n))

    def share(self, rows: slice) -> InductionTask:
        """The task on the sequences ``rows``."""
        return InductionTask(self.clean[rows], self.corrupt[rows], self.positions, self.targets[rows])


@dataclass(frozen=True)
class Edge:
    """writer head (layer, head) -> reader (layer, index): a query head for Q, a KV head for K and V."""

    comp: Comp
    writer_layer: int
    writer_head: int
    reader_layer: int
    reader_index: int


def induction_task(tokens: TokenSet, sequences: int, length: int, seed: int) -> InductionTask:
    """S sequences of ``length`` random pool tokens repeated once (BOS first if the model expects
    one), and their corruption (module docstring)."""
    if length < 2:
        raise ValueError(f"edge attribution needs a repeated span of at least 2 tokens, got {length}")
    gen = torch.Generator().manual_seed(stable_seed(seed, "edge_attribution", length))
    half = _draw(gen, tokens.pool, (sequences, length))
    clean = torch.cat([half, half], 1)
    corrupt = _draw(gen, tokens.pool, (sequences, 2 * length))
    o = 0
    if tokens.bos is not None:
        bos = torch.full((sequences, 1), tokens.bos, dtype=clean.dtype)
        clean, corrupt, o = torch.cat([bos, clean], 1), torch.cat([bos, corrupt], 1), 1
    positions = torch.arange(o + length, o + 2 * length - 1)
    return InductionTask(clean, corrupt, positions, clean[:, positions + 1])


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _rows(model, task: InductionTask, batch_size: int) -> int:
    """``batch_size``, lowered to LOGITS_BUDGET."""
    return max(1, min(batch_size, LOGITS_BUDGET // (len(task.positions) * model.cfg.d_vocab)))


def gradient_bytes(model, task: InductionTask) -> int:
    """What one sequence of an EAP batch holds beyond the model: the per-head Q, K and V inputs
    (the residual stream forked per head) of every layer and their gradients, float32:
    2 x 3 x layers x heads x d_model x tokens x 4 bytes (153 MB for SmolLM2's 41 tokens)."""
    cfg = model.cfg
    return 2 * 3 * cfg.n_layers * cfg.n_heads * cfg.d_model * task.clean.shape[1] * 4


def gradient_rows(model, task: InductionTask, batch_size: int, memory_gb: float | None) -> int:
    """``_rows``, lowered so that a batch's ``gradient_bytes`` fit ``memory_gb`` (None: no bound).
    On SmolLM2 the job's peak memory follows the batch (3.3 GB at 8 sequences, 5.2 at 16, 9.4 at
    32) and its time does not (45, 42 and 47 s for 64 sequences on one core)."""
    rows = _rows(model, task, batch_size)
    if memory_gb is None:
        return rows
    return max(1, min(rows, int(memory_gb * 1e9) // gradient_bytes(model, task)))


@contextmanager
def split_inputs(model) -> Iterator[None]:
    """Per-head Q/K/V input hooks on, and no parameter gradients, for the duration."""
    was = bool(getattr(model.cfg, "use_split_qkv_input", False))
    grads = [p.requires_grad for p in model.parameters()]
    model.set_use_split_qkv_input(True)
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        yield
    finally:
        model.set_use_split_qkv_input(was)
        for p, g in zip(model.parameters(), grads):
            p.requires_grad_(g)


def n_kv_heads(model) -> int:
    return int(getattr(model.cfg, "n_key_value_heads", None) or model.cfg.n_heads)


def _metric(model, x: torch.Tensor, task: InductionTask, rows: slice, hooks: list) -> torch.Tensor:
    """M per sequence (float64 [B]): mean log p(target) over the task's positions."""
    pos = task.positions.to(x.device)
    if UNEMBED_IN in model.hook_dict:  # unembed only the measured positions
        logits = model.run_with_hooks(x, fwd_hooks=hooks + [(UNEMBED_IN, lambda h, hook: h[:, pos])])
    else:
        logits = model.run_with_hooks(x, fwd_hooks=hooks)[:, pos]
    tgt = task.targets[rows]
    return gathered_logprobs(logits, tgt.repeat(x.shape[0] // len(tgt), 1)[..., None])[..., 0].mean(-1)


def _keep(store: dict, key) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    def hook(x, hook):
        store[key] = x
        return x
    return hook


@torch.no_grad()
def _pass(model, task: InductionTask, rows: slice, corrupt: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """hook_z of every layer and the residual entering layer 0, on the corrupted (or clean)
    input. The pass stops at the last layer's hook_z: the last MLP, the unembedding and the
    log-softmax over the vocabulary are not needed (on SmolLM2 a sixth of the pass)."""
    L = model.cfg.n_layers
    store: dict[int | str, torch.Tensor] = {}  # layer -> hook_z, "in" -> the residual entering layer 0

    def last(x, hook):
        store[L - 1] = x
        raise StopForward

    hooks = [(f"blocks.{layer}.attn.hook_z", _keep(store, layer)) for layer in range(L - 1)]
    hooks += [(f"blocks.{L - 1}.attn.hook_z", last), (RESID_IN, _keep(store, "in"))]
    with shared_forks(model), suppress(StopForward):  # no fork hooked: each fork's copies normed once
        model.run_with_hooks((task.corrupt if corrupt else task.clean)[rows].to(_device(model)), fwd_hooks=hooks)
    return [store[layer].detach() for layer in range(L)], store["in"].detach()


def _writer_deltas(model, z_corrupt: list[torch.Tensor], z_clean: list[torch.Tensor]) -> torch.Tensor:
    """a_u(corrupt) - a_u(clean) of every head, float32 [B, L*H, T * d_model] (heads layer-major):
    laid out so that scoring is one batched matrix product per chunk of reader layers, with no copy."""
    W_O = model.W_O.detach().float()  # [L, H, d_head, d_model]
    d = torch.cat([torch.einsum("bphd,hdm->bhpm", (zc.float() - z.float()), W_O[layer].to(zc.device))
                   for layer, (zc, z) in enumerate(zip(z_corrupt, z_clean))], 1)
    return d.flatten(2)


@dataclass
class CleanPass:
    """One clean forward and backward pass: ``z`` the clean hook_z of every layer; ``m`` M per
    sequence; ``grads`` dM/dx_v for every reader input (per comp, per layer from 1:
    [B, T, heads, d_model]), or, with ``reader_outputs`` (what ``eap_attn`` needs, in their place):
    dM/dz at every layer's hook_z (None at 0), the clean stream entering every layer (None at 0)
    and the blocks' arity."""

    grads: dict[Comp, list[torch.Tensor]]
    z: list[torch.Tensor]
    m: torch.Tensor
    z_grads: list[torch.Tensor | None] | None = None
    resid: list[torch.Tensor | None] | None = None
    arity: int = 0


def _gradients(model, task: InductionTask, rows: slice, resid_in: torch.Tensor | None, reader_outputs: bool = False
               ) -> CleanPass:
    """The clean pass (``CleanPass``) on the clean tokens, with the residual entering layer 0
    replaced by ``resid_in`` if given."""
    L = model.cfg.n_layers
    store: dict[tuple[str, int], torch.Tensor] = {}  # (hook, layer) -> the tensor there

    def leaf(x, hook):
        return (x if resid_in is None else resid_in).detach().clone().requires_grad_(True)

    hooks = [(RESID_IN, leaf)] + [(f"blocks.{layer}.attn.hook_z", _keep(store, ("z", layer))) for layer in range(L)]
    if reader_outputs:
        hooks += [(f"blocks.{layer}.hook_in", _keep(store, ("in", layer))) for layer in range(1, L)]
        keys = [("z", layer) for layer in range(1, L)]
    else:
        hooks += [(f"blocks.{layer}.attn.{FORK_HOOK[c]}", _keep(store, (c, layer))) for layer in range(1, L) for c in COMPS]
        keys = [(c, layer) for c in COMPS for layer in range(1, L)]
    with torch.enable_grad(), arity_probe(block_list(model) if reader_outputs else None) as arity:
        m = _metric(model, task.clean[rows].to(_device(model)), task, rows, hooks)
        grads = torch.autograd.grad(m.sum(), [store[k] for k in keys], allow_unused=True)
    got = {k: torch.zeros_like(store[k], dtype=torch.float32) if g is None else g.float() for k, g in zip(keys, grads)}
    out = CleanPass({} if reader_outputs else {c: [got[(c, layer)] for layer in range(1, L)] for c in COMPS},
                    [store[("z", layer)].detach() for layer in range(L)], m.detach())
    if reader_outputs:
        out.z_grads = [None] + [got[("z", layer)] for layer in range(1, L)]
        out.resid = [None] + [store[("in", layer)].detach() for layer in range(1, L)]
        out.arity = arity[0]
    return out


# Reader heads (Q, K, V of consecutive reader layers) per scoring product: one layer's (15 on SmolLM2) is too narrow to
# run fast on a CPU; more compute more non-causal writers (SmolLM2: 2 layers; 4's gradient copy, 45 MB, page-faults).
READERS_PER_PRODUCT = 32


def attribution_scores(model, task: InductionTask, method: EdgeMethod = "eap", steps: int = 8, batch_size: int = 16,
                       progress: Progress | None = None, memory_gb: float | None = None) -> dict[Comp, torch.Tensor]:
    """EAP (or EAP-IG) score of every edge, per sequence: comp -> float64 [S, L, H, L, heads]
    (writer layer, writer head, reader layer, reader head or KV head); non-causal entries are 0.
    Batches of at most ``batch_size`` sequences, fewer where ``memory_gb`` asks (``gradient_rows``)."""
    if method not in EDGE_METHODS:
        raise ValueError(f"edge attribution method {method!r}: choose from {EDGE_METHODS}")
    L, H, S = model.cfg.n_layers, model.cfg.n_heads, len(task.clean)
    width = {"Q": H, "K": n_kv_heads(model), "V": n_kv_heads(model)}
    out = {c: torch.zeros(S, L, H, L, width[c], dtype=torch.float64) for c in COMPS}
    chunk = max(1, READERS_PER_PRODUCT // sum(width.values()))  # reader layers per product
    with split_inputs(model):
        bs = gradient_rows(model, task, batch_size, memory_gb)
        for s0 in range(0, S, bs):
            rows = slice(s0, min(s0 + bs, S))
            z_corrupt, in_corrupt = _pass(model, task, rows, corrupt=True)
            clean = None
            if method in ("eap", "eap_attn"):
                clean = _gradients(model, task, rows, None, reader_outputs=method == "eap_attn")
                grads, z_clean = clean.grads, clean.z
            else:
                z_clean, in_clean = _pass(model, task, rows, corrupt=False)
                total: dict[Comp, list[torch.Tensor]] | None = None
                for k in range(steps):
                    alpha = (k + 0.5) / steps
                    step = _gradients(model, task, rows, in_corrupt + alpha * (in_clean - in_corrupt)).grads
                    total = step if total is None else {c: [a + b for a, b in zip(total[c], step[c])] for c in COMPS}
                if total is None:
                    raise ValueError(f"eap_ig needs steps >= 1, got {steps}")
                grads = {c: [g / steps for g in total[c]] for c in COMPS}
            delta = _writer_deltas(model, z_corrupt, z_clean)
            n = rows.stop - rows.start
            if method == "eap_attn":  # exact through the reader's attention, first order above it
                # _gradients(reader_outputs=True) gave the clean pass its z gradients and streams
                assert clean is not None and clean.z_grads is not None and clean.resid is not None
                for c in COMPS:
                    out[c][rows] = exact_attention_scores(
                        model, task.clean[rows].to(_device(model)), delta, z_clean, clean.z_grads, clean.resid,
                        clean.arity, c, width[c], FORK_HOOK[c],
                        None if progress is None else progress.advance)
                continue
            for lo in range(1, L, chunk):  # [B, readers, T*d] @ [B, T*d, writers below the top reader layer] (readers first: MKL 2x)
                layers = range(lo, min(lo + chunk, L))
                g = torch.cat([grads[c][r - 1].to(delta.device).transpose(1, 2) for r in layers for c in COMPS], 1)
                s = torch.bmm(g.flatten(2), delta[:, :layers[-1] * H].transpose(1, 2)).view(n, len(layers), -1, layers[-1] * H)
                for i, layer in enumerate(layers):  # keep the causal writers (below the reader's layer)
                    for c, part in zip(COMPS, s[:, i, :, :layer * H].split([width[c] for c in COMPS], 1)):
                        out[c][rows, :layer, :, layer] = part.transpose(1, 2).reshape(n, layer, H, width[c]).double().cpu()
            if progress is not None:
                progress.advance(n * (1 if method == "eap" else steps))
    return out


def attribution_work(model, method: EdgeMethod, sequences: int, steps: int) -> tuple[int, str]:
    """How much work ``attribution_scores`` reports progress in: its total and unit."""
    if method == "eap_attn":  # one reader-layer pass per writer head x reader layer x comp
        L, H = model.cfg.n_layers, model.cfg.n_heads
        return sequences * len(COMPS) * H * L * (L - 1) // 2, "writer x reader layer x comp x sequence"
    return sequences * (1 if method == "eap" else steps), "sequences"


def causal_edges(model) -> list[Edge]:
    """Every writer -> reader edge with writer layer < reader layer, per comp (K/V into KV heads)."""
    L, H = model.cfg.n_layers, model.cfg.n_heads
    width = {"Q": H, "K": n_kv_heads(model), "V": n_kv_heads(model)}
    return [Edge(c, lw, hw, lr, r) for c in COMPS for lr in range(1, L) for r in range(width[c])
            for lw in range(lr) for hw in range(H)]


@torch.no_grad()
def exact_scores(model, task: InductionTask, edges: Sequence[Edge], batch_size: int = 16,
                 progress: Progress | None = None, scale: float = 1.0, skip: bool = True) -> torch.Tensor:
    """M(edge patched) - M(clean) per edge and sequence, float64 [E, S] (module docstring):
    edges into one reader layer side by side in a batch, each on its own copy of the sequences,
    the blocks below that layer replaced by the clean stream cached per batch (``skip``, compatlas.behaviour.block_skip; the
    same values as rerunning the whole model, tested). ``scale`` patches
    ``x_v += scale * (a_u(corrupt) - a_u(clean))`` (a small one: a finite difference of EAP)."""
    S, E, L = len(task.clean), len(edges), model.cfg.n_layers
    out = torch.empty(E, S, dtype=torch.float64)
    W_O = model.W_O.detach().float()
    layers = block_list(model) if skip else None
    by_layer: dict[int, list[int]] = {}
    for i, e in enumerate(edges):
        by_layer.setdefault(e.reader_layer, []).append(i)
    with split_inputs(model), shared_forks(model):  # the forks no patch hooks normed once (split_forks)
        bs = _rows(model, task, batch_size)
        for s0 in range(0, S, bs):
            rows = slice(s0, min(s0 + bs, S))
            n = rows.stop - rows.start
            z_corrupt, _ = _pass(model, task, rows, corrupt=True)
            store: dict = {}
            hooks = [(f"blocks.{layer}.attn.hook_z", _keep(store, layer)) for layer in range(L)]
            hooks += [(f"blocks.{layer}.hook_in", _keep(store, ("in", layer))) for layer in range(1, L)]
            with arity_probe(layers) as arity:
                clean_m = _metric(model, task.clean[rows].to(_device(model)), task, rows, hooks)
            per_pass = max(1, bs // n)
            for lr, idx in sorted(by_layer.items()):
                for e0 in range(0, len(idx), per_pass):
                    chunk = [edges[i] for i in idx[e0:e0 + per_pass]]
                    patches: dict[Comp, list] = {}
                    for i, e in enumerate(chunk):
                        dz = (z_corrupt[e.writer_layer][:, :, e.writer_head] - store[e.writer_layer][:, :, e.writer_head]).float()
                        patches.setdefault(e.comp, []).append((i, e.reader_index, dz @ W_O[e.writer_layer, e.writer_head].to(dz.device)))

                    def patch(items):
                        def hook(x, hook):
                            x = x.clone()
                            for i, r, d in items:
                                x[i * n:(i + 1) * n, :, r] += scale * d.to(x.dtype)
                            return x
                        return hook

                    k = len(chunk)
                    hooks = [(f"blocks.{lr}.attn.{FORK_HOOK[c]}", patch(items)) for c, items in patches.items()]
                    resid = store[("in", lr)].detach().repeat(k, 1, 1) if lr > 0 else None
                    with skip_below(layers, lr, resid, arity[0]):
                        m = _metric(model, task.clean[rows].to(_device(model)).repeat(k, 1), task, rows, hooks).view(k, n)
                    out[idx[e0:e0 + k], rows] = (m - clean_m[None]).cpu()
                    if progress is not None:
                        progress.advance(k * n)
    return out


def mean_stderr(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard error over the first axis (sequences); the error is NaN for one sequence."""
    n = x.shape[0]
    se = x.std(0, correction=1) / math.sqrt(n) if n > 1 else torch.full(x.shape[1:], math.nan, dtype=x.dtype)
    return x.mean(0), se


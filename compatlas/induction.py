"""Induction behaviour, measured by forward passes: what the weights-based scores are checked against.

- ``induction_sweep``: the induction-strength log-odds (Roger 2023; docs/math.md). Sequences
  ``r.. A B r.. A``; the control shuffles every token but the last;
  strength = logodds(p(B) | sequence) - logodds(p(B) | control).
  A power of token a: mean strength over S sequences with A = a (B power: with B = b), with
  the nearby-B token B* and a random token R scored on the same sequences.
- ``head_attention_scores``: previous-token, duplicate-token and induction attention per head.
- ``ablation_effects``: the drop in induction strength when one head's output (hook_z) is
  zeroed or replaced by its mean. ``exact`` reruns only the blocks from the ablated head's
  layer up, on the clean residual stream cached once per batch; ``attribution`` estimates
  every head's drop from one forward and one backward pass (attribution patching).
- Tokens: A and B are a seeded random sample of the vocabulary's
  ``clean_tokens`` (no special, added, control, unreachable or duplicate-embedding tokens).

Works on any transformer_lens model with ``run_with_hooks`` and the hook names
``blocks.{l}.attn.hook_z`` / ``hook_pattern`` (a ``TransformerBridge``, in the pipeline and the
tests); exact ablation's block skipping needs the bridge's blocks in the Hugging Face model's
module list, and falls back to whole-model reruns without. Every batch is one padding-free
forward pass (all sequences of a sweep have the same length), on the model's (first) device;
the unembedding sees only the last position.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import polars as pl
import torch

from compatlas.progress import Progress
from compatlas.runtime import stable_seed
from compatlas.tables import HEAD_SCORES_SCHEMA, INDUCTION_TOKENS_SCHEMA
from compatlas.vocab import ABLATION_METHODS, ABLATION_MODES, ROLES, AblationMethod, AblationMode

log = logging.getLogger(__name__)

# p(B) is clamped into [P_EPS, 1 - P_EPS] so that logodds stay finite (|logodds| <= 34.5)
P_EPS = 1e-15


@dataclass(frozen=True)
class TokenSet:
    """Which tokens a sweep draws from: ``pool`` for fillers and random partners (clean tokens),
    ``bos`` prepended to every sequence when the model expects one."""

    pool: torch.Tensor
    bos: int | None = None

    def __post_init__(self):
        if self.pool.numel() < 4:
            raise ValueError(f"the token pool needs at least 4 tokens, it has {self.pool.numel()}")


def logodds(logp: torch.Tensor) -> torch.Tensor:
    """log p - log(1 - p), from log p (stable at both ends: 1 - p = -expm1(log p))."""
    logp = logp.double().clamp(math.log(P_EPS), math.log1p(-P_EPS))
    return logp - torch.log(-torch.expm1(logp))


def _draw(gen: torch.Generator, pool: torch.Tensor, shape: tuple[int, ...], avoid: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """Uniform draws from ``pool``; entries equal to any ``avoid`` (broadcast per row) are redrawn."""
    out = pool[torch.randint(len(pool), shape, generator=gen)]
    for _ in range(64):
        bad = torch.zeros(shape, dtype=torch.bool)
        for a in avoid:
            bad |= out == (a.view(-1, *([1] * (len(shape) - 1))) if a.ndim else a)
        if not bad.any():
            return out
        out[bad] = pool[torch.randint(len(pool), (int(bad.sum()),), generator=gen)]
    raise ValueError("could not draw tokens distinct from A and B: the pool is too small")


def induction_sequences(gen: torch.Generator, tokens: TokenSet, A: torch.Tensor, B: torch.Tensor,
                        before: int, between: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[bos] r_1..r_before A B r'_1..r'_between A`` and its control (every token but the last
    shuffled, per row; BOS stays first). Fillers never equal A or B, so the planted A B is the
    only one."""
    S = len(A)
    fill = _draw(gen, tokens.pool, (S, before + between), avoid=(A, B))
    seq = torch.cat([fill[:, :before], A[:, None], B[:, None], fill[:, before:], A[:, None]], dim=1)
    perm = torch.argsort(torch.rand(S, seq.shape[1] - 1, generator=gen), dim=1)
    ctrl = seq.clone()
    ctrl[:, :-1] = torch.gather(seq[:, :-1], 1, perm)
    if tokens.bos is not None:
        bos = torch.full((S, 1), tokens.bos, dtype=seq.dtype)
        seq, ctrl = torch.cat([bos, seq], 1), torch.cat([bos, ctrl], 1)
    return seq, ctrl


Hook = tuple[str, Callable]

# The unembedding sees only the last position: a strength needs p(B) there alone, and the full
# logits (batch x length x d_vocab) are about a fifth of SmolLM2's forward FLOPs.
LAST_POSITION_HOOK = "unembed.hook_in"


def last_position_hooks(model) -> list[Hook]:
    """A hook that hands the unembedding only the last position (none if the model lacks the hook)."""
    if LAST_POSITION_HOOK not in getattr(model, "hook_dict", {}):
        return []
    return [(LAST_POSITION_HOOK, lambda x, hook: x[:, -1:])]


@torch.no_grad()
def target_logprobs(model, seqs: torch.Tensor, targets: torch.Tensor, batch_size: int,
                    hooks: Callable[[slice], list[Hook]] | None = None,
                    progress: Progress | None = None, full_logits: bool = False) -> torch.Tensor:
    """log p(target) at the last position, float64 [S, k]; forward passes in batches.
    ``hooks(rows)`` gives the forward hooks for the batch covering ``rows``; ``full_logits``
    unembeds every position (the original path, kept as the benchmarks' reference)."""
    device = _device(model)
    last = [] if full_logits else last_position_hooks(model)
    batch_size = max(1, min(batch_size, LOGITS_BUDGET // (seqs.shape[1] * model.cfg.d_vocab))) if full_logits \
        else effective_batch(model, seqs.shape[1], batch_size)
    out = []
    for start in range(0, len(seqs), batch_size):
        rows = slice(start, min(start + batch_size, len(seqs)))
        batch = seqs[rows].to(device)
        fwd = (hooks(rows) if hooks else []) + last
        logits = model.run_with_hooks(batch, fwd_hooks=fwd) if fwd else model(batch)
        lp = logits[:, -1].double().log_softmax(-1)
        out.append(lp.gather(1, targets[rows].to(lp.device)).cpu())
        if progress is not None:
            progress.advance(rows.stop - rows.start)
    return torch.cat(out) if out else torch.empty(0, targets.shape[1], dtype=torch.float64)


def strengths(model, seq: torch.Tensor, ctrl: torch.Tensor, targets: torch.Tensor, batch_size: int,
              hooks: Callable[[slice], list[Hook]] | None = None, progress: Progress | None = None,
              full_logits: bool = False) -> torch.Tensor:
    """Induction strength of each target column, [S, k]: logodds(sequence) - logodds(control)."""
    return (logodds(target_logprobs(model, seq, targets, batch_size, hooks, progress, full_logits))
            - logodds(target_logprobs(model, ctrl, targets, batch_size, hooks, progress, full_logits)))


# Activations per batch: the last position's logits (batch x d_vocab, float32) are capped at 1 GiB,
# and so is the residual stream of every layer that exact ablation caches (batch x length x d_model x layers).
LOGITS_BUDGET = 2**28


def effective_batch(model, length: int, batch_size: int) -> int:
    """``batch_size``, lowered so that one batch's logits fit LOGITS_BUDGET (Gemma's vocabulary is 262k);
    with the full logits (a model without the last-position hook) every position counts."""
    positions = 1 if last_position_hooks(model) else length
    return max(1, min(batch_size, LOGITS_BUDGET // (positions * model.cfg.d_vocab)))


def _device(model) -> torch.device:
    return next(model.parameters()).device


# ----------------------------------------------------------------------------- which tokens


# Reserved/control names that are not text: <|...|>, [unused3], [UNK], <unused12>, <reserved_...>,
# <extra_id_4>, <pad>, <unk>, <mask>, and SentencePiece's byte-fallback <0x0A>.
CONTROL_NAME = re.compile(r"^(<\|.*\|>|\[(unused\d+|UNK|PAD|CLS|SEP|MASK)\]"
                          r"|<(unused|reserved|extra_id|pad|unk|mask|0x[0-9A-Fa-f]{2})[^<>]*>)$", re.IGNORECASE)


def duplicate_rows(W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(group id per row, True where the row equals another row exactly). Exact equality by
    sorting the rows (torch.unique), never a d_vocab x d_vocab comparison."""
    _, group, counts = torch.unique(W, dim=0, return_inverse=True, return_counts=True)
    return group, counts[group] > 1


def _reaches_itself(tokenizer, ids: list[int]) -> list[bool]:
    """Does encoding the token's own text give back the token? False for tokens encoding never
    produces: partial UTF-8 bytes, merges the tokenizer never reaches. A SentencePiece
    tokenizer prepends a word boundary to text: [boundary, token] counts as reaching it."""
    texts = tokenizer.batch_decode([[t] for t in ids])
    encoded = tokenizer(texts, add_special_tokens=False).input_ids
    boundary = {t for t in (tokenizer(" ", add_special_tokens=False).input_ids or [])}
    out = []
    for t, e in zip(ids, encoded):
        out.append(list(e) == [t] or (len(e) == 2 and e[1] == t and e[0] in boundary))
    return out


def control_tokens(tokenizer, d_vocab: int, by_reason: bool = False):
    """Tokens that are not text: special (``all_special_ids``), added (``added_tokens_decoder``)
    and control (a reserved name, CONTROL_NAME). A set, or {reason: ids} with ``by_reason``."""
    if tokenizer is None:
        return {} if by_reason else set()
    names = tokenizer.convert_ids_to_tokens(list(range(d_vocab)))
    found = {"special": list(getattr(tokenizer, "all_special_ids", None) or []),
             "added": sorted((getattr(tokenizer, "added_tokens_decoder", None) or {}).keys()),
             "control": [t for t, n in enumerate(names) if n is None or CONTROL_NAME.match(str(n))]}
    return found if by_reason else {t for ids in found.values() for t in ids if 0 <= t < d_vocab}


def clean_tokens(tokenizer, W_E: torch.Tensor, directions: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, dict[str, int]]:
    """The tokens an induction sweep may use as A, B, fillers and random partners, and how
    many were excluded for each reason (a token counts under its first reason):

    - ``special``: ``tokenizer.all_special_ids`` (BOS, EOS, PAD, ...);
    - ``added``: ``tokenizer.added_tokens_decoder`` (SmolLM2's ``<repo_name>``, ``<jupyter_code>``, ...);
    - ``control``: a reserved name (CONTROL_NAME) in ``convert_ids_to_tokens``;
    - ``unreachable``: encoding the token's decoded text does not give the token (``_reaches_itself``);
    - ``duplicate``: its W_E row (or its row of ``directions``, the unembedding) equals another
      token's exactly: untrained rows, indistinguishable to the model.

    With no tokenizer (hand-built test models) only duplicates are excluded."""
    V = W_E.shape[0]
    reason: list[str | None] = [None] * V

    def mark(ids, why: str) -> None:
        for t in ids:
            if 0 <= t < V and reason[t] is None:
                reason[t] = why

    if tokenizer is not None:
        for why, ids in control_tokens(tokenizer, V, by_reason=True).items():
            mark(ids, why)
        rest = [t for t in range(V) if reason[t] is None]
        mark([t for t, ok in zip(rest, _reaches_itself(tokenizer, rest)) if not ok], "unreachable")
    dup = duplicate_rows(W_E)[1]
    if directions is not None and directions.data_ptr() != W_E.data_ptr():
        dup |= duplicate_rows(directions)[1]
    mark(torch.nonzero(dup).flatten().tolist(), "duplicate")
    counts = {why: sum(r == why for r in reason) for why in ("special", "added", "control", "unreachable", "duplicate")}
    return torch.tensor([t for t in range(V) if reason[t] is None], dtype=torch.long), counts


def sample_tokens(clean: torch.Tensor, n: int, seed: int, what: str) -> torch.Tensor:
    """A seeded uniform sample of ``n`` of the clean tokens (all of them if n is 0 or larger), sorted."""
    if n <= 0 or n >= len(clean):
        return clean.clone()
    gen = torch.Generator().manual_seed(stable_seed(seed, "tokens", what))
    return clean[torch.randperm(len(clean), generator=gen)[:n]].sort().values


def nearest_tokens(directions: torch.Tensor, ids: torch.Tensor, exclude: torch.Tensor | None = None,
                   chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """For each id, the token whose direction (row of ``directions`` [d_vocab, d]: W_U's
    columns, or W_E's rows for tied / encoder models) has the highest cosine similarity, other
    than the token itself and any token whose row equals its row exactly (a duplicate is not a
    neighbour); and that cosine. Chunked: never a d_vocab x d_vocab matrix."""
    unit = torch.nn.functional.normalize(directions.float(), dim=1)
    group = duplicate_rows(directions)[0]
    out = torch.empty(len(ids), dtype=torch.long)
    cos = torch.empty(len(ids), dtype=torch.float64)
    for s in range(0, len(ids), chunk):
        part = ids[s:s + chunk]
        sim = unit[part] @ unit.T
        sim[group[part][:, None] == group[None, :]] = -math.inf  # the token itself and its exact duplicates
        if exclude is not None and len(exclude):
            sim[:, exclude] = -math.inf
        best = sim.max(1)
        out[s:s + len(part)], cos[s:s + len(part)] = best.indices, best.values.double()
    return out, cos


class NearbyB:
    """``nearest_tokens`` on demand, cached: ``near[t] = (B*, cosine)``.

    A sweep needs B* only for the tokens it draws as B (a few hundred), not for every token of
    the pool: on SmolLM2 the whole pool is 48,818 tokens, a 1.4 TFLOP search (30 s on 2 cores)."""

    def __init__(self, directions: torch.Tensor, exclude: torch.Tensor | None = None):
        self.directions, self.exclude = directions, exclude
        self._found: dict[int, tuple[int, float]] = {}

    def lookup(self, ids: torch.Tensor) -> None:
        """Search the ids not searched yet, in one batch."""
        missing = torch.tensor(sorted({int(t) for t in ids.flatten().tolist()} - self._found.keys()), dtype=torch.long)
        if len(missing):
            near_ids, near_cos = nearest_tokens(self.directions, missing, self.exclude)
            self._found.update(zip(missing.tolist(), zip(near_ids.tolist(), near_cos.tolist())))

    def __getitem__(self, t: int) -> tuple[int, float]:
        if t not in self._found:
            self.lookup(torch.tensor([t]))
        return self._found[t]


def _stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mean, std (ddof 1) and standard error over the last axis."""
    n = x.shape[-1]
    std = x.std(-1, correction=1) if n > 1 else torch.full(x.shape[:-1], math.nan, dtype=x.dtype)
    return x.mean(-1), std, std / math.sqrt(n)


def induction_sweep(model, token_ids: torch.Tensor, tokens: TokenSet, near: NearbyB, *,
                    sequences: int, before: int = 10, between: int = 10, seed: int = 0, batch_size: int = 128,
                    decode: Callable[[int], str] = str, progress: Progress | None = None) -> pl.DataFrame:
    """A power and B power of every token in ``token_ids``, S sequences each, with the nearby-B
    (``near[B] = (B*, cosine)``) and random-token controls on the same sequences. One row per token x role."""
    N, S = len(token_ids), sequences
    rows = []
    for role in ROLES:
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(stable_seed(seed, "sweep", role, before, between))
        fixed = token_ids.repeat_interleave(S)
        other = _draw(gen, tokens.pool, (N * S,), avoid=(fixed,))
        A, B = (fixed, other) if role == "A" else (other, fixed)
        R = _draw(gen, tokens.pool, (N * S,), avoid=(A, B))
        near.lookup(B)  # one search for the role's B tokens (the measured ones, when B is measured)
        near_b = torch.tensor([near[int(b)][0] for b in B])
        seq, ctrl = induction_sequences(gen, tokens, A, B, before, between)
        st = strengths(model, seq, ctrl, torch.stack([B, near_b, R], 1), batch_size, progress=progress).view(N, S, 3)
        mean, std, se = _stats(st.permute(2, 0, 1))
        dt = time.perf_counter() - t0
        log.info("%s power, fillers %d+%d: %d tokens x %d sequences (+ controls) in %.1fs, %.1f sequences/s; "
                 "mean strength %.3f", role, before, between, N, S, dt, 2 * N * S / max(dt, 1e-9), mean[0].mean())
        for i, t in enumerate(token_ids.tolist()):
            rows.append({"filler_before": before, "filler_between": between, "token_id": t, "token_text": decode(t),
                         "role": role, "n": S, "mean": mean[0, i].item(), "std": std[0, i].item(),
                         "stderr": se[0, i].item(), "near_b_id": near[t][0] if role == "B" else None,
                         "near_b_cosine": near[t][1] if role == "B" else None,
                         "near_b_mean": mean[1, i].item(), "near_b_stderr": se[1, i].item(),
                         "random_mean": mean[2, i].item(), "random_stderr": se[2, i].item()})
    return pl.DataFrame(rows, schema={k: v for k, v in INDUCTION_TOKENS_SCHEMA.items() if k not in ("model", "checkpoint")})


@torch.no_grad()
def head_attention_scores(model, tokens: TokenSet, *, sequences: int, length: int, seed: int = 0,
                          batch_size: int = 128, progress: Progress | None = None) -> pl.DataFrame:
    """Per head, on S random sequences of ``length`` tokens repeated twice:
    previous-token score (attention i -> i-1, first half: random tokens), duplicate-token score
    (second half, i -> i - length) and induction score (second half, i -> i - length + 1).
    Mean and std over sequences of each sequence's mean over positions."""
    cfg = model.cfg
    T = length
    gen = torch.Generator().manual_seed(stable_seed(seed, "head_scores", T))
    half = _draw(gen, tokens.pool, (sequences, T))
    seqs = torch.cat([half, half], 1)
    o = 0
    if tokens.bos is not None:
        seqs, o = torch.cat([torch.full((sequences, 1), tokens.bos, dtype=seqs.dtype), seqs], 1), 1
    first, second = torch.arange(1, T) + o, torch.arange(T, 2 * T) + o
    found: dict[str, list[torch.Tensor]] = {k: [[] for _ in range(cfg.n_layers)] for k in ("prev", "dup", "ind")}

    def grab(layer: int):
        def hook(pattern, hook):  # [batch, head, query, key]
            found["prev"][layer].append(pattern[:, :, first, first - 1].mean(-1).double().cpu())
            found["dup"][layer].append(pattern[:, :, second, second - T].mean(-1).double().cpu())
            found["ind"][layer].append(pattern[:, :, second, second - T + 1].mean(-1).double().cpu())
        return hook

    hooks = [(f"blocks.{layer}.attn.hook_pattern", grab(layer)) for layer in range(cfg.n_layers)]
    device = _device(model)
    for s in range(0, sequences, batch_size):
        model.run_with_hooks(seqs[s:s + batch_size].to(device), fwd_hooks=hooks + last_position_hooks(model))
        if progress is not None:
            progress.advance(len(seqs[s:s + batch_size]))
    cols: dict[str, list] = {"layer": [], "head": []}
    for name, key in (("prev_token", "prev"), ("duplicate", "dup"), ("induction", "ind")):
        per = torch.stack([torch.cat(found[key][layer]) for layer in range(cfg.n_layers)])  # [L, S, H]
        mean, std, _ = _stats(per.transpose(1, 2))
        cols[f"{name}_mean"], cols[f"{name}_std"] = mean.flatten().tolist(), std.flatten().tolist()
    L, H = cfg.n_layers, cfg.n_heads
    cols["layer"] = [layer for layer in range(L) for _ in range(H)]
    cols["head"] = [h for _ in range(L) for h in range(H)]
    cols["n_sequences"] = [sequences] * (L * H)
    return pl.DataFrame(cols, schema={k: HEAD_SCORES_SCHEMA[k] for k in cols})


@torch.no_grad()
def head_z_means(model, seqs: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """Mean of each head's z (hook_z) over sequences and positions, per layer [H, d_head]."""
    L = model.cfg.n_layers
    sums: list[torch.Tensor | None] = [None] * L
    count = 0

    def grab(layer: int):
        def hook(z, hook):
            s = z.double().sum((0, 1))
            sums[layer] = s if sums[layer] is None else sums[layer] + s
        return hook

    device = _device(model)
    for s in range(0, len(seqs), batch_size):
        batch = seqs[s:s + batch_size].to(device)
        model.run_with_hooks(batch, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", grab(layer)) for layer in range(L)]
                             + last_position_hooks(model))
        count += batch.shape[0] * batch.shape[1]
    return [s / count for s in sums]


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


def _block_list(model) -> torch.nn.ModuleList | None:
    """The Hugging Face module list that runs the bridge's blocks (``model.layers``, ``transformer.h``, ...)."""
    hf = getattr(model, "original_model", None)
    blocks = getattr(model, "blocks", None)
    if hf is None or blocks is None or not len(blocks):
        return None
    for module in hf.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == len(blocks) and module[0] is blocks[0]:
            return module
    return None


class _Skip(torch.nn.Module):
    """Stands in for a block below the ablated layer. The block just below returns the clean
    residual stream cached for the batch (the input the ablated layer saw in the clean pass);
    lower ones pass their input on. ``arity``: the block returns a tuple of that length (0: a tensor)."""

    def __init__(self, residual: torch.Tensor | None, arity: int):
        super().__init__()
        self.residual, self.arity = residual, arity

    def forward(self, hidden_states, *args, **kwargs):
        h = hidden_states if self.residual is None else self.residual
        return (h,) + (None,) * (self.arity - 1) if self.arity else h


def _upper_logprobs(model, layers: torch.nn.ModuleList, batch: torch.Tensor, target: torch.Tensor, start: int,
                    resid: torch.Tensor | None, arity: int, hooks: list[Hook]) -> torch.Tensor:
    """log p(target) at the last position when only blocks ``start``.. run, the lower ones replaced
    by _Skip (block start - 1 handing on ``resid``, the clean stream entering ``start``)."""
    saved = [layers[i] for i in range(start)]
    try:
        for i in range(start):
            layers[i] = _Skip(resid if i == start - 1 else None, arity)
        logits = model.run_with_hooks(batch, fwd_hooks=hooks + last_position_hooks(model))
    finally:
        for i, block in enumerate(saved):
            layers[i] = block
    return logits[:, -1].double().log_softmax(-1).gather(1, target.to(logits.device)).cpu()[:, 0]


@torch.no_grad()
def _cached_drops(model, seq, ctrl, target, clean, means, batch_size, progress) -> torch.Tensor:
    """Exact ablation at a fraction of the cost: per batch of sequences, one clean pass caches the
    residual stream entering every block; each head's ablation then reruns only the blocks from
    its layer up, the blocks below replaced by the cached stream. Same drops as _full_drops."""
    layers = _block_list(model)
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
            resid: list[torch.Tensor | None] = [None] * L
            arity = [0]

            def keep(layer: int):
                def hook(x, hook):
                    resid[layer] = x.detach().clone()
                return hook

            def shape(module, args, output):  # what a block returns: a tensor, or a tuple of some length
                arity[0] = len(output) if isinstance(output, tuple) else 0

            handle = layers[0].register_forward_hook(shape)
            try:
                model.run_with_hooks(batch, fwd_hooks=[(f"blocks.{layer}.hook_in", keep(layer)) for layer in range(1, L)]
                                     + last_position_hooks(model))
            finally:
                handle.remove()
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
            zs: list[torch.Tensor | None] = [None] * L

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
                lo = logodds(logits[:, -1].double().log_softmax(-1).gather(1, target[rows].to(logits.device)))
                grads = torch.autograd.grad(lo.sum(), zs)  # rows are independent: per-row gradients
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


# ----------------------------------------------------------------------------- one model, end to end


def token_set(tokenizer, pool: torch.Tensor, prepend_bos: str | bool = "auto") -> TokenSet:
    """The sweep's pool (clean tokens, see ``clean_tokens``) and BOS. ``prepend_bos='auto'``
    prepends BOS when the tokenizer itself adds one to encoded text (the induction-strength
    setup: BOS "if the model expects one")."""
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if prepend_bos == "auto":
        adds = tokenizer is not None and bos_id is not None and tokenizer("a").input_ids[:1] == [bos_id]
        bos = bos_id if adds else None
    else:
        if prepend_bos and bos_id is None:
            raise ValueError("prepend_bos is true but the tokenizer has no BOS token")
        bos = bos_id if prepend_bos else None
    return TokenSet(pool=pool, bos=bos)


def token_directions(W_E: torch.Tensor, W_U: torch.Tensor | None) -> torch.Tensor:
    """Rows to measure "nearby B" by: W_U's columns, or W_E's rows when there is no unembedding
    (encoders) or it is tied to W_E."""
    if W_U is None or (W_U.shape == W_E.T.shape and torch.equal(W_U, W_E.T)):
        return W_E
    return W_U.T


def measure_behaviour(model, tokenizer, directions: torch.Tensor, settings: dict, W_E: torch.Tensor | None = None
            ) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    """Every forward-pass measurement of one model: the strength sweep (per filler setting), head
    attention scores and head ablation. ``settings`` is the config's ``induction`` section;
    ``directions`` the rows nearby-B is measured in (token_directions), ``W_E`` the embedding
    (duplicate rows excluded; ``directions`` if not given). Returns the token and head tables
    and what was chosen (for provenance): how many tokens were excluded and why."""
    d_vocab = directions.shape[0]
    seed, bs = settings["seed"], settings["batch_size"]
    clean, excluded = clean_tokens(tokenizer, directions if W_E is None else W_E, directions)
    log.info("clean tokens: %d of %d (excluded: %s)", len(clean), d_vocab, excluded)
    tokens = token_set(tokenizer, sample_tokens(clean, settings["pool"], seed, "pool"), settings["prepend_bos"])
    ids = (torch.tensor(settings["token_ids"], dtype=torch.long) if settings.get("token_ids")
           else sample_tokens(clean, settings["tokens"], seed, "measured"))
    if ids.numel() and (ids.min() < 0 or ids.max() >= d_vocab):
        raise ValueError(f"induction.token_ids must lie in 0..{d_vocab - 1}")
    # B* is never a special, added or control token (not text the model predicts); it may be unreachable
    not_text = torch.tensor(sorted(control_tokens(tokenizer, d_vocab)), dtype=torch.long)
    near = NearbyB(directions, not_text)
    decode = (lambda t: tokenizer.decode([t])) if tokenizer is not None else (lambda t: f"t{t}")
    fillers = settings["fillers"]
    sweep_progress = Progress(log, "induction sweep", 2 * 2 * len(fillers) * len(ids) * settings["sequences"],
                              "sequences")
    sweeps = [induction_sweep(model, ids, tokens, near, sequences=settings["sequences"], before=before,
                              between=between, seed=seed, batch_size=bs, decode=decode, progress=sweep_progress)
              for before, between in fillers]
    hs = settings["head_scores"]
    heads = head_attention_scores(model, tokens, sequences=hs["sequences"], length=hs["length"], seed=seed, batch_size=bs,
                                  progress=Progress(log, "head scores", hs["sequences"], "sequences"))
    abl = settings["ablation"]
    before, between = fillers[0]
    effects = ablation_effects(model, tokens, sequences=abl["sequences"], before=before, between=between,
                               mode=abl["mode"], method=abl.get("method", "exact"), seed=seed, batch_size=bs)
    chosen = {"clean_tokens": len(clean), "excluded_tokens": excluded, "pool_tokens": len(tokens.pool),
              "measured_tokens": len(ids), "bos": tokens.bos}
    return pl.concat(sweeps), heads.join(effects, on=["layer", "head"]), chosen


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def forward_dtype(name: str, device: torch.device) -> torch.dtype:
    """``induction.dtype``: ``auto`` is bfloat16 on a GPU and float32 on the CPU (where half
    precision is slow and gains nothing)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"induction.dtype {name!r}: choose auto or one of {sorted(DTYPES)}")
    return DTYPES[name]


def boot_and_measure_behaviour(model_id: str, entry: dict, checkpoint: dict | None, settings: dict, meta_path: str,
                               workdir, device: str = "auto") -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    """Boot one model (x checkpoint) and measure it: the tables of the ``induction_tokens`` and
    ``head_scores`` views, and the provenance for their shards. Only the extraction's metadata
    is read (the forward passes need the model, not the weight shard)."""
    from compatlas.loading import boot
    from compatlas.runtime import resolve_device
    from compatlas.tables import provenance
    from compatlas.weights import load_meta

    t0 = time.perf_counter()
    meta = load_meta(meta_path)
    if not meta.get("has_unembed", True):
        raise ValueError(f"model {model_id!r} has no unembedding (an encoder): induction needs next-token "
                         f"logits; set models.{model_id}.induction.enabled: false")
    dev = resolve_device(device)
    dtype = forward_dtype(settings.get("dtype", "auto"), dev)
    device_map = settings.get("device_map", "none")
    device_map = None if device_map in (None, "none") else device_map
    bridge, _ = boot(entry, checkpoint, workdir, str(dev), dtype=dtype, device_map=device_map)
    bridge.eval()
    n_ctx = getattr(bridge.cfg, "n_ctx", None)
    longest = max([sum(f) + 3 for f in settings["fillers"]] + [2 * settings["head_scores"]["length"]]) + 1
    if n_ctx and longest > n_ctx:
        raise ValueError(f"model {model_id!r} has a context of {n_ctx} tokens; induction.fillers / head_scores.length "
                         f"need {longest}")
    with torch.no_grad():  # the raw embeddings (the shard's may be centred by processing)
        W_E = bridge.W_E.detach().float().cpu()
        W_U = bridge.W_U.detach().float().cpu()
    tokens, heads, chosen = measure_behaviour(bridge, bridge.tokenizer, token_directions(W_E, W_U), settings, W_E)
    label = meta.get("checkpoint", "final")
    tokens = tokens.with_columns(model=pl.lit(model_id), checkpoint=pl.lit(label)).select(list(INDUCTION_TOKENS_SCHEMA))
    heads = heads.with_columns(model=pl.lit(model_id), checkpoint=pl.lit(label)).select(list(HEAD_SCORES_SCHEMA))
    # the forward passes run on the model as loaded, whatever processing its weight shard had
    record = provenance(meta, processing="none", weight_processing="none (forward passes on the loaded model)",
                        settings=settings, tokens=chosen, dtype=str(dtype).removeprefix("torch."),
                        device_map=device_map, device=str(dev), seconds=round(time.perf_counter() - t0, 3))
    return tokens, heads, record

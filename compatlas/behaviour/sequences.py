"""Induction sequences and the forward passes that score them: ``r.. A B r.. A`` and its
shuffled control, log p(target) at the last position, and the log-odds strength (Roger 2023;
docs/math.md#induction-strength-the-log-odds-sweep).

Every batch is one padding-free forward pass (all sequences of a sweep have the same length),
on the model's (first) device; the unembedding sees only the last position."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from compatlas.behaviour.block_skip import UNEMBED_IN
from compatlas.progress import Progress

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


# The float64 copy of the logits that ``gathered_logprobs`` makes at a time: 2 MB (5 rows of a 49k
# vocabulary) stays in the cache; SmolLM2's exact patching converted [32 x 19 x 49k] at once, 5x slower.
LOGPROB_BYTES = 2**21


def gathered_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits in float64) at ``targets`` ([..., V] and [..., k] -> [..., k]: ``gather``
    along the last axis), a few rows at a time: each row's log-softmax is its own, so the values are
    those of the whole tensor at once."""
    rows = logits.reshape(-1, logits.shape[-1])
    index = targets.reshape(len(rows), -1).to(logits.device)
    n = max(1, LOGPROB_BYTES // (8 * rows.shape[1]))
    return torch.cat([r.double().log_softmax(-1).gather(-1, i) for r, i in zip(rows.split(n), index.split(n))]
                     ).view(targets.shape)


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
LAST_POSITION_HOOK = UNEMBED_IN


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
        out.append(gathered_logprobs(logits[:, -1], targets[rows]).cpu())
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


def _stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mean, std (ddof 1) and standard error over the last axis."""
    n = x.shape[-1]
    std = x.std(-1, correction=1) if n > 1 else torch.full(x.shape[:-1], math.nan, dtype=x.dtype)
    return x.mean(-1), std, std / math.sqrt(n)

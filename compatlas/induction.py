"""Induction behaviour, measured by forward passes: what the weights-based scores are checked against.

- ``induction_sweep``: seed 004's induction strength. Sequences ``r.. A B r.. A``; the control
  shuffles every token but the last; strength = logodds(p(B) | sequence) - logodds(p(B) | control).
  A power of token a: mean strength over S sequences with A = a (B power: with B = b), with
  the nearby-B token B* and a random token R scored on the same sequences.
- ``head_attention_scores``: previous-token, duplicate-token and induction attention per head.
- ``ablation_effects``: the drop in induction strength when one head's output (hook_z) is
  zeroed or replaced by its mean.

Works on any transformer_lens model with ``run_with_hooks`` and the hook names
``blocks.{l}.attn.hook_z`` / ``hook_pattern``: a ``TransformerBridge`` in the pipeline, a
hand-built ``HookedTransformer`` in the tests. Every batch is one padded-free forward pass
(all sequences of a sweep have the same length), on the model's device.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import polars as pl
import torch

from compatlas.composition import stable_seed

log = logging.getLogger(__name__)

ROLES = ("A", "B")
# p(B) is clamped into [P_EPS, 1 - P_EPS] so that logodds stay finite (|logodds| <= 34.5)
P_EPS = 1e-15

TOKEN_SCHEMA = {
    "model": pl.Utf8, "checkpoint": pl.Utf8, "filler_before": pl.Int32, "filler_between": pl.Int32,
    "token_id": pl.Int64, "token_text": pl.Utf8, "role": pl.Utf8, "n": pl.Int64, "mean": pl.Float64,
    "std": pl.Float64, "stderr": pl.Float64, "near_b_id": pl.Int64, "near_b_mean": pl.Float64,
    "near_b_stderr": pl.Float64, "random_mean": pl.Float64, "random_stderr": pl.Float64,
}
HEAD_SCHEMA = {
    "model": pl.Utf8, "checkpoint": pl.Utf8, "layer": pl.Int32, "head": pl.Int32,
    "prev_token_mean": pl.Float64, "prev_token_std": pl.Float64, "duplicate_mean": pl.Float64,
    "duplicate_std": pl.Float64, "induction_mean": pl.Float64, "induction_std": pl.Float64,
    "n_sequences": pl.Int64, "ablation": pl.Utf8, "ablation_drop": pl.Float64, "ablation_drop_stderr": pl.Float64,
    "clean_strength": pl.Float64,
}


@dataclass(frozen=True)
class TokenSet:
    """Which tokens a sweep draws from: ``pool`` for fillers and random partners (special tokens
    excluded), ``bos`` prepended to every sequence when the model expects one."""

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


@torch.no_grad()
def target_logprobs(model, seqs: torch.Tensor, targets: torch.Tensor, batch_size: int,
                    hooks: Callable[[slice], list[Hook]] | None = None) -> torch.Tensor:
    """log p(target) at the last position, float64 [S, k]; forward passes in batches.
    ``hooks(rows)`` gives the forward hooks for the batch covering ``rows``."""
    device = _device(model)
    batch_size = effective_batch(model, seqs.shape[1], batch_size)
    out = []
    for start in range(0, len(seqs), batch_size):
        rows = slice(start, min(start + batch_size, len(seqs)))
        batch = seqs[rows].to(device)
        fwd = hooks(rows) if hooks else []
        logits = model.run_with_hooks(batch, fwd_hooks=fwd) if fwd else model(batch)
        lp = logits[:, -1].double().log_softmax(-1)
        out.append(lp.gather(1, targets[rows].to(device)).cpu())
    return torch.cat(out) if out else torch.empty(0, targets.shape[1], dtype=torch.float64)


def strengths(model, seq: torch.Tensor, ctrl: torch.Tensor, targets: torch.Tensor, batch_size: int,
              hooks: Callable[[slice], list[Hook]] | None = None) -> torch.Tensor:
    """Induction strength of each target column, [S, k]: logodds(sequence) - logodds(control)."""
    return (logodds(target_logprobs(model, seq, targets, batch_size, hooks))
            - logodds(target_logprobs(model, ctrl, targets, batch_size, hooks)))


# a forward pass returns logits at every position: cap batch x length x d_vocab (float32) at 1 GiB
LOGITS_BUDGET = 2**28


def effective_batch(model, length: int, batch_size: int) -> int:
    """``batch_size``, lowered so that one batch's logits fit LOGITS_BUDGET (Gemma's vocabulary is 262k)."""
    return max(1, min(batch_size, LOGITS_BUDGET // (length * model.cfg.d_vocab)))


def _device(model) -> torch.device:
    return next(model.parameters()).device


def nearest_tokens(directions: torch.Tensor, ids: torch.Tensor, exclude: torch.Tensor | None = None,
                   chunk: int = 256) -> torch.Tensor:
    """For each id, the other token whose direction (row of ``directions`` [d_vocab, d]: W_U's
    columns, or W_E's rows for tied / encoder models) has the highest cosine similarity.
    Chunked: never a d_vocab x d_vocab matrix."""
    unit = torch.nn.functional.normalize(directions.float(), dim=1)
    out = torch.empty(len(ids), dtype=torch.long)
    for s in range(0, len(ids), chunk):
        part = ids[s:s + chunk]
        sim = unit[part] @ unit.T
        sim[torch.arange(len(part)), part] = -math.inf
        if exclude is not None and len(exclude):
            sim[:, exclude] = -math.inf
        out[s:s + len(part)] = sim.argmax(1)
    return out


def _stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mean, std (ddof 1) and standard error over the last axis."""
    n = x.shape[-1]
    std = x.std(-1, correction=1) if n > 1 else torch.full(x.shape[:-1], math.nan, dtype=x.dtype)
    return x.mean(-1), std, std / math.sqrt(n)


def induction_sweep(model, token_ids: torch.Tensor, tokens: TokenSet, near: dict[int, int], *, sequences: int,
                    before: int = 10, between: int = 10, seed: int = 0, batch_size: int = 128,
                    decode: Callable[[int], str] = str) -> pl.DataFrame:
    """A power and B power of every token in ``token_ids``, S sequences each, with the nearby-B
    (``near[B]``) and random-token controls on the same sequences. One row per token x role."""
    N, S = len(token_ids), sequences
    rows = []
    for role in ROLES:
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(stable_seed(seed, "sweep", role, before, between))
        fixed = token_ids.repeat_interleave(S)
        other = _draw(gen, tokens.pool, (N * S,), avoid=(fixed,))
        A, B = (fixed, other) if role == "A" else (other, fixed)
        R = _draw(gen, tokens.pool, (N * S,), avoid=(A, B))
        near_b = torch.tensor([near[int(b)] for b in B])
        seq, ctrl = induction_sequences(gen, tokens, A, B, before, between)
        st = strengths(model, seq, ctrl, torch.stack([B, near_b, R], 1), batch_size).view(N, S, 3)
        mean, std, se = _stats(st.permute(2, 0, 1))
        dt = time.perf_counter() - t0
        log.info("%s power, fillers %d+%d: %d tokens x %d sequences (+ controls) in %.1fs, %.1f sequences/s; "
                 "mean strength %.3f", role, before, between, N, S, dt, 2 * N * S / max(dt, 1e-9), mean[0].mean())
        for i, t in enumerate(token_ids.tolist()):
            rows.append({"filler_before": before, "filler_between": between, "token_id": t, "token_text": decode(t),
                         "role": role, "n": S, "mean": mean[0, i].item(), "std": std[0, i].item(),
                         "stderr": se[0, i].item(), "near_b_id": near[t] if role == "B" else None,
                         "near_b_mean": mean[1, i].item(), "near_b_stderr": se[1, i].item(),
                         "random_mean": mean[2, i].item(), "random_stderr": se[2, i].item()})
    return pl.DataFrame(rows, schema={k: v for k, v in TOKEN_SCHEMA.items() if k not in ("model", "checkpoint")})


@torch.no_grad()
def head_attention_scores(model, tokens: TokenSet, *, sequences: int, length: int, seed: int = 0,
                          batch_size: int = 128) -> pl.DataFrame:
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
        model.run_with_hooks(seqs[s:s + batch_size].to(device), fwd_hooks=hooks)
    cols: dict[str, list] = {"layer": [], "head": []}
    for name, key in (("prev_token", "prev"), ("duplicate", "dup"), ("induction", "ind")):
        per = torch.stack([torch.cat(found[key][layer]) for layer in range(cfg.n_layers)])  # [L, S, H]
        mean, std, _ = _stats(per.transpose(1, 2))
        cols[f"{name}_mean"], cols[f"{name}_std"] = mean.flatten().tolist(), std.flatten().tolist()
    L, H = cfg.n_layers, cfg.n_heads
    cols["layer"] = [layer for layer in range(L) for _ in range(H)]
    cols["head"] = [h for _ in range(L) for h in range(H)]
    cols["n_sequences"] = [sequences] * (L * H)
    return pl.DataFrame(cols, schema={k: HEAD_SCHEMA[k] for k in cols})


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
        model.run_with_hooks(batch, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", grab(layer)) for layer in range(L)])
        count += batch.shape[0] * batch.shape[1]
    return [s / count for s in sums]


def ablation_effects(model, tokens: TokenSet, *, sequences: int, before: int = 10, between: int = 10,
                     mode: str = "zero", seed: int = 0, batch_size: int = 128) -> pl.DataFrame:
    """For every head: mean drop in induction strength of B (clean minus ablated, paired over
    the same S sequences and controls) when the head's z is zeroed (``zero``) or replaced by
    its mean over these sequences and controls (``mean``). The heads of one layer are ablated
    in one forward pass: the batch repeats the sequences once per head."""
    if mode not in ("zero", "mean"):
        raise ValueError(f"ablation mode {mode!r}: choose zero or mean")
    cfg = model.cfg
    L, H, S = cfg.n_layers, cfg.n_heads, sequences
    gen = torch.Generator().manual_seed(stable_seed(seed, "ablation", before, between))
    A = _draw(gen, tokens.pool, (S,))
    B = _draw(gen, tokens.pool, (S,), avoid=(A,))
    seq, ctrl = induction_sequences(gen, tokens, A, B, before, between)
    target = B[:, None]
    clean = strengths(model, seq, ctrl, target, batch_size)[:, 0]
    means = head_z_means(model, torch.cat([seq, ctrl]), batch_size) if mode == "mean" else None
    per_pass = max(1, effective_batch(model, seq.shape[1], batch_size) // S)  # heads ablated side by side
    drop = torch.empty(L, H, S, dtype=torch.float64)
    t0 = time.perf_counter()
    for layer in range(L):
        for g0 in range(0, H, per_pass):
            group = torch.arange(g0, min(g0 + per_pass, H))
            k = len(group)
            head_of_row = group.repeat_interleave(S)  # the replicated batch: S rows per ablated head

            def hooks(rows: slice, layer=layer, head_of_row=head_of_row) -> list[Hook]:
                heads = head_of_row[rows]

                def ablate(z, hook):  # z: [batch, pos, head, d_head]
                    z = z.clone()
                    b = torch.arange(len(heads), device=z.device)
                    h = heads.to(z.device)
                    z[b, :, h] = 0.0 if means is None else means[layer].to(z.device, z.dtype)[h][:, None, :]
                    return z
                return [(f"blocks.{layer}.attn.hook_z", ablate)]

            ablated = strengths(model, seq.repeat(k, 1), ctrl.repeat(k, 1), target.repeat(k, 1), k * S, hooks)
            drop[layer, g0:g0 + k] = clean[None, :] - ablated[:, 0].view(k, S)
        log.info("ablation (%s): layer %d/%d done (%.1fs)", mode, layer + 1, L, time.perf_counter() - t0)
    mean, _, se = _stats(drop)
    return pl.DataFrame({
        "layer": [layer for layer in range(L) for _ in range(H)], "head": [h for _ in range(L) for h in range(H)],
        "ablation": [mode] * (L * H), "ablation_drop": mean.flatten().tolist(),
        "ablation_drop_stderr": se.flatten().tolist(), "clean_strength": [clean.mean().item()] * (L * H),
    }, schema={k: HEAD_SCHEMA[k] for k in ("layer", "head", "ablation", "ablation_drop", "ablation_drop_stderr",
                                           "clean_strength")})


# ----------------------------------------------------------------------------- one model, end to end


def token_set(tokenizer, d_vocab: int, pool_size: int, prepend_bos: str | bool = "auto") -> TokenSet:
    """The first ``pool_size`` non-special tokens of the vocabulary. ``prepend_bos='auto'``
    prepends BOS when the tokenizer itself adds one to encoded text (seed 004: "if the model
    expects one")."""
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    pool = [t for t in range(d_vocab) if t not in special][:pool_size]
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if prepend_bos == "auto":
        adds = tokenizer is not None and bos_id is not None and tokenizer("a").input_ids[:1] == [bos_id]
        bos = bos_id if adds else None
    else:
        if prepend_bos and bos_id is None:
            raise ValueError("prepend_bos is true but the tokenizer has no BOS token")
        bos = bos_id if prepend_bos else None
    return TokenSet(pool=torch.tensor(pool, dtype=torch.long), bos=bos)


def token_directions(W_E: torch.Tensor, W_U: torch.Tensor | None) -> torch.Tensor:
    """Rows to measure "nearby B" by: W_U's columns, or W_E's rows when there is no unembedding
    (encoders) or it is tied to W_E."""
    if W_U is None or (W_U.shape == W_E.T.shape and torch.equal(W_U, W_E.T)):
        return W_E
    return W_U.T


def measure(model, tokenizer, directions: torch.Tensor, settings: dict) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Everything issue 4 measures on one model: the strength sweep (per filler setting), head
    attention scores and head ablation. ``settings`` is the config's ``induction`` section."""
    d_vocab = directions.shape[0]
    tokens = token_set(tokenizer, d_vocab, settings["pool"], settings["prepend_bos"])
    ids = (torch.tensor(settings["token_ids"], dtype=torch.long) if settings.get("token_ids")
           else tokens.pool[:settings["tokens"]])
    if ids.numel() and (ids.min() < 0 or ids.max() >= d_vocab):
        raise ValueError(f"induction.token_ids must lie in 0..{d_vocab - 1}")
    special = torch.tensor(sorted(set(getattr(tokenizer, "all_special_ids", None) or [])), dtype=torch.long)
    need = torch.unique(torch.cat([tokens.pool, ids]))
    near = dict(zip(need.tolist(), nearest_tokens(directions, need, special).tolist()))
    decode = (lambda t: tokenizer.decode([t])) if tokenizer is not None else (lambda t: f"t{t}")
    seed, bs = settings["seed"], settings["batch_size"]
    sweeps = [induction_sweep(model, ids, tokens, near, sequences=settings["sequences"], before=before,
                              between=between, seed=seed, batch_size=bs, decode=decode)
              for before, between in settings["fillers"]]
    heads = head_attention_scores(model, tokens, sequences=settings["head_scores"]["sequences"],
                                  length=settings["head_scores"]["length"], seed=seed, batch_size=bs)
    abl = settings["ablation"]
    before, between = settings["fillers"][0]
    effects = ablation_effects(model, tokens, sequences=abl["sequences"], before=before, between=between,
                               mode=abl["mode"], seed=seed, batch_size=bs)
    return pl.concat(sweeps), heads.join(effects, on=["layer", "head"])


def run_model(model_id: str, entry: dict, checkpoint: dict | None, settings: dict, meta_path: str,
              workdir, device: str = "auto") -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    """Boot one model (x checkpoint) and measure it: the tables of the ``induction_tokens`` and
    ``head_scores`` views, and the provenance for their shards. Only the extraction's metadata
    is read (the forward passes need the model, not the weight shard)."""
    from compatlas.loading import boot
    from compatlas.scores import resolve_device
    from compatlas.storage import library_versions
    from compatlas.weights import load_meta

    t0 = time.perf_counter()
    meta = load_meta(meta_path)
    if not meta.get("has_unembed", True):
        raise ValueError(f"model {model_id!r} has no unembedding (an encoder): induction needs next-token "
                         f"logits; set models.{model_id}.induction.enabled: false")
    dev = resolve_device(device)
    bridge, _ = boot(entry, checkpoint, workdir, str(dev))
    bridge.eval()
    n_ctx = getattr(bridge.cfg, "n_ctx", None)
    longest = max([sum(f) + 3 for f in settings["fillers"]] + [2 * settings["head_scores"]["length"]]) + 1
    if n_ctx and longest > n_ctx:
        raise ValueError(f"model {model_id!r} has a context of {n_ctx} tokens; induction.fillers / head_scores.length "
                         f"need {longest}")
    with torch.no_grad():  # the raw embeddings (the shard's may be centred by processing)
        W_E = bridge.W_E.detach().float().cpu()
        W_U = bridge.W_U.detach().float().cpu()
    tokens, heads = measure(bridge, bridge.tokenizer, token_directions(W_E, W_U), settings)
    label = meta.get("checkpoint", "final")
    tokens = tokens.with_columns(model=pl.lit(model_id), checkpoint=pl.lit(label)).select(list(TOKEN_SCHEMA))
    heads = heads.with_columns(model=pl.lit(model_id), checkpoint=pl.lit(label)).select(list(HEAD_SCHEMA))
    provenance = {k: meta.get(k) for k in ("model", "checkpoint", "checkpoint_step", "checkpoint_tokens",
                                             "source_kind", "source_checksum", "weights_sha256", "quantized")}
    provenance.update(weight_processing="none (forward passes on the loaded model)", settings=settings,
                      device=str(dev), versions=library_versions(), seconds=round(time.perf_counter() - t0, 3))
    return tokens, heads, provenance

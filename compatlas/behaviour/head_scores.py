"""Head attention scores: previous-token, duplicate-token and induction attention per head,
on random sequences repeated twice."""

from __future__ import annotations

import polars as pl
import torch

from compatlas.behaviour.sequences import TokenSet, _device, _draw, _stats, last_position_hooks
from compatlas.progress import Progress
from compatlas.runtime import stable_seed
from compatlas.tables import HEAD_SCORES_SCHEMA


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
    found: dict[str, list[list[torch.Tensor]]] = {k: [[] for _ in range(cfg.n_layers)] for k in ("prev", "dup", "ind")}

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

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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import polars as pl
import torch

# Each concept has its module; the names the pipeline, tests and benchmarks import from here stay here.
from compatlas.behaviour.ablation import (  # noqa: F401
    _attribution_drops,
    _cached_drops,
    _full_drops,
    ablation_effects,
    head_z_means,
)
from compatlas.behaviour.head_scores import head_attention_scores
from compatlas.behaviour.sequences import (  # noqa: F401
    LAST_POSITION_HOOK,
    LOGITS_BUDGET,
    P_EPS,
    Hook,
    TokenSet,
    _device,
    _draw,
    _stats,
    effective_batch,
    induction_sequences,
    last_position_hooks,
    logodds,
    strengths,
    target_logprobs,
)
from compatlas.behaviour.tokens import (  # noqa: F401
    CONTROL_NAME,
    NearbyB,
    clean_tokens,
    control_tokens,
    duplicate_rows,
    nearest_tokens,
    sample_tokens,
    token_directions,
    token_set,
)
from compatlas.models.cpu_matmul import cpu_matmul
from compatlas.progress import Progress
from compatlas.runtime import stable_seed
from compatlas.tables import HEAD_SCORES_SCHEMA, INDUCTION_TOKENS_SCHEMA
from compatlas.vocab import ROLES

log = logging.getLogger(__name__)


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


# ----------------------------------------------------------------------------- one model, end to end


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


@dataclass(frozen=True)
class BootedModel:
    """A model booted for forward passes (``boot_for_forward``) and what its provenance records."""

    meta: dict
    bridge: Any
    device: torch.device
    dtype: torch.dtype
    device_map: str | None
    W_E: torch.Tensor  # the raw embeddings, float32 on the CPU (the shard's may be centred by processing)
    W_U: torch.Tensor


def boot_for_forward(model_id: str, entry: dict, checkpoint: dict | None, settings: dict, meta_path: str, workdir,
                     device: str, task: str, context: Callable[[int], str | None]) -> BootedModel:
    """Boot one model (x checkpoint) on the job's device, dtype and device map, as the induction
    and edge-attribution jobs both do. Only the extraction's metadata is read. ``task`` names
    the job in the error for a model without an unembedding; ``context(n_ctx)`` says what the
    settings need of a context of ``n_ctx`` tokens, or None when it is enough."""
    from compatlas.models.loading import boot
    from compatlas.models.weights import load_meta
    from compatlas.runtime import resolve_device

    meta = load_meta(meta_path)
    if not meta.get("has_unembed", True):
        raise ValueError(f"model {model_id!r} has no unembedding (an encoder): {task} needs next-token "
                         f"logits; set models.{model_id}.induction.enabled: false")
    dev = resolve_device(device)
    dtype = forward_dtype(settings.get("dtype", "auto"), dev)
    device_map = settings.get("device_map", "none")
    device_map = None if device_map in (None, "none") else device_map
    bridge, _ = boot(entry, checkpoint, workdir, str(dev), dtype=dtype, device_map=device_map, extracted=meta)
    bridge.eval()
    n_ctx = getattr(bridge.cfg, "n_ctx", None)
    if n_ctx and (needs := context(n_ctx)):
        raise ValueError(f"model {model_id!r} has a context of {n_ctx} tokens; {needs}")
    with torch.no_grad():
        W_E = bridge.W_E.detach().float().cpu()
        W_U = bridge.W_U.detach().float().cpu()
    return BootedModel(meta, bridge, dev, dtype, device_map, W_E, W_U)


def boot_and_measure_behaviour(model_id: str, entry: dict, checkpoint: dict | None, settings: dict, meta_path: str,
                               workdir, device: str = "auto") -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    """Boot one model (x checkpoint) and measure it: the tables of the ``induction_tokens`` and
    ``head_scores`` views, and the provenance for their shards. Only the extraction's metadata
    is read (the forward passes need the model, not the weight shard)."""
    from compatlas.tables import provenance

    t0 = time.perf_counter()
    longest = max([sum(f) + 3 for f in settings["fillers"]] + [2 * settings["head_scores"]["length"]]) + 1
    m = boot_for_forward(model_id, entry, checkpoint, settings, meta_path, workdir, device, "induction",
                         lambda n_ctx: f"induction.fillers / head_scores.length need {longest}"
                         if longest > n_ctx else None)
    meta, dtype, device_map, dev = m.meta, m.dtype, m.device_map, m.device
    directions = token_directions(m.W_E, m.W_U)
    with cpu_matmul(settings["cpu_matmul"], dev) as matmul:
        tokens, heads, chosen = measure_behaviour(m.bridge, m.bridge.tokenizer, directions, settings, m.W_E)
    label = meta.get("checkpoint", "final")
    tokens = tokens.with_columns(model=pl.lit(model_id), checkpoint=pl.lit(label)).select(list(INDUCTION_TOKENS_SCHEMA))
    heads = heads.with_columns(model=pl.lit(model_id), checkpoint=pl.lit(label)).select(list(HEAD_SCORES_SCHEMA))
    # the forward passes run on the model as loaded, whatever processing its weight shard had
    record = provenance(meta, processing="none", weight_processing="none (forward passes on the loaded model)",
                        settings=settings, tokens=chosen, dtype=str(dtype).removeprefix("torch."),
                        device_map=device_map, device=str(dev), cpu_matmul=matmul,
                        seconds=round(time.perf_counter() - t0, 3))
    return tokens, heads, record

"""Which tokens an induction sweep uses: the clean tokens (no special, added, control,
unreachable or duplicate-embedding tokens), seeded samples of them, BOS, and each token's nearby
B (the token whose unembedding direction is closest), found in chunks, never with a
d_vocab x d_vocab matrix."""

from __future__ import annotations

import math
import re

import torch

from compatlas.behaviour.sequences import TokenSet
from compatlas.runtime import stable_seed

# Reserved/control names that are not text: <|...|>, [unused3], [UNK], <unused12>, <reserved_...>,
# <extra_id_4>, <pad>, <unk>, <mask>, and SentencePiece's byte-fallback <0x0A>.
CONTROL_NAME = re.compile(r"^(<\|.*\|>|\[(unused\d+|UNK|PAD|CLS|SEP|MASK)\]"
                          r"|<(unused|reserved|extra_id|pad|unk|mask|0x[0-9A-Fa-f]{2})[^<>]*>)$", re.IGNORECASE)


def duplicate_rows(W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(group id per row, True where the row equals another row exactly). Exact equality by
    sorting the rows (torch.unique), never a d_vocab x d_vocab comparison."""
    _, group, counts = torch.unique(W, dim=0, return_inverse=True, return_counts=True)
    return group, counts[group] > 1


def _decode_and_encode(tokenizer, ids: list[int]) -> tuple[list[str], list[list[int]]]:
    """Each token's text (``batch_decode([[t] ...])``) and its encoding (``tokenizer(texts,
    add_special_tokens=False).input_ids``). A fast tokenizer whose wrapper adds no clean-up runs
    both in one call of its Rust backend each, as the wrapper itself would: the wrapper's
    per-token Python is 1.3 s of SmolLM2's 49,152 tokens in every job that boots it."""
    from tokenizers import Tokenizer

    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces", True) or len(ids) < 2:
        texts = tokenizer.batch_decode([[t] for t in ids])
        return texts, tokenizer(texts, add_special_tokens=False).input_ids
    texts = backend.decode_batch([[t] for t in ids], skip_special_tokens=False)
    # the wrapper encodes the first text, setting the backend as it encodes (no truncation or
    # padding, its split_special_tokens), then the backend the rest, as the wrapper's own batch call does
    first = tokenizer(texts[:1], add_special_tokens=False).input_ids
    return texts, first + [e.ids for e in backend.encode_batch(texts[1:], add_special_tokens=False, is_pretokenized=False)]


def _reaches_itself(tokenizer, ids: list[int]) -> list[bool]:
    """Does encoding the token's own text give back the token? False for tokens encoding never
    produces: partial UTF-8 bytes, merges the tokenizer never reaches. A SentencePiece
    tokenizer prepends a word boundary to text: [boundary, token] counts as reaching it."""
    encoded = _decode_and_encode(tokenizer, ids)[1]
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


def bos_token(tokenizer, prepend_bos: str | bool = "auto") -> int | None:
    """The BOS id to start sequences with, or None. ``'auto'`` prepends BOS when the tokenizer
    itself adds one to encoded text (the induction-strength setup: BOS "if the model expects one")."""
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if prepend_bos == "auto":
        adds = tokenizer is not None and bos_id is not None and tokenizer("a").input_ids[:1] == [bos_id]
        return bos_id if adds else None
    if prepend_bos and bos_id is None:
        raise ValueError("prepend_bos is true but the tokenizer has no BOS token")
    return bos_id if prepend_bos else None


def token_set(tokenizer, pool: torch.Tensor, prepend_bos: str | bool = "auto") -> TokenSet:
    """The sweep's pool (clean tokens, see ``clean_tokens``) and BOS (``bos_token``)."""
    return TokenSet(pool=pool, bos=bos_token(tokenizer, prepend_bos))


def token_directions(W_E: torch.Tensor, W_U: torch.Tensor | None) -> torch.Tensor:
    """Rows to measure "nearby B" by: W_U's columns, or W_E's rows when there is no unembedding
    (encoders) or it is tied to W_E."""
    if W_U is None or (W_U.shape == W_E.T.shape and torch.equal(W_U, W_E.T)):
        return W_E
    return W_U.T

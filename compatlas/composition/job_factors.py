"""Every per-head factor a composition job needs, made in layer chunks, so that the device holds
the weights, both factor families and their sandwich only for a few layers at a time.

A job scoring several metrics needs one ``composition.head_factors`` per ``factor_family``. With
``subspace`` among them its orthonormal factors are the base, and every other family's cores are
sandwiches of the base's: with ``emit = U_O^T``, ``absorb = U_A`` (subspace) and a family's
``emit'`` (rows in W_O's row space) and ``absorb'`` (columns in A's column space),

    emit' absorb' = (emit' U_O) (U_O^T U_A) (U_A^T absorb')

so the family's d_head x d_head core of a head pair is ``left[h1] @ base core @ right[h2]``, two
d_head-long products instead of a d_model-long one. What the GEMMs then need of a sandwiched family
is ``left``, ``right`` and its norms and spectra; of the base (or of the one family of a job that
scores one), ``emit`` and ``absorb_cols``. After ``job_factors`` the job can drop the weights: per
layer it holds about the base's emit and absorb columns (0.6 GB at Llama-2-70B shapes).

The magnitude family (frobenius, svd_bound, contribution) always takes this road (``share_cores``,
the default), subspace in the job or not, so that its numbers do not depend on the metrics beside
it: a job without subspace factors subspace's bases for it. Measured on 2 CPU cores (float32, no
nulls; d_model 4096, 32 query / 4 KV heads, d_head 128, 2 layers, 4 layer pairs): the four metrics
10.7 s against 17.3 s with each family's own GEMMs; the magnitude family alone 10.8 s against
8.6 s, a cost that no shipped configuration pays (every one scores subspace beside them). The
sandwiched scores differ from the own GEMMs' by float rounding (3e-6 relative there).
``share_cores=False`` gives each family its own GEMMs (the reference the benchmarks compare with).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from compatlas.composition.scores import HeadFactors, factor_family, head_factors
from compatlas.models.weights import AttentionWeights
from compatlas.vocab import Metric

CHUNK_BYTES = 4 * 2**30  # the weights of the layers factored at once, times 8 (both families' factors beside them)


@dataclass
class Sandwich:
    """Another family's cores from the base family's (the module docstring):
    ``core = left[h1] @ base core @ right[h2]``, ``left`` [L, H, dh, dh] per writer head, ``right[c]``
    [L, Hg, dh, g dh]: the g query heads of each base absorb head side by side."""

    left: torch.Tensor
    right: dict[str, torch.Tensor]


def sandwich(f: HeadFactors, base: HeadFactors) -> Sandwich:
    """``left = emit U_O`` and ``right = U_A^T absorb (post)`` with the base's orthonormal ``emit = U_O^T``
    and ``absorb = U_A``: ``f``'s emit rows lie in W_O's row space and its absorb columns in A's
    column space, which U_O and U_A span (zero columns past a rank change nothing), so
    ``emit absorb = (emit U_O) (U_O^T U_A) (U_A^T absorb)`` exactly."""
    emit = f.gemm_emit()
    L, H, dh, _ = emit.shape
    right = {}
    for c in base.absorb:
        Hg = base.absorb[c].shape[1]
        if f.absorb[c].shape[1] != Hg:
            raise ValueError(f"{c}: {f.absorb[c].shape[1]} absorb heads against the base's {Hg}")
        C = base.absorb[c].transpose(-2, -1) @ f.absorb[c]  # [L, Hg, dh, dh]
        post = f.post.get(c)
        C = C.repeat_interleave(H // Hg, dim=1) @ post if post is not None else C.repeat_interleave(H // Hg, dim=1)
        right[c] = C.view(L, Hg, H // Hg, dh, dh).permute(0, 1, 3, 2, 4).reshape(L, Hg, dh, H // Hg * dh)
    return Sandwich(emit @ base.gemm_emit().transpose(-2, -1), right)




@dataclass
class JobFactors:
    """A job's factors: ``f[family]`` (a sandwiched family's without emit and absorb), ``sand[family]``
    for the sandwiched ones, and the base (or only) families in ``direct``."""

    f: dict[Metric, HeadFactors]
    sand: dict[Metric, Sandwich] = field(default_factory=dict)

    @property
    def direct(self) -> list[Metric]:
        return [fam for fam in self.f if fam not in self.sand]


def _strip(f: HeadFactors, keep_gemm: bool) -> HeadFactors:
    """What the job keeps of a family's factors: the norms and spectra, and only where it runs the
    GEMM its operands and post products (``absorb`` itself is dropped: ``absorb_cols`` is its copy)."""
    return HeadFactors(f.metric, f.emit if keep_gemm else None, f.writer_norm, f.writer_sv, {}, f.reader_norm,
                       f.reader_sv, f.post if keep_gemm else {}, f.absorb_cols if keep_gemm else {})


def _layers(w: AttentionWeights, a: int, b: int) -> AttentionWeights:
    """Local layers a..b-1 of w, as views (their norm gains too: the activation space reads them)."""
    return AttentionWeights(W_Q=w.W_Q[a:b], W_K=w.W_K[a:b], W_V=w.W_V[a:b], W_O=w.W_O[a:b], W_E=None,
                            ln1_w=None if w.ln1_w is None else w.ln1_w[a:b], meta=w.meta,
                            layer_ids=None if w.layer_ids is None else w.layer_ids[a:b])


def _concat(parts: list, dim: int = 0):
    """Chunk results joined: tensors along ``dim``, dicts key by key, anything else (a metric, None) as the first."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, dict):
        return {k: _concat([p[k] for p in parts], dim) for k in first}
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, dim) if len(parts) > 1 else first
    return first


def _concat_factors(parts: list[HeadFactors]) -> HeadFactors:
    out: dict[str, Any] = {}
    for fl in fields(HeadFactors):
        vals = [getattr(p, fl.name) for p in parts]
        if fl.name == "absorb_cols":  # [d, L Hg dh]: layers side by side along the columns
            out[fl.name] = {c: torch.cat([v[c] for v in vals], 1) if len(vals) > 1 else vals[0][c] for c in vals[0]}
        else:
            out[fl.name] = _concat(vals)
    return HeadFactors(**out)


def job_factors(w: AttentionWeights, metrics: tuple[Metric, ...],
                prepare: Callable[[AttentionWeights], tuple[AttentionWeights, dict | None]] | None = None,
                share_cores: bool = True) -> JobFactors:
    """The factors of every family the metrics need, made CHUNK_BYTES of weights at a time;
    ``prepare`` turns each chunk of ``w``'s layers, in order, into the weights to factor and their
    measured Gram matrices or None (``head_factors``' ``grams``): the job's, moved to its device and
    into its space, so that the device never holds more than a chunk of weights. With
    ``share_cores`` every family but subspace is a sandwich of subspace's, whose bases are made
    for it where the metrics do not ask for subspace (the module docstring)."""
    families = list(dict.fromkeys(factor_family(m) for m in metrics))
    base: Metric | None = "subspace" if share_cores and any(fam != "subspace" for fam in families) else None
    if base is not None and base not in families:
        families.append(base)
    per_layer = sum(x[0].numel() * x.element_size() for x in (w.W_Q, w.W_K, w.W_V, w.W_O)) * 8
    step = max(1, CHUNK_BYTES // max(per_layer, 1))
    parts: dict[Metric, list[HeadFactors]] = {fam: [] for fam in families}
    sand_parts: dict[Metric, list[Sandwich]] = {fam: [] for fam in families if base not in (None, fam)}
    for a in range(0, w.n_layers, step):
        wc = _layers(w, a, min(a + step, w.n_layers))
        wc, grams = prepare(wc) if prepare is not None else (wc, None)
        fc = {fam: head_factors(wc, fam, grams=grams) for fam in families}
        if base is not None:  # else sand_parts is empty
            for fam in sand_parts:
                sand_parts[fam].append(sandwich(fc[fam], fc[base]))
        for fam, x in fc.items():
            parts[fam].append(_strip(x, keep_gemm=fam not in sand_parts))
        del fc, wc, grams
    f = {fam: _concat_factors(p) for fam, p in parts.items()}
    sand = {fam: Sandwich(_concat([s.left for s in p]), _concat([s.right for s in p])) for fam, p in sand_parts.items()}
    return JobFactors(f, sand)

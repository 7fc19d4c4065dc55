"""One composition job on one device: every requested metric of one space over a block of layer
pairs, in few large GEMMs, resident on the device from the weights to the finished block.

The metrics themselves are ``composition.scores``' (``head_factors``, ``pair_denominator``,
``normalised_score``), the nulls ``composition.nulls``' (``draw_nulls``, ``spectrum_baseline``,
``gaussian_baselines``); this module only decides what runs where and how often:

- metrics that share their head factors (``composition.factor_family``: frobenius, svd_bound and
  contribution) share them and their core products, each metric only adds its denominators; with
  ``subspace`` in the job the others' cores are sandwiches of its cores (``job_factors``), so the
  d_model-long GEMMs run once per comp and tile;
- the writer layers are stacked into tiles, so that one GEMM ``[k H d_head, d_model] @ [d_model,
  nR Hg d_head]`` scores k writer layers against the union of their readers, as large as
  ``tile_bytes`` allows (the GPU: a share of its free memory; the CPU: about one writer layer
  of GPT-2-small, larger GEMMs being no faster there);
- the null pairs have the causal pairs' shapes and go into the same tiles;
- both nulls' draws and scores stay on the device, and the finished block ([metric, comp, score /
  spectrum mean / spectrum std, pair, H, H] and the Gaussian baselines) comes back in one copy.

``JobClock`` records where the time goes (``transfer``, ``factors``, ``gemms``, ``scores``,
``nulls``, ``table``), synchronising the device at each phase's end.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

import torch

from compatlas.composition.job_factors import JobFactors, Sandwich
from compatlas.composition.nulls import Nulls, gaussian_baselines, spectrum_baseline
from compatlas.composition.precision import core_gemm, gemm_operand
from compatlas.composition.scores import HeadFactors, factor_family, normalised_score, pair_denominator
from compatlas.runtime import one_thread_on
from compatlas.vocab import COMPS, Comp, Metric, ScoreDtype

CPU_TILE_BYTES = 32 * 2**20  # one GPT-2-small writer layer's products (28 MiB); stacking more was no faster on 2 cores
GPU_TILE_SHARE = 0.15  # of the device's free memory, for one tile's products (its post products and their
# contiguous copy take as much again each)
GPU_TILE_MAX = 4 * 2**30  # past a few GB a GEMM is as fast as it gets


@dataclass
class JobClock:
    """Seconds per phase of a job; the device is synchronised at each phase's end, so that an
    asynchronous GPU's work is counted in the phase that queued it."""

    device: torch.device
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds[name] += time.perf_counter() - t0


@dataclass
class Tile:
    """k writer layers against the union of their readers (local layer indices), and where each of
    the job's pairs among them goes: ``pos[i]`` is the pair's row in the block, ``wi[i]`` and
    ``ri[i]`` its writer's and reader's place in ``writers`` and ``readers``."""

    writers: list[int]
    readers: list[int]
    pos: torch.Tensor
    wi: torch.Tensor
    ri: torch.Tensor


def plan_tiles(pairs: list[tuple[int, int]], bytes_per_head_pair: int, H: int, tile_bytes: int,
               device: torch.device) -> list[Tile]:
    """Tiles covering ``pairs`` (local (writer, reader) layer indices): consecutive writer layers
    join one tile while its products ([k H, nR H] head pairs of ``bytes_per_head_pair`` each) fit
    ``tile_bytes``; a writer whose readers alone do not fit gets several tiles."""
    readers_of: dict[int, list[int]] = defaultdict(list)
    for a, b in pairs:
        readers_of[a].append(b)
    per_layer = H * H * bytes_per_head_pair  # one writer layer x one reader layer
    groups: list[tuple[list[int], list[int]]] = []
    for a in sorted(readers_of):
        rs = sorted(set(readers_of[a]))
        if groups:
            ws, union = groups[-1]
            merged = sorted(set(union) | set(rs))
            if (len(ws) + 1) * len(merged) * per_layer <= tile_bytes:
                groups[-1] = (ws + [a], merged)
                continue
        step = max(1, tile_bytes // per_layer)
        groups += [([a], rs[i:i + step]) for i in range(0, len(rs), step)]
    tiles = []
    for ws, rs in groups:
        w_at, r_at = {w: i for i, w in enumerate(ws)}, {r: i for i, r in enumerate(rs)}
        hit = [(p, w_at[a], r_at[b]) for p, (a, b) in enumerate(pairs) if a in w_at and b in r_at]
        pos, wi, ri = (torch.tensor(x, dtype=torch.long, device=device) for x in zip(*hit))
        tiles.append(Tile(ws, rs, pos, wi, ri))
    return tiles


def _layer_slice(x: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """``x[layers]``: a view where the layers are consecutive, else a copy."""
    if layers == list(range(layers[0], layers[0] + len(layers))):
        return x[layers[0]:layers[0] + len(layers)]
    return x[layers]


@dataclass
class GemmOperands:
    """A family's ``emit`` and ``absorb_cols`` as the core GEMM reads them (``precision.gemm_operand``)."""

    emit: torch.Tensor  # [L, H, dh, d]
    cols: dict[str, torch.Tensor]  # [d, L * Hg * dh]


def gemm_operands(f: HeadFactors, dtype: ScoreDtype) -> GemmOperands:
    return GemmOperands(gemm_operand(f.gemm_emit(), dtype), {c: gemm_operand(a, dtype) for c, a in f.absorb_cols.items()})


def tile_sq_norms(f: HeadFactors, ops: GemmOperands, comp: Comp, writers: list[int], readers: list[int],
                  dtype: ScoreDtype, keep: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Squared Frobenius norms [k H1, nR H2] of the d_head x d_head cores of every head pair of k
    writer layers and nR reader layers: one GEMM (``composition.layer_pair_scores``'s algebra,
    with the writer layers stacked); and with ``keep`` the GEMM's product [k H1 dh, nR Hg dh]."""
    L, H1, dh, d = ops.emit.shape
    Hg = ops.cols[comp].shape[1] // (L * dh)
    g, post, k, nR = H1 // Hg, f.post.get(comp), len(writers), len(readers)
    E = _layer_slice(ops.emit, writers).reshape(k * H1 * dh, d)
    width = Hg * dh
    F = _layer_slice(ops.cols[comp].view(d, L, width).transpose(0, 1), readers)  # [nR, d, width]: a view
    F = F.transpose(0, 1).reshape(d, nR * width)  # a view when the readers are consecutive
    core = core_gemm(E, F, dtype)
    if post is None:  # per query head, or a subspace basis shared by the KV group
        sq = _block_sq_norms(core.view(k * H1, dh, nR * Hg, dh))
        return sq.view(k * H1, nR, Hg).repeat_interleave(g, dim=2).view(k * H1, nR * Hg * g), core if keep else None
    # each query head j of KV head m: core[.., m, :] @ post[m * g + j]
    core = core.view(k * H1 * dh, nR, Hg, dh).permute(1, 2, 0, 3)  # [nR, Hg, k H1 dh, dh]
    P = _layer_slice(post, readers).reshape(nR, Hg, g, dh, dh).permute(0, 1, 3, 2, 4).reshape(nR, Hg, dh, g * dh)
    sq = _block_sq_norms((core @ P).view(nR * Hg * k * H1, dh, g, dh))  # [nR Hg k H1, g]
    return sq.view(nR, Hg, k * H1, g).permute(2, 0, 1, 3).reshape(k * H1, nR * Hg * g), None


def _block_sq_norms(x: torch.Tensor) -> torch.Tensor:
    """Squared Frobenius norms [a, b] of the blocks ``x[i, :, j, :]`` of x [a, dh, b, dh]: one pass
    over the products (the bulk of a job's memory traffic), reading them once and writing nothing."""
    return torch.linalg.vector_norm(x, dim=(1, 3)).square_()


def _heads(x: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """Per-head quantities [L, H, ...] of some layers, flattened to [len(layers) H, ...]."""
    x = _layer_slice(x, layers)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def tile_spectra(f: HeadFactors, comp: Comp, writers: list[int],
                 readers: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(writer norms, writer spectra, reader norms, reader spectra) of a tile's heads, flattened."""
    return (_heads(f.writer_norm, writers), _heads(f.writer_sv, writers),
            _heads(f.reader_norm[comp], readers), _heads(f.reader_sv[comp], readers))


def sandwich_sq_norms(core: torch.Tensor, s: Sandwich, comp: Comp, writers: list[int], readers: list[int]) -> torch.Tensor:
    """Squared norms [k H1, nR H2] of another family's cores from a tile's base products ``core``
    [k H1 dh, nR Hg dh] (``tile_sq_norms(..., keep=True)``): two d_head-long products, each
    d_head / d_model of the base GEMM's FLOPs."""
    left, right = _heads(s.left, writers), _heads(s.right[comp], readers)  # [k H1, dh, dh], [nR Hg, dh, g dh]
    kH1, dh = left.shape[:2]
    nRHg, g = right.shape[0], right.shape[2] // dh
    x = (left @ core.view(kH1, dh, nRHg * dh)).view(kH1 * dh, nRHg, dh).transpose(0, 1)  # [nR Hg, k H1 dh, dh]
    sq = _block_sq_norms((x @ right).view(nRHg * kH1, dh, g, dh))  # [nR Hg k H1, g]
    return sq.view(nRHg, kH1, g).transpose(0, 1).reshape(kH1, nRHg * g)


def score_tiles(jf: JobFactors, metrics: tuple[Metric, ...], pairs: list[tuple[int, int]], nulls: Nulls | None,
                dtype: ScoreDtype, clock: JobClock, tile_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores and spectrum nulls of every head pair of ``pairs`` (local layer indices) and the
    Gaussian baselines, on the factors' device (``nulls=None``: the scores alone, the nulls' places
    left unset: the kernel alone, as the benchmark times it). A sandwiched family's cores come
    from the base's GEMM (``job_factors``), so the d_model-long GEMMs run once per comp.

    Returns ``block`` [len(metrics), 3 comps, 3 (score, spectrum mean, spectrum std), len(pairs), H, H]
    and ``gauss`` [len(metrics), 3 comps, 2 (mean, std)]."""
    f = jf.f
    ref = next(iter(f.values())).writer_sv  # [L, H, dh]
    dev, H, dh = ref.device, ref.shape[1], ref.shape[2]
    block = torch.empty(len(metrics), len(COMPS), 3, len(pairs), H, H, dtype=ref.dtype, device=dev)
    gauss = torch.empty(len(metrics), len(COMPS), 2, dtype=ref.dtype, device=dev)
    families: dict[Metric, list[int]] = defaultdict(list)  # family -> indices into metrics
    for i, m in enumerate(metrics):
        families[factor_family(m)].append(i)
    def small() -> AbstractContextManager[None]:  # runtime.one_thread: small ops pay a thread hand-off
        return one_thread_on(dev)
    tile_bytes = tile_bytes or default_tile_bytes(dev)
    # a head pair's core (a shared absorb's post products take as much again, beside it)
    tiles = plan_tiles(pairs, dh * dh * ref.element_size(), H, tile_bytes, dev)
    with clock.phase("factors"):  # the GEMM's operands at the job's precision, rounded once
        ops = {fam: gemm_operands(f[fam], dtype) for fam in jf.direct}
    if nulls is not None:
        with clock.phase("nulls"):
            for fam, idx in families.items():
                g = gaussian_baselines(nulls.gaussian, fam, [metrics[i] for i in idx],
                                       lambda f: tile_sq_norms(f, gemm_operands(f, dtype), "Q", [0], [1], dtype)[0],
                                       small)
                gauss[idx] = g[:, None, :].expand(len(idx), len(COMPS), 2)
    for c_i, c in enumerate(COMPS):
        for t in tiles:
            with clock.phase("gemms"):
                sq, core = {}, None
                for fam in ops:
                    sq[fam], core = tile_sq_norms(f[fam], ops[fam], c, t.writers, t.readers, dtype, keep=bool(jf.sand))
                for fam, sw in jf.sand.items():
                    assert core is not None  # a sandwiched family has a base, whose GEMM above kept its product
                    sq[fam] = sandwich_sq_norms(core, sw, c, t.writers, t.readers)
                del core
            for fam, idx in families.items():
                spectra = tile_spectra(f[fam], c, t.writers, t.readers)
                shape = (len(t.writers), H, len(t.readers), H)
                for i in idx:
                    with clock.phase("scores"), small():
                        s = normalised_score(metrics[i], sq[fam], pair_denominator(metrics[i], *spectra)).view(shape)
                        block[i, c_i, 0, t.pos] = s[t.wi, :, t.ri, :]
                    if nulls is not None:
                        with clock.phase("nulls"), small():
                            for j, x in enumerate(spectrum_baseline(metrics[i], *spectra, nulls.P2[metrics[i], c])):
                                block[i, c_i, 1 + j, t.pos] = x.view(shape)[t.wi, :, t.ri, :]
    return block, gauss


def default_tile_bytes(dev: torch.device) -> int:
    """How much one tile's products may take: a share of the GPU's free memory, or the CPU's cache-sized tile."""
    if dev.type != "cuda":
        return CPU_TILE_BYTES
    free, _ = torch.cuda.mem_get_info(dev)
    return int(min(free * GPU_TILE_SHARE, GPU_TILE_MAX))

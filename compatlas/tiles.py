"""Composition jobs as tiles of the layer grid: which layer pairs each of a model's ``blocks`` jobs scores.

The scored layers ``l_0 < ... < l_{L-1}`` make an L x L grid of (writer, reader) layer pairs:
the causal pairs (writer < reader) above the diagonal, their mirrors (reader < writer, the null
of ``calibration``) below it, the same-layer pairs (l, l) on it. A job pays once per layer it
touches (reading the layer, factoring its heads: ``table.score_space`` factors only those) and
once per pair it scores, so a job should score many pairs of few layers.

- **Groups.** The layers are cut into g contiguous groups ``G_0, ..., G_{g-1}`` (by position in
  the scored list), sizes differing by at most one, the larger first: ``|G_i| = ceil(L / g)`` for
  ``i < L mod g``, else ``floor(L / g)``.
- **Tiles.** Tile (i, j), i <= j, holds the causal pairs (a, b) with a in G_i, b in G_j and a < b,
  their mirrors (b, a), and for a diagonal tile (i, i) also the same-layer pairs (l, l) of G_i.
  Off the diagonal that is ``|G_i| |G_j|`` causal pairs, on it ``|G_i| (|G_i| - 1) / 2`` causal
  and ``|G_i|`` same-layer ones. Every causal, mirrored and same-layer pair lies in exactly one
  of the ``g (g + 1) / 2`` tiles, and a tile touches the layers of its one or two groups only:
  ``|G_i| + |G_j| <= 2 ceil(L / g)`` layers, against the whole model's L.
- **Jobs.** For ``blocks`` = B jobs, g is the smallest with ``g (g + 1) / 2 >= B`` (and at most
  L, so that no group is empty). The tiles, row-major ((0, 0), (0, 1), ..., (0, g-1), (1, 1), ...),
  are cut into B contiguous runs balanced by the layer pairs they score (causal, mirrored and
  same-layer: each one GEMM of the same shape): cut k (k = 1 .. B-1) falls where the cumulative
  pair count is nearest ``k / B`` of the total, every run keeping at least one tile. B > T (T the
  number of tiles, only when B > L (L + 1) / 2) leaves the last B - T jobs empty. A job touches
  the layers of its tiles' groups; within a row a run of tiles touches G_i and a range of
  reader groups.
- **B = 1** is one tile, (0, 0) with G_0 every layer: every causal pair in writer-then-reader order
  (``layer_pairs``), then the mirrors in the same order and the same-layer pairs in layer order,
  as the composition job has always scored a whole model.

Within a job the causal pairs are sorted by writer, then reader (a writer's readers together, as
the job's GEMMs take them), the null pairs are their mirrors in that order followed by the job's
same-layer pairs in layer order. (These tiles of the layer grid are jobs; ``composition.job``'s
tiles are the GEMMs inside one job, writer layers stacked.)

``blocks: auto`` (``auto_blocks``): the fewest jobs whose largest fits ``composition.job_memory_gb``,
a job holding about its touched layers' float32 attention weights, their per-head factors (about as
much again) and one tile of products (``job_bytes``).

The module is plain Python (no torch), at the shared bottom: the plan (``compatlas.plan``) uses it
to resolve ``blocks: auto`` while Snakemake parses the workflow, the composition job
(``compatlas.composition.scores`` re-exports ``block_pairs``, ``null_pairs``) to pick its pairs.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

Pair = tuple[int, int]


def grid_size(blocks: int, n_layers: int) -> int:
    """g: the smallest with ``g (g + 1) / 2 >= blocks``, at most ``n_layers`` (at least 1)."""
    if blocks < 1:
        raise ValueError(f"blocks must be a positive integer, not {blocks!r}")
    g = math.ceil((math.sqrt(8 * blocks + 1) - 1) / 2)
    while g * (g + 1) // 2 < blocks:  # float rounding, either way
        g += 1
    while g > 1 and (g - 1) * g // 2 >= blocks:
        g -= 1
    return max(1, min(g, n_layers))


def group_bounds(n_layers: int, g: int) -> list[tuple[int, int]]:
    """[start, stop) positions of g contiguous groups of n_layers, the larger ones first."""
    size, extra = divmod(n_layers, g)
    bounds, start = [], 0
    for i in range(g):
        stop = start + size + (i < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def grid_tiles(g: int) -> list[tuple[int, int]]:
    """The tiles (i, j), i <= j, row-major."""
    return [(i, j) for i in range(g) for j in range(i, g)]


def tile_weight(sizes: Sequence[int], tile: tuple[int, int]) -> int:
    """Layer pairs a tile scores: its causal pairs, as many mirrors, and its same-layer pairs."""
    i, j = tile
    if i == j:
        return sizes[i] * (sizes[i] - 1) + sizes[i]
    return 2 * sizes[i] * sizes[j]


def balanced_runs(weights: Sequence[int], blocks: int) -> list[tuple[int, int]]:
    """[start, stop) of ``blocks`` contiguous runs of the items: cut k where the cumulative weight
    is nearest ``k / blocks`` of the total (ties: the earlier cut), every run non-empty while
    there are items for it; past ``len(weights)`` runs the rest are empty."""
    T = len(weights)
    if blocks >= T:
        return [(t, t + 1) for t in range(T)] + [(T, T)] * (blocks - T)
    cum = [0]
    for x in weights:
        cum.append(cum[-1] + x)
    total, cuts = cum[-1], [0]
    for k in range(1, blocks):
        lo, hi = cuts[-1] + 1, T - (blocks - k)  # a tile for this run, one for each of the later ones
        target = k * total / blocks
        c = min(max(bisect_left(cum, target, lo, hi + 1), lo), hi)  # first cut at or past the target
        if c > lo and target - cum[c - 1] <= cum[c] - target:
            c -= 1
        cuts.append(c)
    cuts.append(T)
    return list(pairwise(cuts))


@dataclass(frozen=True)
class Tiling:
    """How ``blocks`` jobs cut a model's n_layers scored layers (positions 0..n_layers-1): the
    groups' [start, stop) positions, the tiles row-major and each job's [start, stop) run of tiles."""

    n_layers: int
    blocks: int
    groups: tuple[tuple[int, int], ...]
    tiles: tuple[tuple[int, int], ...]
    runs: tuple[tuple[int, int], ...]

    def job_tiles(self, block: int) -> tuple[tuple[int, int], ...]:
        if not 0 <= block < self.blocks:
            raise ValueError(f"block {block} out of range for {self.blocks} blocks")
        a, b = self.runs[block]
        return self.tiles[a:b]

    def job_groups(self, block: int) -> list[int]:
        """The groups a job's tiles touch, in order."""
        return sorted({g for tile in self.job_tiles(block) for g in tile})

    def job_layer_count(self, block: int) -> int:
        """How many layers a job touches (reads and factors)."""
        return sum(self.groups[g][1] - self.groups[g][0] for g in self.job_groups(block))

    def job_pair_count(self, block: int) -> int:
        """How many layer pairs a job scores (causal, mirrored and same-layer)."""
        sizes = [b - a for a, b in self.groups]
        return sum(tile_weight(sizes, t) for t in self.job_tiles(block))


def tiling(n_layers: int, blocks: int) -> Tiling:
    """The tiling of n_layers scored layers into ``blocks`` jobs (the module docstring)."""
    if n_layers < 0:
        raise ValueError(f"n_layers must be >= 0, not {n_layers}")
    if n_layers == 0:
        if blocks < 1:
            raise ValueError(f"blocks must be a positive integer, not {blocks!r}")
        return Tiling(0, blocks, (), (), ((0, 0),) * blocks)
    g = grid_size(blocks, n_layers)
    groups = group_bounds(n_layers, g)
    tiles = grid_tiles(g)
    sizes = [b - a for a, b in groups]
    runs = balanced_runs([tile_weight(sizes, t) for t in tiles], blocks)
    return Tiling(n_layers, blocks, tuple(groups), tuple(tiles), tuple(runs))


def layer_pairs(layers: Sequence[int]) -> list[Pair]:
    """All (writer, reader) layer pairs with writer < reader, in order."""
    return [(a, b) for i, a in enumerate(layers) for b in layers[i + 1:]]


def touched_layers(pairs: Sequence[Pair]) -> list[int]:
    """The layers some (writer, reader) layer pairs touch, in order: all a job must read and factor."""
    return sorted({layer for pair in pairs for layer in pair})


def _job(layers: Sequence[int], blocks: int, block: int) -> tuple[list[Pair], list[int]]:
    """A job's causal pairs (writer, then reader) and its same-layer layers (in order)."""
    t = tiling(len(layers), blocks)
    causal: list[Pair] = []
    same: list[int] = []
    for i, j in t.job_tiles(block):
        (a0, a1), (b0, b1) = t.groups[i], t.groups[j]
        causal += [(layers[a], layers[b]) for a in range(a0, a1) for b in range(max(b0, a + 1), b1)]
        if i == j:
            same += [layers[a] for a in range(a0, a1)]
    return sorted(causal), sorted(same)


def block_pairs(layers: Sequence[int], blocks: int, block: int) -> list[Pair]:
    """The causal layer pairs (writer < reader) of job ``block`` out of ``blocks``: those of its
    tiles of the layer grid (the module docstring), writer then reader. ``layers``: the scored
    layers, ascending."""
    return _job(layers, blocks, block)[0]


def null_pairs(layers: Sequence[int], blocks: int, block: int) -> list[Pair]:
    """The (writer, reader) layer pairs of job ``block`` whose heads cannot compose: the reader
    runs before the writer or beside it, so it never sees the writer's output.

    Each causal pair (a, b) of the job is mirrored as (b, a), in the causal pairs' order; then the
    same-layer pairs (l, l) (distinct heads only, see ``calibration``) of its diagonal tiles, in
    layer order. Every mirror and every same-layer pair is in exactly one job, with the causal
    pairs' GEMM shapes."""
    causal, same = _job(layers, blocks, block)
    return [(b, a) for a, b in causal] + [(layer, layer) for layer in same]


def block_layers(layers: Sequence[int], blocks: int, block: int) -> list[int]:
    """The layers job ``block`` touches (its tiles' groups): ``touched_layers`` of its pairs."""
    t = tiling(len(layers), blocks)
    return [layers[p] for g in t.job_groups(block) for p in range(*t.groups[g])]


# ----------------------------------------------------------------------------- blocks: auto


@dataclass(frozen=True)
class Shape:
    """What a job's memory depends on: a model's attention dimensions."""

    n_heads: int
    n_kv_heads: int
    d_model: int
    d_head: int

    @property
    def layer_bytes(self) -> int:
        """One layer's W_Q, W_K, W_V and W_O in float32."""
        return (2 * self.n_heads + 2 * self.n_kv_heads) * self.d_model * self.d_head * 4

    @property
    def tile_bytes(self) -> int:
        """One tile of products at its smallest, one writer layer by one reader layer: the
        [H d_head, H d_head] float32 products, with the post products and their copy beside them (x3)."""
        return 3 * (self.n_heads * self.d_head) ** 2 * 4


def job_bytes(shape: Shape, touched: int) -> int:
    """About what one composition job holds: its touched layers' weights in float32, their
    per-head factors (about as much again: emit per query head, absorb per comp) and one tile of products."""
    return 2 * touched * shape.layer_bytes + shape.tile_bytes


def null_bytes(d_model: int, d_head: int, samples: int, n_metrics: int, itemsize: int = 4) -> int:
    """About what one composition job's nulls hold for ``composition.baseline_samples`` = ``samples``:
    the Gaussian baseline's 2 x samples random heads (W_Q, W_K, W_V, W_O), the spectrum null's kept
    [samples, d_head, d_head] draws per metric x comp, and one draw's float64 temporaries."""
    gaussian = 8 * samples * d_model * d_head * itemsize
    spectrum = 3 * n_metrics * samples * d_head**2 * itemsize + 4 * samples * d_head**2 * 8
    return gaussian + spectrum


def auto_blocks(n_layers: int, shape: Shape, budget_bytes: float) -> tuple[int, int]:
    """(blocks, bytes): the fewest jobs whose largest fits ``budget_bytes`` (``job_bytes`` of the
    most layers one job touches), and that job's bytes. 1 when the whole model fits; the finest
    tiling (one group a layer, ``L (L + 1) / 2`` jobs) when nothing does (its bytes then exceed
    the budget: the caller says so).

    Grid by grid: every tile is in some job, so no tiling of g groups does better than its largest
    tile (two groups of ``ceil(L / g)``), which each job gets alone at ``g (g + 1) / 2`` blocks. The
    first g whose largest tile fits holds the answer, among its ``g`` block counts."""
    for g in range(1, max(n_layers, 1) + 1):
        sizes = [b - a for a, b in group_bounds(n_layers, g)] if n_layers else [0]
        largest = max(sizes[i] + (sizes[j] if j != i else 0) for i, j in grid_tiles(len(sizes)))
        if job_bytes(shape, largest) > budget_bytes and g < max(n_layers, 1):
            continue
        for blocks in range(g * (g - 1) // 2 + 1, g * (g + 1) // 2 + 1):
            t = tiling(n_layers, blocks)
            need = job_bytes(shape, max(t.job_layer_count(b) for b in range(blocks)))
            if need <= budget_bytes or blocks == g * (g + 1) // 2:
                return blocks, need
    raise AssertionError("unreachable: the last grid returns")

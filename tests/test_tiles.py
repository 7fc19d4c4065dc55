"""Composition jobs as tiles of the layer grid (``compatlas.tiles``): every causal, mirrored and
same-layer pair in exactly one job for every block count; a job touches only its tiles' groups;
one block is the whole model in the order it has always been scored; ``blocks: auto``."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from compatlas.composition.scores import block_pairs as scores_block_pairs
from compatlas.tiles import (
    Shape,
    auto_blocks,
    block_layers,
    block_pairs,
    grid_size,
    job_bytes,
    layer_pairs,
    null_pairs,
    tiling,
    touched_layers,
)


def test_four_layers_in_three_blocks_by_hand():
    """B = 3: g = 2 (3 tiles), groups [0, 1] and [2, 3]; tiles (0, 0), (0, 1), (1, 1), one a job."""
    layers = [0, 1, 2, 3]
    assert grid_size(3, 4) == 2
    t = tiling(4, 3)
    assert t.groups == ((0, 2), (2, 4)) and t.tiles == ((0, 0), (0, 1), (1, 1)) and t.runs == ((0, 1), (1, 2), (2, 3))
    assert [block_pairs(layers, 3, b) for b in range(3)] == [
        [(0, 1)],                            # (0, 0): within [0, 1]
        [(0, 2), (0, 3), (1, 2), (1, 3)],    # (0, 1): [0, 1] writes, [2, 3] reads
        [(2, 3)],                            # (1, 1): within [2, 3]
    ]
    assert [null_pairs(layers, 3, b) for b in range(3)] == [
        [(1, 0), (0, 0), (1, 1)],
        [(2, 0), (3, 0), (2, 1), (3, 1)],
        [(3, 2), (2, 2), (3, 3)],
    ]
    assert [block_layers(layers, 3, b) for b in range(3)] == [[0, 1], [0, 1, 2, 3], [2, 3]]
    # the same grid over other layer numbers: positions, not values, make the groups
    assert block_pairs([2, 3, 5, 8], 3, 1) == [(2, 5), (2, 8), (3, 5), (3, 8)]
    assert null_pairs([2, 3, 5, 8], 3, 2) == [(8, 5), (5, 5), (8, 8)]


def test_tiles_are_merged_into_runs_balanced_by_pairs():
    """B = 2 on 4 layers: g = 2, tiles of 4, 8 and 4 pairs (causal, mirrored, same-layer): half of
    16 lies as near a cut after (0, 0) as after (0, 1), and the tie goes to the earlier cut."""
    t = tiling(4, 2)
    assert t.tiles == ((0, 0), (0, 1), (1, 1)) and t.runs == ((0, 1), (1, 3))
    assert [t.job_pair_count(b) for b in range(2)] == [4, 12]
    assert block_pairs([0, 1, 2, 3], 2, 1) == [(0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    # 6 layers in 5 blocks: g = 3, groups of 2, tiles of 4, 8, 8, 4, 8 and 4 pairs (cumulative 4, 12,
    # 20, 24, 32, 36); the cuts nearest 7.2, 14.4, 21.6 and 28.8 of them: only (1, 1) and (1, 2) share a job
    t = tiling(6, 5)
    assert t.runs == ((0, 1), (1, 2), (2, 3), (3, 5), (5, 6))
    assert [t.job_pair_count(b) for b in range(5)] == [4, 8, 8, 12, 4]
    # 80 layers in 105 blocks: g = 14, one tile a job, at most two groups of 6 layers
    t = tiling(80, 105)
    assert len(t.groups) == 14 and all(b - a == 1 for a, b in t.runs)
    assert max(t.job_layer_count(b) for b in range(105)) == 12


def test_one_block_is_the_whole_model_in_its_old_order():
    for layers in ([], [4], [0, 1], list(range(7)), [2, 3, 5, 8]):
        assert block_pairs(layers, 1, 0) == layer_pairs(layers)
        assert null_pairs(layers, 1, 0) == [(b, a) for a, b in layer_pairs(layers)] + [(x, x) for x in layers]
    assert scores_block_pairs is block_pairs  # composition.scores re-exports the tiling


def layer_sets() -> list[list[int]]:
    rng = random.Random(0)
    sets = [list(range(L)) for L in range(0, 10)] + [[2, 3, 5, 8], [7], [1, 4]]
    sets += [sorted(rng.sample(range(40), k)) for k in (5, 11, 13, 17)]
    return sets


@pytest.mark.parametrize("layers", layer_sets(), ids=lambda x: f"{len(x)}layers")
def test_every_pair_is_in_exactly_one_block(layers):
    L = len(layers)
    causal = layer_pairs(layers)
    nulls = [(b, a) for a, b in causal] + [(x, x) for x in layers]
    n_tiles = max(L * (L + 1) // 2, 1 if L else 0)
    for B in sorted({1, 2, 3, 4, 5, 7, 8, 16, 31, len(causal), len(causal) + 1, n_tiles, n_tiles + 3} - {0}):
        jobs = [(block_pairs(layers, B, b), null_pairs(layers, B, b)) for b in range(B)]
        got_c = Counter(p for c, _ in jobs for p in c)
        got_n = Counter(p for _, n in jobs for p in n)
        assert got_c == Counter(causal) and max(got_c.values(), default=1) == 1, (L, B)
        assert got_n == Counter(nulls) and max(got_n.values(), default=1) == 1, (L, B)
        t = tiling(L, B)
        for b, (c, n) in enumerate(jobs):
            assert c == sorted(c) and all(x < y for x, y in c)
            assert n[:len(c)] == [(y, x) for x, y in c] and all(x == y for x, y in n[len(c):])  # mirrors, then same-layer
            # a job touches the layers of its tiles' groups and no other
            assert touched_layers(c + n) == block_layers(layers, B, b), (L, B, b)
            assert len(block_layers(layers, B, b)) == t.job_layer_count(b)
            assert len(c) + len(n) == t.job_pair_count(b)
        empty = sum(not (c or n) for c, n in jobs)
        assert empty == max(0, B - len(t.tiles)), (L, B)  # empty only past the tiles
        if L:
            assert len(t.tiles) == min(grid_size(B, L) * (grid_size(B, L) + 1) // 2, n_tiles)


def test_grid_size_is_the_smallest_that_has_enough_tiles():
    for B in range(1, 400):
        g = grid_size(B, 10**6)
        assert g * (g + 1) // 2 >= B > (g - 1) * g // 2
    assert grid_size(100, 4) == 4  # at most one group a layer
    with pytest.raises(ValueError, match="positive"):
        grid_size(0, 4)


def test_blocks_cut_the_layers_a_job_touches():
    """The old contiguous shares of the pair list touched nearly every layer in every job (80
    layers, 8 blocks: 488 layers read and factored in all, 80 by the largest job; 64 blocks: 2888
    and 53); tiles touch the groups of their tiles (8 blocks: g = 4, groups of 20)."""
    layers = list(range(80))
    t = tiling(80, 8)
    assert all(b - a == 20 for a, b in t.groups)
    touched = [len(block_layers(layers, 8, b)) for b in range(8)]
    assert touched == [20, 40, 40, 60, 40, 40, 20, 40] and sum(touched) == 300
    touched = [len(block_layers(layers, 64, b)) for b in range(64)]
    assert sum(touched) == 873 and max(touched) == 21


LLAMA_70B = Shape(n_heads=64, n_kv_heads=8, d_model=8192, d_head=128)


def test_auto_blocks_is_the_fewest_whose_jobs_fit():
    tiny = Shape(n_heads=8, n_kv_heads=2, d_model=128, d_head=16)
    assert auto_blocks(4, tiny, 16e9) == (1, job_bytes(tiny, 4))
    assert LLAMA_70B.layer_bytes == 603_979_776  # 144 heads' d_model x d_head float32 matrices
    for L, gb in ((12, 8), (12, 5), (20, 10), (80, 16)):
        budget = gb * 1e9
        blocks, need = auto_blocks(L, LLAMA_70B, budget)

        def worst(B: int) -> int:
            t = tiling(L, B)
            return job_bytes(LLAMA_70B, max(t.job_layer_count(b) for b in range(B)))

        assert need == worst(blocks) <= budget, (L, gb)
        if L <= 20:  # brute force: no fewer blocks fit
            assert all(worst(B) > budget for B in range(1, blocks)), (L, gb)
    assert auto_blocks(80, LLAMA_70B, 16e9)[0] == 104  # at most 12 layers a job
    assert auto_blocks(80, LLAMA_70B, 200e9)[0] == 1
    blocks, need = auto_blocks(6, LLAMA_70B, 1e9)  # nothing fits: the finest tiling, and its bytes
    assert blocks == 21 and need > 1e9


def test_the_blocks_benchmark_runs_at_a_tiny_shape(tmp_path, capsys):
    """``benchmarks/bench_blocks.py`` on a tiny shape (its times mean nothing): both schemes score
    the same pairs as the one job, and every figure is there."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_blocks.py"
    spec = importlib.util.spec_from_file_location("bench_blocks", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--shape", "tiny", "--layers", "5", "--blocks", "8", "--metrics", "frobenius,subspace",
                "--json", str(tmp_path / "r.json")])
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["layer_pairs"] == 25 and r["one_job_s"] > 0 and r["floor"]["s"] > 0
    for scheme in ("tiles", "contiguous"):
        rows = r["schemes"][scheme]["rows"]
        assert len(rows) == 8 and sum(x["pairs"] for x in rows) == 25 and r["schemes"][scheme]["ratio"] > 0
    out = capsys.readouterr().out
    assert "tiles      B=8: sum" in out and "contiguous B=8: sum" in out and "x the fp32 floor" in out

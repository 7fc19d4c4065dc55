"""Which edges exact patching measures (``compatlas.function.edge_measure``): a random draw
stratified over |attribution| and over a composition score, so that patching can disagree with
both (a sample of one method's top edges agrees with that method by construction), and beside it
the top edges of each method and of the composition score, so that patching reaches the edges
that carry the function (``eap_vs_exact`` ranks on the draw and checks the top edge on both)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from compatlas.function.edge_attribution import Edge
from compatlas.runtime import stable_seed
from compatlas.vocab import COMPS, Comp


def exact_sample(attribution: dict[Comp, torch.Tensor], composition: dict[Comp, torch.Tensor] | None,
                 edges: Sequence[Edge], per_comp: int, seed: int) -> list[Edge]:
    """The edges exact patching measures, per comp: a sample stratified over |attribution| and over a
    composition score, so that patching can disagree with both (a sample of one method's top edges
    agrees with that method by construction). ``attribution`` and ``composition``: comp ->
    [L, H, L, width] (writer layer, writer head, reader layer, reader unit; NaN: no score, ranked
    lowest); ``composition`` None stratifies over |attribution| alone. Each variable is cut at its
    50th and 90th percentile (the bulk, the upper tail, the top tenth), giving up to 3 x 3 cells;
    ``per_comp`` edges are spread over the non-empty cells as evenly as they allow and drawn at
    random (seeded) inside each; every edge of a comp with no more than ``per_comp``."""
    chosen: list[Edge] = []
    for c in COMPS:
        mine = [e for e in edges if e.comp == c]
        if len(mine) <= per_comp:
            chosen += mine
            continue

        def strata(t: torch.Tensor | None) -> torch.Tensor:
            if t is None:
                return torch.zeros(len(mine), dtype=torch.long)
            v = torch.tensor([t[e.writer_layer, e.writer_head, e.reader_layer, e.reader_index].item() for e in mine],
                             dtype=torch.float64)
            v = torch.nan_to_num(v, nan=-math.inf)
            cuts = torch.quantile(v[torch.isfinite(v)], torch.tensor([0.5, 0.9], dtype=torch.float64)) \
                if torch.isfinite(v).any() else torch.zeros(2, dtype=torch.float64)
            return torch.bucketize(v, cuts)  # how many cuts lie strictly below

        cell = strata(attribution[c].abs()) * 3 + strata(None if composition is None else composition[c])
        gen = torch.Generator().manual_seed(stable_seed(seed, "exact_sample", c))
        members = {k: [i for i in torch.randperm(len(mine), generator=gen).tolist() if int(cell[i]) == k]
                   for k in sorted(set(cell.tolist()))}
        picked: list[int] = []
        while len(picked) < per_comp:  # round robin over the cells: as even as their sizes allow
            for k in members:
                if members[k] and len(picked) < per_comp:
                    picked.append(members[k].pop(0))
        chosen += [mine[i] for i in sorted(picked)]
    return chosen


def top_edges(grids: Sequence[dict[Comp, torch.Tensor]], edges: Sequence[Edge], top: int,
              drawn: Sequence[Edge] = ()) -> list[Edge]:
    """The edges exact patching adds to the stratified draw so that it reaches what matters: per comp,
    the ``top`` largest edges of each grid (comp -> [L, H, L, width]; an attribution's |score|, a
    composition score; NaN ranked lowest, ties by edge order), those not ``drawn`` already, in edge
    order. A draw alone gives the top stratum a few random edges: SmolLM2's largest K edge by EAP,
    the circuit edge 16.0 -> KV 18.2, went unpatched."""
    if top <= 0:
        return []
    have, added = set(drawn), []
    for c in COMPS:
        mine = [e for e in edges if e.comp == c]
        for grid in grids:
            if c not in grid or not mine:
                continue
            v = torch.tensor([grid[c][e.writer_layer, e.writer_head, e.reader_layer, e.reader_index].item() for e in mine],
                             dtype=torch.float64)
            order = torch.argsort(torch.nan_to_num(v, nan=-math.inf), descending=True, stable=True)
            for i in order[:top].tolist():
                if mine[i] not in have:
                    have.add(mine[i])
                    added.append(mine[i])
    index = {e: i for i, e in enumerate(edges)}
    return sorted(added, key=index.__getitem__)

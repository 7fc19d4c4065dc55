"""Edge attribution (EAP, EAP exact through the reader's attention, EAP-IG, exact edge patching)
on a model with a planted circuit and on random grouped-query models.

The planted model is test_induction's hand-set circuit (0.0 an exact previous-token head, 1.0
an induction head reading 0.0's output with its keys) with soft attention (logits of about 2
rather than 30): a saturated softmax has no gradient, so EAP cannot see an edge there (it is a
first-order method; exact patching can, and the module says so). The edge 0.0 -> 1.0 K carries
the task by construction: it must come first by EAP and by exact patching."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
import torch
from conftest import tiny_hf_model
from test_induction import V, induction_model

from compatlas.behaviour.sequences import TokenSet
from compatlas.function.edge_attribution import (
    InductionTask,
    attribution_scores,
    causal_edges,
    exact_scores,
    induction_task,
)
from compatlas.function.edge_measure import attribute_edges
from compatlas.function.exact_sample import exact_sample, top_edges
from compatlas.models.loading import boot
from compatlas.models.small_models import word_tokenizer
from compatlas.tables import EDGE_ATTRIBUTION_SCHEMA

pytestmark = pytest.mark.usefixtures("one_torch_thread")

POOL = TokenSet(pool=torch.arange(V))
SETTINGS = {"sequences": 12, "length": 10, "batch_size": 48, "methods": ["eap", "eap_ig"], "steps": 4,
            "exact_edges": 8, "exact_sequences": 12}  # 8 per comp covers every edge of a 2 x 2-head model


def planted_model(folder, sharp: float = 0.2):
    """test_induction.induction_model's circuit with attention logits scaled by ``sharp``."""
    return induction_model(folder, sharp=sharp)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    return planted_model(tmp_path_factory.mktemp("planted"))


def random_gqa(folder, dtype: torch.dtype):
    """A random Llama-style model, 3 layers, 4 query / 2 KV heads (seed 0), booted in ``dtype``."""
    torch.manual_seed(0)
    tiny_hf_model("llama-gqa", V).save_pretrained(folder)
    word_tokenizer(V, folder)
    bridge, _ = boot({"source": {"kind": "local", "path": str(folder)}}, None, folder, dtype=dtype)
    return bridge.eval()


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    """``random_gqa`` in float64 (finite differences)."""
    return random_gqa(tmp_path_factory.mktemp("gqa"), torch.float64)


def test_task_layout_by_hand():
    task = induction_task(TokenSet(pool=torch.arange(4, 40), bos=1), sequences=3, length=5, seed=0)
    assert task.clean.shape == task.corrupt.shape == (3, 11)
    assert (task.clean[:, 0] == 1).all() and (task.corrupt[:, 0] == 1).all()
    assert torch.equal(task.clean[:, 1:6], task.clean[:, 6:11])  # the span, repeated
    assert task.positions.tolist() == [6, 7, 8, 9]  # the second copy's r_1..r_4 predict r_2..r_5
    assert torch.equal(task.targets, task.clean[:, 2:6])
    # the corruption resamples both copies: no repeat left
    assert not torch.equal(task.corrupt[:, 1:6], task.corrupt[:, 6:11])
    assert (task.corrupt[:, 1:] != task.clean[:, 1:]).float().mean() > 0.8


@pytest.fixture(scope="module")
def planted_table(planted):
    table, facts = attribute_edges(planted, POOL, SETTINGS, seed=0)
    return table, facts


def test_planted_k_edge_ranks_first_by_eap_and_exact(planted_table):
    table, facts = planted_table
    assert facts["edges"] == facts["exact_edges"] == 12  # 2 writers x 2 readers x 3 comps, all patched
    assert table.columns == [c for c in EDGE_ATTRIBUTION_SCHEMA if c not in ("model", "checkpoint")]
    for method in ("eap", "eap_ig"):
        rows = table.filter(pl.col("method") == method)
        top = rows.sort(pl.col("score").abs(), descending=True).row(0, named=True)
        assert (top["comp"], top["writer_layer"], top["writer_head"], top["reader_layer"], top["reader_head"]) \
            == ("K", 0, 0, 1, 0), method
        assert top["score"] < 0  # patching it in removes induction
    rows = table.filter(pl.col("method") == "eap")
    top = rows.sort(pl.col("exact").abs(), descending=True).row(0, named=True)
    assert (top["comp"], top["writer_head"], top["reader_head"]) == ("K", 0, 0)
    assert top["exact"] < -0.5 and top["exact_stderr"] < 0.1 * abs(top["exact"])
    # on this edge the first-order estimate is close to the patched value (soft attention)
    assert top["score"] == pytest.approx(top["exact"], rel=0.1)
    second = rows.sort(pl.col("exact").abs(), descending=True).row(1, named=True)
    assert abs(second["exact"]) < 0.05 * abs(top["exact"])


def _copy_only(task: InductionTask, which: int) -> InductionTask:
    """The task with only the first (0) or second (1) copy corrupted (the alternatives)."""
    o = task.clean.shape[1] // 2
    parts = (task.corrupt[:, :o], task.clean[:, o:]) if which == 0 else (task.clean[:, :o], task.corrupt[:, o:])
    return InductionTask(task.clean, torch.cat(parts, 1), task.positions, task.targets)


def test_corruption_reaches_q_k_and_v(gqa, planted):
    """Resampling both copies gives every comp at least the attribution that corrupting either copy
    alone gives, and on the planted circuit the K edge all of it: corrupting the second copy alone
    leaves the keys unchanged (its K edge gets almost nothing), as the module docstring says."""
    task = induction_task(POOL, 6, 8, seed=1)
    total = {name: {c: s.mean(0).abs().sum().item() for c, s in attribution_scores(gqa, t, "eap", batch_size=6).items()}
             for name, t in (("both", task), ("first", _copy_only(task, 0)), ("second", _copy_only(task, 1)))}
    for c in ("Q", "K", "V"):
        assert total["both"][c] > 0.9 * max(total["first"][c], total["second"][c]) > 0, (c, total)
    assert total["second"]["K"] < 0.3 * total["both"]["K"]
    ours = induction_task(POOL, 8, 10, seed=2)
    k_ours = attribution_scores(planted, ours, "eap", batch_size=8)["K"].mean(0)[0, 0, 1, 0]
    k_second = attribution_scores(planted, _copy_only(ours, 1), "eap", batch_size=8)["K"].mean(0)[0, 0, 1, 0]
    assert abs(k_second) < 0.05 * abs(k_ours)


def test_eap_is_the_first_order_term_of_edge_patching(gqa):
    """EAP = d/dt M(x_v + t (a_u(corrupt) - a_u(clean))) at t = 0, for every edge (Q into query
    heads, K/V into the 2 KV heads): a central finite difference of exact patching agrees."""
    task = induction_task(POOL, 4, 6, seed=3)
    edges = causal_edges(gqa)
    assert len(edges) == 4 * (4 + 8) + 2 * (4 + 8) * 2  # Q: 4 query heads, K/V: 2 KV heads, per reader layer 1, 2
    eap = attribution_scores(gqa, task, "eap", batch_size=4)
    eps = 1e-2  # central: the error is third order; Llama's RMSNorm computes in float32 whatever the dtype
    fd = (exact_scores(gqa, task, edges, batch_size=64, scale=eps)
          - exact_scores(gqa, task, edges, batch_size=64, scale=-eps)).mean(1) / (2 * eps)
    est = torch.tensor([eap[e.comp].mean(0)[e.writer_layer, e.writer_head, e.reader_layer, e.reader_index].item()
                        for e in edges], dtype=torch.float64)
    assert est.abs().max() > 1e-3
    err = (est - fd).abs()
    print("first order: max |EAP - finite difference| / max |EAP|", (err.max() / est.abs().max()).item())
    assert (err <= 1e-3 * est.abs() + 1e-3 * est.abs().max()).all()


def test_eap_scores_are_direct_sums_over_causal_edges_in_any_chunking(tmp_path, monkeypatch):
    """Each edge's EAP score is sum over positions and d_model of delta_u * dM/dx_v (summed here
    directly from the same deltas and gradients, in float64), and every non-causal entry (writer
    layer >= reader layer) is 0, however many reader layers share a product (6 layers, 8 readers a
    layer: 1, 2, 3 or all 5 at a time)."""
    from compatlas.function import edge_attribution as ea

    torch.manual_seed(1)
    tiny_hf_model("llama-gqa", V, num_hidden_layers=6).save_pretrained(tmp_path)
    word_tokenizer(V, tmp_path)
    model = boot({"source": {"kind": "local", "path": str(tmp_path)}}, None, tmp_path, dtype=torch.float64)[0].eval()
    L, H, S = model.cfg.n_layers, model.cfg.n_heads, 3
    task = induction_task(POOL, S, 5, seed=1)
    with ea.split_inputs(model):
        z_corrupt, _ = ea._pass(model, task, slice(0, S), corrupt=True)
        clean = ea._gradients(model, task, slice(0, S), None)
    delta = ea._writer_deltas(model, z_corrupt, clean.z).double().view(S, L, H, -1)
    causal = (torch.arange(L)[:, None] < torch.arange(L)[None, :]).double()  # [writer layer, reader layer]
    want = {c: torch.stack([torch.zeros(S, L, H, g[0].shape[2], dtype=torch.float64)] + [
        torch.einsum("swhk,srk->swhr", delta, g[lr - 1].double().transpose(1, 2).flatten(2)) * causal[:, lr, None, None]
        for lr in range(1, L)], 3) for c, g in clean.grads.items()}  # [S, L, H, L, readers]
    assert all(w.abs().max() > 1e-5 for w in want.values())  # Q and K: about 6e-5 on this random model
    for per_product in (1, 16, 24, 1000):
        monkeypatch.setattr(ea, "READERS_PER_PRODUCT", per_product)
        got = attribution_scores(model, task, "eap", batch_size=S)
        for c in want:
            assert torch.allclose(got[c], want[c], rtol=1e-5, atol=1e-6 * want[c].abs().max().item()), (per_product, c)
            assert (got[c].permute(1, 3, 0, 2, 4)[causal == 0] == 0).all()  # writer layer >= reader layer: exactly 0


def test_gqa_rows_share_their_kv_heads_score(gqa):
    table, facts = attribute_edges(gqa, POOL, {**SETTINGS, "sequences": 4, "length": 6, "methods": ["eap"],
                                               "exact_edges": 2, "exact_sequences": 4}, seed=0)
    assert facts["edges"] == 96 and facts["exact_edges"] == 6
    # rows: every causal writer x reader query head per comp (K/V repeated on the group's 2 query heads)
    assert table.height == 3 * (4 * 4 + 8 * 4)
    kv = table.filter(pl.col("comp") != "Q")
    assert (kv["reader_kv_head"] == kv["reader_head"] // 2).all()
    spread = kv.group_by("comp", "writer_layer", "writer_head", "reader_layer", "reader_kv_head").agg(
        pl.col("score").n_unique().alias("n"), pl.len().alias("rows"))
    assert (spread["n"] == 1).all() and (spread["rows"] == 2).all()
    # the exact sample: two edges per comp
    assert table.filter(pl.col("exact").is_not_null()).height == 2 * 1 + 2 * 2 * 2  # Q rows 1 each, K/V 2 each


def test_exact_sample_is_stratified_over_attribution_and_composition():
    """Per comp, the sample covers every cell of |attribution| x composition (cut at their 50th and
    90th percentiles) as evenly as the cells allow, not the top edges of either: an edge with no
    attribution and no composition can be drawn, so patching can disagree with both."""
    L, H = 6, 4  # 15 layer pairs x 4 x 4 = 240 causal edges per comp
    edges = causal_edges_of(L, H)
    gen = torch.Generator().manual_seed(1)
    attribution = {c: torch.randn(L, H, L, H, generator=gen, dtype=torch.float64) for c in "QKV"}
    composition = {c: torch.rand(L, H, L, H, generator=gen, dtype=torch.float64) for c in "QKV"}
    picked = exact_sample(attribution, composition, edges, 36, seed=0)
    assert picked == exact_sample(attribution, composition, edges, 36, seed=0)  # seeded
    assert picked != exact_sample(attribution, composition, edges, 36, seed=1)
    for c in "QKV":
        mine = [e for e in edges if e.comp == c]
        mine_picked = [e for e in picked if e.comp == c]
        assert len(mine_picked) == 36 == len(set(mine_picked))

        def cut(t, es):
            v = torch.tensor([t[e.writer_layer, e.writer_head, e.reader_layer, e.reader_index].item() for e in es],
                             dtype=torch.float64)
            q = torch.quantile(torch.tensor([t[e.writer_layer, e.writer_head, e.reader_layer, e.reader_index].item()
                                             for e in mine], dtype=torch.float64), torch.tensor([0.5, 0.9], dtype=torch.float64))
            return (v > q[0]).long() + (v > q[1]).long()

        cells = cut(attribution[c].abs(), mine_picked) * 3 + cut(composition[c], mine_picked)
        counts = torch.bincount(cells, minlength=9)
        # 9 cells of 240 edges: 4 each, but the top tenth of both holds only a handful (under 4 by
        # chance here), and what it cannot give goes round the other cells: 4 or 5 each
        available = torch.bincount(cut(attribution[c].abs(), mine) * 3 + cut(composition[c], mine), minlength=9)
        assert (counts == torch.where(available < 4, available, counts)).all() and (counts >= 1).all(), counts
        assert ((counts[available >= 5] >= 4) & (counts[available >= 5] <= 5)).all(), (counts, available)
    # without a composition score: the three |attribution| strata, 12 each
    alone = [e for e in exact_sample(attribution, None, edges, 36, seed=0) if e.comp == "K"]
    mine = [e for e in edges if e.comp == "K"]
    mag = torch.tensor([attribution["K"][e.writer_layer, e.writer_head, e.reader_layer, e.reader_index].abs().item()
                        for e in mine], dtype=torch.float64)
    q = torch.quantile(mag, torch.tensor([0.5, 0.9], dtype=torch.float64))
    got = torch.tensor([attribution["K"][e.writer_layer, e.writer_head, e.reader_layer, e.reader_index].abs().item()
                        for e in alone], dtype=torch.float64)
    assert [int(((got > q[0]).long() + (got > q[1]).long() == k).sum()) for k in range(3)] == [12, 12, 12]
    small = [e for e in causal_edges_of(2, 2)]
    assert len(exact_sample({c: torch.zeros(2, 2, 2, 2) for c in "QKV"}, None, small, 36, seed=0)) == len(small)


def test_top_edges_add_each_grids_largest_to_the_draw():
    """Beside the random draw, each grid's top k edges per comp (NaN ranked lowest), those not drawn
    already, once each, in edge order: the draw plus them holds every grid's top k."""
    L, H = 6, 4
    edges = causal_edges_of(L, H)
    gen = torch.Generator().manual_seed(2)
    a = {c: torch.randn(L, H, L, H, generator=gen, dtype=torch.float64) for c in "QKV"}
    b = {c: torch.rand(L, H, L, H, generator=gen, dtype=torch.float64) for c in "QKV"}
    b["K"][0] = math.nan  # writers of layer 0 have no score there: never a top edge of b
    drawn = exact_sample(a, b, edges, 36, seed=0)
    added = top_edges([{c: t.abs() for c, t in a.items()}, b], edges, 5, drawn)
    assert not set(added) & set(drawn) and len(set(added)) == len(added)
    assert added == sorted(added, key=edges.index)
    for c in "QKV":
        mine = [e for e in edges if e.comp == c]
        for grid in ({k: t.abs() for k, t in a.items()}, b):
            def value(e, grid=grid, c=c):
                return grid[c][e.writer_layer, e.writer_head, e.reader_layer, e.reader_index].item()

            top5 = sorted((e for e in mine if not math.isnan(value(e))), key=lambda e: -value(e))[:5]
            assert set(top5) <= set(drawn) | set(added), c
    assert top_edges([a], edges, 0, drawn) == []


def test_the_exact_sample_holds_the_top_edges_and_says_which(gqa):
    """attribute_edges patches the random draw and each method's top |score| edges beside it; the table
    says which (exact_sample), and the facts count both."""
    table, facts = attribute_edges(gqa, POOL, {**SETTINGS, "sequences": 4, "length": 6, "methods": ["eap"],
                                               "exact_edges": 2, "exact_top": 2, "exact_sequences": 4}, seed=0)
    assert facts["exact_random"] == 6 and facts["exact_edges"] == 6 + facts["exact_top"] and facts["exact_top"] > 0
    units = table.with_columns(unit=pl.when(pl.col("comp") == "Q").then(pl.col("reader_head")).otherwise(pl.col("reader_kv_head")))
    units = units.unique(["comp", "writer_layer", "writer_head", "reader_layer", "unit"])
    assert (units["exact"].is_not_null() == units["exact_sample"].is_not_null()).all()
    assert units.filter(pl.col("exact_sample") == "random").height == 6
    assert units.filter(pl.col("exact_sample") == "top").height == facts["exact_top"]
    for c in "QKV":
        top2 = units.filter(pl.col("comp") == c).sort(pl.col("score").abs(), descending=True).head(2)
        assert top2["exact"].is_not_null().all(), c


def causal_edges_of(L: int, H: int):
    class Cfg:
        n_layers, n_heads = L, H

    class M:
        cfg = Cfg()

    return causal_edges(M())


def test_exact_patching_from_the_reader_layer_equals_the_whole_model(gqa):
    """Skipping the blocks below the reader (their clean stream cached) changes nothing."""
    from compatlas.behaviour.block_skip import block_list

    assert block_list(gqa) is not None  # the blocks can be skipped on this model
    task = induction_task(POOL, 3, 6, seed=4)
    edges = causal_edges(gqa)[::5]
    fast = exact_scores(gqa, task, edges, batch_size=12)
    whole = exact_scores(gqa, task, edges, batch_size=12, skip=False)
    assert fast.abs().max() > 1e-4
    assert torch.allclose(fast, whole, rtol=1e-6, atol=1e-9)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Gemma-style attention: one KV head for 4 query heads, QK-norm, sandwich norms, GemmaRMSNorm's 1 + w gain."""
    folder = tmp_path_factory.mktemp("gemma")
    torch.manual_seed(1)
    tiny_hf_model("gemma", V, num_hidden_layers=2).save_pretrained(folder)
    word_tokenizer(V, folder)
    model, _ = boot({"source": {"kind": "local", "path": str(folder)}}, None, folder, dtype=torch.float64)
    return model.eval()


def test_first_order_on_gemma_with_one_kv_head(gemma):
    """Through the bridge's split-QKV hooks on Gemma-style attention, EAP is the derivative of
    edge patching too."""
    model = gemma
    task = induction_task(POOL, 3, 5, seed=5)
    edges = causal_edges(model)
    assert {e.reader_index for e in edges if e.comp != "Q"} == {0} and len(edges) == 4 * 4 + 2 * 4
    eap = attribution_scores(model, task, "eap", batch_size=3)
    eps = 1e-2
    fd = (exact_scores(model, task, edges, batch_size=96, scale=eps)
          - exact_scores(model, task, edges, batch_size=96, scale=-eps)).mean(1) / (2 * eps)
    est = torch.tensor([eap[e.comp].mean(0)[e.writer_layer, e.writer_head, e.reader_layer, e.reader_index].item()
                        for e in edges], dtype=torch.float64)
    assert est.abs().max() > 1e-4
    assert ((est - fd).abs() <= 1e-3 * est.abs() + 1e-3 * est.abs().max()).all()


def test_eap_attn_sees_the_planted_edge_through_saturated_attention(tmp_path):
    """The planted circuit with its attention saturated (logits of about 30): plain EAP's gradient
    is zero there and misses the edge that carries the task; eap_attn (exact through the reader's
    attention) ranks it first, as exact patching does, and agrees with patching on the rest."""
    table, _ = attribute_edges(induction_model(tmp_path), POOL, {**SETTINGS, "methods": ["eap", "eap_attn"]}, seed=0)
    edge = (pl.col("comp") == "K") & (pl.col("writer_head") == 0) & (pl.col("reader_head") == 0)
    for method in ("eap_attn", "exact"):
        rows = table.filter(pl.col("method") == "eap_attn")
        col = "score" if method == "eap_attn" else "exact"
        top = rows.sort(pl.col(col).abs(), descending=True).row(0, named=True)
        assert (top["comp"], top["writer_layer"], top["writer_head"], top["reader_layer"], top["reader_head"]) \
            == ("K", 0, 0, 1, 0), method
        assert top[col] < -0.5
    eap = table.filter((pl.col("method") == "eap") & edge).row(0, named=True)
    print("K 0.0 -> 1.0: exact", eap["exact"], "eap", eap["score"], "eap_attn",
          table.filter((pl.col("method") == "eap_attn") & edge)["score"].item())
    assert eap["score"] > 0.2 * eap["exact"]  # the saturated softmax: EAP gets under a fifth of it, or the wrong sign
    fixed = table.filter(pl.col("method") == "eap_attn")
    assert fixed.select(pl.corr("score", "exact", method="spearman")).item() > 0.9


def _reference_eap_attn(model, task: InductionTask, edges) -> torch.Tensor:
    """eap_attn by brute force, per edge and sequence [E, S]: the whole model run with only the
    reader head's own input shifted by the writer's a_u(corrupt) - a_u(clean), and
    sum over the heads reading it of (z' - z) . dM/dz, dM/dz by autograd on a clean pass."""
    from compatlas.function.edge_attribution import FORK_HOOK, RESID_IN, _metric, _pass, n_kv_heads, split_inputs

    L, H, S = model.cfg.n_layers, model.cfg.n_heads, len(task.clean)
    group = H // n_kv_heads(model)
    out = torch.empty(len(edges), S, dtype=torch.float64)
    with split_inputs(model):
        z_corrupt, _ = _pass(model, task, slice(0, S), corrupt=True)
        z: dict = {}

        def keep(name):
            def hook(x, hook):
                z[name] = x
                return x
            return hook

        with torch.enable_grad():
            m = _metric(model, task.clean, task, slice(0, S), [(RESID_IN, lambda x, hook: x.detach().requires_grad_(True))]
                        + [(f"blocks.{layer}.attn.hook_z", keep(f"blocks.{layer}.attn.hook_z")) for layer in range(L)])
            names = [f"blocks.{layer}.attn.hook_z" for layer in range(L)]
            grads = dict(zip(names, torch.autograd.grad(m.sum(), [z[n] for n in names])))
        W_O = model.W_O.detach()
        for i, e in enumerate(edges):
            name = f"blocks.{e.reader_layer}.attn.hook_z"
            d = (z_corrupt[e.writer_layer][:, :, e.writer_head] - z[f"blocks.{e.writer_layer}.attn.hook_z"][:, :, e.writer_head]
                 ).detach() @ W_O[e.writer_layer, e.writer_head]
            after: dict = {}

            def shift(x, hook, r=e.reader_index, d=d):
                x = x.clone()
                x[:, :, r] += d.to(x.dtype)
                return x

            with torch.no_grad():
                model.run_with_hooks(task.clean, fwd_hooks=[(f"blocks.{e.reader_layer}.attn.{FORK_HOOK[e.comp]}", shift),
                                                            (name, lambda x, hook: after.setdefault("z", x))])
            heads = [e.reader_index] if e.comp == "Q" else list(range(e.reader_index * group, (e.reader_index + 1) * group))
            change = (after["z"] - z[name].detach())[:, :, heads] * grads[name][:, :, heads]
            out[i] = change.sum((1, 2, 3)).double()
    return out


@pytest.mark.parametrize("name", ["gqa", "gemma"])
def test_eap_attn_equals_patching_each_reader_head_alone(name, request, monkeypatch):
    """One reader-layer pass with every head's input shifted at once (the blocks below skipped,
    nothing above run, writers split over several passes) gives, for every edge, what the
    whole model gives with only that head's input shifted: GQA's KV heads (4 query / 2 KV
    heads) and Gemma's (one KV head, QK-norm, sandwich norms) included."""
    import compatlas.function.eap_attn

    model = request.getfixturevalue(name)
    monkeypatch.setattr(compatlas.function.eap_attn, "FORK_BUDGET", 3 * 13 * model.cfg.n_heads * model.cfg.d_model)  # 3 rows: 1 writer
    task = induction_task(POOL, 3, 6, seed=6)
    edges = causal_edges(model)
    fast = attribution_scores(model, task, "eap_attn", batch_size=3)
    got = torch.stack([fast[e.comp][:, e.writer_layer, e.writer_head, e.reader_layer, e.reader_index] for e in edges])
    want = _reference_eap_attn(model, task, edges)
    assert want.abs().max() > 1e-4
    print("max |fast - reference|", (got - want).abs().max().item(), "of", want.abs().max().item())
    # float64 model; Llama's RMSNorm computes in float32 whatever the dtype: 2e-7 of the largest
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


def test_composition_grid_takes_a_kv_groups_largest_score():
    """The exact sample's composition strata: a K/V edge's score is the largest of its KV group's
    query heads' (as composition_vs_function compares them), a Q edge's its own; NaN where none."""
    from compatlas.function.edge_measure import composition_grid

    class Cfg:
        n_layers, n_heads, n_key_value_heads = 2, 4, 2

    class M:
        cfg = Cfg()

    rows = [(c, 0, wh, 1, rh, float(10 * wh + rh)) for c in "QK" for wh in range(4) for rh in range(4)]
    df = pl.DataFrame(rows, schema=["comp", "writer_layer", "writer_head", "reader_layer", "reader_head", "score"],
                      orient="row")
    grid = composition_grid(M(), df)
    assert grid["Q"].shape == (2, 4, 2, 4) and grid["K"].shape == (2, 4, 2, 2)
    assert grid["Q"][0, 2, 1, 3] == 23.0
    assert grid["K"][0, 2, 1, 0] == 21.0 and grid["K"][0, 2, 1, 1] == 23.0  # query heads (0, 1) and (2, 3)
    assert torch.isnan(grid["V"]).all() and torch.isnan(grid["K"][1]).all()
    assert composition_grid(M(), None) is None


def test_edge_table_halves_and_tests_against_scipy():
    """Each edge's split halves are the means over the even and the odd sequences; its p is scipy's
    one-sample t-test; its q is Benjamini-Hochberg over the comp's causal edges, a K/V edge once
    (into its KV head) though its row repeats on each query head of the group."""
    import numpy as np
    from scipy import stats

    from compatlas.function.edge_measure import edge_table
    from compatlas.function.edge_sums import EdgeSums

    class Cfg:
        n_layers, n_heads, n_key_value_heads = 3, 4, 2

    class M:
        cfg = Cfg()

    gen = torch.Generator().manual_seed(3)
    S = 10
    per = {c: torch.randn(S, 3, 4, 3, 4 if c == "Q" else 2, generator=gen, dtype=torch.float64) * 0.5
           + (0.4 if c == "K" else 0.0) for c in "QKV"}
    table = edge_table(M(), {"eap": EdgeSums.of(per)}, [], torch.empty(0, S))
    k = table.filter((pl.col("comp") == "K") & (pl.col("reader_head") % 2 == 0))  # one row per KV-head edge
    x = np.stack([per["K"][:, r["writer_layer"], r["writer_head"], r["reader_layer"], r["reader_kv_head"]].numpy()
                  for r in k.iter_rows(named=True)], 1)
    np.testing.assert_allclose(k["score_half_a"], x[0::2].mean(0))
    np.testing.assert_allclose(k["score_half_b"], x[1::2].mean(0))
    p = stats.ttest_1samp(x, 0.0).pvalue
    np.testing.assert_allclose(k["p_value"], p, rtol=1e-9)
    np.testing.assert_allclose(k["q_value"], stats.false_discovery_control(p, method="bh"), rtol=1e-9)
    assert k.height == (4 + 8) * 2 and (k["q_value"] < 0.05).sum() > 0  # the planted K shift is found


def test_eap_vs_exact_ranks_on_the_draw_and_agrees_on_every_patched_edge():
    """The view's Spearman is over the random draw alone (so that it can still disagree), its top
    edge and top-k overlap over every patched edge; an older shard without exact_sample counts as drawn."""
    import duckdb
    from scipy import stats

    from compatlas.atlas.database import derived_view_sql

    rng = np.random.default_rng(0)
    n = 30
    score = rng.normal(size=n)
    exact = score + rng.normal(size=n)
    kind = ["random"] * 24 + ["top"] * 6
    exact[24:] = -10 - np.arange(6)          # the added top edges: the largest |exact|
    score[24:] = -20 - np.arange(6)          # ... and the largest |score|, in the same order
    con = duckdb.connect()
    rows = pl.DataFrame({"model": "m", "checkpoint": "final", "method": "eap", "comp": "K", "writer_layer": 0,
                         "writer_head": np.arange(n), "reader_layer": 1, "reader_head": 0, "reader_kv_head": 0,
                         "score": score, "exact": exact, "exact_sample": kind})
    con.register("edge_attribution", rows.to_arrow())
    con.execute(derived_view_sql("eap_vs_exact", 0.05, 0.4, 0.4))
    r = con.execute("SELECT n_exact, n_random, n_top, spearman, top_edge_agrees, top_k_overlap, top_exact_edge "
                    "FROM eap_vs_exact").fetchall()[0]
    assert r[:3] == (30, 24, 6)
    assert r[3] == pytest.approx(stats.spearmanr(score[:24], exact[:24])[0], abs=1e-12)
    assert r[4] and r[5] == 1.0 and r[6] == "0.29 -> 1.0"
    old = rows.with_columns(exact_sample=pl.lit(None, dtype=pl.Utf8))
    con.unregister("edge_attribution")
    con.register("edge_attribution", old.to_arrow())
    r = con.execute("SELECT n_random, n_top, spearman FROM eap_vs_exact").fetchall()[0]
    assert r[:2] == (30, 0) and r[2] == pytest.approx(stats.spearmanr(score, exact)[0], abs=1e-12)


def test_a_memory_budget_bounds_the_batch_not_the_scores(gqa):
    """gradient_rows: the batch that fits memory_gb by gradient_bytes (hand-computed here), never
    above batch_size nor below 1; and EAP over batches of 1 gives the scores of batches of 12 (a
    float64 model: to rounding)."""
    from compatlas.function.edge_attribution import gradient_bytes, gradient_rows

    task = induction_task(POOL, sequences=12, length=6, seed=0)
    cfg = gqa.cfg
    per = 2 * 3 * cfg.n_layers * cfg.n_heads * cfg.d_model * task.clean.shape[1] * 4  # the two copies (and BOS, if any)
    assert gradient_bytes(gqa, task) == per
    assert gradient_rows(gqa, task, 12, None) == 12 and gradient_rows(gqa, task, 12, 5 * per / 1e9) == 5
    assert gradient_rows(gqa, task, 3, 5 * per / 1e9) == 3 and gradient_rows(gqa, task, 12, 1e-12) == 1
    settings = {**SETTINGS, "sequences": 12, "length": 6, "methods": ["eap"], "exact_edges": 0, "exact_sequences": 1}
    whole, facts = attribute_edges(gqa, POOL, settings, seed=0)
    ones, facts1 = attribute_edges(gqa, POOL, {**settings, "memory_gb": 1e-12}, seed=0)
    assert facts1["gradient_batch"] == 1 and facts["gradient_batch"] == 12
    assert np.allclose(ones["score"].to_numpy(), whole["score"].to_numpy(), rtol=1e-9, atol=1e-12)


def test_edge_sums_of_shares_merge_into_the_whole():
    """Sums over shares of the sequences (sequence_share: even starts, every sequence once) merge
    into the figures of all of them, checked against numpy on the per-sequence scores: the mean,
    the standard error (ddof 1) and the means over the even and the odd sequences; a frame's rows
    read back are the same sums."""
    from compatlas.function.edge_sums import EdgeSums, sequence_share

    gen = torch.Generator().manual_seed(1)
    S = 23
    per = {c: torch.randn(S, 2, 3, 2, 3, generator=gen, dtype=torch.float64) * 3 + 5 for c in "QKV"}
    for jobs in (1, 2, 3, 5):
        shares = [sequence_share(S, jobs, j) for j in range(jobs)]
        assert [s.start for s in shares] == [0, *[s.stop for s in shares[:-1]]] and shares[-1].stop == S
        assert all(s.start % 2 == 0 and s.stop > s.start for s in shares)
        parts = [EdgeSums.of({c: x[s] for c, x in per.items()}, s.start) for s in shares]
        merged = parts[0]
        for p in parts[1:]:
            merged = merged.merge(p)
        x = per["K"].numpy()
        assert merged.n == S
        np.testing.assert_allclose(merged.mean("K").numpy(), x.mean(0), rtol=1e-13)
        np.testing.assert_allclose(merged.stderr("K").numpy(), x.std(0, ddof=1) / math.sqrt(S), rtol=1e-12)
        a, b = merged.halves("K")
        np.testing.assert_allclose(a.numpy(), x[0::2].mean(0), rtol=1e-13)
        np.testing.assert_allclose(b.numpy(), x[1::2].mean(0), rtol=1e-13)
    shapes = {c: tuple(x.shape[1:]) for c, x in per.items()}
    back = EdgeSums.from_frame(merged.frame("eap"), merged.counts(), shapes)
    assert back.n == merged.n and all(torch.equal(back.m2[c], merged.m2[c]) for c in "QKV")
    with pytest.raises(ValueError, match="each job needs 2 or more"):
        sequence_share(5, 3, 0)


def test_attribution_split_over_jobs_gives_the_one_jobs_table(gqa):
    """attribute_edges on two attribution jobs' shares (attribute_share, one per half of the
    sequences) writes the table of one job over all of them: the same exact sample, and every
    figure to float64 rounding; a share computed with other settings is refused by name."""
    from compatlas.function.edge_measure import attribute_share

    settings = {**SETTINGS, "sequences": 10, "length": 6, "methods": ["eap", "eap_ig"], "exact_edges": 3,
                "exact_sequences": 4}
    whole, _ = attribute_edges(gqa, POOL, settings, seed=0)
    shares = [attribute_share(gqa, POOL, settings, 0, j, 2) for j in range(2)]
    assert [(f["sequences_from"], f["sequences_to"]) for _, f in shares] == [(0, 6), (6, 10)]
    split, facts = attribute_edges(gqa, POOL, settings, seed=0, shares=shares)
    assert facts["attribution_jobs"] == 2
    key = ["method", "comp", "writer_layer", "writer_head", "reader_layer", "reader_head"]
    a, b = whole.sort(key), split.sort(key)
    assert a.select(key, "exact_sample").equals(b.select(key, "exact_sample"))
    for col in ("score", "score_stderr", "score_half_a", "score_half_b", "p_value", "q_value", "exact"):
        np.testing.assert_allclose(b[col].to_numpy().astype(float), a[col].to_numpy().astype(float), rtol=1e-9,
                                   atol=1e-15, equal_nan=True, err_msg=col)
    with pytest.raises(ValueError, match="do not cover"):
        attribute_edges(gqa, POOL, settings, seed=0, shares=shares[:1])


def test_exact_patching_split_over_jobs_gives_the_one_jobs_table(gqa):
    """Exact patching split over jobs (exact_shares.patch_share, each on its share of the exact
    sequences after merging the attribution shares) and stacked by exact_table, on the model's
    shape alone (no model), gives one job's table: the same sample, every figure to float64
    rounding; a job that patched another sample, or missing sequences, is refused."""
    from compatlas.function.edge_attribution import n_kv_heads
    from compatlas.function.edge_measure import attribute_share
    from compatlas.function.exact_shares import ModelShape, exact_rows, exact_table, patch_share

    settings = {**SETTINGS, "sequences": 10, "length": 6, "methods": ["eap"], "exact_edges": 4, "exact_sequences": 5,
                "exact_top": 2}
    whole, facts1 = attribute_edges(gqa, POOL, settings, seed=0)
    shares = [attribute_share(gqa, POOL, settings, 0, j, 2) for j in range(2)]
    parts = [patch_share(gqa, POOL, settings, 0, None, shares, j, 2) for j in range(2)]
    assert [(f["sequences_from"], f["sequences_to"]) for _, f in parts] == [(0, 2), (2, 5)]
    shape = ModelShape(gqa.cfg.n_layers, gqa.cfg.n_heads, n_kv_heads(gqa))
    split, facts = exact_table(shape, settings, 0, None, shares, parts)
    assert facts["exact_jobs"] == 2 and facts["exact_edges"] == facts1["exact_edges"] > 3 * 4
    key = ["method", "comp", "writer_layer", "writer_head", "reader_layer", "reader_head"]
    a, b = whole.sort(key), split.sort(key)
    assert a.select(key, "exact_sample").equals(b.select(key, "exact_sample"))
    assert b["exact"].drop_nulls().len() == a["exact"].drop_nulls().len() > 0
    for col in ("score", "score_stderr", "exact", "exact_stderr"):
        np.testing.assert_allclose(b[col].to_numpy().astype(float), a[col].to_numpy().astype(float), rtol=1e-9,
                                   atol=1e-15, equal_nan=True, err_msg=col)
    other = patch_share(gqa, POOL, settings, 1, None, shares, 1, 2)  # another seed draws another sample
    with pytest.raises(ValueError, match="another sample"):
        exact_table(shape, settings, 0, None, shares, [parts[0], other])
    with pytest.raises(ValueError, match="do not cover"):
        exact_table(shape, settings, 0, None, shares, parts[:1])
    assert [exact_rows(5, 3, j) for j in range(3)] == [slice(0, 1), slice(1, 3), slice(3, 5)]
    # a shard of other settings is refused by name; the attribution shares' check leaves out the exact_* keys
    from compatlas.function.edge_measure import check_share_settings, refuse_other_settings

    with pytest.raises(ValueError, match=r"an exact patching share \(job 1\) was computed with the settings"):
        refuse_other_settings([(None, {"job": 1, "settings": settings})], {**settings, "exact_sequences": 6},
                              "an exact patching share")
    share_settings = {k: v for k, v in settings.items() if not k.startswith("exact_")}
    check_share_settings([(None, {"job": 0, "settings": share_settings})],
                         {"edge_attribution": {**settings, "exact_sequences": 6}})
    with pytest.raises(ValueError, match=r"an attribution share \(job 0\)"):
        check_share_settings([(None, {"job": 0, "settings": share_settings})],
                             {"edge_attribution": {**settings, "length": 7}})
    with pytest.raises(ValueError, match="one or more"):
        exact_rows(2, 3, 0)

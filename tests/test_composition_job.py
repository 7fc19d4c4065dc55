"""The batched, device-resident job (``composition_job``, ``composition_table.score_space``) gives
the per-layer-pair kernel's numbers: every metric, GQA, causal and null pairs, tiles of any size,
on the CPU and (where present) on a GPU; and the precision setting rounds what it says."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch
from conftest import random_weights

from compatlas.composition.nulls import gaussian_baseline, haar_overlap_blocks, spectrum_baseline
from compatlas.composition.precision import gemm_operand, round_tf32
from compatlas.composition.scores import block_pairs, head_factors, layer_pair_scores, null_pairs
from compatlas.composition.table import score_block, score_space
from compatlas.composition.token_space import add_space_factors
from compatlas.runtime import stable_seed
from compatlas.vocab import COMPS, KERNEL_METRICS, NORMALISED_METRICS

KEY = ["comp", "writer_layer", "writer_head", "reader_layer", "reader_head"]
N = 6  # null draws


def reference_table(w, metric, pairs, seed=0, n=N) -> pl.DataFrame:
    """The job's rows from the kernel's per-layer-pair functions, one pair at a time (the path of
    the composition rule before the batched job), in float64."""
    f = head_factors(w, metric)
    d, dh, H = w.d_model, w.d_head, w.n_heads
    rows = []
    for c in COMPS:
        P2 = haar_overlap_blocks(d, dh, n, stable_seed(seed, "spectrum", metric, "residual", c)).pow(2)
        g_mean, g_std = (gaussian_baseline(metric, "Q", d, dh, n, stable_seed(seed, "gaussian", d, dh))  # one law for Q, K, V
                         if metric in NORMALISED_METRICS else (None, None))  # a magnitude has no Gaussian null
        for a, b in pairs:
            s = layer_pair_scores(f, a, [b], c)[0]
            mu, sd = spectrum_baseline(metric, f.writer_norm[a], f.writer_sv[a], f.reader_norm[c][b], f.reader_sv[c][b], P2)
            for h1 in range(H):
                for h2 in range(H):
                    if a != b or h1 != h2:
                        rows.append((c, a, h1, b, h2, float(s[h1, h2]), g_mean, g_std, float(mu[h1, h2]), float(sd[h1, h2])))
    cols = KEY + ["score", "baseline_gaussian_mean", "baseline_gaussian_std", "baseline_spectrum_mean", "baseline_spectrum_std"]
    return pl.DataFrame(rows, schema=cols, orient="row").sort(KEY)


@pytest.fixture(scope="module")
def gqa():
    return random_weights(11, L=4, H=4, Hkv=2, d=24, dh=4, spectrum=0.5, scale=0.5)


@pytest.mark.parametrize("share_cores", [False, True])  # each family's own GEMMs; the sandwich of subspace's
@pytest.mark.parametrize("tile_bytes", [None, 1])  # one tile; one tile per writer and reader layer
def test_score_space_equals_the_per_pair_kernel(gqa, tile_bytes, share_cores):
    layers = list(range(4))
    pairs = block_pairs(layers, 2, 1) + null_pairs(layers, 2, 1)
    tables, facts = score_space(gqa, KERNEL_METRICS, "residual", pairs, baseline_samples=N, device="cpu", dtype="float64",
                                tile_bytes=tile_bytes, share_cores=share_cores)
    assert set(facts["seconds_by_phase"]) >= {"transfer", "factors", "gemms", "scores", "nulls", "table"}
    for metric in KERNEL_METRICS:
        got, want = tables[metric].sort(KEY), reference_table(gqa, metric, pairs)
        assert got.select(KEY).equals(want.select(KEY)), metric
        assert (got["metric"] == metric).all()
        for col in want.columns[len(KEY):]:
            np.testing.assert_allclose(got[col].to_numpy().astype(float), want[col].to_numpy().astype(float),
                                       rtol=1e-10, atol=1e-12, err_msg=f"{metric} {col}")
        if metric == "contribution":  # the score over the reader's own QK / OV norm
            own = head_factors(gqa, "frobenius").reader_norm
            expect = [r["score"] / float(own[r["comp"]][r["reader_layer"], r["reader_head"]]) for r in got.iter_rows(named=True)]
            np.testing.assert_allclose(got["score_share"].to_numpy(), expect, rtol=1e-10)
        else:
            assert got["score_share"].null_count() == got.height


@pytest.mark.parametrize("space", ["residual", "token", "activation"])
def test_a_metrics_float32_numbers_do_not_depend_on_the_metrics_beside_it(gqa, space):
    """The composition rule scores every metric of a space in one job: each metric's rows are bit
    for bit those of a job scoring it alone (what the rule ran before, one job per metric)."""
    from conftest import random_moments

    pairs = block_pairs(list(range(4)), 1, 0) + null_pairs(list(range(4)), 1, 0)
    kw = dict(baseline_samples=N, device="cpu", dtype="float32",
              moments=random_moments(4, 4, 2, 4, 4) if space == "activation" else None)
    tables, _ = score_space(gqa, KERNEL_METRICS, space, pairs, **kw)
    for metric in KERNEL_METRICS:
        assert tables[metric].equals(score_block(gqa, metric, space, pairs, **kw)[0]), metric


def test_float32_job_equals_the_float64_kernel_to_float_tolerance(gqa):
    pairs = block_pairs(list(range(4)), 1, 0) + null_pairs(list(range(4)), 1, 0)
    tables, _ = score_space(gqa, KERNEL_METRICS, "residual", pairs, baseline_samples=N, device="cpu", dtype="float32")
    for metric in KERNEL_METRICS:
        got, want = tables[metric].sort(KEY), reference_table(gqa, metric, pairs)
        scale = want["score"].abs().max()  # contribution is a magnitude: its error relative to its size
        np.testing.assert_allclose(got["score"].to_numpy(), want["score"].to_numpy(), rtol=2e-4, atol=1e-6 * scale)


def test_score_block_is_one_metric_of_score_space_and_keeps_the_row_order(gqa):
    pairs = [(0, 2), (0, 1), (1, 3), (2, 0), (1, 1)]
    kw = dict(baseline_samples=N, device="cpu", dtype="float64")
    one = score_block(gqa, "svd_bound", "residual", pairs, **kw)[0]
    both = score_space(gqa, ("frobenius", "svd_bound"), "residual", pairs, **kw)[0]["svd_bound"]
    assert one.equals(both)
    # rows: writer layer, then comp, then the pairs' order (as the per-layer loop wrote them)
    blocks = one.select("writer_layer", "comp", "reader_layer").unique(maintain_order=True).rows()
    assert blocks[:6] == [(0, "Q", 2), (0, "Q", 1), (0, "K", 2), (0, "K", 1), (0, "V", 2), (0, "V", 1)]
    assert one.filter((pl.col("writer_layer") == 1) & (pl.col("reader_layer") == 1)).height == 3 * 12


def test_token_space_job_equals_one_metric_jobs():
    w = random_weights(2, L=3, H=4, Hkv=2, d=16, dh=4, vocab=64, embed_decades=1.0, meta={"norm_type": "RMS"})
    add_space_factors(w)
    pairs = [(0, 1), (1, 2), (2, 0)]
    kw = dict(baseline_samples=N, device="cpu", dtype="float64")
    tables, facts = score_space(w, KERNEL_METRICS, "token", pairs, **kw)
    for metric in KERNEL_METRICS:  # all three: frobenius and svd_bound from subspace's cores; alone: their own
        one = score_block(w, metric, "token", pairs, **kw)[0]
        assert tables[metric].drop("score", "score_share").equals(one.drop("score", "score_share"))
        for col in ("score", "score_share"):
            np.testing.assert_allclose(tables[metric][col].to_numpy().astype(float), one[col].to_numpy().astype(float),
                                       rtol=1e-9, atol=1e-12)
    assert facts["embedding_dropped"] == 0


def test_round_tf32_keeps_ten_mantissa_bits_rounded_to_nearest():
    x = torch.randn(10_000, dtype=torch.float32) * torch.logspace(-3, 3, 10_000)
    r = round_tf32(x)
    assert (r.view(torch.int32) & ((1 << 13) - 1) == 0).all()
    rel = ((r - x).abs() / x.abs()).max()
    assert rel <= 2.0**-11 and rel > 2.0**-13  # half a unit in the 10th bit, reached
    assert round_tf32(torch.tensor([1 + 2**-11 + 2**-20])).item() == 1 + 2**-10  # above the tie: up
    assert round_tf32(torch.tensor([1 + 2**-12])).item() == 1.0  # below: down
    assert gemm_operand(x, "bf16").equal(x.to(torch.bfloat16).float())


@pytest.mark.parametrize("dtype,tol", [("tf32", 2e-3), ("bf16", 2e-2)])
def test_reduced_precision_scores_stay_near_float32(gqa, dtype, tol):
    pairs = [(0, 1), (1, 2), (2, 3)]
    kw = dict(baseline_samples=N, device="cpu")
    ref = score_space(gqa, KERNEL_METRICS, "residual", pairs, dtype="float32", **kw)[0]
    low = score_space(gqa, KERNEL_METRICS, "residual", pairs, dtype=dtype, **kw)[0]
    for metric in KERNEL_METRICS:
        d = (low[metric]["score"] - ref[metric]["score"]).abs().max() / ref[metric]["score"].abs().max()
        assert 0 < d < tol, (metric, d)  # changed (rounded), but only a little
        assert low[metric]["baseline_spectrum_mean"].equals(ref[metric]["baseline_spectrum_mean"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU path is checked where one is present")
@pytest.mark.parametrize("dtype", ["float32", "tf32", "bf16"])
def test_gpu_job_equals_the_cpu_job(gqa, dtype):
    """Same scores and spectrum nulls (same draws, copied to the device); the Gaussian heads are
    drawn by the GPU's generator, so that baseline agrees within its Monte Carlo error."""
    pairs = block_pairs(list(range(4)), 1, 0) + null_pairs(list(range(4)), 1, 0)
    kw = dict(baseline_samples=N, dtype=dtype)
    cpu = score_space(gqa, KERNEL_METRICS, "residual", pairs, device="cpu", **kw)[0]
    gpu = score_space(gqa, KERNEL_METRICS, "residual", pairs, device="cuda", **kw)[0]
    tol = {"float32": 1e-5, "tf32": 5e-3, "bf16": 3e-2}[dtype]
    for metric in KERNEL_METRICS:
        for col in ("score", "baseline_spectrum_mean", "baseline_spectrum_std"):
            scale = max(1.0, cpu[metric][col].abs().max())
            np.testing.assert_allclose(gpu[metric][col].to_numpy(), cpu[metric][col].to_numpy(), atol=tol * scale, rtol=0)
        if metric in NORMALISED_METRICS:
            g, c = gpu[metric]["baseline_gaussian_mean"].to_numpy(), cpu[metric]["baseline_gaussian_mean"].to_numpy()
            assert np.abs(g - c).max() < 5 * cpu[metric]["baseline_gaussian_std"].max() / np.sqrt(N)


def test_the_gpu_job_benchmark_runs_on_the_cpu(tmp_path, capsys):
    """``benchmarks/bench_gpu_job.py`` at its CI shape: every figure is there and positive, and the
    70B estimate's arithmetic runs on the tiny shape's measurement (its numbers mean nothing here)."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu_job.py"
    spec = importlib.util.spec_from_file_location("bench_gpu_job", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--device", "cpu", "--shapes", "tiny", "--repeats", "1", "--json", str(tmp_path / "r.json")]) == 0
    m = json.loads((tmp_path / "r.json").read_text())["shapes"]["tiny"]
    assert m["pairs"] == 16 and m["floor_s"]["float32"] > 0 and m["kernel_share"] > 0
    job = m["job"]["float32"]
    assert job["share_of_fp32_floor"] > 0 and set(job["split_s"]) >= {"transfer", "factors", "gemms", "nulls", "table"}
    assert "of the fp32 floor" in capsys.readouterr().out
    m["job"]["float32"]["gpu_peak_bytes"] = 1e9  # as a GPU run would record it
    est = bench.checkpoint_estimate(m, n_layers=8)
    assert [r["blocks"] for r in est["by_blocks"]][:3] == [1, 2, 4] and all(r["hours"] > 0 for r in est["by_blocks"])


def test_small_factorisations_on_host_threads_give_the_batched_results():
    from compatlas.composition.small_linalg import on_host

    x = torch.randn(3, 70, 8, 8, dtype=torch.float32)
    torch.testing.assert_close(on_host(torch.linalg.svdvals, x, force=True), torch.linalg.svdvals(x), atol=1e-5, rtol=1e-5)
    U, S, Vh = on_host(torch.linalg.svd, x, force=True)
    assert U.shape == x.shape and S.shape == (3, 70, 8) and U.dtype == x.dtype
    torch.testing.assert_close(U @ torch.diag_embed(S) @ Vh, x, atol=1e-4, rtol=1e-4)


def test_factors_made_one_layer_at_a_time_score_the_same(gqa, monkeypatch):
    from compatlas.composition import job_factors

    pairs = block_pairs(list(range(4)), 1, 0) + null_pairs(list(range(4)), 1, 0)
    kw = dict(baseline_samples=N, device="cpu", dtype="float64")
    whole = score_space(gqa, KERNEL_METRICS, "residual", pairs, **kw)[0]
    monkeypatch.setattr(job_factors, "CHUNK_BYTES", 1)  # one layer per chunk
    chunked = score_space(gqa, KERNEL_METRICS, "residual", pairs, **kw)[0]
    for metric in KERNEL_METRICS:
        for col in ("score", "score_share"):
            np.testing.assert_allclose(chunked[metric][col].to_numpy().astype(float),
                                       whole[metric][col].to_numpy().astype(float), rtol=1e-12)
        assert chunked[metric].drop("score", "score_share").equals(whole[metric].drop("score", "score_share"))


def test_activation_space_all_metrics_in_one_pass_equal_one_metric_jobs(gqa):
    """With measured Gram matrices the sandwich still holds (only the d_head x d_head factors change)."""
    from conftest import random_moments

    m = random_moments(4, 4, 2, 4, 4)
    pairs = [(0, 1), (1, 3), (3, 0), (2, 2)]
    kw = dict(baseline_samples=N, device="cpu", dtype="float64", moments=m)
    tables, _ = score_space(gqa, KERNEL_METRICS, "activation", pairs, share_cores=True, **kw)
    for metric in KERNEL_METRICS:
        one = score_block(gqa, metric, "activation", pairs, **kw)[0]
        assert tables[metric].drop("score", "score_share").equals(one.drop("score", "score_share"))
        for col in ("score", "score_share"):
            np.testing.assert_allclose(tables[metric][col].to_numpy().astype(float), one[col].to_numpy().astype(float),
                                       rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("blocks", [1, 3, 8])
def test_a_block_job_factors_each_touched_layer_once_per_family(gqa, monkeypatch, blocks):
    """Blocks cost what their pairs cost: however many GEMM tiles a job's pairs fall into (tiny
    tiles here: one writer layer by one reader layer), each layer it touches is factored once per
    family, and no layer it does not touch is."""
    from compatlas import tiles
    from compatlas.composition import job_factors

    built: list[tuple[str, tuple[int, ...]]] = []
    real = job_factors.head_factors

    def counting(w, metric, *args, **kwargs):  # which model layers: known by their W_Q
        built.append((metric, tuple(next(i for i in range(gqa.n_layers) if torch.equal(x, gqa.W_Q[i].to(x.dtype))) for x in w.W_Q)))
        return real(w, metric, *args, **kwargs)

    monkeypatch.setattr(job_factors, "head_factors", counting)
    monkeypatch.setattr(job_factors, "CHUNK_BYTES", 1)  # one layer a chunk
    layers = list(range(gqa.n_layers))
    w = gqa
    for b in range(blocks):
        built.clear()
        pairs = block_pairs(layers, blocks, b) + null_pairs(layers, blocks, b)
        if not pairs:
            continue
        score_space(w, KERNEL_METRICS, "residual", pairs, baseline_samples=4, device="cpu", tile_bytes=1)
        touched = tuple(tiles.block_layers(layers, blocks, b))
        for fam in ("frobenius", "subspace"):
            assert sorted(ids for m, ids in built if m == fam) == [(layer,) for layer in touched]


def test_the_magnitude_family_is_always_a_sandwich_of_subspace_and_matches_its_own_gemms(gqa):
    """share_cores (the default): a job without subspace still makes the magnitude cores from
    subspace's bases, so its numbers are those of a job with subspace; against each family's own
    GEMMs (share_cores=False) they differ by float32 rounding only, a zero and a rank-deficient head
    (directions the bases drop) included."""
    from compatlas.composition.job_factors import job_factors
    from compatlas.models.weights import AttentionWeights

    assert set(job_factors(gqa, ("frobenius",)).sand) == {"frobenius"}
    assert job_factors(gqa, ("frobenius",), share_cores=False).sand == {}
    W_O, W_Q = gqa.W_O.clone(), gqa.W_Q.clone()
    W_O[1, 2] = 0
    W_Q[2, 1, :, 1:] = W_Q[2, 1, :, :1]  # rank one
    w = AttentionWeights(W_Q=W_Q, W_K=gqa.W_K, W_V=gqa.W_V, W_O=W_O, W_E=gqa.W_E)
    pairs = block_pairs(list(range(4)), 1, 0) + null_pairs(list(range(4)), 1, 0)
    mag = ("frobenius", "svd_bound", "contribution")
    kw = dict(baseline_samples=N, device="cpu", dtype="float32")
    alone, _ = score_space(w, mag, "residual", pairs, **kw)
    beside, _ = score_space(w, KERNEL_METRICS, "residual", pairs, **kw)
    own, _ = score_space(w, mag, "residual", pairs, share_cores=False, **kw)
    for m in mag:
        assert alone[m].equals(beside[m]), m
        got, want = alone[m]["score"].to_numpy(), own[m]["score"].to_numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.nanmax(np.abs(want)))  # a zero head: 0 / 0

"""The behaviour jobs' float32 CPU products through oneDNN (compatlas.models.cpu_matmul): the same products
as a float64 reference to float32's rounding, forward and backward; routed only where they are
large enough, only inside the context; and the behaviour measurements on a model the same as on
torch's BLAS to float32's rounding."""

from __future__ import annotations

import pytest
import torch
from test_edge_attribution import random_gqa
from test_induction import V

from compatlas.behaviour.ablation import ablation_effects
from compatlas.behaviour.sequences import TokenSet
from compatlas.function.edge_attribution import attribution_scores, causal_edges, exact_scores, induction_task
from compatlas.models import cpu_matmul as cm

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not cm.onednn_available(), reason="this torch has no oneDNN (torch.backends.mkldnn)")]

ONEDNN_OP = "mkldnn::_linear_pointwise"


def onednn_calls(fn) -> int:
    """How many products ``fn`` ran in oneDNN (torch's profiler counts the op)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == ONEDNN_OP)


def close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Within float32's rounding of a sum of products: 1e-5 of the reference's largest entry."""
    return got.dtype == torch.float32 and bool(((got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()).item())


def operands(seed: int, m: int, k: int, n: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(k, n, generator=g), torch.randn(n, generator=g)


@pytest.mark.parametrize("layout", ["contiguous", "a transposed", "b transposed", "b a column slice"])
def test_products_equal_a_float64_reference_and_run_in_onednn(layout):
    a, b, bias = operands(0, 150, 300, 120)  # 5.4e6 multiply-adds: routed
    if layout == "a transposed":
        a = a.t().contiguous().t()
    if layout == "b transposed":
        b = b.t().contiguous().t()
    if layout == "b a column slice":  # as GPT-2's fused W_QKV hands each head its columns
        b = torch.cat([b, torch.randn(300, 40)], 1)[:, :120]
    A, B = torch.randn(3, 150, 300), torch.randn(3, 300, 120)
    ref = a.double() @ b.double()
    with cm.cpu_matmul("onednn") as kind:
        assert kind == "onednn"
        assert close(a @ b, ref)
        assert close(torch.addmm(bias, a, b), ref + bias.double())
        assert close(torch.nn.functional.linear(a, b.t(), bias), ref + bias.double())
        assert close(torch.nn.functional.linear(a.view(3, 50, 300), b.t()), ref.view(3, 50, 120))  # a 3-d input
        assert close(torch.bmm(A, B), A.double() @ B.double())
        assert close(torch.einsum("bmk,bkn->bmn", A, B), A.double() @ B.double())
        # addmm with other coefficients is torch's own
        assert close(torch.addmm(bias, a, b, beta=2.0, alpha=0.5), 0.5 * ref + 2 * bias.double())
        assert onednn_calls(lambda: a @ b) == 1
        assert onednn_calls(lambda: torch.bmm(A, B)) == 3  # one per matrix of the batch
        assert onednn_calls(lambda: torch.addmm(bias, a, b, beta=2.0)) == 0


def test_compact_copies_only_what_onednn_cannot_read_directly():
    w = torch.randn(128, 384)
    assert cm.compact(w) is w and cm.compact(w.t()).data_ptr() == w.data_ptr()  # rows or columns one after another
    head = w[:, :16].t()  # a head's columns of a fused weight: rows 384 apart
    assert not head.is_contiguous() and cm.compact(head).is_contiguous() and torch.equal(cm.compact(head), head)


def test_small_products_other_dtypes_and_outside_the_context_stay_with_torch():
    a, b, _ = operands(1, 40, 64, 40)  # 1e5 multiply-adds: attention's size, faster in MKL
    big_a, big_b, _ = operands(2, 150, 300, 120)
    outside = big_a @ big_b
    with cm.cpu_matmul("onednn"):
        assert onednn_calls(lambda: a @ b) == 0
        assert torch.equal(a @ b, a @ b) and close(a @ b, a.double() @ b.double())
        assert onednn_calls(lambda: big_a.double() @ big_b.double()) == 0  # float64: torch's BLAS
        inside = big_a @ big_b
    assert onednn_calls(lambda: big_a @ big_b) == 0  # the override ended with the context
    assert torch.equal(big_a @ big_b, outside)  # torch's kernel back: the same bits as before
    assert close(inside, outside.double())


def test_gradients_run_through_onednn_and_match_the_reference():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, 300, generator=g, requires_grad=True)
    w = torch.randn(160, 300, generator=g, requires_grad=True)
    xd, wd = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    torch.nn.functional.linear(xd, wd).pow(2).sum().backward()
    with cm.cpu_matmul("onednn"):
        loss = torch.nn.functional.linear(x, w).pow(2).sum()
        assert onednn_calls(lambda: torch.autograd.grad(loss, [x, w], retain_graph=True)) == 2  # dx and dW
        gx, gw = torch.autograd.grad(loss, [x, w])
    assert close(gx, xd.grad) and close(gw, wd.grad)


def test_blas_a_gpu_and_unknown_kinds():
    a, b, _ = operands(4, 150, 300, 120)
    with cm.cpu_matmul("blas") as kind:
        assert kind == "blas" and onednn_calls(lambda: a @ b) == 0
    with cm.cpu_matmul("onednn", "cuda") as kind:  # a GPU's products are not touched (no GPU needed to say so)
        assert kind == "device" and onednn_calls(lambda: a @ b) == 0
    with pytest.raises(ValueError, match="cpu_matmul 'mkl': choose from"), cm.cpu_matmul("mkl"):  # type: ignore[arg-type]
        pass


@pytest.fixture(scope="module")
def gqa32(tmp_path_factory):
    """test_edge_attribution's random GQA model, in float32 (the dtype whose products are routed)."""
    return random_gqa(tmp_path_factory.mktemp("gqa32"), torch.float32)


def test_behaviour_measurements_equal_torchs_blas_to_float32_rounding(gqa32, monkeypatch):
    """EAP, exact edge patching and exact ablation on a small model, every product routed (the
    bound lowered to 0, so that attention's products go too): the numbers of torch's BLAS, to
    float32's rounding, and oneDNN really ran them."""
    monkeypatch.setattr(cm, "ONEDNN_MIN_WORK", 0)
    task = induction_task(TokenSet(pool=torch.arange(V)), sequences=6, length=8, seed=0)
    edges = causal_edges(gqa32)[::7]

    def measure():
        eap = attribution_scores(gqa32, task, "eap", batch_size=6)
        exact = exact_scores(gqa32, task, edges, batch_size=12)
        drops = ablation_effects(gqa32, TokenSet(pool=torch.arange(V)), sequences=4, batch_size=8)["ablation_drop"]
        return eap, exact, torch.tensor(drops.to_numpy())

    blas = measure()
    with cm.cpu_matmul("onednn"):
        assert onednn_calls(lambda: exact_scores(gqa32, task, edges[:2], batch_size=12)) > 0
        routed = measure()
    for c in "QKV":
        assert (routed[0][c] - blas[0][c]).abs().max() <= 1e-4 * blas[0][c].abs().max()
    for got, ref in zip(routed[1:], blas[1:]):
        assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()

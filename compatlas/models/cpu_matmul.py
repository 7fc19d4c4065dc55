"""Which library multiplies float32 matrices on the CPU in the behaviour jobs' forward and backward passes.

torch sends every float32 ``mm``, ``addmm`` and ``bmm`` on the CPU to its BLAS (MKL on x86), and MKL
takes its AVX2 path on AMD CPUs, AVX-512 ones included: on the 2-core AMD EPYC (Zen 5) the default
run is measured on, one core multiplies SmolLM2's MLP shapes at about 110 GFLOP/s there, and at
about 250 in oneDNN (``torch.ops.mkldnn._linear_pointwise``, shipped inside torch), whose kernels
follow the instructions a CPU has, not its vendor. The induction, edge attribution and exact
patching jobs spend 73 to 84% of their time in these products (``perf record``), so ``onednn``
(the default of ``induction.cpu_matmul``) routes them there for the duration of a job:

- ``mm(a, b)`` is ``_linear_pointwise(a, b.T)``: a @ b, since the op computes x @ W.T (+ bias);
- ``addmm(bias, a, b)`` with a 1-d bias and alpha = beta = 1 (what ``nn.Linear`` calls) is
  ``_linear_pointwise(a, b.T, bias)``;
- ``bmm`` is one such product per matrix of the batch;
- a product of fewer than ``ONEDNN_MIN_WORK`` multiply-adds (m x k x n), any other dtype or
  arguments, and every product outside the context stay with torch's BLAS: below about 10**6,
  oneDNN's per-call cost loses (attention's 40 x 64 x 40 products take 13 us there, 4 in MKL).

Autograd is untouched: these are the CPU kernels under it, so backward passes' products are routed
the same way. The two libraries sum in other orders, so every number moves in its last bits, as it
does on another machine's kernels (SmolLM2's edge scores by at most 5e-6 of 2.9, its ablation drops by
3.2e-5 of 4.5; docs/configuration.md has the whole atlas compared). ``blas`` keeps torch's own
kernels: the bits of runs before 2026-11-29.
Training, composition and the activation moments always use torch's BLAS (training is pinned to
AVX2 kernels, ``compatlas.runtime.pin_cpu_kernels``). A GPU's products are not touched.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from compatlas.vocab import CPU_MATMULS, CpuMatmul

# Multiply-adds (m x k x n) from which oneDNN beats MKL on one core (benchmarks/bench_cpu_matmul.py:
# 0.25x at 40 x 64 x 40, 0.44x at 64 x 64 x 64, 0.95x at 128 x 64 x 128, 1.8 to 2.4x from 10**7 up).
ONEDNN_MIN_WORK = 2**20


def compact(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself where its rows or its columns are stored one after another, else a contiguous
    copy: oneDNN takes a weight with a leading dimension wider than the matrix (a slice of a wider
    one, as GPT-2's fused W_QKV hands each head) down a reference path, a thousand times slower."""
    return x if x.is_contiguous() or x.t().is_contiguous() else x.contiguous()


def _onednn(a: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if 1 not in a.stride():  # neither rows nor columns unit-stride: not a matrix oneDNN reads directly
        a = a.contiguous()
    return torch.ops.mkldnn._linear_pointwise(a, compact(weight_t), bias, "none", [], "")


def _routed(a: torch.Tensor, n: int) -> bool:
    return a.dtype == torch.float32 and a.shape[-2] * a.shape[-1] * n >= ONEDNN_MIN_WORK


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if _routed(a, b.shape[1]):
        return _onednn(a, b.t(), None)
    # torch's own kernel: the .out overload, which this module does not replace
    return torch.ops.aten.mm.out(a, b, out=a.new_empty((a.shape[0], b.shape[1])))


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    if beta == 1 and alpha == 1 and bias.dim() == 1 and bias.dtype == a.dtype and _routed(a, b.shape[1]):
        return _onednn(a, b.t(), bias)
    return torch.ops.aten.addmm.out(bias, a, b, beta=beta, alpha=alpha,
                                    out=a.new_empty((a.shape[0], b.shape[1]), dtype=torch.result_type(a, b)))


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]))
    if not _routed(a, b.shape[2]):
        return torch.ops.aten.bmm.out(a, b, out=out)
    for i in range(a.shape[0]):
        out[i] = _onednn(a[i], b[i].t(), None)
    return out


def onednn_available() -> bool:
    """Whether this torch has oneDNN (``torch.backends.mkldnn``) and the op products are routed to
    (a build without it, or a version that renamed it, multiplies in torch's BLAS)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@contextmanager
def cpu_matmul(kind: CpuMatmul, device: torch.device | str = "cpu") -> Iterator[str]:
    """Float32 CPU products through ``kind`` for the duration (module docstring); yields what
    multiplies them, for the shard's provenance: ``onednn``, ``blas``, or ``device`` when the job
    runs on a GPU (nothing is replaced). ``onednn`` on a torch without oneDNN is ``blas``."""
    if kind not in CPU_MATMULS:
        raise ValueError(f"cpu_matmul {kind!r}: choose from {CPU_MATMULS}")
    if torch.device(device).type != "cpu":
        yield "device"
        return
    if kind == "blas" or not onednn_available():
        yield "blas"
        return
    with warnings.catch_warnings():  # torch warns that an aten kernel is overridden: that is the point
        warnings.simplefilter("ignore", UserWarning)
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("mm", _mm, "CPU")
        lib.impl("addmm", _addmm, "CPU")
        lib.impl("bmm", _bmm, "CPU")
    try:
        yield "onednn"
    finally:
        lib._destroy()  # torch's kernels back (what a Library's finaliser does when it is collected)

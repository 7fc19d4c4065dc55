"""The precision of the composition job's core products (config ``dtype``, ``vocab.ScoreDtype``).

Only the d_model-long core GEMMs (``emit @ absorb``, the bulk of a job's FLOPs) change with the
setting; the per-head factors, spectra, nulls and norms stay in the storage dtype (float32, or
float64 for ``float64``), so a setting's error is the core products' error alone:

- ``float32``: IEEE float32 products (TF32 off);
- ``tf32``: the products' inputs rounded to TF32's 10-bit mantissa, float32 accumulation (on a
  GPU the tensor cores do this; on the CPU it is emulated by rounding the inputs, to nearest);
- ``bf16``: the inputs rounded to bfloat16 (8-bit mantissa), float32 accumulation and output (on
  a GPU a bfloat16 GEMM with a float32 result; on the CPU the same rounding, then a float32 GEMM);
- ``float64``: everything in float64 (the reference the others are measured against,
  docs/statistics.md#precision-of-the-core-products).

The CPU emulation gives the GPU's arithmetic up to the order of the float32 sums, so the error
figures are computable without a GPU.
"""

from __future__ import annotations

import torch

from compatlas.vocab import SCORE_DTYPES, ScoreDtype

_TF32_DROP = 13  # float32 has 23 mantissa bits, TF32 10


def storage_dtype(dtype: ScoreDtype) -> torch.dtype:
    """The dtype of the weights, factors and scores of a job run at ``dtype``."""
    if dtype not in SCORE_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {SCORE_DTYPES}")
    return torch.float64 if dtype == "float64" else torch.float32


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded to nearest on TF32's 10-bit mantissa (ties away from zero, as the
    GPU's conversion), still stored as float32. Inf and NaN are left alone (the kernel has none)."""
    bits = x.contiguous().view(torch.int32)
    half = 1 << (_TF32_DROP - 1)
    return ((bits + half) & ~((1 << _TF32_DROP) - 1)).view(torch.float32)


def gemm_operand(x: torch.Tensor, dtype: ScoreDtype) -> torch.Tensor:
    """``x`` as the core GEMM reads it: rounded once per job, not once per product."""
    if dtype == "bf16":
        x = x.to(torch.bfloat16)
        return x if x.is_cuda else x.float()  # CPU: exact bf16 values, multiplied in float32
    if dtype == "tf32" and not x.is_cuda:
        return round_tf32(x)
    return x


def core_gemm(a: torch.Tensor, b: torch.Tensor, dtype: ScoreDtype) -> torch.Tensor:
    """``a @ b`` of two ``gemm_operand``s at ``dtype``, with a float32 (float64) result."""
    if not a.is_cuda:
        return a @ b  # inputs already rounded by gemm_operand
    if dtype == "bf16":
        try:
            return torch.mm(a, b, out_dtype=torch.float32)  # bf16 products, float32 accumulation and output
        except (RuntimeError, TypeError):  # an older torch: float32 accumulation, bfloat16 output
            return (a @ b).float()
    with _tf32(dtype == "tf32"):
        return a @ b


class _tf32:
    """TF32 for the float32 GEMMs inside (or IEEE float32), whatever the process's global
    setting, which is restored after."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self) -> None:
        self.before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high" if self.on else "highest")

    def __exit__(self, *exc: object) -> None:
        torch.set_float32_matmul_precision(self.before)

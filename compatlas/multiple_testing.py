"""Benjamini-Hochberg over many tests, one definition for composition's calibration and for edge
attribution's per-edge tests (the shared bottom: numpy and scipy only)."""

from __future__ import annotations

import numpy as np


def bh_q_values(p: np.ndarray) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values (q) over the finite entries of ``p``; NaN stays NaN."""
    from scipy import stats

    p = np.asarray(p, dtype=np.float64)
    q = np.full_like(p, np.nan)
    ok = np.isfinite(p)
    if ok.any():
        q[ok] = stats.false_discovery_control(p[ok], method="bh")
    return q

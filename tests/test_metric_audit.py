"""The metric audit (compatlas.audits.metric_audit): its constructions give the values derived by
hand, and Axioms 1 to 3 give the same verdicts in every space."""

from __future__ import annotations

import math

import numpy as np
import pytest

from compatlas.audits.metric_audit import constructions, score
from compatlas.vocab import COMPS, WEIGHT_SPACES


@pytest.mark.parametrize("d", [4, 16, 64])
def test_identity_construction_values(d):
    factors = constructions()["axiom1_full"][f"identity_d{d}"]
    for c in COMPS:
        assert score("frobenius", "residual", c, factors) == pytest.approx(d ** -0.5, abs=1e-12)
        assert score("svd_bound", "residual", c, factors) == pytest.approx(1.0, abs=1e-12)
        assert score("subspace", "token", c, factors) == pytest.approx(1.0, abs=1e-12)


def test_rotation_sweep_subspace_is_cos_squared():
    # every principal angle between the write rows (cos t U_in + sin t U_out) and U_in is t
    sweep = constructions()["axiom3_sweep"]
    thetas = np.linspace(math.pi / 2, 0.0, len(sweep))
    for theta, factors in zip(thetas, sweep.values()):
        assert score("subspace", "residual", "Q", factors) == pytest.approx(math.cos(theta) ** 2, abs=1e-10)


def test_axioms_1_to_3_agree_across_spaces():
    """The constructions live where all three bases agree, so only Axiom 4 may tell spaces apart."""
    from compatlas.audits.metric_audit import audit_metric

    for metric in ("subspace", "frobenius"):
        verdicts = {}
        for space in WEIGHT_SPACES:
            for r in audit_metric(metric, space):
                if r["axiom"] != "axiom4_invariant":
                    verdicts.setdefault((r["axiom"], r["construction"]), set()).add(r["passed"])
        assert all(len(v) == 1 for v in verdicts.values()), verdicts

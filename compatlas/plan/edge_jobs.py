"""How many jobs a model's edge attribution gets beside the one that writes its table, from its
``induction.edge_attribution`` settings (no torch: the Snakefile asks while it plans).

With ``jobs`` 1 the edge attribution job does everything. With more, the sequences' attribution
runs as ``jobs`` share jobs (``function.edge_sums``), exact patching as up to as many jobs over
the exact sequences (``function.exact_shares``), and the edge attribution job only merges."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def attribution_jobs(settings: Mapping[str, Any]) -> int:
    """The attribution share jobs: ``jobs``, none where it is 1."""
    jobs = int(settings.get("jobs", 1))
    return 0 if jobs == 1 else jobs


def exact_jobs(settings: Mapping[str, Any]) -> int:
    """The exact-patching jobs: none where ``jobs`` is 1, else ``jobs``, at most one per exact
    sequence (the first ``exact_sequences`` of the ``sequences``)."""
    jobs = int(settings.get("jobs", 1))
    return 0 if jobs == 1 else max(1, min(jobs, settings["exact_sequences"], settings["sequences"]))

"""What a job's settings need in memory, known from the config: a size no machine of the run
can hold is refused while the config is planned, in one line naming its key and the memory
(``induction.edge_attribution.sequences: 1000000000`` had passed validation and failed inside the
job, allocating 160 GB, with a traceback naming no key).

The bound is this machine's memory (where the run is planned: every job of a local run, and on a
cluster the node Snakemake runs on, no smaller than the memory its profile gives a job)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from compatlas.plan.config import ConfigError
from compatlas.tiles import Shape

INT64 = FLOAT64 = 8


def machine_memory() -> int | None:
    """This machine's physical memory in bytes, None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def edge_attribution_bytes(settings: Mapping[str, Any], shape: Shape | None, n_layers: int | None) -> int:
    """The bytes an edge attribution job holds in proportion to its sequences: their tokens (the
    repeated span, clean and corrupted inputs of 2 length + 1 tokens, the targets: about
    6 length + 2 int64 a sequence) and, where the model's shape is known, every method's score of
    every edge on every sequence of one job's share (float64 [sequences / jobs, L, H, L, H + 2 H_kv]). A lower bound: the
    model and its activations come on top."""
    per_sequence = (6 * settings["length"] + 2) * INT64
    if shape is not None and n_layers is not None:
        per_sequence += (len(settings["methods"]) * n_layers**2 * shape.n_heads
                         * (shape.n_heads + 2 * shape.n_kv_heads) * FLOAT64)
    return -(-settings["sequences"] // settings.get("jobs", 1)) * per_sequence  # one job's share


def check_edge_attribution(model_key: str, overrides: Mapping[str, Any], induction: Mapping[str, Any],
                           shape: Shape | None, n_layers: int | None, memory: int | None) -> None:
    """ConfigError naming the key that sets the sequences (the model's ``overrides`` of the
    induction section, or the section's own) when the edge attribution job of the model at
    ``model_key`` (``models.<name>``) needs more than ``memory`` bytes."""
    ea = induction["edge_attribution"]
    if not induction["enabled"] or not ea["enabled"]:
        return
    if 2 * ea.get("jobs", 1) > ea["sequences"]:  # each share needs two sequences for its standard errors' sake
        own = "jobs" in overrides.get("edge_attribution", {})
        key = f"{model_key}.induction.edge_attribution.jobs" if own else "induction.edge_attribution.jobs"
        raise ConfigError(f"config error at {key}: {ea['jobs']} jobs for {ea['sequences']} sequences; each job needs "
                          "2 or more (at most sequences / 2)")
    if memory is None:
        return
    if (need := edge_attribution_bytes(ea, shape, n_layers)) > memory:
        own = "sequences" in overrides.get("edge_attribution", {})
        key = f"{model_key}.induction.edge_attribution.sequences" if own else "induction.edge_attribution.sequences"
        raise ConfigError(f"config error at {key}: {ea['sequences']:,} sequences of {ea['length']} tokens need at least "
                          f"{need / 1e9:,.1f} GB in the edge attribution job of {model_key.split('.', 1)[1]}, more than "
                          f"this machine's {memory / 1e9:,.1f} GB; lower it (the default is 512)")

"""When a model's checkpoints are, known without loading any: the published schedules of hub
families (offline, from transformer_lens), a training run's schedule, and checkpoint labels.

Used by validation (``compatlas.plan.config``: is a step published?) and planning (``compatlas.plan``:
which step and how many tokens is each checkpoint?).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Mapping
from typing import Any

# tokens per training step, from the families' papers (Pythia: 1024 sequences x 2048 tokens;
# stanford-crfm's Mistral GPT-2 runs: 512 sequences x 1024 tokens)
TOKENS_PER_STEP = {"EleutherAI/pythia": 2_097_152, "stanford-crfm/": 524_288}
# families whose published checkpoint schedule transformer_lens knows offline (hub revisions)
SERIES_PREFIXES = ("EleutherAI/pythia", "pythia-", "stanford-crfm/")


def tokens_per_step(name: str) -> int | None:
    """Tokens a hub family's training step sees, where its paper says."""
    return next((n for prefix, n in TOKENS_PER_STEP.items() if name.startswith(prefix)), None)


@functools.cache
def hub_series(name: str) -> tuple[tuple[int, ...], int | None] | None:
    """(published steps, tokens per step) of a hub family with a known schedule, else None.
    Offline: only families whose schedule transformer_lens ships (others would need the hub)."""
    if not name.startswith(SERIES_PREFIXES):
        return None
    if name.startswith("pythia-"):  # transformer_lens's alias of EleutherAI/pythia-*
        name = f"EleutherAI/{name}"
    from transformer_lens.tools.model_registry.checkpoints import get_checkpoint_labels

    logging.disable(logging.WARNING)  # its "Pythia models on HF were updated on 4/3/23" on every lookup
    try:
        labels, _ = get_checkpoint_labels(name)
    except ValueError:
        return None
    finally:
        logging.disable(logging.NOTSET)
    return tuple(labels), tokens_per_step(name)


def checkpoint_step(series: tuple[tuple[int, ...], int | None] | None, ckpt: Mapping[str, Any]) -> int | None:
    """The training step a checkpoint is at, wherever it can be known without loading it."""
    if "value" in ckpt:
        return ckpt["value"]
    if series is None:
        return None
    labels = series[0]
    if "index" in ckpt and -len(labels) <= ckpt["index"] < len(labels):
        return labels[ckpt["index"]]
    m = re.fullmatch(r"(?:step|checkpoint-)(\d+)", str(ckpt.get("revision", "")))
    return int(m[1]) if m and int(m[1]) in labels else None


def checkpoint_label(ckpt: Mapping[str, Any]) -> str:
    """The name a checkpoint goes by (its wildcard and folders): its ``label``, else ``step<value>``,
    ``index<index>`` or the revision."""
    if "label" in ckpt:
        return ckpt["label"]
    if "value" in ckpt:
        return f"step{ckpt['value']}"
    if "index" in ckpt:
        return f"index{ckpt['index']}"
    return ckpt["revision"]


def schedule(spec: Mapping[str, Any]) -> list[int]:
    """A training run's checkpoint steps: 0, the powers of ``log_base`` up to ``log_until``,
    and every ``every`` steps up to ``steps`` (which is always included)."""
    steps = spec["steps"]
    out = {0, steps}
    if spec.get("log_until"):
        p = 1
        while p <= min(spec["log_until"], steps):
            out.add(p)
            p *= spec["log_base"]
    if spec.get("every"):
        out.update(range(spec["every"], steps + 1, spec["every"]))
    return sorted(out)

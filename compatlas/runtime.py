"""What a job needs from its surroundings: seeds, the device, the library versions.

Small helpers every stage shares (composition, calibration, invariance, induction, training),
kept apart from any one of them so that none imports another just for a seed. Only the
standard library at import time: torch is imported inside ``resolve_device``, so the CLI and
the atlas can record versions without loading it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The libraries whose versions every shard and every extraction records.
VERSIONED_PACKAGES = ("compatlas", "torch", "transformer-lens", "transformers", "polars", "duckdb", "scipy")


def stable_seed(*parts: object) -> int:
    """A seed from any parts (config seed, model shape, layer pair...), stable across runs and jobs.

    Python's ``hash`` is salted per process; a digest of the parts' ``repr`` is not, so two jobs
    (or a rerun) that draw for the same parts draw the same numbers."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") & (2**63 - 1)


def resolve_device(device: str) -> torch.device:
    """The torch device for the config's ``device``: ``auto`` is CUDA when torch sees a GPU,
    else the CPU; an explicit ``cuda`` without a GPU is an error, never a silent CPU run."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: cuda requested but torch sees no CUDA device")
    return torch.device(device)


def free_bytes(device: torch.device) -> int | None:
    """Memory free for a job on ``device``: a GPU's free memory, the host's available memory
    (``MemAvailable``, which counts reclaimable caches); None where it cannot be told."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def library_versions() -> dict[str, str]:
    """Installed versions of ``VERSIONED_PACKAGES`` (``not installed`` for a missing one), read
    from the package metadata without importing the packages."""
    out = {}
    for pkg in VERSIONED_PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one CPU thread, then restore the count. Two callers, two reasons: training,
    whose reductions must not depend on the cores a job gets (near the phase change a last-bit
    difference grows into a different run: seed 1 of the default recipe formed its induction
    heads near step 700 on 2 threads and a shifted circuit on 1); and the batched small
    factorisations of ``composition.head_factors``, where with two threads every small call pays
    a thread hand-off (on a busy machine GPT-2-small's took 15 s against 0.8 s)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)

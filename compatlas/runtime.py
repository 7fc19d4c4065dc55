"""What a job needs from its surroundings: seeds, the device, the library versions.

Small helpers every stage shares (composition, calibration, invariance, induction, training),
kept apart from any one of them so that none imports another just for a seed. Only the
standard library at import time: torch is imported inside ``resolve_device``, so the CLI and
the atlas can record versions without loading it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The libraries whose versions every shard and every extraction records.
VERSIONED_PACKAGES = ("compatlas", "torch", "transformer-lens", "transformers", "polars", "duckdb", "scipy")


# The CPU float kernels training runs on, chosen by name rather than by the CPU. torch picks its
# vector kernels (ATen's) and MKL its GEMM code path by the instructions a CPU has, and the two paths
# round differently in the last bit; over 800 training steps, near the phase change, that bit grows
# into another model (the default recipe's loss at step 400: 2.872 on AVX2 kernels, 2.818 on
# AVX-512). With both pinned to AVX2 a training run is the same on every x86-64 CPU that has AVX2
# (docs/behaviour.md#what-can-differ-across-machines).
PINNED_CPU_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}


def pin_cpu_kernels() -> None:
    """Set ``PINNED_CPU_KERNELS`` in the environment. torch and MKL read them once, on first
    use, so this must run before torch is imported: in a job's own process (a job server's fork
    has imported torch already)."""
    if "torch" in sys.modules:
        raise RuntimeError("pin_cpu_kernels must run before torch is imported")
    os.environ.update(PINNED_CPU_KERNELS)


def cpu_kernels() -> str:
    """The CPU float kernels this process runs on: torch's vector kernels (``AVX2``, ``AVX512``,
    ``DEFAULT`` ...) and MKL's pinned code path, if any (``MKL_CBWR``)."""
    import torch

    return f"aten={torch.backends.cpu.get_cpu_capability()} mkl_cbwr={os.environ.get('MKL_CBWR', 'auto')}"


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


def one_thread_on(device: torch.device) -> AbstractContextManager[None]:
    """``one_thread`` where ``device`` (a torch device) is the CPU, nothing elsewhere: the small
    batched factorisations of a job on a GPU run there, not on the host's threads."""
    return one_thread() if device.type == "cpu" else nullcontext()

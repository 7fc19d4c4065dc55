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


def pin_cpu_kernels() -> bool:
    """Set ``PINNED_CPU_KERNELS`` in the environment; whether they hold in this process. torch and
    MKL read them once, on first use. Before torch is imported they always hold. In a job server's
    fork (compatlas.worker: torch imported, never run) they hold if nothing has used torch yet,
    which is checked, not assumed: torch's kernels must then be AVX2 and MKL's code path pinned.
    Where they do not hold (or cannot be told to, on a CPU without AVX2) the caller must run in a
    process of its own (``compatlas.worker.run_fresh``)."""
    os.environ.update(PINNED_CPU_KERNELS)
    if "torch" not in sys.modules:
        return True
    import torch

    if not torch.cpu._is_avx2_supported() or torch.backends.cpu.get_cpu_capability() != "AVX2":
        return False
    branch = _mkl_cbwr_branch()
    return branch is None or branch != MKL_CBWR_BRANCH_OFF


# MKL's conditional numerical reproducibility: the branch it reports when MKL_CBWR was not read
# (mkl_service.h). A process whose MKL started before MKL_CBWR was set reports it; one pinned reports
# another (AUTO or the named path, depending on the CPU).
MKL_CBWR_BRANCH = 1
MKL_CBWR_BRANCH_OFF = 1


def _mkl_cbwr_branch() -> int | None:
    """MKL's code-path branch in this process (``mkl_cbwr_get(MKL_CBWR_BRANCH)``), None where this
    torch has no MKL (its service function, built into libtorch_cpu, is not found)."""
    import ctypes

    import torch

    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        get = ctypes.CDLL(lib).mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    return int(get(MKL_CBWR_BRANCH))


# glibc's allocator in the jobs. torch's CPU tensors are plain malloc, and glibc serves a large one
# (past a threshold it sets as it goes) by a fresh mmap whose pages the kernel zeroes on first touch
# and takes back on free: SmolLM2's exact-patching job took 4.3 million page faults and 7.5 s of
# system time. Served from the heap up to 32 MiB (glibc's most) and the heap not trimmed, freed
# tensors are reused: 0.4 million faults, 1.3 s. The arithmetic is the same, so are the numbers;
# a job's peak memory moves by a few percent either way (benchmarks/README.md, "Allocator").
JOB_MALLOC = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296:glibc.malloc.top_pad=268435456"


def job_environment(environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """What the run adds to its jobs' environment: ``JOB_MALLOC`` as ``GLIBC_TUNABLES``, unless
    ``environ`` sets its own (a user's tunables are theirs). Read by glibc when a process starts:
    it reaches the job server and every job started after it is set."""
    return {} if "GLIBC_TUNABLES" in environ else {"GLIBC_TUNABLES": JOB_MALLOC}


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

"""Batched factorisations of many small matrices (a head's d_head x d_head cores and R factors),
wherever they run fastest.

On a GPU, torch runs a batch of k x k SVDs (k > 32) as one cuSOLVER call per matrix: at
Llama-2-70B shapes a job's ~2,000 of them took seconds, longer than its GEMMs. The host does each
in well under a millisecond, so a CUDA batch is copied to the host (in float64: the copy is a few
MB, and the host's LAPACK is as fast in float64), split over a thread pool (torch's batched
LAPACK calls loop over the batch on one thread; the threads release the GIL), and copied back.
``ON_HOST`` switches this off (the benchmark times both). CPU tensors are factored in place.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import torch

ON_HOST = True  # CUDA batches of small factorisations go to the host (module docstring)
MIN_CHUNK = 16  # matrices per host thread at least


def on_host(fn: Callable[[torch.Tensor], torch.Tensor | tuple[torch.Tensor, ...]], x: torch.Tensor,
            force: bool = False):
    """``fn(x)`` for a batch x [..., k, k] (``fn`` batched over the leading axes), computed on the
    host when x is on a GPU and ``ON_HOST`` is set (or ``force``: the tests' way to take this path
    on the CPU); the results in x's device and dtype."""
    if not (force or (x.is_cuda and ON_HOST)):
        return fn(x)
    flat = x.detach().reshape(-1, *x.shape[-2:]).to("cpu", torch.float64)
    workers = max(1, min(os.cpu_count() or 1, flat.shape[0] // MIN_CHUNK))
    chunks = flat.chunk(workers)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the pool is the parallelism: no intra-op threads under each of its threads
    try:
        with ThreadPoolExecutor(workers) as pool:
            parts = list(pool.map(fn, chunks))
    finally:
        torch.set_num_threads(threads)
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(cast(list[torch.Tensor], parts)).reshape(  # fn returns one kind for every chunk
            *x.shape[:-2], *first.shape[1:]).to(x.device, x.dtype)
    return tuple(torch.cat([p[i] for p in parts]).reshape(*x.shape[:-2], *first[i].shape[1:]).to(x.device, x.dtype)
                 for i in range(len(first)))

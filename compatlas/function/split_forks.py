"""One layer norm per split-QKV fork where no hook reads or patches it.

In split-QKV mode (``edge_attribution.split_inputs``) every attention layer of the
TransformerBridge forks the residual entering it per head (``[B, T, H, d_model]``: 9 query,
3 key and 3 value copies on SmolLM2), fires the fork's hook (``hook_q_input``...) and applies
the block's ln1 to every copy (``_fork_and_norm_per_head``). Where no hook is registered on the
fork's hook point the H copies are equal, so ``shared_forks`` norms one (the bridge's own
method with one head) and expands it to H heads, materialised (``.contiguous()``) so that the
per-head projection sees the layout it saw before. A layer norm is a function of its row alone,
and on every architecture measured on CPU (tiny GPT-2, Llama GQA, Pythia, Gemma and Gemma 3,
float32 and float64; SmolLM2-135M in float32, 1 and 2 threads) exact patching's and EAP's values
are bit for bit those of the H-copy norm (tests/test_split_forks.py); on SmolLM2 the per-head
norms were a tenth of exact patching's time. Off CPU (not measured) the forks are the bridge's own.

The decision is taken per fork and per call, from the hook point itself: a fork with any
forward or backward hook (the reader layer's patch in exact patching, EAP's gradient
captures) runs the bridge's own path unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

log = logging.getLogger(__name__)

METHOD = "_fork_and_norm_per_head"
_warned: list[bool] = []  # the missing-method line is logged once per process
# Set by the tests to measure the bridge's own path (the shortcut forced off).
DISABLED = False
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _hooked(point: Any) -> bool:
    """Whether anything is registered on the hook point (a torch module), or on every module:
    then the fork is the bridge's own. Anything that is not a module counts as hooked."""
    glob = torch.nn.modules.module
    return any(getattr(point, h, True) or getattr(glob, "_global" + h, None) for h in _HOOKS)


def _shared(own):
    """``_fork_and_norm_per_head`` normalising one copy where the fork's hook point has no hook."""
    def fork(source: torch.Tensor, hook: Any, n_heads: int) -> torch.Tensor:
        if n_heads == 1 or source.device.type != "cpu" or _hooked(hook):  # bits measured on CPU only
            return own(source, hook, n_heads)
        one = own(source, hook, 1)
        return one.expand(*one.shape[:2], n_heads, one.shape[3]).contiguous()
    return fork


def _attentions(model) -> list:
    """The bridge's attention components with a split-QKV fork of their own."""
    return [m for m in model.modules() if callable(getattr(type(m), METHOD, None))]


@contextmanager
def shared_forks(model) -> Iterator[None]:
    """For the duration, every fork with no hook registered normalises one copy (module docstring).
    Nested uses are no-ops; a bridge without ``_fork_and_norm_per_head`` runs unchanged (logged once)."""
    if DISABLED:
        yield
        return
    attentions = _attentions(model)
    if not attentions:
        if not _warned:
            _warned.append(True)
            log.info("split-QKV forks normalised per head: %s has no %s", type(model).__name__, METHOD)
        yield
        return
    patched = [m for m in attentions if METHOD not in vars(m)]  # the others: an enclosing shared_forks
    for m in patched:
        object.__setattr__(m, METHOD, _shared(getattr(m, METHOD)))
    try:
        yield
    finally:
        for m in patched:
            vars(m).pop(METHOD, None)

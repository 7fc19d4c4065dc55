"""Running a bridge from layer l up: the blocks below replaced by the clean residual stream.

Exact ablation, exact edge patching and ``eap_attn`` all change something at layer l and rerun
the model; the layers below see only clean inputs, so their output is cached once per batch
(TransformerLens's ``blocks.{l}.hook_in``) and handed on instead of recomputed. This needs the
Hugging Face module list that runs the bridge's blocks; where there is none, nothing is skipped
and the whole model reruns (same values, more time). Tests check skipped against whole runs.
The other end: a hook that raises ``StopForward`` ends a pass once it has what it was run for.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

UNEMBED_IN = "unembed.hook_in"  # the unembedding's input: where a pass that needs no logits can stop


class StopForward(Exception):
    """Raised by a hook where the pass has given what it was run for: nothing above is computed."""


def stop_forward(x, hook):
    raise StopForward


def block_list(model) -> torch.nn.ModuleList | None:
    """The Hugging Face module list that runs the bridge's blocks (``model.layers``, ``transformer.h``, ...)."""
    hf = getattr(model, "original_model", None)
    blocks = getattr(model, "blocks", None)
    if hf is None or blocks is None or not len(blocks):
        return None
    for module in hf.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == len(blocks) and module[0] is blocks[0]:
            return module
    return None


class Skip(torch.nn.Module):
    """Stands in for a block below the changed layer. The block just below returns the clean
    residual stream cached for the batch (the input the changed layer saw in the clean pass);
    lower ones pass their input on. ``arity``: the block returns a tuple of that length (0: a tensor)."""

    def __init__(self, residual: torch.Tensor | None, arity: int):
        super().__init__()
        self.residual, self.arity = residual, arity

    def forward(self, hidden_states, *args, **kwargs):
        h = hidden_states if self.residual is None else self.residual
        return (h,) + (None,) * (self.arity - 1) if self.arity else h


@contextmanager
def skip_below(layers: torch.nn.ModuleList | None, start: int, resid: torch.Tensor | None, arity: int) -> Iterator[None]:
    """Blocks below ``start`` replaced by ``Skip`` for the duration: the one just below hands on
    ``resid``, the clean stream entering ``start``. Nothing is skipped without a block list."""
    if layers is None or start == 0:
        yield
        return
    saved = [layers[i] for i in range(start)]
    try:
        for i in range(start):
            layers[i] = Skip(resid if i == start - 1 else None, arity)
        yield
    finally:
        for i, block in enumerate(saved):
            layers[i] = block


@contextmanager
def arity_probe(layers: torch.nn.ModuleList | None) -> Iterator[list[int]]:
    """What a block returns, seen on the first block during a clean pass: a tuple of some length,
    or a tensor (0); ``Skip`` must return the same. Yields a one-item list filled by the pass."""
    arity = [0]

    def shape(module, args, output):
        arity[0] = len(output) if isinstance(output, tuple) else 0

    handle = layers[0].register_forward_hook(shape) if layers is not None else None
    try:
        yield arity
    finally:
        if handle is not None:
            handle.remove()

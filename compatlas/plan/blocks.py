"""How many composition jobs a model's cell gets: ``blocks`` as the config gives it, or ``auto``
resolved from the model's size and the memory a job gets (``composition.job_memory_gb``), and what
the user is told about it. The jobs are tiles of the layer grid (``compatlas.tiles``)."""

from __future__ import annotations

from collections.abc import Sequence

from compatlas.tiles import Shape, auto_blocks, tiling

JOB_MEMORY_GB = 16.0  # composition.job_memory_gb when the config gives none (no schema default: jobs keep their params)


def resolve_blocks(name: str, kind: str, layers: Sequence[int] | None, shape: Shape | None, asked: int | str,
                   job_memory_gb: float = JOB_MEMORY_GB) -> tuple[int, tuple[str, ...]]:
    """A model's composition jobs per cell, and notes: the config's count, or for ``auto`` the fewest
    whose largest job fits ``job_memory_gb`` (``tiles.auto_blocks``: its touched layers' float32
    attention weights, their per-head factors and one tile of products), where the model's
    dimensions are known without loading it (built and trained models); 1 for the others, said in a note."""
    notes: tuple[str, ...] = ()
    key = f"models.{name}.blocks"
    if asked != "auto":
        blocks = int(asked)
    elif shape is None or layers is None:
        blocks = 1
        notes = (f"{key}: auto gives 1 block: a {kind} model's size is not known before it is loaded; set blocks "
                 "to a number to split its composition jobs (docs/configuration.md#choosing-the-block-size)",)
    else:
        blocks, need = auto_blocks(len(layers), shape, job_memory_gb * 1e9)
        if need > job_memory_gb * 1e9:
            notes = (f"{key}: auto gives {blocks} blocks (every tile one layer by one layer), and a job still "
                     f"needs about {need / 1e9:.1f} GB, more than composition.job_memory_gb: {job_memory_gb:g}",)
    # a job beyond the tiles of the layer grid scores nothing
    if layers is not None and blocks > (n_tiles := len(tiling(len(layers), blocks).tiles)):
        notes += (f"models.{name}: blocks {blocks} is more than the {n_tiles} tiles of its {len(layers)} layers' "
                  f"grid: {blocks - n_tiles} of its composition jobs per metric x space x checkpoint score nothing "
                  f"(blocks: {n_tiles} is enough)",)
    return blocks, notes

"""The checks of one model that need more than the schema: its checkpoints known (a series
expanded, a training run's made), its source's files read where they are local (a layer outside
the model, from a folder's config.json or a GGUF header; an empty folder; a step the family
never published; two checkpoints with one label). ``compatlas.plan`` calls ``check_model`` while
it resolves each model: the plan resolves, these check, and neither climbs back into the other.

Errors name the config key and the problem in one line (``ConfigError``)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from compatlas.plan.checkpoints import checkpoint_label, hub_series
from compatlas.plan.config import ConfigError

# files that carry a tokenizer's vocabulary (tokenizer_config.json alone does not)
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def check_model(model_id: str, entry: Mapping[str, Any], training: Mapping[str, Any], check_sources: bool) -> int | None:
    """Check what a model's jobs would fail on, its checkpoints known (a series expanded, a training
    run's made: ``compatlas.plan``); return its layer count where it is known without loading it
    (built, trained; local and GGUF with ``check_sources``, from their files), else None."""
    src, key = entry["source"], f"models.{model_id}"
    layers = entry.get("layers")
    n_layers = None
    if layers and layers[0] > layers[1]:
        raise ConfigError(f"config error at {key}.layers: first layer {layers[0]} is after last layer {layers[1]}")
    if src["kind"] == "trained":
        n_layers = training[src["run"]]["n_layers"]
    if src["kind"] == "build":
        n_layers = src["n_layers"]
        check_layers(key, layers, n_layers)
        if src["n_heads"] % src.get("n_kv_heads", src["n_heads"]):
            raise ConfigError(f"config error at {key}.source.n_kv_heads: {src['n_heads']} query heads "
                              f"cannot be grouped into {src['n_kv_heads']} KV heads")
    if src["kind"] == "hub":  # offline: the families' schedules ship with transformer_lens
        _check_hub_checkpoints(key, src, entry.get("checkpoints", []))
    if not check_sources:
        return n_layers
    if src["kind"] == "local":
        from compatlas.models.sources import ModelLoadError, local_model_dir

        try:
            folder = local_model_dir(src)
        except ModelLoadError as e:
            raise ConfigError(f"config error at {key}.source.package: {e}") from e
        if not folder.is_dir():
            raise ConfigError(f"config error at {key}.source.path: model directory {str(folder)!r} does not exist")
        n_layers = _local_n_layers(key, folder)
        check_layers(key, layers, n_layers)
    if src["kind"] == "gguf":
        from compatlas.models.sources import ModelLoadError, gguf_file, gguf_header

        try:
            header = gguf_header(gguf_file(src["package"], src.get("file")))
        except ModelLoadError as e:
            raise ConfigError(f"config error at {key}.source: {e}") from e
        n_layers = header.get("n_layers")
        check_layers(key, layers, n_layers)
    labels = [checkpoint_label(c) for c in entry.get("checkpoints", [])]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"config error at {key}.checkpoints: duplicate checkpoint labels {labels}")
    if labels and src["kind"] not in ("hub", "trained"):
        raise ConfigError(f"config error at {key}.checkpoints: checkpoints need a hub source "
                          "(or a training run, which makes its own)")
    return n_layers


def _local_n_layers(key: str, folder: Path) -> int | None:
    """The layer count of a save_pretrained folder, read from its config.json (no weights loaded);
    a folder that is not a whole model with its tokenizer is an error here, not in a job."""
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        what = "is empty" if not any(folder.iterdir()) else "has no config.json"
        raise ConfigError(f"config error at {key}.source.path: model directory {str(folder)!r} {what} "
                          "(expected a save_pretrained folder: config.json, weights, tokenizer)")
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"config error at {key}.source.path: model directory {str(folder)!r} has no tokenizer "
                          f"(none of {', '.join(TOKENIZER_FILES)}); save it there with tokenizer.save_pretrained")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"config error at {key}.source.path: cannot read {cfg_file}: {e}") from e
    for node in (cfg, cfg.get("text_config") or {}):
        for k in LAYER_KEYS:
            if isinstance(node.get(k), int):
                return node[k]
    return None


def check_layers(key: str, layers: Sequence[int] | None, n_layers: int | None) -> None:
    if layers and n_layers is not None and layers[1] >= n_layers:
        raise ConfigError(f"config error at {key}.layers: layer {layers[1]} is outside the model "
                          f"(it has {n_layers} layers, 0..{n_layers - 1})")


def _check_hub_checkpoints(key: str, src: Mapping[str, Any], checkpoints: Sequence[Mapping[str, Any]]) -> None:
    """What the extract job would fail on, said before any job: a revision named twice, a step the
    family never published, an index past its schedule."""
    for i, c in enumerate(checkpoints):
        named = [k for k in ("value", "index", "revision") if k in c]
        if len(named) > 1:
            raise ConfigError(f"config error at {key}.checkpoints.{i}: a checkpoint names one of value, index or "
                              f"revision, not {' and '.join(named)}")
        if src.get("revision") and named and named[0] in ("value", "index"):
            raise ConfigError(f"config error at {key}.source.revision: a checkpoint `{named[0]}` selects the revision "
                              f"itself; drop source.revision (or give the checkpoints as revisions)")
    series = hub_series(src["name"])
    for i, c in enumerate(checkpoints):
        if series is None:
            if "value" in c or "index" in c:
                raise ConfigError(f"config error at {key}.checkpoints.{i}: {src['name']} has no known checkpoint "
                                  "schedule (Pythia, stanford-crfm); name the checkpoint by its `revision`")
            continue
        labels = series[0]
        if "value" in c and c["value"] not in labels:
            near = sorted(labels, key=lambda s: abs(s - c["value"]))[:2]
            raise ConfigError(f"config error at {key}.checkpoints.{i}.value: {c['value']} is not a published checkpoint "
                              f"of {src['name']} (nearest: {sorted(near)})")
        if "index" in c and not -len(labels) <= c["index"] < len(labels):
            raise ConfigError(f"config error at {key}.checkpoints.{i}.index: {c['index']} is out of range "
                              f"({src['name']} has {len(labels)} checkpoints, 0..{len(labels) - 1})")

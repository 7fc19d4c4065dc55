"""Configuration: validated against workflow/schemas/config.schema.yaml before any job runs.

``validate_config`` says whether a config is well formed and fills in the schema's defaults, on
a copy (the user's dict is left as written). What the pipeline does with it (models, checkpoints,
layers, overrides) is resolved once from the validated copy, in ``compatlas.plan``, which calls
``check_model`` on each model once its checkpoints are known: a step the family never published,
a layer outside the model (read from a local folder's config.json or a GGUF header), two
checkpoints with one label.

Errors name the config key and the problem in one line, e.g.
``config error at models.toy.source.architecture: 'gpt3' is not one of ['gpt2', 'llama']``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from compatlas.checkpoints import checkpoint_label, hub_series

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "workflow" / "schemas" / "config.schema.yaml"


class ConfigError(ValueError):
    pass


def _key(path) -> str:
    return ".".join(str(p) for p in path) or "<top level>"


def _fill_defaults(schema: dict, node: Any, root: dict) -> None:
    """Set schema defaults in place (jsonschema validates but does not fill)."""
    if not isinstance(node, dict):
        return
    for name, sub in schema.get("properties", {}).items():
        if "$ref" in sub:
            sub = _resolve(root, sub["$ref"])
        if name not in node and "default" in sub:
            node[name] = copy.deepcopy(sub["default"])
        if name in node:
            _fill_defaults(sub, node[name], root)
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        sub = _resolve(root, extra["$ref"]) if "$ref" in extra else extra
        for name, value in node.items():
            if name not in schema.get("properties", {}):
                _fill_defaults(sub, value, root)


def _resolve(root: dict, ref: str) -> dict:
    node: Any = root
    for part in ref.lstrip("#/").split("/"):
        node = node[part]
    return node


def _explain(error) -> str:
    """One line for the most specific schema error (oneOf: the branch whose `kind` matches)."""
    import jsonschema

    if error.validator == "oneOf" and isinstance(error.instance, dict):
        kind = error.instance.get("kind")
        for sub in error.context or []:
            branch = sub.schema_path[0] if sub.schema_path else None
            if sub.validator == "const" and list(sub.path) == ["kind"]:
                continue
            kinds = [s.get("$ref", "").rsplit("/", 1)[-1] for s in error.schema["oneOf"]]
            if branch is not None and kinds[branch] == kind:
                return _explain(sub) if sub.context else _line(sub)
        return (f"config error at {_key(error.absolute_path)}.kind: {kind!r} is not a source kind "
                "(hub, local, gguf, build)" if kind else f"config error at {_key(error.absolute_path)}: source needs a 'kind'")
    return _line(jsonschema.exceptions.best_match([error]))


def _line(error) -> str:
    msg = f"unknown key: {error.message}" if error.validator == "additionalProperties" else error.message
    return f"config error at {_key(error.absolute_path)}: {msg}"


def validate_config(config: Mapping[str, Any], schema_path: Path = SCHEMA_PATH) -> dict[str, Any]:
    """The config with its schema defaults filled, as a new dict (``config`` is left as the user
    wrote it); raise ConfigError with one clear line if it breaks the schema or a rule the schema
    cannot state (a training run's spans, a run named like a model, nothing to score).

    What needs the config resolved (checkpoint series, a model's layer count, checkpoint labels)
    is checked while it is planned: ``compatlas.plan.build_plan`` validates, then plans."""
    import jsonschema

    schema = yaml.safe_load(schema_path.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    # deepest error first; at equal depth an unknown key explains more than a missing one
    errors = sorted(validator.iter_errors(config),
                    key=lambda e: (len(list(e.absolute_path)), e.validator == "additionalProperties"))
    if errors:
        raise ConfigError(_explain(errors[-1]))
    validated = copy.deepcopy(config)
    _fill_defaults(schema, validated, schema)
    for run, spec in validated["training"].items():
        key = f"training.{run}"
        if run in validated["models"]:
            raise ConfigError(f"config error at {key}: a model of that name exists; training runs name models")
        if spec["min_span"] > spec["max_span"] or 2 * spec["max_span"] > spec["seq_len"]:
            raise ConfigError(f"config error at {key}: need min_span <= max_span <= seq_len / 2")
    if not validated["models"] and not validated["training"]:
        raise ConfigError("config error at models: no models (and no training runs) to score")
    return validated


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
        from compatlas.sources import ModelLoadError, local_model_dir

        try:
            folder = local_model_dir(src)
        except ModelLoadError as e:
            raise ConfigError(f"config error at {key}.source.package: {e}") from e
        if not folder.is_dir():
            raise ConfigError(f"config error at {key}.source.path: model directory {str(folder)!r} does not exist")
        n_layers = _local_n_layers(key, folder)
        check_layers(key, layers, n_layers)
    if src["kind"] == "gguf":
        from compatlas.sources import ModelLoadError, gguf_file, gguf_header

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

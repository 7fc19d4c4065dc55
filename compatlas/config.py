"""Configuration: validated against workflow/schemas/config.schema.yaml before any job runs.

Errors name the config key and the problem in one line, e.g.
``config error at models.toy.source.architecture: 'gpt3' is not one of ['gpt2', 'llama']``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

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


def validate_config(config: dict[str, Any], schema_path: Path = SCHEMA_PATH, check_sources: bool = True) -> dict[str, Any]:
    """Validate (and fill defaults in) a config dict; raise ConfigError with one clear message."""
    import jsonschema

    schema = yaml.safe_load(schema_path.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    # deepest error first; at equal depth an unknown key explains more than a missing one
    errors = sorted(validator.iter_errors(config),
                    key=lambda e: (len(list(e.absolute_path)), e.validator == "additionalProperties"))
    if errors:
        raise ConfigError(_explain(errors[-1]))
    _fill_defaults(schema, config, schema)
    for model_id, entry in config["models"].items():
        _check_model(model_id, entry, check_sources)
    return config


def _check_model(model_id: str, entry: dict[str, Any], check_sources: bool) -> None:
    src, key = entry["source"], f"models.{model_id}"
    layers = entry.get("layers")
    if layers and layers[0] > layers[1]:
        raise ConfigError(f"config error at {key}.layers: first layer {layers[0]} is after last layer {layers[1]}")
    if src["kind"] == "build":
        if layers and layers[1] >= src["n_layers"]:
            raise ConfigError(f"config error at {key}.layers: layer {layers[1]} is outside the model "
                              f"(it has {src['n_layers']} layers, 0..{src['n_layers'] - 1})")
        if src["n_heads"] % src.get("n_kv_heads", src["n_heads"]):
            raise ConfigError(f"config error at {key}.source.n_kv_heads: {src['n_heads']} query heads "
                              f"cannot be grouped into {src['n_kv_heads']} KV heads")
    if not check_sources:
        return
    if src["kind"] == "local":
        from compatlas.loading import ModelLoadError, local_model_dir

        try:
            folder = local_model_dir(src)
        except ModelLoadError as e:
            raise ConfigError(f"config error at {key}.source.package: {e}") from e
        if not folder.is_dir():
            raise ConfigError(f"config error at {key}.source.path: model directory {str(folder)!r} does not exist")
    if src["kind"] == "gguf":
        from compatlas.loading import ModelLoadError, check_gguf, gguf_file

        try:
            check_gguf(gguf_file(src["package"], src.get("file")))
        except ModelLoadError as e:
            raise ConfigError(f"config error at {key}.source: {e}") from e
    labels = [checkpoint_label(c) for c in entry.get("checkpoints", [])]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"config error at {key}.checkpoints: duplicate checkpoint labels {labels}")
    if labels and src["kind"] != "hub":
        raise ConfigError(f"config error at {key}.checkpoints: checkpoints need a hub source")


def checkpoint_label(ckpt: dict[str, Any]) -> str:
    if "label" in ckpt:
        return ckpt["label"]
    if "value" in ckpt:
        return f"step{ckpt['value']}"
    if "index" in ckpt:
        return f"index{ckpt['index']}"
    return ckpt["revision"]


def model_checkpoints(entry: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """label -> checkpoint spec as boot() takes it; a model without checkpoints has one, 'final'."""
    out = {}
    for c in entry.get("checkpoints", []):
        spec = {"label": checkpoint_label(c)}
        if "value" in c:
            spec.update(checkpoint_value=c["value"], step=c["value"])
        if "index" in c:
            spec["checkpoint_index"] = c["index"]
        if "revision" in c:
            spec["revision"] = c["revision"]
        out[spec["label"]] = spec
    return out or {"final": {"label": "final"}}


def selected_layers(entry: dict[str, Any], n_layers: int, model_id: str = "?") -> list[int]:
    """The layers to score; a range outside the model is an error naming the key."""
    first, last = entry.get("layers") or (0, n_layers - 1)
    if last >= n_layers:
        raise ConfigError(f"config error at models.{model_id}.layers: layer {last} is outside the model "
                          f"(it has {n_layers} layers, 0..{n_layers - 1})")
    return list(range(first, last + 1))


def induction_settings(config: dict[str, Any], model_id: str) -> dict[str, Any]:
    """The induction section with the model's overrides applied (nested sections key by key)."""
    merged = copy.deepcopy(config["induction"])
    for key, value in config["models"][model_id].get("induction", {}).items():
        if isinstance(value, dict):
            merged[key] = {**merged.get(key, {}), **value}
        else:
            merged[key] = value
    return merged

"""Configuration: validated against workflow/schemas/config.schema.yaml before any job runs.

``validate_config`` says whether a config is well formed and fills in the schema's defaults, on
a copy (the user's dict is left as written). What the pipeline does with it (models, checkpoints,
layers, overrides) is resolved once from the validated copy, in ``compatlas.plan``, which checks each model
(``compatlas.plan.model_checks``) once its checkpoints are known. This module knows the schema only:
it imports no other part of compatlas.

Errors name the config key and the problem in one line, e.g.
``config error at models.toy.source.architecture: 'gpt3' is not one of ['gpt2', 'llama']``.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "config.schema.yaml"


class ConfigError(ValueError):
    pass


# A model's (or training run's) name is a folder under results/ and a wildcard of every job: a
# letter or digit, then letters, digits, '_', '.' and '-' (no '/', no '..', no space or line break)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", re.ASCII)
# Values in a config once its YAML aliases are expanded: far above any real config (a model's
# entry is tens), far below what an alias bomb expands to
MAX_VALUES = 1_000_000
MAX_DEPTH = 64


def _key(path) -> str:
    return ".".join(str(p) for p in path) or "<top level>"


def _fill_defaults(schema: dict, node: Any, root: dict) -> None:
    """Set schema defaults in place (jsonschema validates but does not fill)."""
    if not isinstance(node, dict):
        return
    for name, sub in schema.get("properties", {}).items():
        if "$ref" in sub:  # a default beside the reference is this property's own
            sub = {**_resolve(root, sub["$ref"]), **({"default": sub["default"]} if "default" in sub else {})}
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
    return _one_line(f"config error at {_key(error.absolute_path)}: {msg}")


def _one_line(msg: str, limit: int = 300) -> str:
    """``msg`` on one line, a value quoted in it cut short (a long description must not become a
    line of megabytes)."""
    msg = " ".join(msg.split())
    return msg if len(msg) <= limit else msg[:limit] + " ..."


def validate_config(config: Mapping[str, Any], schema_path: Path = SCHEMA_PATH) -> dict[str, Any]:
    """The config with its schema defaults filled, as a new dict (``config`` is left as the user
    wrote it); raise ConfigError with one clear line if it breaks the schema or a rule the schema
    cannot state (a training run's spans, a run named like a model, nothing to score).

    What needs the config resolved (checkpoint series, a model's layer count, checkpoint labels)
    is checked while it is planned: ``compatlas.plan.build_plan`` validates, then plans."""
    import jsonschema

    check_size(config)  # before anything walks it: an alias bomb is tiny in memory, huge expanded
    _check_names(config)
    schema = yaml.safe_load(schema_path.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    # deepest error first; at equal depth an unknown key explains more than a missing one
    errors = sorted(validator.iter_errors(config),
                    key=lambda e: (len(list(e.absolute_path)), e.validator == "additionalProperties"))
    _check_blocks(config)  # before the schema's errors: its line for an anyOf says less
    if errors:
        raise ConfigError(_explain(errors[-1]))
    validated = copy.deepcopy(dict(config))  # a dict: the defaults are filled in place
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


def _check_names(config: Mapping[str, Any]) -> None:
    """Every model and training run is named by a safe path component (``NAME``), or ConfigError
    naming it (quoted: ``'toy\\n'``, a name with a line break, had passed)."""
    for section in ("models", "training"):
        entries = config.get(section)
        for name in entries if isinstance(entries, Mapping) else ():
            if not isinstance(name, str) or not NAME.fullmatch(name):
                raise ConfigError(_one_line(
                    f"config error at {section}.{name!r}: not a name a results folder can take: a letter or digit, "
                    "then letters, digits, '_', '.' and '-', at most 100 characters"))


def check_size(config: Any) -> None:
    """ConfigError naming the key when ``config`` holds more than MAX_VALUES values once its YAML
    aliases are expanded (an alias bomb: a few lines whose expansion every reader of the config, the
    schema's check and an error message among them, would walk), or nests deeper than MAX_DEPTH or
    into itself."""
    sizes: dict[int, int] = {}

    def size(node: Any, path: tuple[Any, ...]) -> int:
        if not isinstance(node, (dict, list)):
            return 1
        if id(node) in sizes:  # an alias of a value already counted: its expansion again
            if sizes[id(node)] < 0:
                raise ConfigError(_one_line(f"config error at {_key(path)}: a YAML alias refers to the value that holds it"))
            return sizes[id(node)]
        if len(path) > MAX_DEPTH:
            raise ConfigError(_one_line(f"config error at {_key(path[:MAX_DEPTH])}: nested deeper than {MAX_DEPTH} levels"))
        sizes[id(node)] = -1
        children = node.items() if isinstance(node, dict) else enumerate(node)
        sizes[id(node)] = 1 + sum(size(v, (*path, k)) for k, v in children)
        return sizes[id(node)]

    if (total := size(config, ())) <= MAX_VALUES:
        return
    path: list[Any] = []
    node = config
    while isinstance(node, dict) and node:  # down to the key whose value alone is too large
        key, child = max(node.items(), key=lambda kv: sizes.get(id(kv[1]), 1))
        if sizes.get(id(child), 1) <= MAX_VALUES:
            break
        path, node = [*path, key], child
    raise ConfigError(_one_line(f"config error at {_key(path)}: {sizes.get(id(node), total):,} values once its YAML "
                                f"aliases are expanded, more than {MAX_VALUES:,}: a config this large is a mistake "
                                "(aliases that repeat one another?)"))


def _check_blocks(config: Mapping[str, Any]) -> None:
    """``blocks`` (composition's, a model's or a training run's override) is a positive integer or
    ``auto``; anything else is a ConfigError naming the key."""
    places = [("composition", config.get("composition"))]
    for section in ("models", "training"):
        entries = config.get(section)
        if isinstance(entries, Mapping):
            places += [(f"{section}.{name}", entry) for name, entry in entries.items()]
    for key, node in places:
        if not isinstance(node, Mapping) or "blocks" not in node:
            continue
        value = node["blocks"]
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            continue
        raise ConfigError(f"config error at {key}.blocks: {value!r} is neither a positive integer nor auto")


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML keeps the last of two equal keys without a word (``metrics:`` twice plans only the
    second); a config file loaded with this refuses them."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *recipe``: its keys are defaults the mapping's own override
            continue
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise ConfigError(f"duplicate key '{key}' at line {line} (first at line {seen[key]}): YAML would keep "
                              "only the last; remove one")
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load_config_file(path: str | Path) -> Any:
    """A config file's YAML, refusing duplicate keys (``ConfigError`` naming the key and its
    line), text that is not UTF-8 and a content too large once its aliases are expanded
    (``check_size``), each in one line; ``yaml.YAMLError`` for YAML that does not parse."""
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"not UTF-8 text: byte 0x{raw[e.start]:02x} at line {line}; save it as UTF-8 "
                          "(e.g. iconv -f latin1 -t utf-8)") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except RecursionError:
        raise ConfigError(f"nested too deeply (more than {MAX_DEPTH} levels is a mistake)") from None
    check_size(data)
    return data

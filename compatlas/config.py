"""Configuration: validated against workflow/schemas/config.schema.yaml before any job runs.

Errors name the config key and the problem in one line, e.g.
``config error at models.toy.source.architecture: 'gpt3' is not one of ['gpt2', 'llama']``.
"""

from __future__ import annotations

import copy
import functools
import json
import re
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

    # models made from training runs by an earlier validation are made again below (idempotent)
    if isinstance(config.get("models"), dict):
        for name in [k for k, v in config["models"].items() if isinstance(v, dict)
                     and isinstance(v.get("source"), dict) and v["source"].get("kind") == "trained"]:
            del config["models"][name]
    schema = yaml.safe_load(schema_path.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    # deepest error first; at equal depth an unknown key explains more than a missing one
    errors = sorted(validator.iter_errors(config),
                    key=lambda e: (len(list(e.absolute_path)), e.validator == "additionalProperties"))
    if errors:
        raise ConfigError(_explain(errors[-1]))
    _fill_defaults(schema, config, schema)
    config.setdefault("models", {})
    _add_training_runs(config)
    if not config["models"]:
        raise ConfigError("config error at models: no models (and no training runs) to score")
    for model_id, entry in config["models"].items():
        if "checkpoint_series" in entry:
            _expand_series(model_id, entry)
        _check_model(model_id, entry, check_sources)
    return config


# tokens per training step, from the families' papers (Pythia: 1024 sequences x 2048 tokens;
# stanford-crfm's Mistral GPT-2 runs: 512 sequences x 1024 tokens)
TOKENS_PER_STEP = {"EleutherAI/pythia": 2_097_152, "stanford-crfm/": 524_288}
# families whose published checkpoint schedule transformer_lens knows offline (hub revisions)
SERIES_PREFIXES = ("EleutherAI/pythia", "pythia-", "stanford-crfm/")


@functools.lru_cache(maxsize=None)
def hub_series(name: str) -> tuple[tuple[int, ...], int | None] | None:
    """(published steps, tokens per step) of a hub family with a known schedule, else None.
    Offline: only families whose schedule transformer_lens ships (others would need the hub)."""
    if not name.startswith(SERIES_PREFIXES):
        return None
    if name.startswith("pythia-"):  # transformer_lens's alias of EleutherAI/pythia-*
        name = f"EleutherAI/{name}"
    from transformer_lens.tools.model_registry.checkpoints import get_checkpoint_labels

    try:
        labels, _ = get_checkpoint_labels(name)
    except ValueError:
        return None
    per_step = next((n for prefix, n in TOKENS_PER_STEP.items() if name.startswith(prefix)), None)
    return tuple(labels), per_step


def _checkpoint_step(series: tuple[tuple[int, ...], int | None] | None, ckpt: dict[str, Any]) -> int | None:
    """The training step a checkpoint is at, wherever it can be known without loading it."""
    if "value" in ckpt:
        return ckpt["value"]
    if series is None:
        return None
    labels = series[0]
    if "index" in ckpt and -len(labels) <= ckpt["index"] < len(labels):
        return labels[ckpt["index"]]
    m = re.fullmatch(r"(?:step|checkpoint-)(\d+)", str(ckpt.get("revision", "")))
    return int(m[1]) if m and int(m[1]) in labels else None


def _expand_series(model_id: str, entry: dict[str, Any]) -> None:
    """checkpoint_series -> checkpoints, from the family's published schedule (no network)."""
    from transformer_lens.tools.model_registry.checkpoints import get_checkpoint_labels

    key, series, src = f"models.{model_id}.checkpoint_series", entry.pop("checkpoint_series"), entry["source"]
    if src["kind"] != "hub":
        raise ConfigError(f"config error at {key}: checkpoint series need a hub source")
    try:
        published, _ = get_checkpoint_labels(src["name"])
    except Exception as e:
        raise ConfigError(f"config error at {key}: {src['name']!r} has no published checkpoint schedule ({e})") from e
    if "steps" in series:
        missing = sorted(set(series["steps"]) - set(published))
        if missing:
            raise ConfigError(f"config error at {key}.steps: {missing} are not published steps of {src['name']}")
        chosen = list(series["steps"])
    else:
        first, last = series.get("range", (published[0], published[-1]))
        chosen = [s for s in published if first <= s <= last]
    chosen = chosen[::series.get("every", 1)]
    per_step = next((n for prefix, n in TOKENS_PER_STEP.items() if src["name"].startswith(prefix)), None)
    have = {c.get("value") for c in entry.get("checkpoints", [])}
    merged = entry.get("checkpoints", []) + [  # labelled step<value> by checkpoint_label
        {"value": s, **({"tokens": s * per_step} if per_step else {})} for s in chosen if s not in have]
    # in training order when every checkpoint has a step (the last one is "final" for the audits)
    entry["checkpoints"] = sorted(merged, key=lambda c: c["value"]) if all("value" in c for c in merged) else merged


def _add_training_runs(config: dict[str, Any]) -> None:
    """Each training run becomes a model of the zoo, with a checkpoint per scheduled step."""
    from compatlas.training import schedule

    for run, spec in config["training"].items():
        key = f"training.{run}"
        if run in config["models"] and config["models"][run].get("source", {}).get("run") != run:
            raise ConfigError(f"config error at {key}: a model of that name exists; training runs name models")
        if spec["min_span"] > spec["max_span"] or 2 * spec["max_span"] > spec["seq_len"]:
            raise ConfigError(f"config error at {key}: need min_span <= max_span <= seq_len / 2")
        steps = schedule({**spec["schedule"], "steps": spec["steps"]})
        tokens_per_step = spec["batch_size"] * spec["seq_len"]
        entry = {
            "description": spec.get("description", f"attention-only, trained by the pipeline ({run})"),
            "source": {"kind": "trained", "run": run, "path": f"{config['results']}/train/{run}"},
            "processing": "none",
            "checkpoints": [{"value": n, "tokens": n * tokens_per_step} for n in steps],  # labels: step<n>
            # trained with BOS first (token 0 of the word-level tokenizer)
            "induction": {"prepend_bos": True, "pool": spec["d_vocab"]},
        }
        for key_ in ("spaces", "blocks"):
            if spec.get(key_):
                entry[key_] = spec[key_]
        config["models"][run] = entry


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
    if src["kind"] == "hub":  # offline: the families' schedules ship with transformer_lens
        _check_hub_checkpoints(key, src, entry.get("checkpoints", []))
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
        _check_layers(key, layers, _local_n_layers(key, folder))
    if src["kind"] == "gguf":
        from compatlas.loading import ModelLoadError, check_gguf, gguf_file

        try:
            header = check_gguf(gguf_file(src["package"], src.get("file")))
        except ModelLoadError as e:
            raise ConfigError(f"config error at {key}.source: {e}") from e
        _check_layers(key, layers, header.get("n_layers"))
    labels = [checkpoint_label(c) for c in entry.get("checkpoints", [])]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"config error at {key}.checkpoints: duplicate checkpoint labels {labels}")
    if labels and src["kind"] not in ("hub", "trained"):
        raise ConfigError(f"config error at {key}.checkpoints: checkpoints need a hub source "
                          "(or a training run, which makes its own)")


# files that carry a tokenizer's vocabulary (tokenizer_config.json alone does not)
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


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


def _check_layers(key: str, layers: list[int] | None, n_layers: int | None) -> None:
    if layers and n_layers is not None and layers[1] >= n_layers:
        raise ConfigError(f"config error at {key}.layers: layer {layers[1]} is outside the model "
                          f"(it has {n_layers} layers, 0..{n_layers - 1})")


def _check_hub_checkpoints(key: str, src: dict[str, Any], checkpoints: list[dict[str, Any]]) -> None:
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


def checkpoint_label(ckpt: dict[str, Any]) -> str:
    if "label" in ckpt:
        return ckpt["label"]
    if "value" in ckpt:
        return f"step{ckpt['value']}"
    if "index" in ckpt:
        return f"index{ckpt['index']}"
    return ckpt["revision"]


def model_checkpoints(entry: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """label -> checkpoint spec as boot() takes it, in training order (by step; checkpoints whose
    step is unknown, such as a named revision, last); a model without checkpoints has one, 'final'.

    The step and the tokens seen are filled wherever the series is known (an index or a
    ``step1000`` / ``checkpoint-100`` revision of Pythia or stanford-crfm, too)."""
    src = entry.get("source", {})
    series = hub_series(src["name"]) if src.get("kind") == "hub" else None
    specs = []
    for c in entry.get("checkpoints", []):
        spec = {"label": checkpoint_label(c)}
        if "value" in c:
            spec["checkpoint_value"] = c["value"]
        step = _checkpoint_step(series, c)
        if step is not None:
            spec["step"] = step
        if "tokens" in c:
            spec["tokens"] = c["tokens"]
        elif step is not None and series is not None and series[1]:
            spec["tokens"] = step * series[1]
        if "index" in c:
            spec["checkpoint_index"] = c["index"]
        if "revision" in c:
            spec["revision"] = c["revision"]
        specs.append(spec)
    specs.sort(key=lambda s: (s.get("step") is None, s.get("step") or 0))  # stable: config order otherwise
    return {s["label"]: s for s in specs} or {"final": {"label": "final"}}


def last_checkpoint(entry: dict[str, Any]) -> str:
    """The label of a model's latest checkpoint (largest step), the one "last" means."""
    return list(model_checkpoints(entry))[-1]


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


def trained_run(config: dict[str, Any], model_id: str) -> dict[str, Any] | None:
    """The training spec behind a model, or None for models that are not trained here."""
    src = config["models"][model_id]["source"]
    return config["training"][src["run"]] if src.get("kind") == "trained" else None

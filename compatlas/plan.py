"""The plan: what the pipeline does with a validated config, resolved once.

A config says things indirectly: a model inherits ``spaces``, ``blocks`` and the ``induction``
section unless it overrides them, a hub model may ask for a ``checkpoint_series`` of its
family's published steps, and a training run is a model too, with a checkpoint per scheduled
step. ``build_plan`` validates a config (``compatlas.config``) and resolves all of that into
frozen dataclasses, in the manner of nanoGPT's ``GPTConfig``:

- ``Plan``: the run's settings and its models, in config order (training runs last);
- ``ModelPlan``: one model with its source, layers, spaces, blocks, induction settings and
  checkpoints, every override applied;
- ``CheckpointPlan``: one checkpoint with its label, its training step and the tokens seen
  wherever they can be known without loading it.

``workflow/common.smk`` builds the plan when the workflow is parsed, and the rules hand each job
what it needs from it as ``params``; nothing else reads the config. What needs the config
resolved is checked here (a step the family never published, a layer outside the model, two
checkpoints with one label), with the one-line errors of ``compatlas.config``. The config a user
wrote is never changed: validation works on a copy and the plan keeps read-only views of it.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from compatlas.config import ConfigError, validate_config

# tokens per training step, from the families' papers (Pythia: 1024 sequences x 2048 tokens;
# stanford-crfm's Mistral GPT-2 runs: 512 sequences x 1024 tokens)
TOKENS_PER_STEP = {"EleutherAI/pythia": 2_097_152, "stanford-crfm/": 524_288}
# families whose published checkpoint schedule transformer_lens knows offline (hub revisions)
SERIES_PREFIXES = ("EleutherAI/pythia", "pythia-", "stanford-crfm/")
# files that carry a tokenizer's vocabulary (tokenizer_config.json alone does not)
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
# what a training segment does not depend on: adding checkpoints, or scoring them otherwise,
# must not change (and rerun) the segments already trained
NOT_SEGMENT_KEYS = ("steps", "schedule", "description", "spaces", "blocks")


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class CheckpointPlan:
    """One checkpoint of a model. ``value``, ``index`` and ``revision`` are as the config asked
    for it (a hub source resolves them to a revision); ``step`` and ``tokens`` are filled
    wherever the family's schedule (or the training run) tells them."""

    label: str
    step: int | None = None
    tokens: int | None = None
    value: int | None = None
    index: int | None = None
    revision: str | None = None

    def spec(self) -> dict[str, Any]:
        """The checkpoint as the loaders take it and the jobs record it (their ``params``: its
        keys and their order are part of what Snakemake compares to decide a rerun)."""
        spec: dict[str, Any] = {"label": self.label}
        if self.value is not None:
            spec["checkpoint_value"] = self.value
        if self.step is not None:
            spec["step"] = self.step
        if self.tokens is not None:
            spec["tokens"] = self.tokens
        if self.index is not None:
            spec["checkpoint_index"] = self.index
        if self.revision is not None:
            spec["revision"] = self.revision
        return spec


FINAL = CheckpointPlan("final")  # the one checkpoint of a model that lists none


@dataclass(frozen=True)
class ModelPlan:
    """One model of the zoo with every override resolved.

    ``entry`` is the model's config entry as its jobs see it: validated, a training run's made
    for it, without the checkpoint list (adding a checkpoint must not rerun the jobs of the
    others). ``layer_range`` is the ``[first, last]`` the config gave, if any; ``layers`` the
    layers to score where the model's size is known without loading it (``n_layers``: a built
    or trained model, a local or GGUF one whose files were read), else None."""

    name: str
    entry: Mapping[str, Any]
    checkpoints: tuple[CheckpointPlan, ...]
    layer_range: tuple[int, int] | None
    n_layers: int | None
    spaces: tuple[str, ...]
    blocks: int
    induction: Mapping[str, Any]
    training: Mapping[str, Any] | None  # the run behind a trained model, else None

    @property
    def source(self) -> Mapping[str, Any]:
        return self.entry["source"]

    @property
    def kind(self) -> str:
        return self.source["kind"]

    @property
    def layers(self) -> tuple[int, ...] | None:
        if self.n_layers is None:
            return None
        return tuple(scored_layers(self.layer_range, self.n_layers, self.name))

    @property
    def labels(self) -> tuple[str, ...]:
        """The checkpoint labels in training order."""
        return tuple(c.label for c in self.checkpoints)

    @property
    def last(self) -> CheckpointPlan:
        """The latest checkpoint (largest step), the one the audits and "last" mean."""
        return self.checkpoints[-1]

    def checkpoint(self, label: str) -> CheckpointPlan:
        for c in self.checkpoints:
            if c.label == label:
                return c
        raise KeyError(f"model {self.name} has no checkpoint {label!r}")

    def previous(self, label: str) -> CheckpointPlan | None:
        """The checkpoint before ``label`` in training order (the one a training segment resumes)."""
        i = self.labels.index(label)
        return self.checkpoints[i - 1] if i else None

    def segment_spec(self) -> dict[str, Any]:
        """What a training segment of this (trained) model depends on: the run without its
        length, schedule and what is scored of it."""
        if self.training is None:
            raise ValueError(f"model {self.name} is not trained by the pipeline")
        return {k: thaw(v) for k, v in self.training.items() if k not in NOT_SEGMENT_KEYS}


@dataclass(frozen=True)
class Plan:
    """The whole run: the validated config (defaults filled, read-only) and its models.

    The global sections are the config's own (``composition``, ``invariance``, ``induction``...);
    what a model overrides is resolved in its ``ModelPlan``."""

    config: Mapping[str, Any]
    models: Mapping[str, ModelPlan]

    @property
    def results(self) -> str:
        return self.config["results"]

    @property
    def metrics(self) -> tuple[str, ...]:
        return self.config["metrics"]

    def pairs(self) -> Iterator[tuple[ModelPlan, CheckpointPlan]]:
        """Every (model, checkpoint) of the zoo, models in config order, checkpoints in training order."""
        for model in self.models.values():
            for ckpt in model.checkpoints:
                yield model, ckpt

    def trained(self) -> list[ModelPlan]:
        return [m for m in self.models.values() if m.training is not None]


def build_plan(config: Mapping[str, Any], check_sources: bool = True) -> Plan:
    """Validate ``config`` and resolve it into the plan (``config`` is not changed). With
    ``check_sources``, local and GGUF sources are read (their files, their layer count) so that a
    missing folder or a layer outside the model is an error now, not in a job."""
    validated = validate_config(config)
    entries = {**validated["models"], **{run: _trained_entry(validated, run) for run in validated["training"]}}
    models = {}
    for model_id, raw in entries.items():
        entry = {k: v for k, v in raw.items() if k != "checkpoint_series"}
        if "checkpoint_series" in raw:
            entry["checkpoints"] = _expand_series(model_id, raw)
        n_layers = _check_model(model_id, entry, validated["training"], check_sources)
        models[model_id] = ModelPlan(
            name=model_id,
            entry=freeze({k: v for k, v in entry.items() if k != "checkpoints"}),
            checkpoints=_checkpoints(entry),
            layer_range=tuple(entry["layers"]) if entry.get("layers") else None,
            n_layers=n_layers,
            spaces=tuple(entry.get("spaces", validated["spaces"])),
            blocks=entry.get("blocks", validated["composition"]["blocks"]),
            induction=freeze(_induction_settings(validated["induction"], entry.get("induction", {}))),
            training=freeze(validated["training"][entry["source"]["run"]]) if entry["source"]["kind"] == "trained" else None,
        )
    return Plan(config=freeze(validated), models=MappingProxyType(models))


def scored_layers(layer_range: Sequence[int] | None, n_layers: int, model_id: str = "?") -> list[int]:
    """The layers to score of a model with ``n_layers`` layers: the config's inclusive ``[first,
    last]``, or all of them; a range outside the model is an error naming the key. Jobs call it
    with the plan's ``layer_range`` once the weights tell the size of a hub model."""
    first, last = layer_range or (0, n_layers - 1)
    if last >= n_layers:
        raise ConfigError(f"config error at models.{model_id}.layers: layer {last} is outside the model "
                          f"(it has {n_layers} layers, 0..{n_layers - 1})")
    return list(range(first, last + 1))


# ----------------------------------------------------------------------------- read-only values


def freeze(value: Any) -> Any:
    """A read-only copy of a YAML value: mappings become MappingProxyType, lists tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """The plain dicts and lists a frozen value was made from (Snakemake records a job's params
    by their ``repr``, and a rerun is decided on it: what the plan hands a job as params must be
    the plain values the config holds)."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


# ----------------------------------------------------------------------------- overrides


def _induction_settings(section: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The induction section with a model's overrides applied (nested sections key by key)."""
    merged = copy.deepcopy(dict(section))
    for key, value in overrides.items():
        if isinstance(value, Mapping):
            merged[key] = {**merged.get(key, {}), **value}
        else:
            merged[key] = value
    return merged


def _trained_entry(validated: dict[str, Any], run: str) -> dict[str, Any]:
    """The model a training run makes, with a checkpoint per scheduled step (labels: step<n>)."""
    spec = validated["training"][run]
    steps = schedule({**spec["schedule"], "steps": spec["steps"]})
    tokens_per_step = spec["batch_size"] * spec["seq_len"]
    entry = {
        "description": spec.get("description", f"attention-only, trained by the pipeline ({run})"),
        "source": {"kind": "trained", "run": run, "path": f"{validated['results']}/train/{run}"},
        "processing": "none",
        "checkpoints": [{"value": n, "tokens": n * tokens_per_step} for n in steps],
        # trained with BOS first (token 0 of the word-level tokenizer)
        "induction": {"prepend_bos": True, "pool": spec["d_vocab"]},
    }
    for key in ("spaces", "blocks"):
        if spec.get(key):
            entry[key] = copy.deepcopy(spec[key])
    return entry


def schedule(spec: Mapping[str, Any]) -> list[int]:
    """A training run's checkpoint steps: 0, the powers of ``log_base`` up to ``log_until``,
    and every ``every`` steps up to ``steps`` (which is always included)."""
    steps = spec["steps"]
    out = {0, steps}
    if spec.get("log_until"):
        p = 1
        while p <= min(spec["log_until"], steps):
            out.add(p)
            p *= spec["log_base"]
    if spec.get("every"):
        out.update(range(spec["every"], steps + 1, spec["every"]))
    return sorted(out)


# ----------------------------------------------------------------------------- checkpoints


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


def _checkpoint_step(series: tuple[tuple[int, ...], int | None] | None, ckpt: Mapping[str, Any]) -> int | None:
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


def checkpoint_label(ckpt: Mapping[str, Any]) -> str:
    if "label" in ckpt:
        return ckpt["label"]
    if "value" in ckpt:
        return f"step{ckpt['value']}"
    if "index" in ckpt:
        return f"index{ckpt['index']}"
    return ckpt["revision"]


def _checkpoints(entry: Mapping[str, Any]) -> tuple[CheckpointPlan, ...]:
    """A model's checkpoints in training order (by step; those whose step is unknown, such as a
    named revision, last, in config order); a model without checkpoints has one, ``final``.

    The step and the tokens seen are filled wherever the series is known (an index or a
    ``step1000`` / ``checkpoint-100`` revision of Pythia or stanford-crfm, too)."""
    src = entry["source"]
    series = hub_series(src["name"]) if src["kind"] == "hub" else None
    plans = []
    for c in entry.get("checkpoints", []):
        step = _checkpoint_step(series, c)
        tokens = c.get("tokens")
        if tokens is None and step is not None and series is not None and series[1]:
            tokens = step * series[1]
        plans.append(CheckpointPlan(label=checkpoint_label(c), step=step, tokens=tokens, value=c.get("value"),
                                    index=c.get("index"), revision=c.get("revision")))
    plans.sort(key=lambda p: (p.step is None, p.step or 0))  # stable: config order otherwise
    return tuple(plans) or (FINAL,)


def _expand_series(model_id: str, entry: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A model's checkpoints with its ``checkpoint_series`` added, from the family's published
    schedule (no network)."""
    from transformer_lens.tools.model_registry.checkpoints import get_checkpoint_labels

    key, series, src = f"models.{model_id}.checkpoint_series", entry["checkpoint_series"], entry["source"]
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
    merged = list(entry.get("checkpoints", [])) + [  # labelled step<value> by checkpoint_label
        {"value": s, **({"tokens": s * per_step} if per_step else {})} for s in chosen if s not in have]
    # in training order when every checkpoint has a step (the last one is "final" for the audits)
    return sorted(merged, key=lambda c: c["value"]) if all("value" in c for c in merged) else merged


# ----------------------------------------------------------------------------- checks


def _check_model(model_id: str, entry: Mapping[str, Any], training: Mapping[str, Any], check_sources: bool) -> int | None:
    """Check what a model's jobs would fail on; return its layer count where it is known without
    loading it (built, trained; local and GGUF with ``check_sources``), else None."""
    src, key = entry["source"], f"models.{model_id}"
    layers = entry.get("layers")
    n_layers = None
    if layers and layers[0] > layers[1]:
        raise ConfigError(f"config error at {key}.layers: first layer {layers[0]} is after last layer {layers[1]}")
    if src["kind"] == "trained":
        n_layers = training[src["run"]]["n_layers"]
    if src["kind"] == "build":
        n_layers = src["n_layers"]
        _check_layers(key, layers, n_layers)
        if src["n_heads"] % src.get("n_kv_heads", src["n_heads"]):
            raise ConfigError(f"config error at {key}.source.n_kv_heads: {src['n_heads']} query heads "
                              f"cannot be grouped into {src['n_kv_heads']} KV heads")
    if src["kind"] == "hub":  # offline: the families' schedules ship with transformer_lens
        _check_hub_checkpoints(key, src, entry.get("checkpoints", []))
    if not check_sources:
        return n_layers
    if src["kind"] == "local":
        from compatlas.loading import ModelLoadError, local_model_dir

        try:
            folder = local_model_dir(src)
        except ModelLoadError as e:
            raise ConfigError(f"config error at {key}.source.package: {e}") from e
        if not folder.is_dir():
            raise ConfigError(f"config error at {key}.source.path: model directory {str(folder)!r} does not exist")
        n_layers = _local_n_layers(key, folder)
        _check_layers(key, layers, n_layers)
    if src["kind"] == "gguf":
        from compatlas.loading import ModelLoadError, check_gguf, gguf_file

        try:
            header = check_gguf(gguf_file(src["package"], src.get("file")))
        except ModelLoadError as e:
            raise ConfigError(f"config error at {key}.source: {e}") from e
        n_layers = header.get("n_layers")
        _check_layers(key, layers, n_layers)
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


def _check_layers(key: str, layers: Sequence[int] | None, n_layers: int | None) -> None:
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

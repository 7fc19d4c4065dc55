"""The plan: what the pipeline does with a validated config, resolved once.

A config says things indirectly: a model inherits ``spaces``, ``blocks`` and the ``induction``
section unless it overrides them, a hub model may ask for a ``checkpoint_series`` of its
family's published steps, and a training run is a model too, with a checkpoint per scheduled
step. ``build_plan`` validates a config (``compatlas.plan.config``) and resolves all of that into
frozen dataclasses, in the manner of nanoGPT's ``GPTConfig``:

- ``Plan``: the run's settings and its models, in config order (training runs last);
- ``ModelPlan``: one model with its source, layers, spaces, blocks, induction settings and
  checkpoints, every override applied;
- ``CheckpointPlan``: one checkpoint with its label, its training step and the tokens seen
  wherever they can be known without loading it.

``workflow/common.smk`` builds the plan when the workflow is parsed, and the rules hand each job
what it needs from it as ``params``; nothing else reads the config. What can only be checked
once the config is resolved (a step the family never published, a layer outside the model, two
checkpoints with one label) is checked while planning, by ``compatlas.plan.model_checks.check_model``, with
the same one-line errors. The config a user wrote is never changed: validation works on a copy
and the plan keeps read-only views of it (``freeze``; ``thaw`` gives back plain values).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from compatlas.plan.blocks import JOB_MEMORY_GB, resolve_blocks
from compatlas.plan.checkpoints import checkpoint_label, checkpoint_step, hub_series, schedule, tokens_per_step
from compatlas.plan.config import ConfigError, validate_config
from compatlas.plan.job_memory import check_edge_attribution, machine_memory
from compatlas.plan.model_checks import check_layers, check_model
from compatlas.tiles import Shape, null_bytes
from compatlas.vocab import ACTIVATION_ONLY_METRICS

# what a training segment does not depend on: adding checkpoints, or scoring them otherwise,
# must not change (and rerun) the segments already trained
NOT_SEGMENT_KEYS = ("steps", "schedule", "description", "spaces", "blocks", "activation")


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
    or trained model, a local or GGUF one whose files were read), else None. ``blocks``: its
    composition jobs per cell, ``auto`` resolved (``compatlas.plan.blocks``)."""

    name: str
    entry: Mapping[str, Any]
    checkpoints: tuple[CheckpointPlan, ...]
    layer_range: tuple[int, int] | None
    n_layers: int | None
    spaces: tuple[str, ...]
    blocks: int
    induction: Mapping[str, Any]
    training: Mapping[str, Any] | None  # the run behind a trained model, else None
    activation: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # the text sample of its moments (activation space)

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

    @property
    def dims(self) -> Mapping[str, Any] | None:
        """The config's dimensions of a model built or trained here (n_layers, n_heads, d_head,
        d_vocab, maybe n_kv_heads); None for a loaded model, whose size is known once loaded."""
        if self.kind == "build":
            return self.source
        if self.kind == "trained":
            assert self.training is not None  # build_plan gives every trained model its run
            return self.training
        return None

    @property
    def parameters(self) -> int | None:
        """About how many parameters a model built or trained here has (12 d_model^2 per layer,
        embedding and unembedding); None for a loaded model, whose size is known once loaded."""
        if (dims := self.dims) is None:
            return None
        d_model = dims["n_heads"] * dims["d_head"]
        return dims["n_layers"] * 12 * d_model**2 + 2 * dims["d_vocab"] * d_model

    @property
    def shape(self) -> Shape | None:
        """The attention dimensions a composition job's memory depends on (``blocks: auto``), where
        the config gives them; None for a loaded model."""
        if (dims := self.dims) is None:
            return None
        return Shape(n_heads=dims["n_heads"], n_kv_heads=dims.get("n_kv_heads") or dims["n_heads"],
                     d_model=dims["n_heads"] * dims["d_head"], d_head=dims["d_head"])

    def cells(self, metrics: Sequence[str]) -> tuple[tuple[str, str], ...]:
        """The (metric, space) cells the model is scored in, metrics first: every metric in every
        space of the model's, but an activation-only metric (``pattern_output``: a forward pass's)
        in the activation space only. The config's metrics are the run's and its spaces the model's,
        so a run scoring residual space beside pattern_output leaves out the cells that cannot exist
        (refusing them would forbid that run; ``build_plan`` refuses a metric no model can score)."""
        return tuple((m, s) for m in metrics for s in self.spaces if m not in ACTIVATION_ONLY_METRICS or s == "activation")

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
    notes: tuple[str, ...] = ()  # what validation could not check (hub sources offline), to tell the user

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


def build_plan(config: Mapping[str, Any], check_sources: bool = True, check_hub: bool = False) -> Plan:
    """Validate ``config`` and resolve it into the plan (``config`` is not changed). With
    ``check_sources``, local and GGUF sources are read (their files, their layer count) so that a
    missing folder or a layer outside the model is an error now, not in a job. With
    ``check_hub``, the hub is asked once per repository whether it has it and every revision its
    checkpoints ask for (``compatlas.plan.hub_refs``); where it cannot be asked, ``Plan.notes`` says so."""
    validated = validate_config(config)
    entries = {**validated["models"], **{run: _trained_entry(validated, run) for run in validated["training"]}}
    models, resolved = {}, {}
    for model_id, raw in entries.items():
        entry = {k: v for k, v in raw.items() if k != "checkpoint_series"}
        if "checkpoint_series" in raw:
            entry["checkpoints"] = _expand_series(model_id, raw)
        n_layers = check_model(model_id, entry, validated["training"], check_sources)
        resolved[model_id] = entry
        models[model_id] = ModelPlan(
            name=model_id,
            entry=freeze({k: v for k, v in entry.items() if k != "checkpoints"}),
            checkpoints=_checkpoints(entry),
            layer_range=tuple(entry["layers"]) if entry.get("layers") else None,
            n_layers=n_layers,
            spaces=tuple(entry.get("spaces", validated["spaces"])),
            blocks=1,  # "auto" or the config's count: resolved below, once the model is planned
            induction=freeze(_induction_settings(validated["induction"], entry.get("induction", {}))),
            training=freeze(validated["training"][entry["source"]["run"]]) if entry["source"]["kind"] == "trained" else None,
            # a model's override replaces a key whole: its text source is not merged with the default's
            activation=freeze({**validated["activation"], **entry.get("activation", {})}),
        )
    for metric in set(ACTIVATION_ONLY_METRICS) & set(validated["metrics"]):
        if not any("activation" in m.spaces for m in models.values()):
            raise ConfigError(f"config error at metrics: {metric} is scored in the activation space only, and no "
                              "model has it (add activation to spaces)")
    notes = _check_hub_sources(resolved) if check_hub else ()
    composition = validated["composition"]
    budget = composition.get("job_memory_gb", JOB_MEMORY_GB)
    memory = machine_memory()
    for name, m in list(models.items()):
        blocks, why = resolve_blocks(name, m.kind, m.layers, m.shape, resolved[name].get("blocks", composition["blocks"]),
                                     budget)
        if m.shape is not None and (need := null_bytes(m.shape.d_model, m.shape.d_head, composition["baseline_samples"],
                                                       len(validated["metrics"]))) > budget * 1e9:
            raise ConfigError(f"config error at composition.baseline_samples: {composition['baseline_samples']} needs about "
                              f"{need / 1e9:,.1f} GB for one composition job's nulls of {name} (d_model "
                              f"{m.shape.d_model}, d_head {m.shape.d_head}), more than composition.job_memory_gb: "
                              f"{budget:g}; lower it (the default is 32)")
        models[name] = replace(m, blocks=blocks)
        notes += why
        check_edge_attribution(f"{'training' if name in validated['training'] else 'models'}.{name}",
                               resolved[name].get("induction", {}), m.induction, m.shape, m.n_layers, memory)
    return Plan(config=freeze(validated), models=MappingProxyType(models), notes=notes)


def _check_hub_sources(entries: Mapping[str, Mapping[str, Any]]) -> tuple[str, ...]:
    """Ask the hub about every hub source (once per repository); a ConfigError names the key of the
    first thing it does not have, and what validation could not check comes back as notes."""
    from compatlas.plan.hub_refs import HubCheckError, check_checkpoints, fetch_refs

    refs: dict[str, Any] = {}
    unchecked: dict[str, list[str]] = {}
    for model_id, entry in entries.items():
        src = entry["source"]
        if src["kind"] != "hub":
            continue
        key = f"models.{model_id}"
        try:
            if src["name"] not in refs:
                refs[src["name"]] = fetch_refs(src["name"])
            found = refs[src["name"]]
            if isinstance(found, str):
                unchecked.setdefault(found, []).append(model_id)
                continue
            check_checkpoints(src, entry.get("checkpoints", []), found)
        except HubCheckError as e:
            raise ConfigError(f"config error at {key}.{e.key}: {e}") from e
    return tuple(f"hub sources not checked against the hub ({why}): {', '.join(ids)}" for why, ids in unchecked.items())


def scored_layers(layer_range: Sequence[int] | None, n_layers: int, model_id: str = "?") -> list[int]:
    """The layers to score of a model with ``n_layers`` layers: the config's inclusive ``[first,
    last]``, or all of them; a range outside the model is an error naming the key. Jobs call it
    with the plan's ``layer_range`` once the weights tell the size of a hub model."""
    first, last = layer_range or (0, n_layers - 1)
    check_layers(f"models.{model_id}", (first, last), n_layers)
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
    for key in ("spaces", "blocks", "activation"):
        if spec.get(key):
            entry[key] = copy.deepcopy(spec[key])
    return entry


# ----------------------------------------------------------------------------- checkpoints


def _checkpoints(entry: Mapping[str, Any]) -> tuple[CheckpointPlan, ...]:
    """A model's checkpoints in training order (by step; those whose step is unknown, such as a
    named revision, last, in config order); a model without checkpoints has one, ``final``.

    The step and the tokens seen are filled wherever the series is known (an index or a
    ``step1000`` / ``checkpoint-100`` revision of Pythia or stanford-crfm, too)."""
    src = entry["source"]
    series = hub_series(src["name"]) if src["kind"] == "hub" else None
    plans = []
    for c in entry.get("checkpoints", []):
        step = checkpoint_step(series, c)
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
    per_step = tokens_per_step(src["name"])
    have = {c.get("value") for c in entry.get("checkpoints", [])}
    merged = list(entry.get("checkpoints", [])) + [  # labelled step<value> by checkpoint_label
        {"value": s, **({"tokens": s * per_step} if per_step else {})} for s in chosen if s not in have]
    # in training order when every checkpoint has a step (the last one is "final" for the audits)
    return sorted(merged, key=lambda c: c["value"]) if all("value" in c for c in merged) else merged

"""The closed sets of `compatlas.vocab` against the config schema's enums, so they cannot drift.

JSON Schema cannot import Python, so `workflow/schemas/config.schema.yaml` spells some sets out
again. Every enum of the schema (and the source kinds, spelled as one `const` per branch) must
be named in `SCHEMA_ENUMS` below and hold the same values as its vocabulary tuple; a new enum in the schema
fails here until it is added to `compatlas.vocab` (or listed as not a vocabulary set).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import yaml

from compatlas import vocab

SCHEMA = yaml.safe_load((Path(__file__).resolve().parents[1] / "workflow/schemas/config.schema.yaml").read_text())

# where in the schema (a path of keys, '*' for an array's items) -> the vocabulary it must equal
SCHEMA_ENUMS: dict[str, tuple[Any, ...]] = {
    "properties.device": vocab.DEVICES,
    "properties.dtype": vocab.SCORE_DTYPES,
    "properties.metrics.*": vocab.METRICS,
    "properties.spaces.*": vocab.SPACES,
    "$defs.activation_text.properties.kind": vocab.TEXT_KINDS,
    "properties.composition.properties.null_stratify": vocab.NULL_STRATIFY,
    "properties.composition.properties.null_pairs": vocab.NULL_PAIRS,
    "properties.invariance.properties.transforms.*": vocab.TRANSFORMS,
    "properties.induction.properties.dtype": vocab.FORWARD_DTYPES,
    "properties.induction.properties.device_map": vocab.DEVICE_MAPS,
    "properties.induction.properties.cpu_matmul": vocab.CPU_MATMULS,
    "properties.induction.properties.ablation.properties.mode": vocab.ABLATION_MODES,
    "properties.induction.properties.ablation.properties.method": vocab.CONFIG_ABLATION_METHODS,
    "properties.induction.properties.edge_attribution.properties.methods.*": vocab.EDGE_METHODS,
    "$defs.model.properties.processing": vocab.PROCESSINGS,
    "$defs.model.properties.norm_gains": vocab.NORM_GAINS,
    "$defs.model.properties.spaces.*": vocab.SPACES,
    "$defs.model.properties.induction.properties.dtype": vocab.FORWARD_DTYPES,
    "$defs.model.properties.induction.properties.device_map": vocab.DEVICE_MAPS,
    "$defs.model.properties.induction.properties.cpu_matmul": vocab.CPU_MATMULS,
    "$defs.model.properties.induction.properties.ablation.properties.mode": vocab.ABLATION_MODES,
    "$defs.model.properties.induction.properties.ablation.properties.method": vocab.CONFIG_ABLATION_METHODS,
    "$defs.model.properties.induction.properties.edge_attribution.properties.methods.*": vocab.EDGE_METHODS,
    "$defs.training_run.properties.spaces.*": vocab.SPACES,
    "$defs.training_run.properties.architecture": vocab.ARCHITECTURES,
    "$defs.training_run.properties.data": vocab.TRAINING_DATA,
    "$defs.build.properties.architecture": vocab.ARCHITECTURES,
}
# enums that are not sets of names compatlas works with: prepend_bos is auto or a boolean
NOT_VOCABULARY = {"properties.induction.properties.prepend_bos",
                  "$defs.model.properties.induction.properties.prepend_bos"}


def enums(node: Any, path: tuple[str, ...] = ()) -> dict[str, list[Any]]:
    """Every `enum` of the schema, by its path."""
    found: dict[str, list[Any]] = {}
    if isinstance(node, dict):
        if "enum" in node:
            found[".".join(path)] = node["enum"]
        for key, value in node.items():
            found |= enums(value, path + (("*",) if key == "items" else (key,)))
    elif isinstance(node, list):
        for value in node:
            found |= enums(value, path)
    return found


def test_every_schema_enum_is_a_vocabulary_set():
    found = enums(SCHEMA)
    unnamed = set(found) - set(SCHEMA_ENUMS) - NOT_VOCABULARY
    assert not unnamed, f"schema enums with no compatlas.vocab set (add one, and a line to SCHEMA_ENUMS): {unnamed}"
    missing = set(SCHEMA_ENUMS) - set(found)
    assert not missing, f"SCHEMA_ENUMS names enums the schema no longer has: {missing}"
    for path, values in SCHEMA_ENUMS.items():
        assert sorted(found[path]) == sorted(values), f"{path}: schema {found[path]} vs vocab {values}"


def test_defaults_of_list_settings_are_the_whole_vocabulary_in_its_order():
    """The metrics' default is every metric the kernel scores in any space; pattern_output (activation
    space only, a forward-pass cost per model) is asked for by name."""
    props = SCHEMA["properties"]
    assert tuple(props["metrics"]["default"]) == vocab.KERNEL_METRICS
    assert vocab.METRICS == vocab.KERNEL_METRICS + vocab.ACTIVATION_ONLY_METRICS
    assert tuple(props["invariance"]["properties"]["transforms"]["default"]) == vocab.TRANSFORMS


def test_source_kinds_are_the_schema_branches_plus_trained():
    kinds = [SCHEMA["$defs"][ref["$ref"].rsplit("/", 1)[-1]]["properties"]["kind"]["const"]
             for ref in SCHEMA["$defs"]["model"]["properties"]["source"]["oneOf"]]
    assert tuple(kinds) == vocab.CONFIG_SOURCE_KINDS
    assert set(vocab.SOURCE_KINDS) - set(kinds) == {"trained"}  # made by the config from training runs


def test_each_tuple_is_its_literal():
    for name, value in vars(vocab).items():
        if name.isupper() and not name.startswith("CONFIG_"):
            assert any(get_args(v) == value for k, v in vars(vocab).items() if not k.isupper()), name
    assert set(vocab.CONFIG_ABLATION_METHODS) <= set(vocab.ABLATION_METHODS)


def test_vocab_imports_nothing_heavy():
    import subprocess
    import sys

    code = "import sys, compatlas.vocab, compatlas.tables, compatlas.runtime; print(sorted(sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert not {"torch", "transformers", "transformer_lens", "numpy"} & set(eval(loaded))


def test_every_source_kind_has_a_loader():
    """The loader table covers the closed set of source kinds, no more, no less."""
    from compatlas.models.loading import LOADERS

    assert set(LOADERS) == set(vocab.SOURCE_KINDS)

"""Provenance checked where a file is read, not only recorded (docs/faults.md): a sealed shard
copied under another model's folder, a metadata file edited by hand or copied from another
model, non-finite weights, and a model folder changed since extraction each end in a one-line
error naming the file (and what to delete), never in another model's numbers with exit 0."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_hf_model
from test_faults import NUMBERS, composition_frame, make_atlas

from compatlas.atlas import build_atlas, query
from compatlas.models.loading import ModelLoadError, boot
from compatlas.models.small_models import word_tokenizer
from compatlas.models.weights import AttentionWeights, CorruptShardError, load_meta
from compatlas.storage import (
    BadShard,
    check_shards,
    checksum_path,
    read_sealed_json,
    sealed_json,
    shard_error,
    write_shard,
)


def test_a_sealed_shard_under_another_models_folder_is_named_set_aside_and_left_out(tmp_path):
    """toy-llama-gqa's shard (with its seal) copied under toy-gpt2's folder had been served as
    toy-gpt2's numbers, and recalibrated on, with exit 0."""
    db, shards, metas = make_atlas(tmp_path)
    a, b = shards["composition"]
    clean_a = query(db, "SELECT count(*), round(sum(score), 9) FROM composition WHERE model = 'a'").row(0)
    shutil.copy(a, b)
    shutil.copy(checksum_path(a), checksum_path(b))
    assert "its provenance says model=a (its path: model=b)" in shard_error(b)
    with pytest.raises(BadShard, match=r"model=b/.*block=0.parquet is corrupt or truncated \(its provenance says model=a"):
        check_shards([b], tmp_path / "results")  # what every job that reads it does: set aside, named
    assert not b.exists() and list((tmp_path / "results" / "quarantine").rglob("block=0.parquet.*"))
    shutil.copy(a, b)
    shutil.copy(checksum_path(a), checksum_path(b))
    build_atlas(db, shards, metas)  # the atlas build leaves it out and says so
    excluded = query(db, "SELECT path, error FROM excluded_shards").rows()
    assert len(excluded) == 1 and "model=b" in excluded[0][0] and "provenance says model=a" in excluded[0][1]
    assert query(db, "SELECT count(*) FROM composition WHERE model = 'b'").item() == 0
    assert query(db, "SELECT count(*), round(sum(score), 9) FROM composition WHERE model = 'a'").row(0) == clean_a
    assert query(db, NUMBERS).row(0)[2] == 2  # both models still listed


def test_a_metadata_file_edited_by_hand_or_copied_from_another_model_is_refused(tmp_path):
    """moments.json's attn_scale 4.0 -> 5.0 had changed every activation-space score with exit 0."""
    meta = tmp_path / "moments" / "toy-gpt2" / "final" / "moments.json"
    meta.parent.mkdir(parents=True)
    record = {"model": "toy-gpt2", "checkpoint": "final", "attn_scale": 4.0, "moments_sha256": "ab"}
    meta.write_text(sealed_json(record))
    assert {k: v for k, v in read_sealed_json(meta).items() if k != "content_sha256"} == record
    meta.write_text(meta.read_text().replace('"attn_scale": 4.0', '"attn_scale": 5.0'))
    with pytest.raises(CorruptShardError, match=r"cannot trust metadata .*toy-gpt2/final/moments.json: .* was changed after "
                                                r"it was written .*; delete .*toy-gpt2/final and rerun snakemake"):
        load_meta(meta)
    # a whole, sealed file of another model, copied into this model's folder
    other = tmp_path / "weights" / "toy-gpt2" / "final" / "meta.json"
    other.parent.mkdir(parents=True)
    other.write_text(sealed_json({"model": "toy-llama-gqa", "checkpoint": "final", "weights_sha256": "cd"}))
    with pytest.raises(CorruptShardError, match=r"says model=toy-llama-gqa \(its folder: toy-gpt2\): copied or moved"):
        load_meta(other)
    # a file written before metadata was sealed is read as it is (no content_sha256 to check)
    other.write_text(json.dumps({"model": "toy-gpt2", "checkpoint": "final"}))
    assert load_meta(other)["model"] == "toy-gpt2"


def test_non_finite_attention_weights_are_refused_naming_the_tensor_and_the_model():
    w = AttentionWeights(W_Q=torch.zeros(2, 2, 8, 4), W_K=torch.zeros(2, 2, 8, 4), W_V=torch.zeros(2, 2, 8, 4),
                         W_O=torch.zeros(2, 2, 4, 8), W_E=torch.zeros(16, 8), meta={"source_path": "/models/m"})
    w.validate()
    w.W_K[1, 0, 3, 2] = float("nan")
    w.W_K[0, 1, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"W_K holds 2 non-finite values \(NaN or inf\) in /models/m"):
        w.validate()


def _tiny_folder(folder: Path) -> Path:
    torch.manual_seed(0)
    tiny_hf_model("gpt2", 64, n_layer=2, n_head=2, n_embd=16, n_positions=32).save_pretrained(folder)
    word_tokenizer(64, folder)
    return folder


def test_a_non_finite_parameter_anywhere_fails_the_boot_naming_it(tmp_path):
    """A NaN in one MLP weight: extraction (attention only) cannot see it; every job that runs the
    model (induction, edge attribution, moments) had sealed NaN shards."""
    from safetensors.torch import load_file, save_file

    folder = _tiny_folder(tmp_path / "m")
    entry = {"source": {"kind": "local", "path": str(folder)}}
    boot(entry, None, folder)
    weights = load_file(folder / "model.safetensors")
    key = next(k for k in weights if "mlp.c_fc.weight" in k)
    weights[key][0, 0] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"parameter \S*mlp.c_fc.weight holds 1 non-finite value \(NaN or inf\) "
                                             rf"in the model at {folder}"):
        boot(entry, None, folder)


def test_a_model_folder_changed_since_extraction_is_refused(tmp_path):
    """64 floats of a k_proj changed in the model cache had changed head scores with exit 0."""
    from safetensors.torch import load_file, save_file

    folder = _tiny_folder(tmp_path / "m")
    entry = {"source": {"kind": "local", "path": str(folder)}}
    _, prov = boot(entry, None, folder)
    extracted = {"source_checksum": prov["source_checksum"]}
    boot(entry, None, folder, extracted=extracted)  # unchanged: boots
    weights = load_file(folder / "model.safetensors")
    key = next(k for k in weights if "attn.c_attn.weight" in k)
    weights[key][0, :64] += 0.01
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=rf"the weights in {folder} changed since extraction \(source_checksum"):
        boot(entry, None, folder, extracted=extracted)


def test_an_atlas_without_its_seal_is_not_trusted(tmp_path, caplog):
    """The seal deleted, then a read-write session deletes a model: queries had answered from the
    edited atlas with no warning (models 2 -> 1)."""
    import duckdb

    db, _, _ = make_atlas(tmp_path)
    clean = query(db, NUMBERS).row(0)
    checksum_path(db).unlink()
    con = duckdb.connect(str(db))
    con.execute("DELETE FROM models WHERE model = 'b'")
    con.close()
    assert query(db, NUMBERS).row(0) == clean
    assert "has no seal (atlas.duckdb.sha256), so its bytes cannot be checked; answering from the last good atlas" in caplog.text


def test_a_shard_computed_from_other_weights_than_its_models_extraction_is_left_out(tmp_path):
    """A shard whose provenance names other weights than its model's meta.json (an older extraction's
    shard, or one copied from another results folder with its seal): left out of the atlas, named,
    set aside so that the next run remakes it."""
    db, shards, metas = make_atlas(tmp_path)
    for meta, w in zip(metas, ("1" * 64, "2" * 64), strict=True):
        meta.write_text(sealed_json({**json.loads(meta.read_text()), "weights_sha256": w}))
    a, b = shards["composition"]
    write_shard(composition_frame("a"), a, {"model": "a", "checkpoint": "final", "weights_sha256": "1" * 64})
    write_shard(composition_frame("b", seed=1), b, {"model": "b", "checkpoint": "final", "weights_sha256": "3" * 64})
    build_atlas(db, shards, metas)
    excluded = query(db, "SELECT path, error FROM excluded_shards").rows()
    assert len(excluded) == 1 and "model=b" in excluded[0][0], excluded
    assert "computed from other weights than b/final's extraction (weights_sha256 333333333333..., the extraction's " \
           "222222222222...); set aside as" in excluded[0][1]
    assert query(db, "SELECT count(DISTINCT model) FROM composition").item() == 1 and not b.exists()


def test_a_shard_vanishing_while_a_connection_opens_degrades_only_its_view(tmp_path, monkeypatch, caplog):
    """During a rerun that remade a calibration shard, `SELECT ... FROM composition` had failed with
    "IO Error: No files found" for the other view's file: the shard went between the connection's
    check and its view's creation."""
    import compatlas.atlas.database as database

    db, shards, _ = make_atlas(tmp_path)
    gone = shards["head_scores"][1]
    original = database._parquet_view

    def vanish_then_view(name, paths, *args, **kwargs):
        if name == "head_scores" and gone.exists():
            gone.unlink()  # after the stat that let it in
        return original(name, paths, *args, **kwargs)

    monkeypatch.setattr(database, "_parquet_view", vanish_then_view)
    assert query(db, "SELECT count(DISTINCT model) FROM composition").item() == 2
    assert query(db, "SELECT list(DISTINCT model) FROM head_scores").item().to_list() == ["a"]
    assert "result shard " + str(gone) + " vanished while the connection opened" in caplog.text


def test_a_shard_with_nan_where_a_number_must_be_is_not_sealed(tmp_path):
    """NaN or inf in a column that must hold numbers (tables.MUST_BE_FINITE: edge attribution's 3,456 of
    3,456 NaN scores and head scores' NaN ablation drops had been sealed from a model with one NaN
    weight) is refused, naming the shard, the column and the count, and nothing is written; NaN where
    a statistic may be undefined (a drop's standard error) and NULL are kept. A shard written a part
    at a time is checked part by part."""
    import polars as pl

    from compatlas.storage import NonFiniteShard, write_shard_parts
    from compatlas.tables import EDGE_ATTRIBUTION_SCHEMA, HEAD_SCORES_SCHEMA

    heads = pl.DataFrame([{c: None for c in HEAD_SCORES_SCHEMA} | {"model": "a", "checkpoint": "final", "layer": 0,
                                                                    "head": h, "prev_token_mean": 0.1, "duplicate_mean": 0.0,
                                                                    "induction_mean": 0.2, "ablation_drop": 0.5,
                                                                    "ablation_drop_stderr": float("nan")} for h in range(8)],
                         schema=HEAD_SCORES_SCHEMA)
    path = tmp_path / "induction" / "model=a" / "checkpoint=final" / "heads.parquet"
    write_shard(heads, path, {"model": "a"})  # NaN where it may be, NULL elsewhere
    assert shard_error(path) is None
    path.unlink()
    checksum_path(path).unlink()
    bad = heads.with_columns(ablation_drop=pl.when(pl.col("head") < 3).then(float("nan")).otherwise(pl.col("ablation_drop")))
    bad = bad.with_columns(induction_mean=pl.when(pl.col("head") == 7).then(float("inf")).otherwise(pl.col("induction_mean")))
    with pytest.raises(NonFiniteShard, match=r"refusing to seal .*model=a/checkpoint=final/heads.parquet: ablation_drop "
                                             r"holds 3 NaN or infinite values, induction_mean holds 1 NaN or infinite "
                                             r"value \(of 8 rows\)"):
        write_shard(bad, path, {"model": "a"})
    assert not path.exists() and not checksum_path(path).exists() and not list(path.parent.glob(".*.tmp"))
    edges = pl.DataFrame([{c: None for c in EDGE_ATTRIBUTION_SCHEMA} | {"score": float("nan")}], schema=EDGE_ATTRIBUTION_SCHEMA)
    with pytest.raises(NonFiniteShard, match=r"edges.parquet: score holds 1 NaN or infinite value \(of 1 rows\)"):
        write_shard_parts([edges], tmp_path / "edges.parquet", {}, EDGE_ATTRIBUTION_SCHEMA)
    assert not (tmp_path / "edges.parquet").exists()

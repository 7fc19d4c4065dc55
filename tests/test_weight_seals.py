"""The weight shard's seals (``weights.shard_seals``): meta.json records a sha256 per layer and per
shared piece, and ``load_weights`` checks only what it reads. A byte flipped in layer k fails
exactly the loads (and composition jobs) that read layer k, naming the file and the layer; one in
W_E fails every load that reads W_E; metadata written before the seals still loads, through the
whole file's sha256."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import polars as pl
import pytest
import torch
from conftest import random_weights

from compatlas.composition.scores import block_pairs, null_pairs
from compatlas.composition.table import score_space
from compatlas.composition.token_space import add_space_factors
from compatlas.models.weights import SEALS, CorruptShardError, load_meta, load_weights, save_weights
from compatlas.storage import pieces_sha256, sealed_json

L = 5
KEY = ["comp", "writer_layer", "writer_head", "reader_layer", "reader_head"]


def sha(*tensors: torch.Tensor) -> str:
    """sha256 of the tensors' bytes concatenated, computed here apart from the package's code."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.fixture
def shard(tmp_path: Path):
    """A saved shard with every kind of tensor (GQA, ln1_w, W_U, ln_final_w, extras): the
    weights, the shard's path and its meta.json's."""
    w = random_weights(3, L=L, H=4, Hkv=2, d=16, dh=4, vocab=40, unembed=True, ln1=0.5, meta={"norm_type": "RMS"})
    w.ln_final_w = torch.rand(16, dtype=torch.float64)
    add_space_factors(w)
    tensors, meta = tmp_path / "weights.safetensors", tmp_path / "meta.json"
    save_weights(w, tensors, meta)
    return w, tensors, meta


def header(path: Path) -> tuple[dict, int]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), 8 + n


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def byte_of(path: Path, name: str, layer: int | None = None, n_layers: int = L) -> int:
    """The file offset of a byte inside tensor ``name`` (inside its layer ``layer``'s bytes)."""
    h, start = header(path)
    a, b = h[name]["data_offsets"]
    if layer is None:
        return start + (a + b) // 2
    per = (b - a) // n_layers
    return start + a + layer * per + per // 3


def test_the_seals_are_the_sha256_of_each_layers_bytes_and_of_each_shared_piece(shard):
    w, tensors, meta_path = shard
    meta = load_meta(meta_path)
    seals = meta[SEALS]
    assert seals["layer_keys"] == ["W_Q", "W_K", "W_V", "W_O", "ln1_w"]  # the documented order
    assert seals["layers"] == [sha(w.W_Q[k], w.W_K[k], w.W_V[k], w.W_O[k], w.ln1_w[k]) for k in range(L)]
    raw = tensors.read_bytes()
    _, start = header(tensors)
    assert seals["shared"] == {"header": hashlib.sha256(raw[:start]).hexdigest(), "W_E": sha(w.W_E), "W_U": sha(w.W_U),
                               "ln_final_w": sha(w.ln_final_w),
                               **{f"extra.{k}": sha(v) for k, v in w.extras.items()}}
    assert meta["weights_sha256"] == hashlib.sha256(raw).hexdigest()  # kept: provenance and the atlas use it


@pytest.mark.parametrize("k", [0, 2, L - 1])
def test_a_byte_flipped_in_layer_k_fails_exactly_the_loads_that_read_it(shard, k):
    w, tensors, meta = shard
    flip(tensors, byte_of(tensors, "W_V", k))
    for layers in ([k], [(k + 1) % L, k], list(range(L)), None):
        with pytest.raises(CorruptShardError) as e:
            load_weights(tensors, meta, layers=layers)
        msg = str(e.value)
        assert f"weight shard {tensors}" in msg and f"the bytes of layer {k} do not match the seal recorded in {meta}" in msg
        assert "rerun the extract rule" in msg
    for j in [j for j in range(L) if j != k]:
        part = load_weights(tensors, meta, layers=[j])
        for name in ("W_Q", "W_K", "W_V", "W_O", "ln1_w"):
            assert torch.equal(getattr(part, name), getattr(w, name)[[j]]), (j, name)
        assert torch.equal(part.W_E, w.W_E) and torch.equal(part.W_U, w.W_U)
    others = [j for j in range(L) if j != k]
    assert load_weights(tensors, meta, layers=others).layer_ids == tuple(others)
    assert load_weights(tensors, meta, layers=[k], verify=False).W_V[0].ne(w.W_V[k]).sum() == 1  # the flip, read as is


def test_several_bad_layers_are_all_named(shard):
    _, tensors, meta = shard
    flip(tensors, byte_of(tensors, "W_Q", 1))
    flip(tensors, byte_of(tensors, "ln1_w", 3))  # the last per-layer tensor, after W_E in the file
    with pytest.raises(CorruptShardError, match=r"the bytes of layers 1, 3 do not match their seals"):
        load_weights(tensors, meta)
    with pytest.raises(CorruptShardError, match=r"the bytes of layer 3 do not match"):
        load_weights(tensors, meta, layers=[3, 4])
    load_weights(tensors, meta, layers=[0, 2, 4])


@pytest.mark.parametrize("name", ["W_E", "W_U", "extra.R_token"])
def test_a_byte_flipped_in_the_vocabulary_side_fails_every_load_that_reads_it(shard, name):
    w, tensors, meta = shard
    flip(tensors, byte_of(tensors, name))
    for layers in ([0], [3], None):
        with pytest.raises(CorruptShardError, match=rf"weight shard {tensors} .*the bytes of {name} do not match the seal"):
            load_weights(tensors, meta, layers=layers)
    # a load that leaves the vocabulary side out reads none of it, nor checks it
    part = load_weights(tensors, meta, layers=[3], vocabulary=False)
    assert part.W_E is None and part.W_U is None and part.extras == {} and torch.equal(part.W_V, w.W_V[[3]])
    assert torch.equal(part.ln_final_w, w.ln_final_w)


def test_a_byte_flipped_in_the_header_or_ln_final_w_fails_every_load(shard):
    _, tensors, meta = shard
    _, start = header(tensors)
    good = tensors.read_bytes()
    for at, what in ((start - 1, "its header"), (byte_of(tensors, "ln_final_w"), "ln_final_w")):
        flip(tensors, at)
        for vocabulary in (True, False):
            with pytest.raises(CorruptShardError, match=rf"the bytes of {what} do not match"):
                load_weights(tensors, meta, layers=[2], vocabulary=vocabulary)
        tensors.write_bytes(good)


def test_a_truncated_or_grown_shard_fails_every_load(shard):
    _, tensors, meta = shard
    good = tensors.read_bytes()
    for bad in (good[:-8], good + b"\0"):
        tensors.write_bytes(bad)
        with pytest.raises(CorruptShardError, match=rf"weight shard {tensors} is corrupt or truncated: \d+ bytes, its header"):
            load_weights(tensors, meta, layers=[0], vocabulary=False)
    tensors.write_bytes(good[: len(good) // 2])
    with pytest.raises(CorruptShardError, match="is corrupt or truncated"):
        load_weights(tensors, meta, layers=[0], verify=False)  # past the end: cut short, even unverified
    with pytest.raises(ValueError, match=r"layers \[7\] are not in weight shard"):
        load_weights(tensors, meta, layers=[7], verify=False)


def test_metadata_without_seals_loads_through_the_whole_files_sha256(shard, caplog):
    """meta.json written before the seals: every load checks the whole file, and says why."""
    w, tensors, meta = shard
    old = {k: v for k, v in load_meta(meta).items() if k not in (SEALS, "content_sha256")}
    meta.write_text(sealed_json(old))
    with caplog.at_level(logging.INFO, logger="compatlas.models.weights"):
        part = load_weights(tensors, meta, layers=[1])
    assert torch.equal(part.W_K, w.W_K[[1]])
    assert any("records no per-layer seals" in r.getMessage() and "whole file's sha256" in r.getMessage()
               for r in caplog.records)
    flip(tensors, byte_of(tensors, "W_V", 3))
    with pytest.raises(CorruptShardError, match=rf"weight shard {tensors} is corrupt or truncated: sha256 .* does not match"):
        load_weights(tensors, meta, layers=[1])  # layer 1 is intact, but only the whole file was sealed


def test_pieces_sha256_equals_hashing_each_piece_apart(tmp_path):
    data = bytes(range(256)) * 5
    path = tmp_path / "f"
    path.write_bytes(data)
    pieces = {"a": [(0, 3), (10, 300), (301, 302)], "b": [(5, 700)], "empty": [(9, 9)], "overlap": [(200, 1280)]}
    for chunk in (1, 7, 64, 1 << 20):  # pieces across chunk boundaries
        whole, got = pieces_sha256(path, pieces, chunk=chunk)
        assert whole == hashlib.sha256(data).hexdigest()
        assert got == {k: hashlib.sha256(b"".join(data[a:b] for a, b in r)).hexdigest() for k, r in pieces.items()}
    with pytest.raises(ValueError, match="not ascending"):
        pieces_sha256(path, {"x": [(10, 20), (0, 5)]})
    with pytest.raises(ValueError, match=r"reach past its end"):
        pieces_sha256(path, {"x": [(1000, 2000)]})


def test_a_composition_job_fails_only_where_it_reads_the_flipped_byte(shard, tmp_path):
    """``composition_job``: a residual job reads neither W_E nor its seal, a token job does; a job
    whose block does not touch the flipped layer scores as from the whole model."""
    from compatlas.composition.shard_job import composition_job

    w, tensors, meta = shard
    layers, blocks = list(range(L)), 3
    settings = {"baseline_samples": 4, "seed": 0, "max_condition": 1e6}

    def job(space: str, block: int) -> pl.DataFrame:
        out = tmp_path / "out" / f"metric=frobenius/space={space}"
        causal, null = out / f"block={block}.parquet", out / f"null-block={block}.parquet"
        composition_job(tensors, meta, space, [causal], [null], layers=layers, blocks=blocks, block=block,
                        settings=settings, device="cpu", dtype="float64")
        return pl.concat([pl.read_parquet(causal), pl.read_parquet(null)]).sort(KEY)

    def expect(space: str, block: int) -> pl.DataFrame:
        pairs = block_pairs(layers, blocks, block) + null_pairs(layers, blocks, block)
        return score_space(w, ("frobenius",), space, pairs, baseline_samples=4, seed=0, device="cpu",
                           dtype="float64")[0]["frobenius"].sort(KEY)

    touched = {b: {x for p in block_pairs(layers, blocks, b) + null_pairs(layers, blocks, b) for x in p}
               for b in range(blocks)}
    flip(tensors, byte_of(tensors, "W_E"))
    for b in range(blocks):
        got = job("residual", b)  # W_E is not read: same scores as from the whole model
        assert got.select(KEY).equals(expect("residual", b).select(KEY))
        assert (got["score"] - expect("residual", b)["score"]).abs().max() == 0
        with pytest.raises(CorruptShardError, match="the bytes of W_E do not match"):
            job("token", b)
    flip(tensors, byte_of(tensors, "W_E"))  # the same flip again: W_E back as saved
    k = 4
    flip(tensors, byte_of(tensors, "W_O", k))
    for b in range(blocks):
        if k in touched[b]:
            with pytest.raises(CorruptShardError, match=rf"the bytes of layer {k} do not match"):
                job("residual", b)
        else:
            assert job("token", b).select(KEY, "score").equals(expect("token", b).select(KEY, "score"))
    assert any(k not in t for t in touched.values()) and any(k in t for t in touched.values())

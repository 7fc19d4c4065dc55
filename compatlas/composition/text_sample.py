"""The text a model's activation statistics are taken over (``compatlas.composition.moments``): where it
comes from, and its cut into token chunks.

Sources (``activation.text.kind`` in the config):

- ``stdlib``: the docstrings of a fixed list of Python standard-library modules, read at run
  time from the interpreter that runs the job (the repository carries no copied text). Works
  offline on every machine; its sha256 and token count go into provenance, since another Python
  version reads slightly different text.
- ``file``: a local UTF-8 text file, or JSON Lines with a ``text`` field per line.
- ``hub``: one file of a Hugging Face dataset repository (text or JSON Lines), downloaded once
  (a cluster with the hub, or its cache under ``HF_HUB_OFFLINE=1``).
- ``induction``: no text: random tokens of the model's clean pool, each chunk's second half a
  copy of its first (the induction task's own statistics; for the models trained here, whose
  word-level vocabulary reads any real text as unknown tokens).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Modules whose docstrings make the default sample: prose about programs, nothing to do with
# the induction task. Sorted, so the text is the same wherever these modules are the same.
STDLIB_MODULES = ("argparse", "asyncio.events", "collections", "csv", "dataclasses", "datetime", "decimal",
                  "email.message", "functools", "heapq", "http.client", "inspect", "json", "logging", "os",
                  "pathlib", "pickle", "random", "re", "shutil", "socket", "statistics", "string",
                  "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest.case", "urllib.parse",
                  "zipfile")


class TextSampleError(ValueError):
    """A text source that cannot give the sample asked for; says which source and why."""


@dataclass(frozen=True)
class TokenChunks:
    """``tokens`` [chunks, length] (BOS first where the model expects one) and what they came from."""

    tokens: torch.Tensor
    facts: dict[str, Any]


def stdlib_text() -> str:
    """The docstrings of STDLIB_MODULES and of their public classes and functions, in a fixed order."""
    parts: list[str] = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr in sorted(vars(module)):
            with warnings.catch_warnings():  # typing's deprecated aliases warn when read
                warnings.simplefilter("ignore", DeprecationWarning)
                obj = getattr(module, attr)
                if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                    continue
                if inspect.isclass(obj) or inspect.isfunction(obj):
                    parts.append(inspect.getdoc(obj) or "")
    return "\n\n".join(p for p in parts if p)


def _lines_or_text(raw: str, where: str) -> str:
    """A JSON Lines file's ``text`` fields joined, or the text itself."""
    if not where.endswith((".jsonl", ".json")):
        return raw
    texts = []
    for i, line in enumerate(raw.splitlines(), 1):
        if line.strip():
            try:
                texts.append(str(json.loads(line)["text"]))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise TextSampleError(f"{where}:{i}: not a JSON object with a 'text' field ({e})") from e
    return "\n\n".join(texts)


def _read_utf8(path: Path, what: str) -> str:
    """A text file's content; TextSampleError naming it where it is not UTF-8 or holds no text."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TextSampleError(f"{what} {path} is not UTF-8 text (byte {e.start}: {e.reason}); convert it, e.g. "
                              f"`iconv -f latin1 -t utf-8`") from e
    if not text.strip():
        raise TextSampleError(f"{what} {path} holds no text ({path.stat().st_size} bytes of whitespace or nothing)")
    return text


def read_text(spec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The text of a ``stdlib``, ``file`` or ``hub`` source and what names it in provenance."""
    kind = spec["kind"]
    if kind == "stdlib":
        import sys
        text, facts = stdlib_text(), {"modules": len(STDLIB_MODULES), "python": sys.version.split()[0]}
    elif kind == "file":
        path = Path(spec["path"])
        if not path.is_file():
            raise TextSampleError(f"activation.text.path {str(path)!r} is not a file")
        text, facts = _lines_or_text(_read_utf8(path, "activation.text.path"), path.name), {"path": str(path.resolve())}
    elif kind == "hub":
        from huggingface_hub import hf_hub_download

        local = hf_hub_download(spec["repo"], spec["file"], repo_type="dataset", revision=spec.get("revision"))
        text = _lines_or_text(_read_utf8(Path(local), f"activation.text.file of {spec['repo']}:"), spec["file"])
        facts = {"repo": spec["repo"], "file": spec["file"], "revision": spec.get("revision") or "main",
                 "snapshot": Path(local).parent.name}
    else:
        raise TextSampleError(f"activation.text.kind {kind!r} has no text (choose stdlib, file, hub or induction)")
    return text, {"kind": kind, **facts, "sha256": hashlib.sha256(text.encode()).hexdigest(), "characters": len(text)}


def text_chunks(tokenizer, spec: dict[str, Any], chunks: int, length: int, bos: int | None) -> TokenChunks:
    """``chunks`` consecutive windows of ``length`` tokens of the source's text (the first
    ``length - 1`` after BOS where ``bos`` is given), tokenised once."""
    text, facts = read_text(spec)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    body = length - (bos is not None)
    need = chunks * body
    if len(ids) < need:
        where = facts.get("path") or facts.get("file") or facts["kind"]
        raise TextSampleError(f"activation.text ({facts['kind']}: {where}) gives {len(ids)} tokens; {chunks} chunks x "
                              f"{body} need {need}: give a longer text, or lower activation.chunks or length")
    t = torch.tensor(ids[:need], dtype=torch.long).view(chunks, body)
    if bos is not None:
        t = torch.cat([torch.full((chunks, 1), bos, dtype=torch.long), t], dim=1)
    unk = getattr(tokenizer, "unk_token_id", None)
    unknown = float((t == unk).float().mean()) if unk is not None else 0.0
    return TokenChunks(t, {**facts, "tokens": int(t.numel()), "chunks": chunks, "length": length,
                           "unknown_token_share": round(unknown, 4)})


def induction_chunks(pool: torch.Tensor, chunks: int, length: int, bos: int | None, seed: int) -> TokenChunks:
    """Random tokens of ``pool``, each chunk's second half a copy of its first."""
    g = torch.Generator().manual_seed(seed)
    body = length - (bos is not None)
    half = (body + 1) // 2
    first = pool[torch.randint(len(pool), (chunks, half), generator=g)]
    t = torch.cat([first, first], dim=1)[:, :body]
    if bos is not None:
        t = torch.cat([torch.full((chunks, 1), bos, dtype=torch.long), t], dim=1)
    return TokenChunks(t, {"kind": "induction", "seed": seed, "pool": len(pool), "tokens": int(t.numel()),
                           "chunks": chunks, "length": length, "unknown_token_share": 0.0})

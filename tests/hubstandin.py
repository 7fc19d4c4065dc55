"""A stand-in for the Hugging Face hub, for tests: two standard-library HTTP servers on 127.0.0.1.

It imitates what ``huggingface_hub`` (and through it transformers and transformer_lens) asks
of the hub when pointed at it with ``HF_ENDPOINT``:

- ``HEAD/GET /<repo>/resolve/<revision>/<file>``: small files served directly with ``ETag``
  and ``X-Repo-Commit``; large files (``*.safetensors``, ``*.bin``) answered with a redirect to
  the second port (the real hub's CDN is another host) carrying ``X-Linked-Etag`` (the file's
  sha256) and ``X-Linked-Size``;
- ``GET /api/models/<repo>[/revision/<rev>]``, ``/api/models/<repo>/tree/<rev>[/<path>]``,
  ``/api/models/<repo>/refs``: repository info, file listings, branches;
- legacy names (``gpt2``) answered with a redirect to the canonical repo
  (``openai-community/gpt2``), as the hub does;
- errors with the hub's ``X-Error-Code`` header (RepoNotFound, RevisionNotFound, EntryNotFound).

Revisions are branches (``main``, ``step1000``, ``checkpoint-100``) of in-memory files, each with
a commit sha derived from its contents; a commit sha is accepted wherever a branch is.
``die_after`` makes the CDN stop half-way through a file and take both servers down, as a hub
killed mid-download would. Every socket has a timeout, so nothing here waits for ever.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

LARGE_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass
class Revision:
    files: dict[str, bytes]

    @property
    def commit(self) -> str:
        h = hashlib.sha1()
        for name in sorted(self.files):
            h.update(name.encode() + b"\0" + hashlib.sha256(self.files[name]).digest())
        return h.hexdigest()


@dataclass
class StandInHub:
    repos: dict[str, dict[str, Revision]] = field(default_factory=dict)  # repo -> branch -> files
    aliases: dict[str, str] = field(default_factory=dict)  # legacy name -> canonical repo
    die_after: int | None = None  # CDN: send this many bytes of a large file, then kill the hub
    requests: list[tuple[str, str, int]] = field(default_factory=list)  # (method, path, status)
    timeout: float = 10.0

    def add(self, repo: str, branch: str, folder_or_files: Path | dict[str, bytes]) -> Revision:
        files = folder_or_files if isinstance(folder_or_files, dict) else {
            p.relative_to(folder_or_files).as_posix(): p.read_bytes()
            for p in sorted(Path(folder_or_files).rglob("*")) if p.is_file()}
        rev = Revision(dict(files))
        self.repos.setdefault(repo, {})[branch] = rev
        return rev

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> StandInHub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._api = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._cdn = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        for s in (self._api, self._cdn):
            s.daemon_threads = True
            s.timeout = self.timeout
        self.endpoint = f"http://127.0.0.1:{self._api.server_address[1]}"
        self.cdn = f"http://127.0.0.1:{self._cdn.server_address[1]}"
        self._threads = [threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
                         for s in (self._api, self._cdn)]
        for t in self._threads:
            t.start()
        self.alive = True
        return self

    def stop(self) -> None:
        """Take both servers down: from now on every connection is refused."""
        if not getattr(self, "alive", False):
            return
        self.alive = False
        for s in (self._api, self._cdn):
            s.shutdown()
            s.server_close()
        for t in self._threads:
            t.join(timeout=self.timeout)

    def __enter__(self) -> StandInHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ lookups
    def find(self, repo: str, revision: str) -> Revision | None:
        branches = self.repos.get(repo, {})
        if revision in branches:
            return branches[revision]
        return next((r for r in branches.values() if r.commit == revision), None)

    def blob(self, sha256: str) -> bytes | None:
        for branches in self.repos.values():
            for rev in branches.values():
                for content in rev.files.values():
                    if hashlib.sha256(content).hexdigest() == sha256:
                        return content
        return None


class _Handler(BaseHTTPRequestHandler):
    hub: StandInHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet; requests are kept in hub.requests
        pass

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.hub.timeout)

    # --------------------------------------------------------------- plumbing
    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.hub.requests.append((self.command, self.path, status))
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _json(self, obj, status: int = 200) -> None:
        self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json"})

    def _error(self, status: int, code: str, message: str) -> None:
        self._send(status, json.dumps({"error": message}).encode(),
                   {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"})

    def _redirect(self, location: str, extra: dict[str, str] | None = None, status: int = 307) -> None:
        self._send(status, b"", {"Location": location, **(extra or {})})

    def do_HEAD(self) -> None:
        self._route()

    def do_GET(self) -> None:
        self._route()

    # --------------------------------------------------------------- routes
    def _route(self) -> None:
        path = urlsplit(self.path).path
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if self.server is self.hub._cdn:
            return self._cdn_blob(parts)
        if parts[:2] == ["api", "models"]:
            return self._api_models(parts[2:])
        if "resolve" in parts:
            i = parts.index("resolve")
            return self._resolve("/".join(parts[:i]), parts[i + 1], "/".join(parts[i + 2:]))
        self._error(404, "RepoNotFound", f"no route for {path}")

    def _canonical(self, repo: str, rest: str, api: bool) -> str | None:
        """The canonical name of a legacy one; answers the redirect (None when one was sent)."""
        if repo in self.hub.aliases:
            target = self.hub.aliases[repo]
            self._redirect(("/api/models/" if api else "/") + target + rest)
            return None
        return repo

    def _resolve(self, repo: str, revision: str, filename: str) -> None:
        if self._canonical(repo, f"/resolve/{quote(revision, safe='')}/{filename}", api=False) is None:
            return
        if repo not in self.hub.repos:
            return self._error(401, "RepoNotFound", f"Repository not found: {repo}")
        rev = self.hub.find(repo, revision)
        if rev is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        if filename not in rev.files:
            return self._error(404, "EntryNotFound", f"{filename} does not exist on {revision}")
        content = rev.files[filename]
        common = {"X-Repo-Commit": rev.commit}
        if filename.endswith(LARGE_SUFFIXES):
            sha = hashlib.sha256(content).hexdigest()
            return self._redirect(f"{self.hub.cdn}/blob/{sha}", {**common, "X-Linked-Etag": f'"{sha}"',
                                                                 "X-Linked-Size": str(len(content))}, status=302)
        etag = hashlib.sha1(content).hexdigest()
        self._send(200, content, {**common, "ETag": f'"{etag}"', "Content-Type": "application/octet-stream"})

    def _cdn_blob(self, parts: list[str]) -> None:
        content = self.hub.blob(parts[-1]) if parts[:1] == ["blob"] else None
        if content is None:
            return self._send(404, b"no such blob")
        start = 0
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes=") and rng[6:].split("-")[0].isdigit():
            start = int(rng[6:].split("-")[0])
        body = content[start:]
        self.hub.requests.append((self.command, self.path, 206 if start else 200))
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(body)))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(content) - 1}/{len(content)}")
        self.end_headers()
        if self.command == "HEAD":
            return
        if self.hub.die_after is not None and self.hub.die_after < len(body):
            self.wfile.write(body[: self.hub.die_after])
            self.wfile.flush()
            # the hub dies mid-download: the connection drops, and every later one is refused
            threading.Thread(target=self.hub.stop, daemon=True).start()
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        self.wfile.write(body)

    def _api_models(self, parts: list[str]) -> None:
        # /api/models/<org>/<name>[/revision/<rev> | /tree/<rev>[/<path>] | /refs]; names may lack an org
        for n in (2, 1):
            repo, rest = "/".join(parts[:n]), parts[n:]
            if repo in self.hub.repos or repo in self.hub.aliases:
                break
        else:
            return self._error(401, "RepoNotFound", f"Repository not found: {'/'.join(parts)}")
        if self._canonical(repo, "/" + "/".join(quote(p, safe="") for p in rest) if rest else "", api=True) is None:
            return
        branches = self.hub.repos[repo]
        if rest[:1] == ["refs"]:
            return self._json({"branches": [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": r.commit}
                                            for b, r in branches.items()], "tags": [], "converts": []})
        revision = rest[1] if len(rest) >= 2 and rest[0] in ("revision", "tree") else "main"
        rev = self.hub.find(repo, revision)
        if rev is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        if rest[:1] == ["tree"]:
            prefix = "/".join(rest[2:]).strip("/")
            entries = [{"type": "file", "path": name, "size": len(c), "oid": hashlib.sha1(c).hexdigest()}
                       for name, c in sorted(rev.files.items())
                       if (not prefix and "/" not in name) or (prefix and name.startswith(prefix + "/"))]
            if prefix and not entries:
                return self._error(404, "EntryNotFound", f"{prefix} does not exist on {revision}")
            return self._json(entries)
        self._json({"id": repo, "modelId": repo, "sha": rev.commit, "private": False, "gated": False,
                    "disabled": False, "tags": [], "siblings": [{"rfilename": n} for n in sorted(rev.files)]})


# ---------------------------------------------------------------------- tiny repos


def tiny_repo(folder: Path, architecture: str, seed: int, dtype: str = "float32", safetensors: bool = True) -> Path:
    """A tiny GPT-2, GPT-NeoX (Pythia's architecture) or Llama (grouped KV heads, untied) with
    random weights and a word-level tokenizer, in the layout the hub serves for that family (not
    what ``save_pretrained`` writes today; see ``hub_layout``)."""
    import torch
    import transformers as tf

    from compatlas.models.small_models import word_tokenizer

    torch.manual_seed(seed)
    if architecture == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=64))
    elif architecture == "neox":
        model = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=16,
                                                       intermediate_size=32, vocab_size=64, max_position_embeddings=64))
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                   hidden_size=32, intermediate_size=64, vocab_size=64,
                                                   max_position_embeddings=64, tie_word_embeddings=False))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(folder)
    hub_layout(folder, architecture, safetensors)
    word_tokenizer(64, folder)
    return folder


def hub_layout(folder: Path, architecture: str, safetensors: bool = True) -> None:
    """Rewrite a ``save_pretrained`` folder into the files the hub serves for the family:

    - GPT-2 (``gpt2``, ``gpt2-medium``, stanford-crfm): keys without the ``transformer.`` prefix,
      no ``lm_head`` (tied to ``wte``), the attention-mask buffers ``h.N.attn.bias`` stored;
    - Pythia: GPT-NeoX keys (``gpt_neox.*``, ``embed_out``) with the old buffers
      (``attention.bias``, ``attention.masked_bias``, ``attention.rotary_emb.inv_freq``);
    - Llama-style: two shards and ``model.safetensors.index.json``, an untied ``lm_head``;
    - ``safetensors=False``: a pickled ``pytorch_model.bin`` only, as older repos ship."""
    import torch
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    config = json.loads((folder / "config.json").read_text())
    if architecture == "gpt2":
        state = {k.removeprefix("transformer."): v for k, v in state.items() if not k.startswith("lm_head.")}
        n = config["n_positions"]
        for layer in range(config["n_layer"]):
            state[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(n, n, dtype=torch.uint8))[None, None].float()
    elif architecture == "neox":
        n, dh = config["max_position_embeddings"], config["hidden_size"] // config["num_attention_heads"]
        for layer in range(config["num_hidden_layers"]):
            head = f"gpt_neox.layers.{layer}.attention."
            state[head + "bias"] = torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None]
            state[head + "masked_bias"] = torch.tensor(-1e9)
            state[head + "rotary_emb.inv_freq"] = 1.0 / (10000 ** (torch.arange(0, dh, 2).float() / dh))
    if not safetensors:
        torch.save({k: v.contiguous() for k, v in state.items()}, folder / "pytorch_model.bin")
        return
    if architecture == "llama":
        keys = sorted(state)
        shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
                  "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
        for name, part in shards.items():
            save_file({k: state[k].contiguous() for k in part}, str(folder / name), metadata={"format": "pt"})
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": {k: name for name, part in shards.items() for k in part}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})


def served_state(rev: Revision) -> dict:
    """The weights a revision serves, read straight from its files (not through transformers)."""
    import io

    import torch
    from safetensors.torch import load

    shards = sorted(n for n in rev.files if n.endswith(".safetensors"))
    if shards:
        return {k: v for n in shards for k, v in load(rev.files[n]).items()}
    return torch.load(io.BytesIO(rev.files["pytorch_model.bin"]), map_location="cpu", weights_only=True)


def _extract_main(cases_path: str) -> None:
    """Run the extract rule's code (scripts/extract.py) on hub models, as a job would: plan the config, then for
    each (model, checkpoint label) load_and_extract + save_weights into <out>/<model>/<label>/.
    Run in a subprocess whose environment points HF_ENDPOINT at the stand-in."""
    import logging
    import sys

    from compatlas.composition.token_space import add_space_factors
    from compatlas.models.loading import load_and_extract
    from compatlas.models.sources import ModelLoadError
    from compatlas.models.weights import save_weights
    from compatlas.plan import build_plan, thaw

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    spec = json.loads(Path(cases_path).read_text())
    plan = build_plan(spec["config"])
    out = Path(spec["out"])
    failed = False
    for model, label in spec["cases"]:
        entry = thaw(plan.models[model].entry)
        ckpt = plan.models[model].checkpoint(label).spec()
        try:
            w, _ = load_and_extract(model, entry, ckpt, out / "work" / model / label)
        except ModelLoadError as e:  # the line a job ends with; go on with the other cases
            print(f"ModelLoadError: {e}", flush=True)
            failed = True
            continue
        add_space_factors(w)  # as scripts/extract.py does
        save_weights(w, out / model / label / "weights.safetensors", out / model / label / "meta.json")
    sys.exit(3 if failed else 0)


if __name__ == "__main__":
    import sys

    _extract_main(sys.argv[1])

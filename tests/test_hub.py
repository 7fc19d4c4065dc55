"""The hub path, against a stand-in of the Hugging Face hub on 127.0.0.1 (tests/hubstandin.py).

Tiny GPT-2 and GPT-NeoX repos with random weights are served under real names (``gpt2`` as a
legacy name of ``openai-community/gpt2``, ``EleutherAI/pythia-70m`` with ``step*`` branches, a
stanford-crfm repo with ``checkpoint-*`` branches, float16 and ``pytorch_model.bin``-only
revisions), large files through a redirect to a second port. The extraction code of the
pipeline runs in a subprocess pointed at it with ``HF_ENDPOINT`` (huggingface_hub reads it at
import), and every extracted tensor must equal the one the asked-for revision serves, computed
here from the served files by hand. Every wait is bounded: each subprocess has a timeout, each
socket of the stand-in too.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import machine_slowdown
from hubstandin import StandInHub, served_state, tiny_repo
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent
STANDIN = Path(__file__).resolve().parent / "hubstandin.py"
# one subprocess: Python and transformer_lens start-up (~15 s) plus a few tiny models; a bound on a hang,
# scaled by the machine's slowdown (load / cores) so that a slow correct run on a busy machine passes
LIMIT_S = 180 * machine_slowdown()

CONFIG = {
    "results": "results", "device": "cpu", "metrics": ["frobenius"], "spaces": ["residual"],
    "models": {
        "gpt2": {"source": {"kind": "hub", "name": "gpt2"}},  # legacy name, redirected by the hub
        "pythia": {"source": {"kind": "hub", "name": "EleutherAI/pythia-70m"},
                   "checkpoints": [{"value": 1000}, {"index": 12}, {"revision": "step143000"}]},
        "crfm": {"source": {"kind": "hub", "name": "stanford-crfm/alias-gpt2-small-x21"},
                 "checkpoints": [{"value": 100}]},
        "pythia-half": {"source": {"kind": "hub", "name": "EleutherAI/pythia-160m"},
                        "checkpoints": [{"value": 512}, {"revision": "step2000"}, {"revision": "step3000"}]},
        "llama": {"source": {"kind": "hub", "name": "TinyOrg/tiny-llama-gqa"}},  # two shards + index, untied
        "missing": {"source": {"kind": "hub", "name": "EleutherAI/no-such-model"}},
    },
}
# what fails, and the one line it fails with
FAILING = {
    ("missing", "final"): "model 'missing': cannot load EleutherAI/no-such-model@main from {endpoint}: "
                          "no such repository on the hub",
    ("pythia-half", "step3000"): "model 'pythia-half': cannot load EleutherAI/pythia-160m@step3000 from {endpoint}: "
                                 "no such revision on the hub",
}
# (config model, checkpoint label) -> (served repo, branch)
CASES = {
    ("gpt2", "final"): ("openai-community/gpt2", "main"),
    ("pythia", "step1000"): ("EleutherAI/pythia-70m", "step1000"),
    ("pythia", "index12"): ("EleutherAI/pythia-70m", "step2000"),  # Pythia's 13th published step
    ("pythia", "step143000"): ("EleutherAI/pythia-70m", "step143000"),
    ("crfm", "step100"): ("stanford-crfm/alias-gpt2-small-x21", "checkpoint-100"),
    ("pythia-half", "step512"): ("EleutherAI/pythia-160m", "step512"),  # float16 weights
    ("pythia-half", "step2000"): ("EleutherAI/pythia-160m", "step2000"),  # pytorch_model.bin only
    ("llama", "final"): ("TinyOrg/tiny-llama-gqa", "main"),
}


def hub_env(hub: StandInHub, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    return {**env, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "5", "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_extract(hub: StandInHub, home: Path, out: Path, cases: list[tuple[str, str]],
                extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    spec = out / "cases.json"
    out.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({"config": CONFIG, "out": str(out), "cases": cases}))
    return subprocess.run([sys.executable, str(STANDIN), str(spec)], capture_output=True, text=True,
                          env={**hub_env(hub, home), **(extra_env or {})}, timeout=LIMIT_S)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-repos")
    hub = StandInHub(aliases={"gpt2": "openai-community/gpt2"})
    hub.add("openai-community/gpt2", "main", tiny_repo(root / "gpt2", "gpt2", seed=0))
    for seed, step in enumerate((1000, 2000, 143000), start=1):
        hub.add("EleutherAI/pythia-70m", f"step{step}", tiny_repo(root / f"p{step}", "neox", seed=seed))
    hub.add("EleutherAI/pythia-70m", "main", root / "p143000")
    hub.add("stanford-crfm/alias-gpt2-small-x21", "checkpoint-100", tiny_repo(root / "crfm", "gpt2", seed=5))
    hub.add("EleutherAI/pythia-160m", "step512", tiny_repo(root / "half", "neox", seed=6, dtype="float16"))
    hub.add("EleutherAI/pythia-160m", "step2000", tiny_repo(root / "bin", "neox", seed=7, safetensors=False))
    hub.add("TinyOrg/tiny-llama-gqa", "main", tiny_repo(root / "llama", "llama", seed=8))
    with hub:
        yield hub


@pytest.fixture(scope="module")
def extracted(hub: StandInHub, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hub-extract")
    proc = run_extract(hub, out / "hf-home", out, list(CASES) + list(FAILING))
    failures = [ln for ln in proc.stdout.splitlines() if ln.startswith("ModelLoadError: ")]
    assert proc.returncode == 3 and len(failures) == len(FAILING), proc.stdout[-2000:] + proc.stderr[-6000:]
    (out / "failures.txt").write_text("\n".join(failures))
    return out


def test_bad_name_and_unpublished_revision_fail_in_one_line(hub: StandInHub, extracted: Path):
    lines = (extracted / "failures.txt").read_text().splitlines()
    for (model, label), start in FAILING.items():
        (line,) = [ln for ln in lines if f"model '{model}'" in ln]
        assert line.removeprefix("ModelLoadError: ").startswith(start.format(endpoint=hub.endpoint)), line
        assert not (extracted / model / label).exists()


def architecture_of(repo: str) -> str:
    return "gpt2" if "gpt2" in repo else "llama" if "llama" in repo else "neox"


def expected_attention(state: dict, architecture: str) -> dict[str, torch.Tensor]:
    """W_Q, W_K, W_V, W_O, W_E and W_U in TransformerLens's layout, by hand from the served state
    dict (the hub's key layouts: GPT-2 unprefixed and without ``lm_head``; GPT-NeoX with
    ``embed_out``; Llama with grouped K/V and an untied ``lm_head``)."""
    state = {k.removeprefix("transformer.").removeprefix("gpt_neox.").removeprefix("model."): v.float()
             for k, v in state.items()}
    n_layers = 1 + max(int(k.split(".")[1]) for k in state if k.startswith(("h.", "layers.")))
    out: dict[str, list[torch.Tensor]] = {"W_Q": [], "W_K": [], "W_V": [], "W_O": []}
    for layer in range(n_layers):
        if architecture == "gpt2":  # Conv1D: x @ W; c_attn's columns are [q | k | v], heads contiguous
            H = 2
            qkv = state[f"h.{layer}.attn.c_attn.weight"]
            d = qkv.shape[0]
            dh = d // H
            for name, part in zip(("W_Q", "W_K", "W_V"), qkv.split(d, dim=1)):
                out[name].append(part.reshape(d, H, dh).permute(1, 0, 2))
            out["W_O"].append(state[f"h.{layer}.attn.c_proj.weight"].reshape(H, dh, d))
        elif architecture == "neox":  # nn.Linear: x @ W.T; query_key_value's rows are [head][q, k, v][d_head]
            H = 2
            qkv = state[f"layers.{layer}.attention.query_key_value.weight"]
            d = qkv.shape[1]
            dh = d // H
            per = qkv.reshape(H, 3, dh, d)
            for i, name in enumerate(("W_Q", "W_K", "W_V")):
                out[name].append(per[:, i].transpose(1, 2))
            out["W_O"].append(state[f"layers.{layer}.attention.dense.weight"].T.reshape(H, dh, d))
        else:  # nn.Linear per projection; 4 query heads share 2 K/V heads, which stay ungrouped
            H, dh = 4, 8
            for name, proj in (("W_Q", "q_proj"), ("W_K", "k_proj"), ("W_V", "v_proj")):
                w = state[f"layers.{layer}.self_attn.{proj}.weight"]
                out[name].append(w.reshape(-1, dh, w.shape[1]).transpose(1, 2))
            out["W_O"].append(state[f"layers.{layer}.self_attn.o_proj.weight"].T.reshape(H, dh, -1))
    tensors = {k: torch.stack(v) for k, v in out.items()}
    tensors["W_E"] = state[{"gpt2": "wte.weight", "neox": "embed_in.weight", "llama": "embed_tokens.weight"}[architecture]]
    # GPT-2 ties its unembedding to W_E (the hub stores no lm_head); the others store theirs
    tensors["W_U"] = {"gpt2": tensors["W_E"], "neox": state.get("embed_out.weight"),
                      "llama": state.get("lm_head.weight")}[architecture].T
    return tensors


@pytest.mark.parametrize("case", list(CASES), ids=lambda c: f"{c[0]}-{c[1]}")
def test_extracted_tensors_equal_the_served_revision(hub: StandInHub, extracted: Path, case):
    repo, branch = CASES[case]
    arch = architecture_of(repo)
    got = load_file(str(extracted / case[0] / case[1] / "weights.safetensors"))
    want = expected_attention(served_state(hub.repos[repo][branch]), arch)
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), f"{name} differs from {repo}@{branch}"
    meta = json.loads((extracted / case[0] / case[1] / "meta.json").read_text())
    assert meta["has_unembed"] and meta["tied_embeddings"] == (arch == "gpt2"), meta
    # and not some other revision's (each revision has its own seed)
    for other, rev in hub.repos[repo].items():
        if rev.commit != hub.repos[repo][branch].commit:
            assert not torch.equal(got["W_Q"], expected_attention(served_state(rev), arch)["W_Q"]), other


def test_provenance_pins_revision_commit_and_checksum(hub: StandInHub, extracted: Path):
    for (model, label), (repo, branch) in CASES.items():
        meta = json.loads((extracted / model / label / "meta.json").read_text())
        rev = hub.repos[repo][branch]
        weights = [n for n in rev.files if n.endswith((".safetensors", ".bin"))]
        digest = hashlib.sha256()
        for n in sorted(weights):
            digest.update(n.encode())
            digest.update(hashlib.sha256(rev.files[n]).hexdigest().encode())
        assert meta["source_commit"] == rev.commit, (model, label)
        assert meta["source_checksum"] == digest.hexdigest(), (model, label)
        assert meta["source_revision"] == branch, (model, label)
        assert meta["source_name"] == CONFIG["models"][model]["source"]["name"]
    meta = {k: json.loads((extracted / k[0] / k[1] / "meta.json").read_text()) for k in CASES}
    # the step of every checkpoint whose series is known, and the tokens seen (Pythia: 2,097,152 a step)
    steps = {k: (m["checkpoint_step"], m["checkpoint_tokens"]) for k, m in meta.items()}
    assert steps[("pythia", "step1000")] == (1000, 1000 * 2_097_152)
    assert steps[("pythia", "index12")] == (2000, 2000 * 2_097_152)
    assert steps[("pythia", "step143000")] == (143000, 143000 * 2_097_152)
    assert steps[("crfm", "step100")] == (100, 100 * 512 * 1024)
    assert steps[("gpt2", "final")] == (None, None)
    assert meta[("pythia", "index12")]["checkpoint_index"] == 12


def test_legacy_name_went_through_the_redirect_and_large_files_through_the_cdn(hub: StandInHub, extracted: Path):
    paths = [(m, p, s) for m, p, s in hub.requests]
    assert any(p.startswith("/api/models/gpt2") and s == 307 for _, p, s in paths)
    assert any(p.startswith("/gpt2/resolve/") and s == 307 for _, p, s in paths)
    assert any(p.startswith("/openai-community/gpt2/resolve/") and p.endswith("model.safetensors") and s == 302
               for _, p, s in paths)
    assert any(p.startswith("/blob/") for _, p, s in paths)  # the CDN port served the weights
    assert any("pytorch_model.bin" in p and s == 302 for _, p, s in paths)


def test_hub_killed_mid_download_names_the_hub_and_the_file_in_one_line(tmp_path: Path):
    """The CDN sends 4 kB of the weights, then the hub dies: the job ends with one line naming the
    hub, the file and the retries spent, and does not fall back to the bridge's own download."""
    import re
    import time

    root = tmp_path / "repo"
    hub = StandInHub(die_after=4096)
    hub.add("EleutherAI/pythia-70m", "step1000", tiny_repo(root, "neox", seed=1))
    assert len(hub.repos["EleutherAI/pythia-70m"]["step1000"].files["model.safetensors"]) > 4096
    with hub:
        t0 = time.perf_counter()
        proc = run_extract(hub, tmp_path / "hf-home", tmp_path / "out", [("pythia", "step1000")])
        seconds = time.perf_counter() - t0
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-4000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("ModelLoadError")]
    assert line.startswith(f"ModelLoadError: model 'pythia': cannot load EleutherAI/pythia-70m@step1000 from "
                           f"{hub.endpoint}: the hub went away during the download of model.safetensors, "
                           "after "), line
    retries = int(re.search(r"after (\d+) retries in (\d+) s", line)[1])
    assert retries >= 5, line  # huggingface_hub resumes a broken download 5 times
    assert "ConnectError" in line or "RemoteProtocolError" in line, line
    # no second download path: the bridge was never booted
    assert "booting the whole model" not in proc.stderr and "streaming extraction not available" not in proc.stderr
    assert "local directory with the same name" not in line
    # the chain of causes, each named, is in the log (stderr here, the rule's log in a job)
    assert "cause 0:" in proc.stderr and "cause 1:" in proc.stderr, proc.stderr[-4000:]
    print(f"hub killed mid-download ({seconds:.1f} s including start-up): {line}")


def test_pipeline_extract_rule_runs_offline_from_a_warm_cache(hub: StandInHub, extracted: Path, tmp_path: Path):
    """One extract job through Snakemake with HF_HUB_OFFLINE=1 and the cache the first run filled:
    the setting reaches the job, no request reaches the hub, and the provenance (commit,
    checksum, step) is the one pinned online."""
    cfg = {**CONFIG, "models": {"pythia": CONFIG["models"]["pythia"]}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    target = "results/weights/pythia/index12/meta.json"
    before = len(hub.requests)
    proc = subprocess.run([sys.executable, "-m", "snakemake", target, "-s", str(REPO / "Snakefile"), "--cores", "1",
                           "--nolock", "--directory", str(tmp_path), "--configfile", str(tmp_path / "config.yaml")],
                          capture_output=True, text=True, timeout=LIMIT_S,
                          env={**hub_env(hub, extracted / "hf-home"), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(hub.requests) == before, hub.requests[before:]
    meta = json.loads((tmp_path / target).read_text())
    online = json.loads((extracted / "pythia" / "index12" / "meta.json").read_text())
    assert meta["source_commit"] == hub.repos["EleutherAI/pythia-70m"]["step2000"].commit
    for key in ("source_commit", "source_checksum", "source_revision", "checkpoint_step", "weights_sha256"):
        assert meta[key] == online[key], key


def test_gpt2_induction_job_runs_through_the_hub(hub: StandInHub, tmp_path: Path):
    """The hub's GPT-2 layout (unprefixed keys, no lm_head) end to end through Snakemake: extraction
    keeps the tied unembedding, so the induction job (which needs logits) runs on it."""
    cfg = {**CONFIG, "models": {"gpt2": CONFIG["models"]["gpt2"]},
           "induction": {"tokens": 4, "sequences": 2, "pool": 32, "head_scores": {"sequences": 2, "length": 10},
                         "ablation": {"sequences": 2}}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    target = "results/induction/model=gpt2/checkpoint=final/heads.parquet"
    proc = subprocess.run([sys.executable, "-m", "snakemake", target, "-s", str(REPO / "Snakefile"), "--cores", "1",
                           "--nolock", "--directory", str(tmp_path), "--configfile", str(tmp_path / "config.yaml")],
                          capture_output=True, text=True, timeout=LIMIT_S, env=hub_env(hub, tmp_path / "hf-home"))
    logs = "".join(p.read_text() for p in (tmp_path / "results" / "logs").rglob("*.log"))
    assert proc.returncode == 0, proc.stderr[-3000:] + logs[-3000:]
    meta = json.loads((tmp_path / "results/weights/gpt2/final/meta.json").read_text())
    assert meta["has_unembed"] and meta["tied_embeddings"], meta
    import polars as pl

    heads = pl.read_parquet(tmp_path / target)
    assert heads.height == 2 * 2 and heads["induction_mean"].is_not_null().all() and heads["ablation_drop"].is_not_null().all(), heads


def run_validate(hub: StandInHub, home: Path, config: dict, extra_env: dict[str, str] | None = None,
                 command: list[str] | None = None) -> subprocess.CompletedProcess:
    (home / "config.yaml").parent.mkdir(parents=True, exist_ok=True)
    (home / "config.yaml").write_text(yaml.safe_dump(config))
    cmd = command or [sys.executable, "-m", "compatlas.cli", "validate", str(home / "config.yaml")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT_S, cwd=home,
                          env={**hub_env(hub, home / "hf-home"), **(extra_env or {})})


def one_model(name: str, source: dict, checkpoints: list | None = None) -> dict:
    entry = {"source": {"kind": "hub", **source}, **({"checkpoints": checkpoints} if checkpoints else {})}
    return {**CONFIG, "models": {name: entry}}


@pytest.mark.parametrize("model, source, checkpoints, line", [
    ("typo", {"name": "EleutherAI/pythia-70mm"}, None,
     "config error at models.typo.source.name: EleutherAI/pythia-70mm is not a repository on the hub at {endpoint}"),
    ("pythia", {"name": "EleutherAI/pythia-70m"}, [{"value": 1000}, {"value": 3000}],
     "config error at models.pythia.checkpoints.1.value: EleutherAI/pythia-70m does not publish step 3000 on the "
     "hub (nearest published: [1000, 2000])"),
    ("pythia", {"name": "EleutherAI/pythia-70m"}, [{"revision": "step3000"}],
     "config error at models.pythia.checkpoints.0.revision: EleutherAI/pythia-70m has no revision 'step3000' "
     "(nearest published steps: [1000, 2000])"),
    ("crfm", {"name": "stanford-crfm/alias-gpt2-small-x21"}, [{"index": 0}],
     "config error at models.crfm.checkpoints.0.index: stanford-crfm/alias-gpt2-small-x21 does not publish step 0 "
     "on the hub (nearest published: [100])"),
])
def test_validate_asks_the_hub_and_fails_in_one_line(hub: StandInHub, tmp_path: Path, model, source, checkpoints, line):
    before = len(hub.requests)
    proc = run_validate(hub, tmp_path, one_model(model, source, checkpoints))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (said,) = proc.stderr.strip().splitlines()
    assert said.startswith(f"{tmp_path / 'config.yaml'}: {line.format(endpoint=hub.endpoint)}"), said
    asked = [p for _, p, _ in hub.requests[before:]]
    assert len([p for p in asked if p.endswith("/refs")]) == 1, asked  # once per repository


def test_snakemake_dry_run_stops_on_a_misspelt_repo_before_any_job(hub: StandInHub, tmp_path: Path):
    cmd = [sys.executable, "-m", "snakemake", "-n", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
           "--configfile", str(tmp_path / "config.yaml")]
    proc = run_validate(hub, tmp_path, one_model("typo", {"name": "EleutherAI/pythia-70mm"}), command=cmd)
    assert proc.returncode != 0
    assert (f"config error at models.typo.source.name: EleutherAI/pythia-70mm is not a repository on the hub at "
            f"{hub.endpoint}") in proc.stderr, proc.stderr[-2000:]
    assert "rule extract" not in proc.stdout + proc.stderr


def test_validate_passes_published_revisions_and_says_when_it_could_not_ask(hub: StandInHub, tmp_path: Path):
    good = {**CONFIG, "models": {k: v for k, v in CONFIG["models"].items() if k not in ("missing", "pythia-half")}}
    proc = run_validate(hub, tmp_path, good)
    assert proc.returncode == 0 and "valid" in proc.stdout and "note" not in proc.stderr, proc.stderr
    # offline: the typo is not caught, and validation says it did not ask
    typo = one_model("typo", {"name": "EleutherAI/pythia-70mm"})
    proc = run_validate(hub, tmp_path, typo, extra_env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "note: hub sources not checked against the hub (HF_HUB_OFFLINE=1): typo" in proc.stderr
    # a hub that does not answer: the same, naming it
    dead = StandInHub().start()
    dead.stop()
    proc = run_validate(dead, tmp_path, typo)
    assert proc.returncode == 0, proc.stderr
    assert f"note: hub sources not checked against the hub (the hub at {dead.endpoint} did not answer " in proc.stderr

"""The environments and Snakemake profiles agree with each other and with the workflow."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def specs(lines: list[str]) -> dict[str, str]:
    """Package name -> version spec (pip options and comments dropped)."""
    out = {}
    for line in lines:
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            pkg, spec = re.match(r"([A-Za-z0-9_.\-]+)(.*)", line).groups()
            out[pkg.lower()] = spec.strip()
    return out


def requirements(name: str) -> dict[str, str]:
    return specs((REPO / "envs" / name).read_text().splitlines())


def rules() -> set[str]:
    return {m for f in (REPO / "workflow").glob("*.smk") for m in re.findall(r"^\s*rule (\w+):", f.read_text(), re.M)}


def profile(name: str) -> dict:
    return yaml.safe_load((REPO / "profiles" / name / "config.yaml").read_text())


def test_conda_env_is_the_cpu_requirement_set():
    env = yaml.safe_load((REPO / "envs" / "compatlas.yaml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert specs(pip) == requirements("requirements-cpu.txt")
    assert "python=3.11" in env["dependencies"]


def test_cuda_set_matches_the_cpu_set():
    cpu, cuda = requirements("requirements-cpu.txt"), requirements("requirements-cuda.txt")
    test_only = {"pytest", "pytest-xdist", "duckdb-cli", "ruff", "mypy"}
    assert set(cuda) == set(cpu) - test_only
    assert all(cuda[p] == cpu[p] for p in cuda if p != "torch"), {p: (cpu[p], cuda[p]) for p in cuda if cuda[p] != cpu[p]}
    assert cpu["snakemake-executor-plugin-slurm"].startswith("==")


def test_profiles_name_real_rules():
    known = rules()
    assert {"extract", "composition", "invariance", "induction", "metric_audit", "atlas", "report"} <= known
    for name in ("slurm", "slurm-gpu"):
        p = profile(name)
        assert p["executor"] == "slurm" and p["default-resources"]["slurm_partition"]
        assert set(p["set-resources"]) <= known and set(p["set-threads"]) <= known
        assert set(p["groups"]) == {"composition", "pattern_output", "calibrate"}  # calibrate rides in its model's bundle
        assert set(p["group-components"]) == set(p["groups"].values())
    assert profile("local")["cores"] == "all" and profile("local")["rerun-incomplete"] is True
    # Snakemake applies profiles/default to every run, on any machine: it may hold nothing else (rerun-triggers
    # without `code`: reruns the same from any checkout of one commit, tests/test_pipeline.py; a newer input counts
    # by mtime alone: the atlas's rebuild relies on it, tests/test_faults_pipeline.py)
    assert profile("default") == {"scheduler": "greedy", "rerun-triggers": ["mtime", "params", "input", "software-env"],
                                  "max-checksum-file-size": 0}


def test_gpu_profile_is_the_slurm_profile_plus_gpus():
    cpu, gpu = profile("slurm"), profile("slurm-gpu")
    assert {r for r, res in gpu["set-resources"].items() if res.get("gpu")} == {"composition", "induction", "edge_attribution",
                                                                                "invariance"}
    assert not any(res.get("gpu") for res in cpu["set-resources"].values())
    # one GPU per Slurm job, composition bundles included (a local resource caps each job only)
    assert gpu["resources"]["gpu"] == 1 and gpu["resource-scopes"] == {"gpu": "local"}
    for res in gpu["set-resources"].values():
        res.pop("gpu", None)
    gpu["resources"].pop("gpu")
    del gpu["resource-scopes"]
    gpu["default-resources"]["slurm_partition"] = cpu["default-resources"]["slurm_partition"]
    assert gpu == cpu

"""A dry run (``snakemake -n``) writes nothing under results/ (workflow/atlas.smk, workflow/common.smk).

With one model added to the config, ``snakemake -n`` had said "38 inputs of the atlas are missing
... remaking them" and dated ``results/atlas.duckdb`` to 1970: going back to the old config then
planned an atlas and report rebuild no run had asked for. The results folder here holds an atlas
(any file: what the Snakefile checks is its presence, its seal and its inputs), a seal and a
shard, and every input of the atlas but that shard is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import machine_slowdown, tiny_config

REPO = Path(__file__).resolve().parent.parent


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` (folders too) with its mtime and size."""
    return {str(p.relative_to(root)): (p.lstat().st_mtime_ns, p.lstat().st_size) for p in [root, *root.rglob("*")]}


def test_a_dry_run_changes_nothing_under_results(tmp_path: Path):
    results = tmp_path / "results"
    shard = results / "composition" / "model=tiny-gpt2" / "checkpoint=final" / "block=0.parquet"
    shard.parent.mkdir(parents=True)
    for path in (results / "atlas.duckdb", results / "atlas.duckdb.sha256", shard):
        path.write_bytes(b"x")
    old = 1_700_000_000
    for path in [results, *results.rglob("*")]:
        os.utime(path, (old, old), follow_symlinks=False)
    cfg = tiny_config()
    cfg["results"] = str(results)
    work = tmp_path / "work"
    work.mkdir()
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    before = snapshot(results)
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-s", str(REPO / "Snakefile"), "--directory",
                           str(work), "--configfile", str(work / "config.yaml")], capture_output=True, text=True,
                          timeout=300 * machine_slowdown())  # a bound on a hang, scaled for a busy machine
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [ln for ln in proc.stderr.splitlines() if "inputs of the atlas are missing" in ln]
    assert len(said) == 1 and "this dry run writes nothing" in said[0], proc.stderr[-3000:]
    assert snapshot(results) == before

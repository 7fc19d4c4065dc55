"""The activation space's text sample (compatlas.composition.text_sample): each source, its provenance, and
its errors naming the source."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from hubstandin import StandInHub

from compatlas.composition.text_sample import STDLIB_MODULES, TextSampleError, induction_chunks, read_text, text_chunks


class Chars:
    """A tokenizer of one token per character (ids = code points mod 1000; '?' unknown = 63)."""

    unk_token_id = 63

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[ord(c) % 1000 for c in text])


def test_stdlib_text_is_prose_read_at_run_time_and_the_same_twice():
    text, facts = read_text({"kind": "stdlib"})
    again, _ = read_text({"kind": "stdlib"})
    assert text == again and facts["sha256"] == read_text({"kind": "stdlib"})[1]["sha256"]
    assert facts["modules"] == len(STDLIB_MODULES) and facts["characters"] > 50_000
    import json as json_module
    assert json_module.__doc__.strip().splitlines()[0] in text  # the module's own docstring, not a copy


def test_file_text_and_json_lines(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 50)
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": f"line {i}"}) for i in range(3)) + "\n")
    text, facts = read_text({"kind": "file", "path": str(tmp_path / "a.txt")})
    assert text.startswith("hello world") and facts["path"].endswith("a.txt")
    assert read_text({"kind": "file", "path": str(tmp_path / "b.jsonl")})[0] == "line 0\n\nline 1\n\nline 2"
    (tmp_path / "c.jsonl").write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(TextSampleError, match=r"c.jsonl:2: not a JSON object with a 'text' field"):
        read_text({"kind": "file", "path": str(tmp_path / "c.jsonl")})
    with pytest.raises(TextSampleError, match="is not a file"):
        read_text({"kind": "file", "path": str(tmp_path / "missing.txt")})
    # an empty file and one that is not UTF-8: named, with what to do (a bare UnicodeDecodeError, and advice to
    # lower activation.chunks, before)
    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(TextSampleError, match=r"activation.text.path .*empty.txt holds no text \(4 bytes"):
        read_text({"kind": "file", "path": str(tmp_path / "empty.txt")})
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(TextSampleError, match=r"activation.text.path .*latin1.txt is not UTF-8 text \(byte 3: .*iconv"):
        read_text({"kind": "file", "path": str(tmp_path / "latin1.txt")})


def test_chunks_are_consecutive_windows_with_bos_and_say_when_the_text_is_short(tmp_path):
    (tmp_path / "a.txt").write_text("abcdefghij" * 3)
    spec = {"kind": "file", "path": str(tmp_path / "a.txt")}
    s = text_chunks(Chars(), spec, chunks=3, length=5, bos=7)
    assert s.tokens[:, 0].tolist() == [7, 7, 7]
    assert s.tokens[:, 1:].flatten().tolist() == [ord(c) for c in ("abcdefghij" * 3)[:12]]
    assert s.facts["tokens"] == 15 and s.facts["unknown_token_share"] == 0.0
    with pytest.raises(TextSampleError, match=r"\(file: .*a.txt\) gives 30 tokens; 8 chunks x 5 need 40: give a longer text"):
        text_chunks(Chars(), spec, chunks=8, length=5, bos=None)


def test_induction_chunks_repeat_their_first_half():
    s = induction_chunks(torch.arange(100, 200), chunks=4, length=11, bos=1, seed=3)
    body = s.tokens[:, 1:]
    assert s.tokens.shape == (4, 11) and (s.tokens[:, 0] == 1).all()
    assert torch.equal(body[:, :5], body[:, 5:]) and ((body >= 100) & (body < 200)).all()


def test_hub_text_is_read_from_a_dataset_repository(tmp_path):
    """The hub path against the stand-in (the real hub is out of reach here): one JSON Lines file
    of a dataset repository, its revision's commit in provenance."""
    lines = "\n".join(json.dumps({"text": f"doc {i}"}) for i in range(4)).encode()
    with StandInHub() as hub:
        hub.add("datasets/someone/texts", "main", {"sample.jsonl": lines})
        code = ("import json; from compatlas.composition.text_sample import read_text; "
                "t, f = read_text({'kind': 'hub', 'repo': 'someone/texts', 'file': 'sample.jsonl'}); "
                "print(json.dumps([t, f]))")
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        env = {**env, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1"}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    text, facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert text == "doc 0\n\ndoc 1\n\ndoc 2\n\ndoc 3"
    assert facts["repo"] == "someone/texts" and len(facts["snapshot"]) == 40

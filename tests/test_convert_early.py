"""Conversion fails early and leaves nothing half-done.

A GGUF or HF directory whose tokenizer we cannot build is refused with a ConvertError naming the
file and what is wrong before the first weight is read, and no output directory is left; a
conversion that fails midway leaves an earlier output as it was.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from skippy_zmq.checkpoint import sources
from skippy_zmq.checkpoint.convert import ConvertError, convert_gguf, convert_hf
from skippy_zmq.checkpoint.families import hf_model_config
from test_families import FIXTURES, fixture_config
from test_families_gguf import write_gguf

gguf = pytest.importorskip("gguf")


@pytest.fixture
def no_weight_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every tensor name a source is asked for; reading one is the failure being tested."""
    asked: list[str] = []
    for cls in (sources.GGUFSource, sources.SafetensorsSource):
        def read(self, name, *rows, _asked=asked):
            _asked.append(name)
            raise AssertionError(f"weight {name!r} read before the tokenizer was checked")
        monkeypatch.setattr(cls, "read", read)
    return asked


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".model") or p.name == "model")


@pytest.mark.parametrize(("model", "pre", "named"), [("bert", "default", "tokenizer.ggml.model 'bert'"),
                                                     ("rwkv", "default", "tokenizer.ggml.model 'rwkv'"),
                                                     ("gpt2", "no-such-pre", "tokenizer.ggml.pre 'no-such-pre'")])
def test_gguf_unsupported_tokenizer_refused_before_any_weight(tmp_path, no_weight_reads, model, pre, named):
    path = write_gguf("llama", tmp_path / "m.gguf", {"tokenizer.ggml.model": model, "tokenizer.ggml.pre": pre})
    (tmp_path / "out").mkdir()
    with pytest.raises(ConvertError, match=named) as err:
        convert_gguf(path, tmp_path / "out" / "model")
    assert str(path) in str(err.value)
    assert no_weight_reads == [] and leftovers(tmp_path / "out") == []


def hf_copy(tmp_path: Path, tokenizer_json: str | None) -> Path:
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / "llama", hf)
    (hf / "tokenizer.json").unlink(missing_ok=True)
    if tokenizer_json is not None:
        (hf / "tokenizer.json").write_text(tokenizer_json)
    return hf


@pytest.mark.parametrize(("tokenizer_json", "named"), [
    (None, "no tokenizer.json"),
    ('{"version": "1.0", "model": {"type": "NoSuchModel"}}', "tokenizer.json"),
    ("not json", "tokenizer.json"),
])
def test_hf_unusable_tokenizer_refused_before_any_weight(tmp_path, no_weight_reads, tokenizer_json, named):
    hf = hf_copy(tmp_path, tokenizer_json)
    (tmp_path / "out").mkdir()
    with pytest.raises(ConvertError, match=named) as err:
        convert_hf(hf, tmp_path / "out" / "model")
    assert str(hf) in str(err.value)
    assert no_weight_reads == [] and leftovers(tmp_path / "out") == []


def test_failure_midway_leaves_the_earlier_output(tmp_path, monkeypatch):
    path = write_gguf("llama", tmp_path / "m.gguf")
    out = tmp_path / "model"
    cfg = convert_gguf(path, out)
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert (out / "model.json").is_file() and (out / "tokenizer.json").is_file()
    assert cfg.vocab_size == hf_model_config(fixture_config("llama")).vocab_size

    calls = []

    def read_then_fail(self, name, *rows):
        calls.append(name)
        if len(calls) > 3:
            raise sources.SourceError(f"{name}: truncated")
        return original(self, name, *rows)

    original = sources.GGUFSource.read
    monkeypatch.setattr(sources.GGUFSource, "read", read_then_fail)
    with pytest.raises(ConvertError, match="truncated"):
        convert_gguf(path, out)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".model")] == []
    assert json.loads((out / "model.json").read_text())["vocab_size"] == cfg.vocab_size

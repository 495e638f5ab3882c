"""llama.cpp's own tokenizer vectors: every ggml-vocab-*.gguf whose vocabulary is BPE or SentencePiece.

Each `.inp` holds test strings separated by "\\n__ggml_vocab_test__\\n"; each `.out` line holds the
ids of one string, tokenized without BOS (llama.cpp's convert_hf_to_gguf_update.py writes them with
`encode(text, add_special_tokens=False)`; tests/test-tokenizer-0.cpp reads them back so). Our ids must
equal every line, the streamed text must equal `decode`, and the other vocabulary types are refused
by name.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from skippy_zmq.text.tokenizer import TextTokenizer
from skippy_zmq.text.vocab import GGUFMetadata, UnsupportedVocab, check_vocab

SEPARATOR = "\n__ggml_vocab_test__\n"
# The vocabulary files with vectors whose tokenizer.ggml.model is gpt2 (BPE) or llama (SentencePiece).
SUPPORTED = ("command-r", "deepseek-coder", "deepseek-llm", "falcon", "gpt-2", "llama-bpe", "llama-spm",
             "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder")
REFUSED = {"bert-bge": "bert", "gemma-4": "gemma4", "nomic-bert-moe": "t5"}


def read_vectors(gguf_path: Path) -> list[tuple[str, list[int]]]:
    """(string, ids) pairs, split as test-tokenizer-0.cpp splits the .inp (a trailing separator
    leaves no last string)."""
    raw = Path(f"{gguf_path}.inp").read_text(encoding="utf-8")
    strings = raw.split(SEPARATOR)
    if strings and strings[-1] == "":
        strings.pop()
    lines = Path(f"{gguf_path}.out").read_text(encoding="utf-8").split("\n")[: len(strings)]
    assert len(lines) == len(strings), f"{gguf_path}: .inp and .out disagree on the number of strings"
    return [(s, [int(x) for x in line.split()]) for s, line in zip(strings, lines)]


@functools.lru_cache(maxsize=None)
def load(folder: Path, name: str) -> TextTokenizer:
    return TextTokenizer.from_gguf(folder / f"ggml-vocab-{name}.gguf")


@pytest.mark.parametrize("name", SUPPORTED)
def test_ids_equal_llama_cpp(llama_cpp_models: Path, name: str) -> None:
    tok = load(llama_cpp_models, name)
    vectors = read_vectors(llama_cpp_models / f"ggml-vocab-{name}.gguf")
    wrong = [(s, tok.encode(s, add_bos=False), ids) for s, ids in vectors if tok.encode(s, add_bos=False) != ids]
    assert not wrong, f"{name}: {len(wrong)}/{len(vectors)} differ, first: {wrong[0]}"
    assert len(vectors) > 30


def stream(tok: TextTokenizer, ids: list[int], skip_special: bool = False) -> str:
    decoder = tok.stream_decoder(skip_special=skip_special)
    return "".join(decoder.push(i) for i in ids) + decoder.flush()


@pytest.mark.parametrize("name", SUPPORTED)
def test_stream_equals_decode(llama_cpp_models: Path, name: str) -> None:
    """Every string, as it is and behind the BOS the server skips (multi-byte characters split
    across tokens and SentencePiece's leading spaces included)."""
    tok = load(llama_cpp_models, name)
    for text, ids in read_vectors(llama_cpp_models / f"ggml-vocab-{name}.gguf"):
        assert stream(tok, ids) == tok.decode(ids), f"{name}: {text!r}"
        with_bos = [tok.bos_id, *ids]
        assert stream(tok, with_bos, True) == tok.decode(with_bos, skip_special=True), f"{name}: {text!r}"


@pytest.mark.parametrize("name", ["llama-spm", "phi-3"])
def test_sentencepiece_spaces_bytes_and_bos(llama_cpp_models: Path, name: str) -> None:
    tok = load(llama_cpp_models, name)
    ids = tok.encode("Hello world")
    assert ids[0] == tok.bos_id == 1 and tok.meta["add_bos"] and tok.meta["kind"] == "spm"
    assert tok.decode(ids[1:]) == "Hello world" == stream(tok, ids[1:])
    assert [tok.token_text(i) for i in ids[1:]] == ["\u2581Hello", "\u2581world"]
    assert b"".join(tok.token_bytes(i) for i in ids[1:]) == b" Hello world"
    # a character outside the vocabulary falls back to its UTF-8 bytes, one <0xNN> piece each
    emoji = tok.encode("\U0001f999", add_bos=False)
    pieces = [tok.token_bytes(i) for i in emoji]
    assert b"".join(pieces) in (b" \xf0\x9f\xa6\x99", b"\xf0\x9f\xa6\x99") and len(pieces[-1]) == 1
    assert stream(tok, emoji) == tok.decode(emoji) == "\U0001f999"


def test_llama3_ids_and_end_of_generation(llama_cpp_models: Path) -> None:
    tok = load(llama_cpp_models, "llama-bpe")
    assert tok.token_text(tok.bos_id) == "<|begin_of_text|>" and tok.meta["add_bos"]   # as llama.cpp
    assert tok.encode("<|eot_id|>", add_bos=False) == [tok.tokenizer.token_to_id("<|eot_id|>")]
    assert tok.tokenizer.token_to_id("<|eot_id|>") in tok.eos_ids


@pytest.mark.parametrize(("name", "model"), sorted(REFUSED.items()))
def test_other_vocabularies_refused_by_name(llama_cpp_models: Path, name: str, model: str) -> None:
    reader = GGUFMetadata(str(llama_cpp_models / f"ggml-vocab-{name}.gguf"))
    with pytest.raises(UnsupportedVocab, match=f"tokenizer.ggml.model '{model}'"):
        check_vocab(reader)


@pytest.mark.parametrize(("shape", "name"), [("llama-3.2-1b", "llama-bpe"), ("qwen2.5-0.5b", "qwen2")])
def test_random_model_takes_a_real_vocabulary(llama_cpp_models: Path, tmp_path: Path, shape: str, name: str) -> None:
    from skippy_zmq.config.model import ModelConfig
    from skippy_zmq.devtools.random_model import RandomSpec, write_random_model

    vocab = str(llama_cpp_models / f"ggml-vocab-{name}.gguf")
    real = load(llama_cpp_models, name)
    cfg = write_random_model(RandomSpec(shape, seed=0, weights="q4", layers=1, vocab=vocab), tmp_path / "m")
    assert cfg.vocab_size == real.vocab_size == ModelConfig.load(tmp_path / "m" / "model.json").vocab_size
    assert cfg.bos_id == real.bos_id and list(cfg.eos_ids) == real.eos_ids
    tok = TextTokenizer.load(tmp_path / "m")
    text, ids = read_vectors(llama_cpp_models / f"ggml-vocab-{name}.gguf")[-1]
    assert tok.encode(text, add_bos=False) == ids and tok.decode(ids) == real.decode(ids)
    assert tok.meta["chat_template"] == real.meta["chat_template"]
    assert RandomSpec(shape, layers=1, vocab=vocab).digest() != RandomSpec(shape, layers=1).digest()


# transformers (the `parity` extra, with torch) cannot load these GGUF architectures' tokenizers
HF_UNLOADABLE = {arch: f"architecture {arch} is not supported by transformers' GGUF loader"
                 for arch in ("command-r", "mpt", "refact")}


@pytest.mark.slow
@pytest.mark.parametrize("name", SUPPORTED)
def test_hf_dir_equals_transformers(llama_cpp_models: Path, tmp_path: Path, name: str) -> None:
    """The tokenizer.json transformers writes from the same vocabulary, read by from_hf_dir: ids, decode
    and the stream equal transformers' on every string (transformers is only a reference here)."""
    pytest.importorskip("torch", reason="transformers reads GGUF tokenizers through torch (parity extra)")
    transformers = pytest.importorskip("transformers", reason="the reference is the parity extra")
    if name in HF_UNLOADABLE:
        pytest.skip(HF_UNLOADABLE[name])
    ref = transformers.AutoTokenizer.from_pretrained(str(llama_cpp_models), gguf_file=f"ggml-vocab-{name}.gguf")
    ref.save_pretrained(tmp_path)
    tok = TextTokenizer.from_hf_dir(tmp_path)
    assert tok.meta["add_bos"] == (ref.bos_token_id is not None and ref.encode("a")[:1] == [ref.bos_token_id])
    for text, _ in read_vectors(llama_cpp_models / f"ggml-vocab-{name}.gguf"):
        ids = ref.encode(text, add_special_tokens=False)
        assert tok.encode(text, add_bos=False) == ids, f"{name}: {text!r}"
        assert tok.decode(ids) == ref.decode(ids) == stream(tok, ids), f"{name}: {text!r}"

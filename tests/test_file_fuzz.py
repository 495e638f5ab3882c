"""Truncated and byte-flipped model files: a small real GGUF and a safetensors model directory, cut at
every section boundary (and at a seeded sample of other offsets) and flipped at a seeded sample of
bytes. Every damaged file either converts (a flip that leaves a valid file: a changed weight or name
character) or fails with a ModelFileError naming the file and the field (and the byte offset for
every structural fault), never struct.error, RecursionError, MemoryError or a hang; and a failed
conversion leaves no output directory behind.

The section boundaries come from gguf.GGUFReader on the intact file (each key/value's and tensor
info's parts, each tensor's data span): an oracle independent of model/gguf_layout.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from skippy_zmq.checkpoint.convert import TOP_NAMES, convert_gguf, convert_hf, hf_layer_name
from skippy_zmq.checkpoint.families import hf_model_config
from skippy_zmq.checkpoint import loader
from skippy_zmq.files.filecheck import ModelFileError, read_safetensors_header
from skippy_zmq.checkpoint.formats import CheckpointError
from skippy_zmq.checkpoint.formats import Encoded, dequantize_grid
from skippy_zmq.files.gguf_layout import read_gguf_layout
from skippy_zmq.devtools.gguf_writer import GGUFStream
from skippy_zmq.devtools.random_model import random_tensors, tensor_specs
from skippy_zmq.text.tokenizer import TextTokenizer, word_level_tokenizer

TINY_HF = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 64, "vocab_size": 64,
           "tie_word_embeddings": True, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 256, "hidden_act": "silu"}
SAMPLE = 40            # extra truncation offsets and byte flips per file, seeded


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> tuple[Path, Path]:
    """(a Q4_1 GGUF of a 1-layer width-64 llama, an HF directory of the same weights in safetensors)."""
    root = tmp_path_factory.mktemp("fuzz")
    cfg = hf_model_config(TINY_HF, name="tiny")
    stream = GGUFStream(root / "tiny.gguf", cfg, tensor_specs(cfg), "tiny")
    hf: dict[str, np.ndarray] = {}
    for spec, tensor in random_tensors(cfg, 0):
        stream.write(spec, tensor)
        name = TOP_NAMES[spec.key][1] if spec.where == "top" else \
            f"model.layers.{spec.where}.{hf_layer_name(cfg, spec.key)}"
        hf[name] = dequantize_grid(tensor) if isinstance(tensor, Encoded) else tensor
    stream.close()
    (root / "hf").mkdir()
    save_file(hf, str(root / "hf" / "model.safetensors"))
    (root / "hf" / "config.json").write_text(json.dumps(TINY_HF))
    TextTokenizer(*word_level_tokenizer(64)).tokenizer.save(str(root / "hf" / "tokenizer.json"))
    return root / "tiny.gguf", root / "hf"


def gguf_boundaries(path: Path) -> list[int]:
    """Every offset where a GGUF section or field part starts or ends, from gguf.GGUFReader."""
    reader = gguf.GGUFReader(path)
    cuts = {0, 4, reader.data_offset}
    for field in [*reader.fields.values(), *(t.field for t in reader.tensors)]:
        at = field.offset
        for part in field.parts:
            cuts.add(at)
            at += int(part.nbytes)
        cuts.add(at)
    for t in reader.tensors:
        cuts.update((t.data_offset, t.data_offset + t.n_bytes - 1))
    return sorted(c for c in cuts if c < path.stat().st_size)


def safetensors_boundaries(path: Path) -> list[int]:
    start, tensors = read_safetensors_header(path)
    cuts = {0, 4, 8, start - 1, start}
    for info in tensors.values():
        cuts.update(start + o for o in info["data_offsets"])
    return sorted(c for c in cuts if c < path.stat().st_size)


def sampled(size: int, seed: int, n: int = SAMPLE) -> list[int]:
    return random.Random(seed).sample(range(size), min(n, size))


def flip(data: bytes, at: int) -> bytes:
    """One bit of byte `at` flipped (which bit: seeded by the offset), so a digit in a JSON header or a
    bit of a count changes, not only whole bytes."""
    out = bytearray(data)
    out[at] ^= 1 << random.Random(at).randrange(8)
    return bytes(out)


def assert_clear(err: ModelFileError, path: Path, structural: bool = True) -> None:
    """The error names the file (for a model-level fault, its directory or config.json may be meant),
    the field, and for a structural fault the byte offset."""
    assert err.field and err.path in str(err) and err.field in str(err)
    if structural:
        assert err.path == str(path)
        assert isinstance(err.offset, int) and 0 <= err.offset and f"at byte {err.offset}" in str(err)
    else:
        assert err.path.startswith(str(path.parent)), err.path


def convert_case(convert, src: Path, out: Path, damaged: Path) -> ModelFileError | None:
    """Convert the damaged input; the error if it fails (then no `out` may exist), None if it converts."""
    try:
        convert(src, out, "q4")
    except ModelFileError as err:
        assert not out.exists(), f"a failed conversion left {out}"
        assert not list(out.parent.glob(f".{out.name}.*")), "a partial directory was left behind"
        return err
    assert (out / "model.json").is_file()
    return None


def test_truncated_gguf_fails_at_once_naming_field_and_offset(tiny_files, tmp_path):
    good, _ = tiny_files
    data = good.read_bytes()
    cuts = sorted(set(gguf_boundaries(good)) | set(sampled(len(data), 1)))
    assert len(cuts) > 150
    for i, cut in enumerate(cuts):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelFileError) as err:
            read_gguf_layout(bad)
        assert_clear(err.value, bad)
        assert err.value.offset <= cut, (cut, str(err.value))
        if i % 4 == 0:           # and convert, on a quarter of the cuts: refused before any weight
            assert_clear(convert_case(convert_gguf, bad, tmp_path / f"out{cut}", bad), bad)
        bad.unlink()


def test_byte_flipped_gguf_converts_or_fails_clearly(tiny_files, tmp_path):
    good, _ = tiny_files
    data = good.read_bytes()
    metadata_end = gguf.GGUFReader(good).data_offset
    offsets = sampled(metadata_end, 2, 3 * SAMPLE) + sampled(len(data), 3, SAMPLE // 4)
    failed = 0
    for at in offsets:
        bad = tmp_path / f"flip{at}.gguf"
        bad.write_bytes(flip(data, at))
        err = convert_case(convert_gguf, bad, tmp_path / f"out{at}", bad)
        if err is not None:
            failed += 1
            assert_clear(err, bad, structural=err.field not in ("metadata", "tokenizer", "tensors"))
    assert failed >= len(offsets) // 4        # most flips in the header break the file, and say so


def test_truncated_safetensors_fails_naming_field_and_offset(tiny_files, tmp_path):
    _, good_dir = tiny_files
    data = (good_dir / "model.safetensors").read_bytes()
    bad_dir = tmp_path / "hf"
    bad_dir.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (bad_dir / name).write_bytes((good_dir / name).read_bytes())
    bad = bad_dir / "model.safetensors"
    for cut in sorted(set(safetensors_boundaries(good_dir / "model.safetensors")) | set(sampled(len(data), 4))):
        bad.write_bytes(data[:cut])
        err = convert_case(convert_hf, bad_dir, tmp_path / f"out{cut}", bad)
        assert err is not None, f"a file cut at {cut} converted"
        assert_clear(err, bad)


def test_byte_flipped_safetensors_converts_or_fails_clearly(tiny_files, tmp_path):
    _, good_dir = tiny_files
    data = (good_dir / "model.safetensors").read_bytes()
    bad_dir = tmp_path / "hf"
    bad_dir.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (bad_dir / name).write_bytes((good_dir / name).read_bytes())
    bad = bad_dir / "model.safetensors"
    header_end = read_safetensors_header(good_dir / "model.safetensors")[0]
    failed = 0
    for at in sampled(header_end, 5) + [0, 3, 7]:       # the header (and its length's bytes, high ones too)
        bad.write_bytes(flip(data, at))
        err = convert_case(convert_hf, bad_dir, tmp_path / f"out{at}", bad)
        if err is not None:
            failed += 1
            assert_clear(err, bad, structural=err.field not in ("metadata", "tokenizer", "tensors"))
    assert failed >= SAMPLE // 2


def test_header_length_is_bounded_before_it_is_read(tmp_path):
    bad = tmp_path / "huge.safetensors"
    bad.write_bytes((1 << 62).to_bytes(8, "little") + b"{}")
    with pytest.raises(ModelFileError, match="header length at byte 0: .* over the 104857600-byte cap"):
        read_safetensors_header(bad)
    bad.write_bytes((1000).to_bytes(8, "little") + b"{}")
    with pytest.raises(ModelFileError, match="header at byte 8: needs 1000 bytes, the file has 2 left"):
        read_safetensors_header(bad)


def test_gguf_counts_and_nesting_are_bounded_by_the_file(tmp_path):
    """Counts that would allocate terabytes, and arrays nested past the limit, fail on the field."""
    head = b"GGUF" + (3).to_bytes(4, "little")
    bad = tmp_path / "counts.gguf"
    bad.write_bytes(head + (0).to_bytes(8, "little") + (1 << 60).to_bytes(8, "little") + bytes(64))
    with pytest.raises(ModelFileError, match="kv_count at byte 16"):
        read_gguf_layout(bad)
    key = (1).to_bytes(8, "little") + b"k"
    array_of_arrays = (9).to_bytes(4, "little") + (9).to_bytes(4, "little") + (1).to_bytes(8, "little")
    nested = array_of_arrays + (9).to_bytes(4, "little") + (1).to_bytes(8, "little") + \
        (9).to_bytes(4, "little") + (1 << 40).to_bytes(8, "little")
    bad.write_bytes(head + (0).to_bytes(8, "little") + (1).to_bytes(8, "little") + key + nested + bytes(64))
    with pytest.raises(ModelFileError, match=r"kv 'k' value\[0\].* arrays nested more than 2 deep"):
        read_gguf_layout(bad)
    huge_string = (8).to_bytes(4, "little") + (1 << 63).to_bytes(8, "little")
    bad.write_bytes(head + (0).to_bytes(8, "little") + (1).to_bytes(8, "little") + key + huge_string + bytes(64))
    with pytest.raises(ModelFileError, match="kv 'k' value length at byte 37: needs 9223372036854775808 bytes"):
        read_gguf_layout(bad)


# orbax's failed restores leave a tensorstore callback aimed at an event loop it has closed (its noise)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_damaged_checkpoint_items_fail_naming_the_item(tiny_files, tmp_path):
    """A converted checkpoint with one of its files cut in half or deleted: loading the stage either
    does not need that file or fails with a CheckpointError (ModelFileError for JSON) naming the item."""
    good, _ = tiny_files
    model = tmp_path / "model"
    convert_gguf(good, model, "q4")
    files = [f for f in sorted(model.rglob("*")) if f.is_file() and f.parent.name != "d"
             and not f.name.startswith(("tokenizer", "source"))]
    failed = 0
    for f in files:
        data = f.read_bytes()
        for damaged in (data[:len(data) // 2], None):
            if damaged is None:
                f.unlink()
            else:
                f.write_bytes(damaged)
            try:
                loader.load_slice(model, 0, 1, fmt="q4")
            except (CheckpointError, ModelFileError) as err:
                failed += 1
                item = f.parent if f.parent.parent.name in ("params", "embed") else f.parent.parent
                assert str(item) in str(err) or str(f) in str(err), (f, str(err))
            except FileNotFoundError as err:      # model.json: the "convert a model first" message
                assert f.name == "model.json" and "no model.json" in str(err)
            f.write_bytes(data)
    assert failed >= len(files) // 2      # commit markers and the like are not read at load


def test_tokenizer_files_are_capped_and_checked(tiny_files, tmp_path):
    from skippy_zmq.files.filecheck import read_json_capped
    from skippy_zmq.text.tokenizer import TextTokenizer

    _, hf = tiny_files
    big = tmp_path / "tokenizer.json"
    big.write_text(json.dumps({"pad": "x" * 100}))
    with pytest.raises(ModelFileError, match=r"tokenizer.json: tok at byte 64: over the 64-byte cap"):
        read_json_capped(big, "tok", cap=64)
    good = (hf / "tokenizer.json").read_text()
    (tmp_path / "tokenizer.json").write_text(good[:len(good) // 2])        # cut: not JSON any more
    with pytest.raises(ModelFileError, match=r"tokenizer.json: tokenizer.json: not a tokenizer"):
        TextTokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text(good)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": ' * 100000)   # deep nesting, cut
    with pytest.raises(ModelFileError, match=r"tokenizer_config.json: tokenizer_config.json: JSON nested too deeply"):
        TextTokenizer.from_hf_dir(tmp_path)


def safetensors_bytes(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


@pytest.mark.parametrize("header, fault", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, "overlaps tensor 'a' [0, 8)"),
    ({"a": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, "tensor 'a' dtype at byte 8: unknown dtype"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, "span of 8 bytes, shape [3] x F32 needs 12"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, "[0, 16] is not inside the 12-byte data section"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}}, "shape at byte 8: not a list"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, "data_offsets at byte 8: [8, 0] is not inside"),
    ([1, 2], "header at byte 8: not a JSON object"),
])
def test_safetensors_header_entries_are_checked(tmp_path, header, fault):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(safetensors_bytes(header, bytes(12)))
    with pytest.raises(ModelFileError) as err:
        read_safetensors_header(bad)
    assert fault in str(err.value) and err.value.path == str(bad)

"""Checkpoints in their serving format: round trips, stage-only restore, exact GGUF levels,
format errors, the older layout, and conversion memory."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest
from conftest import REPO, TINY

from skippy_zmq.checkpoint import checkpoint, loader, sources
from skippy_zmq.model import quant, weights
from skippy_zmq.checkpoint.checkpoint import CheckpointError, CheckpointWriter
from skippy_zmq.checkpoint.convert import LAYER_NAMES, TOP_NAMES, stream_checkpoint, unpermute_rows
from model_helpers import forward_reference, restore_stage, save_params


def write_tree(out: Path, tree: dict, fmt: str, rows_per_block: int = 40) -> Path:
    """A checkpoint-layout tree ([in, out] floats) through the writer; 97 rows = blocks of 40, 40, 17."""
    w = CheckpointWriter(out, TINY, fmt, rows_per_block=rows_per_block)
    w.add_top("norm", tree["norm"])
    w.add_top("embed", tree["embed"])
    for i in range(TINY.n_layers):
        for key, v in tree["layers"][str(i)].items():
            w.put_layer_tensor(i, key, v.T if v.ndim == 2 else v)
        w.end_layer(i)
    w.finish({"format": "test", "sha256": "0" * 64})
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_tree):
    """fmt -> a tiny checkpoint stored in fmt (written once per module)."""
    made = {}

    def get(fmt: str) -> Path:
        if fmt not in made:
            made[fmt] = write_tree(tmp_path_factory.mktemp(fmt) / "m", tiny_tree, fmt)
        return made[fmt]
    return get


def test_stored_formats_cost_what_gguf_blocks_cost():
    assert checkpoint.stored_nbytes((4096, 4096), "q4") / 4096**2 == 0.625      # Q4_1's 5 bits per weight
    assert checkpoint.stored_nbytes((4096, 4096), "int8") / 4096**2 == 1.125    # 1 + 4/32
    assert checkpoint.stored_nbytes((4096, 4096), "bf16") == 2 * 4096**2
    # runtime: 64-column panels, f16 scale and offset per 32 (0.625 B/weight for q4)
    assert checkpoint.runtime_nbytes((100, 64), "q4") == 128 * 64 // 2 + 4 * 128 * 2
    assert checkpoint.runtime_nbytes((100, 64), "q4", "head") == 128 * 64 + 4 * 128 * 2
    assert checkpoint.runtime_nbytes((97, 64), "int8", "embed") == 97 * 64 + 4 * 97 * 2   # int8 rows, f16 s, z
    assert checkpoint.runtime_nbytes((97, 64), "int8", "embed", stored="f32") == 97 * 64 * 4


@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "q4"])
def test_stage_nbytes_is_what_a_stage_holds(converted, fmt):
    import jax

    for start, end in [(0, 1), (1, 3), (3, 4), (0, 4)]:
        _, params = loader.load_slice(converted(fmt), start, end, fmt=fmt)
        held = sum(np.asarray(a).nbytes for a in jax.tree.leaves(params))
        assert checkpoint.stage_nbytes(TINY, start, end, fmt) == held, (start, end)


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_float_round_trip(converted, fmt, tiny_tree):
    path = converted(fmt)
    _, got = loader.load_slice(path, fmt=fmt)
    cast = (lambda a: a) if fmt == "f32" else (lambda a: np.asarray(a, ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(got["embed"]), cast(tiny_tree["embed"]))
    np.testing.assert_array_equal(np.asarray(got["layers"][2]["w_down"]), cast(tiny_tree["layers"]["2"]["w_down"]))
    np.testing.assert_array_equal(np.asarray(got["norm"]), tiny_tree["norm"])


@pytest.mark.parametrize("fmt", ["int8", "q4"])
def test_quantised_checkpoint_keeps_the_levels_quantising_at_load_makes(converted, fmt, tiny_tree):
    """Same levels as weights.to_runtime's quantisation; scales and offsets differ only by f16 rounding."""
    path = converted(fmt)
    _, got = loader.load_slice(path, fmt=fmt)
    want = weights.to_runtime(tiny_tree, np.float32, quantize=fmt)
    for g, w in [(got["layers"][1]["wq"], want["layers"][1]["wq"]), (got["head"], want["head"])]:
        assert (g.bits, g.n) == (w.bits, w.n) and g.bits == (8 if w is want["head"] else {"q4": 4, "int8": 8}[fmt])
        np.testing.assert_array_equal(quant.levels(g), quant.levels(w))
        for a, b in [(g.s, w.s), (g.z, w.z)]:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(np.float16).astype(np.float32))
    rows = got["embed"]     # int8 rows + f16 scales, widened per looked-up row
    assert isinstance(rows, quant.QRows) and rows.q.dtype == np.int8 and rows.s.dtype == np.float16
    ids = np.array([[3, 96, 50]])
    looked_up = np.asarray(quant.embed_rows(rows, ids))
    np.testing.assert_array_equal(looked_up[0], checkpoint.to_float(
        restore_stage(path, TINY, 0, 1)["embed"])[ids[0]])
    assert np.abs(looked_up[0] - tiny_tree["embed"][ids[0]]).max() < 0.01


def test_stage_restores_only_its_items(tmp_path, tiny_tree):
    path = write_tree(tmp_path / "m", tiny_tree, "q4")
    for item in ("layer_00000", "layer_00003", "embed", "top"):   # what a middle stage must never read
        shutil.rmtree(path / "params" / item)
    middle = restore_stage(path, TINY, 1, 3)
    assert sorted(middle) == ["layers"] and sorted(middle["layers"]) == ["1", "2"]
    assert middle["layers"]["2"]["wq"]["q"].dtype == np.uint8 and middle["layers"]["2"]["wq"]["q"].shape == (64, 32)
    assert middle["layers"]["2"]["wq"]["d"].dtype == np.float16 and middle["layers"]["2"]["wq"]["d"].shape == (64, 2)
    with pytest.raises(CheckpointError, match="params/top: checkpoint item missing"):
        restore_stage(path, TINY, 3, 4)


def test_last_stage_gets_the_tied_embedding_as_its_int8_head(tmp_path, tiny_tree):
    path = write_tree(tmp_path / "m", tiny_tree, "q4")
    last = restore_stage(path, TINY, 3, 4)
    assert sorted(last) == ["embed", "layers", "norm"] and last["embed"]["q"].dtype == np.int8
    assert last["embed"]["q"].shape == (97, 64)     # three row blocks put back together
    _, params = loader.load_slice(path, 3, 4, fmt="q4")
    assert params["head"].bits == 8 and params["layers"][0]["w_up"].bits == 4
    assert "embed" not in params      # not first: the int8 head is all it needs of the embedding
    np.testing.assert_array_equal(quant.levels(params["head"]), last["embed"]["q"].T)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "q4"])
def test_a_finer_format_than_stored_is_refused(converted, fmt):
    path = converted(fmt)
    finer = checkpoint.FORMATS[:checkpoint.FORMATS.index(fmt)]
    for asked in finer:
        with pytest.raises(CheckpointError) as err:
            loader.load_slice(path, 0, 1, fmt=asked)
        allowed = ", ".join(checkpoint.FORMATS[checkpoint.FORMATS.index(fmt):])
        only = " only" if fmt == "q4" else ""
        fix = "from the GGUF without --weights (it keeps the file's types)" if asked == "gguf" else \
            f"with --weights {asked}"
        assert str(err.value) == (f"checkpoint stores {fmt}; a stage can run {allowed}{only} (asked for {asked}): "
                                  f"re-convert {fix}")
    if fmt == "q4":
        with pytest.raises(CheckpointError, match=r"^checkpoint stores q4; a stage can run q4 only \(asked for f32\)"):
            loader.load_slice(path, 0, 1)          # the default (quantize=None) means f32


def test_coarser_formats_requantise_at_load(tmp_path, tiny_tree):
    path = write_tree(tmp_path / "m", tiny_tree, "int8")
    _, got = loader.load_slice(path, 0, 1, fmt="q4")
    stored = restore_stage(path, TINY, 0, 1)["layers"]["0"]["w_gate"]
    want = quant.to_qtensor(checkpoint.to_float(stored).T, bits=4)
    assert got["layers"][0]["w_gate"].bits == 4
    np.testing.assert_array_equal(quant.levels(got["layers"][0]["w_gate"]), quant.levels(want))


def test_older_single_pytree_checkpoint_still_loads_as_f32(tmp_path, tiny_tree):
    save_params(tmp_path / "params", tiny_tree)
    TINY.save(tmp_path / "model.json")
    assert checkpoint.stored_weights(tmp_path) == "f32"
    _, got = loader.load_slice(tmp_path, 1, 2)
    np.testing.assert_array_equal(np.asarray(got["layers"][0]["wk"]), tiny_tree["layers"]["1"]["wk"])
    _, q4 = loader.load_slice(tmp_path, 3, 4, fmt="q4")
    assert q4["layers"][0]["wq"].bits == 4 and q4["head"].bits == 8


@pytest.mark.parametrize("layout", ["v2", "older"])
def test_a_bf16_stage_holds_bf16_matrices_and_computes_like_f32(tmp_path, tiny_tree, converted, layout):
    """weights: bf16 halves a float checkpoint's matrices (and embedding) in memory; norms stay in the
    stage dtype; each matmul widens to the activations' dtype, so logits stay close to f32's."""
    import jax
    import jax.numpy as jnp

    if layout == "older":
        save_params(tmp_path / "params", tiny_tree)
        TINY.save(tmp_path / "model.json")
        path = tmp_path
    else:
        path = converted("f32")
    _, f32 = loader.load_slice(path, fmt="f32")
    _, bf16 = loader.load_slice(path, fmt="bf16")
    assert bf16["layers"][1]["w_up"].dtype == jnp.bfloat16 and bf16["embed"].dtype == jnp.bfloat16
    assert bf16["layers"][1]["attn_norm"].dtype == jnp.float32 and bf16["norm"].dtype == jnp.float32
    held = sum(np.asarray(a).nbytes for a in jax.tree.leaves(bf16))
    assert held == checkpoint.stage_nbytes(TINY, 0, TINY.n_layers, "bf16", stored="f32")
    tokens = jnp.asarray([[5, 17, 3, 88, 42, 9]], jnp.int32)
    want, got = forward_reference(f32, tokens, TINY), forward_reference(bf16, tokens, TINY)
    assert got.dtype == jnp.float32
    assert float(jnp.abs(got - want).max()) <= 0.02 * float(jnp.abs(want).max())


# ---------------------------------------------------------------- GGUF blocks


def tiny_gguf(path: Path, tree: dict, qtypes: dict[str, gguf.GGMLQuantizationType]) -> dict[str, np.ndarray]:
    """Tensors only (no metadata): each layer matrix in the qtype given for its key, stored
    llama.cpp-permuted like a real llama GGUF. Returns what each name holds, as gguf dequantises it."""
    writer = gguf.GGUFWriter(str(path), "llama")
    held = {}

    def add(name: str, w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> None:
        data = gguf.quants.quantize(np.ascontiguousarray(w, np.float32), qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
        held[name] = gguf.quants.dequantize(data, qtype)

    F32 = gguf.GGMLQuantizationType.F32
    add("token_embd.weight", tree["embed"], qtypes.get("embed", F32))
    add("output_norm.weight", tree["norm"], F32)
    for i in range(TINY.n_layers):
        for key, w in tree["layers"][str(i)].items():
            w = w.T if w.ndim == 2 else w
            heads = {"wq": TINY.n_heads, "wk": TINY.n_kv_heads}.get(key)
            if heads:   # convert_hf_to_gguf's permute, which unpermute_rows inverts
                w = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
            add(f"blk.{i}.{LAYER_NAMES[key][0]}", w, qtypes.get(key, F32) if w.ndim == 2 else F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def gguf_checkpoint(tmp_path: Path, tree: dict, qtypes: dict, fmt: str) -> tuple[Path, dict]:
    held = tiny_gguf(tmp_path / "t.gguf", tree, qtypes)
    src = sources.GGUFSource(tmp_path / "t.gguf", gguf.GGUFReader(tmp_path / "t.gguf"))
    w = CheckpointWriter(tmp_path / "m", TINY, fmt, rows_per_block=40)

    def name_of(where, key):
        return TOP_NAMES[key][0] if where == "top" else f"blk.{where}.{LAYER_NAMES[key][0]}"

    stream_checkpoint(TINY, src, name_of, w, unpermute=True)
    w.finish({"format": "gguf", "sha256": "1" * 64})
    return tmp_path / "m", held


Q = gguf.GGMLQuantizationType


def test_a_gguf_files_layout_reads_as_gguf_py_reads_it(tmp_path):
    """convert --gguf reads fields and tensors through sources.GGUFFile (the checked layout), not
    gguf.GGUFReader: every value, shape, type, offset and byte as the reader gives them."""
    from skippy_zmq.files.gguf_layout import read_gguf_layout

    w = gguf.GGUFWriter(str(tmp_path / "f.gguf"), "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.5)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_string("tokenizer.chat_template", "{{ messages }}")
    w.add_token_list(["a", "b\u00e9", "<|x|>"])
    w.add_token_types([1, 1, 3])
    w.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0])
    rng = np.random.default_rng(0)
    w.add_tensor("norm.weight", rng.standard_normal(64).astype(np.float32))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0)
    w.add_tensor("blk.0.w", q8, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = sources.GGUFFile(read_gguf_layout(tmp_path / "f.gguf")), gguf.GGUFReader(tmp_path / "f.gguf")
    # the reader adds the header as fields GGUF.version / tensor_count / kv_count (nothing reads them)
    assert {k: f.contents() for k, f in ours.fields.items()} == \
        {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert len(ours.tensors) == len(theirs.tensors) == 2
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, list(a.shape), a.data_offset, a.n_bytes) == \
            (b.name, b.tensor_type, list(b.shape), b.data_offset, b.n_bytes)
        assert a.data.tobytes() == np.asarray(b.data).tobytes()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_gguf_blocks_come_through_exactly(tmp_path, tiny_tree, qtype):
    fmt = "int8" if qtype == Q.Q8_0 else "q4"
    path, held = gguf_checkpoint(tmp_path, tiny_tree, {"wq": qtype, "w_up": qtype, "embed": Q.Q8_0}, fmt)
    layer = restore_stage(path, TINY, 0, 1)["layers"]["0"]
    e = checkpoint.grid(layer["w_up"])
    assert e.fmt == fmt and e.d.dtype == np.float16
    # the levels and scales the file holds: exactly gguf's dequantisation, no f32 round trip
    np.testing.assert_array_equal(checkpoint.dequantize_grid(e), held["blk.0.ffn_up.weight"])
    # Q rows permuted back: levels and scales alike
    np.testing.assert_array_equal(checkpoint.to_float(layer["wq"]), unpermute_rows(held["blk.0.attn_q.weight"], 4))
    assert layer["wk"]["q"].dtype == (np.int8 if fmt == "int8" else np.uint8)   # F32 in the file, quantised


def test_gguf_q4_levels_reach_the_runtime_unchanged(tmp_path, tiny_tree):
    path, held = gguf_checkpoint(tmp_path, tiny_tree, {"w_up": Q.Q4_1, "embed": Q.Q8_0}, "q4")
    raw = gguf.GGUFReader(tmp_path / "t.gguf").tensors
    t = next(t for t in raw if t.name == "blk.0.ffn_up.weight")
    blocks = np.asarray(t.data).reshape(128, 2, 20)              # [out, blocks, d m + 16 bytes]
    levels = np.concatenate([blocks[..., 4:] & 15, blocks[..., 4:] >> 4], axis=-1).reshape(128, 64)
    _, params = loader.load_slice(path, 0, 1, fmt="q4")
    np.testing.assert_array_equal(quant.levels(params["layers"][0]["w_up"]), levels.T)
    np.testing.assert_array_equal(np.asarray(quant.embed_rows(params["embed"], np.arange(97))),
                                  held["token_embd.weight"])   # Q8_0 rows, exactly


def test_gguf_finer_format_dequantises_and_other_types_requantise(tmp_path, tiny_tree):
    path, held = gguf_checkpoint(tmp_path, tiny_tree, {"w_up": Q.Q4_1, "w_down": Q.Q8_0, "wo": Q.F16}, "f32")
    layer = restore_stage(path, TINY, 0, 1)["layers"]["0"]
    np.testing.assert_array_equal(layer["w_up"]["w"], held["blk.0.ffn_up.weight"])
    (tmp_path / "q4").mkdir()
    path, held = gguf_checkpoint(tmp_path / "q4", tiny_tree, {"w_down": Q.Q8_0, "wo": Q.F16}, "q4")
    layer = restore_stage(path, TINY, 0, 1)["layers"]["0"]
    for key, name in [("w_down", "blk.0.ffn_down.weight"), ("wo", "blk.0.attn_output.weight")]:
        assert layer[key]["q"].dtype == np.uint8        # Q8_0 / F16 requantised to 4 bits
        want = checkpoint.encode(held[name], "q4")
        np.testing.assert_array_equal(layer[key]["q"], want["q"])


# ---------------------------------------------------------------- memory


@pytest.mark.slow
def test_conversion_memory_is_bounded(tmp_path):
    """~400 MB of f32 safetensors (6 layers, vocab 32000, untied) converts to q4 in bounded memory."""
    src = tmp_path / "src"
    run = [sys.executable, str(REPO / "scripts" / "random_hf_model.py"), str(src), "--hidden", "768",
           "--layers", "6", "--heads", "12", "--kv-heads", "4", "--ffn", "3072", "--vocab", "32000", "--untied"]
    subprocess.run(run, check=True, capture_output=True, timeout=120)
    source_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    assert 380e6 < source_bytes < 420e6
    out = subprocess.run([str(Path(sys.executable).parent / "skippy-zmq"), "convert", "--hf", str(src), "--out",
                          str(tmp_path / "out"), "--weights", "q4"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    peak = float(re.search(r"peak RSS ([0-9.]+) GiB", out.stderr).group(1)) * 2**30
    # the old reader held every tensor as f32 (plus the tree it built): well over 2x the source
    assert peak < 0.6 * 2**30, f"peak RSS {peak / 2**30:.2f} GiB"
    manifest = json.loads((tmp_path / "out" / "params" / "format.json").read_text())
    assert manifest["weights"] == "q4" and manifest["stored"]["head"] == "int8"


# ---------------------------------------------------------------- running what was stored


def test_q4_checkpoint_runs_cached_decode_like_its_full_forward(tmp_path, tiny_tree):
    import jax.numpy as jnp

    from skippy_zmq.config.model import KVConfig
    from skippy_zmq.model.runner import SliceRunner

    _, params = loader.load_slice(write_tree(tmp_path / "m", tiny_tree, "q4"), fmt="q4")
    ids = np.random.default_rng(3).integers(3, 97, size=24).astype(np.int32)
    want = np.asarray(forward_reference(params, jnp.asarray(ids)[None], TINY))[0]
    r = SliceRunner(TINY, params, 0, TINY.n_layers, KVConfig(lanes=2, capacity=256))
    r.prefill(1, ids[:-2], 0, output="none")
    for i in (len(ids) - 2, len(ids) - 1):
        np.testing.assert_allclose(r.decode(np.array([1]), ids[i:i + 1], np.array([i]))[0], want[i],
                                   rtol=2e-4, atol=2e-4)
    at_load = weights.to_runtime(tiny_tree, jnp.float32, quantize="q4")   # same levels, f32 scales, float embed
    np.testing.assert_allclose(want, np.asarray(forward_reference(at_load, jnp.asarray(ids)[None], TINY))[0],
                               atol=0.02)


@pytest.mark.slow
def test_real_model_q4_checkpoint_greedy_matches_transformers(model_dir, parity, tmp_path):
    """The shipped Q4_1 GGUF converted --weights q4 (its exact levels, Q8_0 embedding as int8 rows)."""
    from skippy_zmq.engine.generate import LocalEngine
    from skippy_zmq.checkpoint.convert import convert_gguf

    convert_gguf(REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf", tmp_path / "q4", "q4")
    engine = LocalEngine(tmp_path / "q4", weights="q4", capacity=256)
    assert isinstance(engine.runner.params["embed"], quant.QRows)
    for case in parity["prompts"]:
        want = case["transformers_fp32_ids"]
        got = engine.generate(case["prompt_ids"], max_tokens=len(want), ignore_eos=True).token_ids
        assert got == want
    with pytest.raises(CheckpointError, match="checkpoint stores q4; a stage can run q4 only"):
        LocalEngine(tmp_path / "q4", capacity=256)


@pytest.mark.parametrize("bits, n, k", [(4, 130, 64), (8, 100, 96), (4, 64, 40)])
def test_pack_rows_packs_what_pack_packs(bits, n, k):
    """The [out, in] packer a stage loads with makes pack()'s panels bit for bit (padding included)."""
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 16, (n, k)).astype(np.uint8 if bits == 4 else np.int8)
    groups = k // 32 if k % 32 == 0 else 1
    s, z = (rng.standard_normal((n, groups)).astype(np.float16) for _ in range(2))
    a = quant.pack(q.T, s.T.astype(np.float32), z.T.astype(np.float32), bits=bits)
    b = quant.pack_rows(q, s, z, bits=bits)
    for x, y in [(a.q, b.q), (a.s, b.s), (a.z, b.z)]:
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def test_a_streamed_layer_is_written_in_parts_and_restored_whole(tmp_path, monkeypatch, tiny_tree):
    """put_layer_tensor flushes a layer's encoded tensors as part items past PART_BYTES (so a layer of
    hundreds of experts never sits in memory whole); restore merges the parts back; keys are checked."""
    monkeypatch.setattr(checkpoint, "PART_BYTES", 1)            # every tensor its own part
    write_tree(tmp_path / "m", tiny_tree, "f32")
    parts = [p for p in (tmp_path / "m" / "params").iterdir() if p.name.startswith("layer_00000.part")]
    assert len(parts) == len(tiny_tree["layers"]["0"])
    for i, layer in checkpoint.stage_items(tmp_path / "m", TINY):
        if isinstance(i, int):
            assert set(layer) == set(tiny_tree["layers"][str(i)])
            for k, v in tiny_tree["layers"][str(i)].items():
                np.testing.assert_array_equal(layer[k]["w"].T if v.ndim == 2 else layer[k], v)
    w = CheckpointWriter(tmp_path / "b", TINY, "f32")
    w.put_layer_tensor(0, "attn_norm", np.ones(TINY.d_model, np.float32))
    with pytest.raises(CheckpointError, match="before layer 0 ended"):
        w.put_layer_tensor(1, "attn_norm", np.ones(TINY.d_model, np.float32))
    with pytest.raises(CheckpointError, match="got keys"):
        w.end_layer(0)

"""Weight-only int8 and 4-bit: quantisation error bounds, GGUF levels kept
exactly, q4 packing, the CPU kernel against the XLA fallback and plain f32
math, a tiny model end to end, and greedy parity on the real model.
(Building, dispatching and falling back: test_quant_kernel.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import MODEL_DIR, TINY, first_mismatch, random_ids
from skippy_zmq.config.model import KVConfig
from skippy_zmq.model import quant, weights
from skippy_zmq.model.runner import SliceRunner
from skippy_zmq.config.topology import TopologyError
from skippy_zmq.config.topology_yaml import parse_topology
from model_helpers import forward_reference

GGUF = MODEL_DIR.parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def device_tree(t: quant.QTensor) -> quant.QTensor:
    return jax.tree.map(jnp.asarray, t)


def test_per_channel_roundtrip_within_half_a_step():
    w = np.random.default_rng(0).standard_normal((96, 40)).astype(np.float32)
    d = quant.quantize_int8(w, offsets=False)
    assert d["q"].dtype == np.int8 and d["q"].shape == (96, 40) and d["s"].shape == (40,)
    np.testing.assert_array_equal(d["z"], 0)
    err = np.abs(d["q"] * d["s"] - w)
    assert np.all(err <= d["s"] / 2 * (1 + 1e-6))
    assert np.abs(d["q"]).max() == 127   # the grid spans each column's max


def test_grouped_roundtrip_within_half_a_step():
    w = np.random.default_rng(1).standard_normal((128, 24)).astype(np.float32)
    d = quant.quantize_int8(w, group_size=32)
    assert d["s"].shape == (4, 24)
    back = d["q"].reshape(4, 32, 24) * d["s"][:, None] + d["z"][:, None]
    assert np.all(np.abs(back - w.reshape(4, 32, 24)) <= d["s"][:, None] / 2 * (1 + 1e-5) + 1e-7)


def f16(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float16).astype(np.float32)


def test_gguf_block_formats_survive_exactly():
    """The converted model is dequantised Q4_1 (linears) and Q8_0 (embedding), f16 d and m
    as GGUF blocks store them: the min/max grid holds Q4_1's 16 levels, the symmetric grid
    Q8_0's 255, and the f16 scales hold d and m themselves."""
    rng = np.random.default_rng(2)
    d, m = f16(rng.uniform(0.01, 0.1, (2, 8))), f16(rng.uniform(-0.5, 0.0, (2, 8)))
    q4_1 = (rng.integers(0, 16, (2, 32, 8)) * d[:, None] + m[:, None]).astype(np.float32)
    q4_1[:, 0], q4_1[:, 1] = m, 15 * d + m                      # blocks use their full range
    q8_0 = (rng.integers(-127, 128, (2, 32, 8)) * d[:, None]).astype(np.float32)
    q8_0[:, 0] = 127 * d
    for w in (q4_1.reshape(64, 8), q8_0.reshape(64, 8)):
        back = np.asarray(quant.dequantize(device_tree(quant.to_qtensor(w))))
        np.testing.assert_allclose(back, w, rtol=3e-7, atol=1e-7)   # float rounding only


@pytest.mark.parametrize("m,k,n", [(1, 64, 64), (3, 64, 97), (7, 96, 192), (33, 128, 130), (5, 1536, 64)])
@pytest.mark.parametrize("impl", ["kernel", "xla"])
@pytest.mark.parametrize("bits", [8, 4])
def test_dense_matches_f32_math_on_the_dequantised_weight(m, k, n, impl, bits):
    if impl == "kernel" and not quant.kernel_available():
        pytest.skip("no C++ compiler for the CPU kernel")
    rng = np.random.default_rng(m + k + n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    t = device_tree(quant.to_qtensor(w, impl=impl, bits=bits))
    got = np.asarray(jax.jit(quant.dense)(x, t))
    want = np.asarray(x) @ np.asarray(quant.dequantize(t), np.float64)
    assert got.shape == (m, n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * np.abs(want).max())
    step = 2.0 / (255 if bits == 8 else 15)   # a grid step of a unit-range weight: the error is noise
    np.testing.assert_allclose(got, np.asarray(x) @ w, atol=step * np.sqrt(k) * 3)


@pytest.mark.parametrize("bits", [8, 4])
def test_kernel_equals_xla_fallback(bits):
    """The native path and the fallback compute the same product (decode rows and a prefill chunk)."""
    if not quant.kernel_available():
        pytest.skip("no C++ compiler for the CPU kernel")
    rng = np.random.default_rng(bits)
    w = rng.standard_normal((576, 200)).astype(np.float32)
    for m in (1, 2, 4, 6, 64):
        x = jnp.asarray(rng.standard_normal((m, 576)).astype(np.float32))
        kernel = np.asarray(jax.jit(quant.dense)(x, device_tree(quant.to_qtensor(w, "kernel", bits))))
        xla = np.asarray(jax.jit(quant.dense)(x, device_tree(quant.to_qtensor(w, "xla", bits))))
        np.testing.assert_allclose(kernel, xla, rtol=1e-5, atol=2e-6 * np.abs(xla).max())


def test_q4_pack_unpack_round_trip():
    rng = np.random.default_rng(5)
    q = rng.integers(0, 16, (96, 100)).astype(np.uint8)            # 100 columns: one padded panel
    s, z = f16(rng.uniform(0.01, 0.1, (3, 100))), f16(rng.uniform(-1, 0, (3, 100)))
    t = quant.pack(q, s, z, bits=4)
    assert t.bits == 4 and t.q.dtype == np.uint8 and t.q.shape == (2, 96, 32) and t.shape == (96, 100)
    assert t.s.dtype == t.z.dtype == np.float16
    assert t.nbytes == 2 * 96 * 32 + 2 * 2 * 3 * 64 * 2           # half a byte a weight, plus f16 scales
    np.testing.assert_array_equal(quant.levels(t), q)
    want = q.reshape(3, 32, 100) * s[:, None] + z[:, None]
    np.testing.assert_allclose(np.asarray(quant.dequantize(device_tree(t))), want.reshape(96, 100), rtol=1e-6,
                               atol=1e-6)
    with pytest.raises(ValueError, match="0..15"):
        quant.pack(q + 1, s, z, bits=4)


def test_q4_grouped_roundtrip_within_half_a_step():
    w = np.random.default_rng(6).standard_normal((128, 24)).astype(np.float32)
    d = quant.quantize_q4(w)
    assert d["q"].dtype == np.uint8 and d["q"].max() <= 15 and d["s"].shape == (4, 24)
    back = d["q"].reshape(4, 32, 24) * d["s"][:, None] + d["z"][:, None]
    assert np.all(np.abs(back - w.reshape(4, 32, 24)) <= np.abs(d["s"][:, None]) / 2 * (1 + 1e-5) + 1e-7)


def gguf_blocks(rng: np.random.Generator, kind: str, blocks: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Weights dequantised from random Q4_1 / Q4_0 blocks the way llama.cpp builds them
    (fp16 scale and min; Q4_1 blocks use levels 0 and 15, Q4_0 blocks level 0
    for their largest magnitude), as [32 * blocks, 1] weights and their levels."""
    lv = rng.integers(0, 16, (blocks, 32))
    d = rng.uniform(0.001, 0.05, blocks).astype(np.float16).astype(np.float32)
    if kind == "q4_1":
        lv[:, 0], lv[:, 1] = 0, 15
        m = rng.uniform(-0.5, 0.0, blocks).astype(np.float16).astype(np.float32)
        w = lv * d[:, None] + m[:, None]
    else:   # without level 15 a block is no min/max block, whose mirrored levels would fit as well
        lv[:, 0], lv[lv == 15] = 0, 14
        d *= rng.choice([-1, 1], blocks)
        w = (lv - 8) * d[:, None]
    return w.astype(np.float32).reshape(-1, 1), lv.reshape(-1, 1).astype(np.uint8)


@pytest.mark.parametrize("kind", ["q4_1", "q4_0"])
def test_q4_reproduces_gguf_q4_levels_exactly(kind):
    w, lv = gguf_blocks(np.random.default_rng(7), kind)
    t = quant.to_qtensor(w, bits=4)
    np.testing.assert_array_equal(quant.levels(t), lv)
    np.testing.assert_allclose(np.asarray(quant.dequantize(device_tree(t))), w, rtol=3e-7, atol=1e-7)


def test_q4_reproduces_the_shipped_gguf_levels_exactly():
    """The default model's linears are Q4_1: every block of layer 0 keeps its very levels."""
    if not GGUF.is_file():
        pytest.skip(f"no GGUF at {GGUF}")
    import gguf

    reader = gguf.GGUFReader(GGUF)
    tensors = [t for t in reader.tensors if t.name.startswith("blk.0.") and t.tensor_type.name == "Q4_1"]
    assert len(tensors) == 7
    for t in tensors:
        raw = np.asarray(t.data).reshape(-1, 20)                     # fp16 d, fp16 m, 16 bytes of nibbles
        want = np.concatenate([raw[:, 4:] & 15, raw[:, 4:] >> 4], axis=1)   # elements 0..15, 16..31
        w = gguf.dequantize(t.data, t.tensor_type).reshape(-1, t.shape[0]).T   # [in, out], as we store it
        got = quant.quantize_q4(w)["q"].T.reshape(-1, 32)
        np.testing.assert_array_equal(got, want, err_msg=t.name)


def test_dense_keeps_leading_dims_and_plain_arrays_bit_exact():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((2, 5, 64)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(quant.dense(x, jnp.asarray(w))), np.asarray(x @ w))
    t = device_tree(quant.to_qtensor(w))
    got = quant.dense(x, t)
    assert got.shape == (2, 5, 48) and got.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(got).reshape(10, 48),
                               np.asarray(quant.dense(x.reshape(10, 64), t)), rtol=1e-6, atol=1e-6)


def test_tiny_model_int8_logits_stay_close(tiny_tree):
    ids = jnp.asarray(random_ids(40, TINY.vocab_size))[None]
    f32 = np.asarray(forward_reference(weights.to_runtime(tiny_tree, jnp.float32), ids, TINY))[0]
    params = weights.to_runtime(tiny_tree, jnp.float32, quantize="int8")
    assert isinstance(params["layers"][0]["w_down"], quant.QTensor)
    assert isinstance(params["head"], quant.QTensor)                 # tied head gets an int8 copy
    assert not isinstance(params["embed"], quant.QTensor)            # lookup stays float
    int8 = np.asarray(forward_reference(params, ids, TINY))[0]
    assert np.abs(int8 - f32).max() < 0.1 < np.abs(f32).max()
    assert (int8.argmax(-1) == f32.argmax(-1)).mean() >= 0.95


@pytest.mark.parametrize("quantize, seed", [("int8", 4), ("q4", 8)])
def test_quantized_runner_cached_decode_matches_full_forward(tiny_tree, quantize, seed):
    params = weights.to_runtime(tiny_tree, jnp.float32, quantize=quantize)
    ids = random_ids(30, TINY.vocab_size, seed=seed)
    want = np.asarray(forward_reference(params, jnp.asarray(ids)[None], TINY))[0]
    r = SliceRunner(TINY, params, 0, TINY.n_layers, KVConfig(lanes=2, capacity=256))
    r.prefill(1, ids[:-3], 0, output="none")
    for i in range(len(ids) - 3, len(ids)):
        got = r.decode(np.array([1]), ids[i:i + 1], np.array([i]))[0]
        np.testing.assert_allclose(got, want[i], rtol=2e-4, atol=2e-4)


def test_tiny_model_q4_equals_its_dequantised_float_model(tiny_tree):
    """q4 layers and an int8 head run the same model as their dequantised f32 weights."""
    ids = jnp.asarray(random_ids(40, TINY.vocab_size))[None]
    params = weights.to_runtime(tiny_tree, jnp.float32, quantize="q4")
    assert params["layers"][0]["w_down"].bits == 4 and params["head"].bits == 8
    assert not isinstance(params["embed"], quant.QTensor)
    plain = jax.tree.map(lambda a: quant.dequantize(a) if isinstance(a, quant.QTensor) else a, params,
                         is_leaf=lambda a: isinstance(a, quant.QTensor))
    q4 = np.asarray(forward_reference(params, ids, TINY))[0]
    np.testing.assert_allclose(q4, np.asarray(forward_reference(plain, ids, TINY))[0], rtol=1e-4, atol=1e-4)
    f32 = np.asarray(forward_reference(weights.to_runtime(tiny_tree, jnp.float32), ids, TINY))[0]
    assert np.abs(q4 - f32).mean() < 0.4 * np.abs(f32).mean()   # gaussian weights: 4 bits is coarse, not wrong


def test_unknown_quantize_mode_is_rejected(tiny_tree):
    with pytest.raises(ValueError, match="quantize must be one of"):
        weights.to_runtime(tiny_tree, jnp.float32, quantize="int4")


def test_topology_stage_weights_choice():
    def stage_weights(value: str) -> str:
        data = {"model": "m", "n_layers": 2, "driver": {"return": "tcp://127.0.0.1:5600", "http": "127.0.0.1:8000"},
                "stages": [{"id": "s0", "layers": [0, 2], "listen": "tcp://127.0.0.1:5601", "weights": value}]}
        return parse_topology(data).stages[0].weights

    assert [stage_weights(w) for w in ("f32", "bf16", "int8", "q4")] == ["f32", "bf16", "int8", "q4"]
    with pytest.raises(TopologyError, match="expected one of auto, gguf, f32, bf16, int8, q4, got 'q3'"):
        stage_weights("q3")


@pytest.mark.parametrize("weights_format", ["int8", "q4"])
def test_real_model_quantised_greedy_matches_transformers(model_dir, parity, weights_format):
    """Measured 96/96 tokens for both: the grids hold the GGUF source's levels exactly."""
    from skippy_zmq.engine.generate import LocalEngine

    engine = LocalEngine(model_dir, weights=weights_format, capacity=256)
    for case in parity["prompts"]:
        want = case["transformers_fp32_ids"]
        got = engine.generate(case["prompt_ids"], max_tokens=len(want), ignore_eos=True).token_ids
        assert first_mismatch(got, want) == len(want), (got, want)


def test_topology_stage_with_int8_weights_serves_the_reference_tokens(model_dir, parity, tmp_path):
    """`weights: int8` on every stage of a real 2-stage pipeline keeps greedy agreement."""
    from procs import running_pipeline, write_topology
    from skippy_zmq.engine.request import GenRequest

    topo = write_topology(tmp_path, model_dir, 2, name="int8", weights="int8")
    with running_pipeline(topo, tmp_path / "run") as (engine, _, _, _):
        case = parity["prompts"][1]
        events = list(engine.generate_blocking(GenRequest("q", tuple(case["prompt_ids"]), max_tokens=16,
                                                          ignore_eos=True)))
        assert [e.token_id for e in events if e.token_id is not None] == case["transformers_fp32_ids"][:16]

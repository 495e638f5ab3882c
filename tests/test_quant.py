"""Weight-only int8: quantisation error bounds, the CPU kernel against plain
f32 math, a tiny model end to end, and greedy parity on the real model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY, first_mismatch, random_ids
from skippy_zmq.config import KVConfig
from skippy_zmq.model import quant, weights
from skippy_zmq.model.llama import forward_reference
from skippy_zmq.model.runner import SliceRunner


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


def test_gguf_block_formats_survive_exactly():
    """The converted model is dequantised Q4_1 (linears) and Q8_0 (embedding):
    the min/max grid holds Q4_1's 16 levels, the symmetric grid Q8_0's 255."""
    rng = np.random.default_rng(2)
    d, m = rng.uniform(0.01, 0.1, (2, 8)), rng.uniform(-0.5, 0.0, (2, 8))
    q4_1 = (rng.integers(0, 16, (2, 32, 8)) * d[:, None] + m[:, None]).astype(np.float32)
    q4_1[:, 0], q4_1[:, 1] = m, 15 * d + m                      # blocks use their full range
    q8_0 = (rng.integers(-127, 128, (2, 32, 8)) * d[:, None]).astype(np.float32)
    q8_0[:, 0] = 127 * d
    for w in (q4_1.reshape(64, 8), q8_0.reshape(64, 8)):
        back = np.asarray(quant.dequantize(device_tree(quant.to_qtensor(w))))
        np.testing.assert_allclose(back, w, rtol=3e-7, atol=1e-7)   # float rounding only


@pytest.mark.parametrize("m,k,n", [(1, 64, 64), (3, 64, 97), (7, 96, 192), (33, 128, 130)])
@pytest.mark.parametrize("impl", ["kernel", "xla"])
def test_dense_matches_f32_math_on_the_dequantised_weight(m, k, n, impl):
    if impl == "kernel" and not quant.kernel_available():
        pytest.skip("no C++ compiler for the int8 CPU kernel")
    rng = np.random.default_rng(m + k + n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    t = device_tree(quant.to_qtensor(w, impl=impl))
    got = np.asarray(jax.jit(quant.dense)(x, t))
    want = np.asarray(x @ quant.dequantize(t))
    assert got.shape == (m, n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got, np.asarray(x) @ w, rtol=0.02, atol=0.1 * np.abs(want).max())


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


def test_int8_runner_cached_decode_matches_full_forward(tiny_tree):
    params = weights.to_runtime(tiny_tree, jnp.float32, quantize="int8")
    ids = random_ids(30, TINY.vocab_size, seed=4)
    want = np.asarray(forward_reference(params, jnp.asarray(ids)[None], TINY))[0]
    r = SliceRunner(TINY, params, 0, TINY.n_layers, KVConfig(lanes=2, capacity=256))
    r.prefill(1, ids[:-3], 0, output="none")
    for i in range(len(ids) - 3, len(ids)):
        got = r.decode(np.array([1]), ids[i:i + 1], np.array([i]))[0]
        np.testing.assert_allclose(got, want[i], rtol=2e-4, atol=2e-4)


def test_unknown_quantize_mode_is_rejected(tiny_tree):
    with pytest.raises(ValueError, match="quantize must be one of"):
        weights.to_runtime(tiny_tree, jnp.float32, quantize="int4")


def test_real_model_int8_greedy_matches_transformers(model_dir, parity):
    """Measured 96/96 tokens: the int8 grids hold the GGUF source's levels exactly."""
    from skippy_zmq.generate import LocalEngine

    engine = LocalEngine(model_dir, weights="int8", capacity=256)
    for case in parity["prompts"]:
        want = case["transformers_fp32_ids"]
        got = engine.generate(case["prompt_ids"], max_tokens=len(want), ignore_eos=True).token_ids
        assert first_mismatch(got, want) == len(want), (got, want)


def test_topology_stage_with_int8_weights_serves_the_reference_tokens(model_dir, parity, tmp_path):
    """`weights: int8` on every stage of a real 2-stage pipeline keeps greedy agreement."""
    from procs import running_pipeline, write_topology
    from skippy_zmq.driver.engine import GenRequest

    topo = write_topology(tmp_path, model_dir, 2, name="int8", weights="int8")
    with running_pipeline(topo, tmp_path / "run") as (engine, _, _, _):
        case = parity["prompts"][1]
        events = list(engine.generate_blocking(GenRequest("q", tuple(case["prompt_ids"]), max_tokens=16,
                                                          ignore_eos=True)))
        assert [e.token_id for e in events if e.token_id is not None] == case["transformers_fp32_ids"][:16]

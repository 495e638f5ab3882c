"""The decode step called through its compiled executable (model/direct.py) is jit's step, bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from conftest import TINY, counting_compiles, random_ids
from skippy_zmq.config.model import Buckets, KVConfig
from skippy_zmq.model import direct, weights
from skippy_zmq.model.runner import SliceRunner
from model_helpers import random_params, read_kv, slice_tree


def runner(tree: dict) -> SliceRunner:
    params = weights.to_runtime(slice_tree(tree, TINY, 0, TINY.n_layers), jnp.float32)
    return SliceRunner(TINY, params, 0, TINY.n_layers, KVConfig(lanes=2, capacity=256), Buckets())


def decode_all(r: SliceRunner, ids: np.ndarray, through_jit: bool) -> np.ndarray:
    r.prefill(1, ids[:8], 0, output="none")
    out = []
    for i in range(8, len(ids)):
        if through_jit:
            r._steps.direct.clear()   # no DirectStep to take: jit runs it (and a new one is built)
        out.append(r.decode(np.array([1]), ids[i:i + 1], np.array([i]))[0])
    return np.stack(out)


def test_direct_steps_equal_jit_steps_bit_for_bit(tiny_tree):
    ids = random_ids(20, TINY.vocab_size, seed=7)
    fast, slow = runner(tiny_tree), runner(tiny_tree)
    got, want = decode_all(fast, ids, False), decode_all(slow, ids, True)
    assert isinstance(fast._steps.direct[((1, 1), 256, "logits")], direct.DirectStep)   # (on the CPU)
    np.testing.assert_array_equal(got, want)
    for a, b in zip(read_kv(fast, 1, len(ids)), read_kv(slow, 1, len(ids))):
        np.testing.assert_array_equal(a, b)


def test_direct_step_compiles_nothing_and_other_params_drop_it(tiny_tree):
    r = runner(tiny_tree)
    ids = random_ids(12, TINY.vocab_size, seed=8)
    r.decode(np.array([0]), ids[:1], np.array([0]))            # jit's run, then its DirectStep
    with counting_compiles() as compiles:
        first = r.decode(np.array([0]), ids[1:2], np.array([1]))
    assert compiles == []
    step = r._steps.direct[((1, 1), 256, "logits")]
    other = random_params(TINY, seed=5)
    swapped, plain = runner(other), runner(other)   # other weights: jit runs them, not that DirectStep
    swapped._steps.direct, swapped._steps.params = {((1, 1), 256, "logits"): step}, r.params
    got, want = ([x.decode(np.array([0]), ids[i:i + 1], np.array([i])) for i in (0, 1)] for x in (swapped, plain))
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got[1], first)
    assert swapped._steps.direct[((1, 1), 256, "logits")].params is swapped.params   # built anew


def test_host_put_makes_the_arrays_device_put_makes_and_hands_the_rest_to_it():
    device = jax.devices("cpu")[0]
    put = direct.HostPut(device)
    assert put.fast   # (jax 0.10.2 on the CPU: the call device_put ends in is there)
    ids, pos, lanes = np.array([[5, 7]], np.int32), np.array([[3, 4]], np.int32), np.array([1], np.int32)
    act = np.linspace(-2, 2, 24, dtype=np.float32).reshape(1, 2, 12)
    for arrays in ((ids, pos, lanes), (act, pos, lanes)):
        got, want = put(arrays), jax.device_put(arrays, device)
        for g, w, a in zip(got, want, arrays):
            assert (g.shape, g.dtype, g.weak_type, g.committed, g.sharding) == \
                (w.shape, w.dtype, w.weak_type, w.committed, w.sharding)
            np.testing.assert_array_equal(np.asarray(g), a)
    # what device_put changes (int64 kept as int32 without x64) or must copy goes through it
    wide, strided = np.array([[5, 7]], np.int64), np.arange(8, dtype=np.int32).reshape(2, 4)[:, ::2]
    got = put((wide, strided, lanes))
    assert [g.dtype for g in got] == [np.int32, np.int32, np.int32]
    np.testing.assert_array_equal(np.asarray(got[1]), strided)

"""The decode step called through its compiled executable (model/direct.py) is jit's step, bit for bit."""

from __future__ import annotations

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

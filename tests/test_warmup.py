"""Warm-up covers what traffic needs: after it, prefill and decode compile nothing (no timing here)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from conftest import TINY, random_ids
from skippy_zmq.config import Buckets, KVConfig
from skippy_zmq.model import weights
from skippy_zmq.model.llama import forward_jit
from skippy_zmq.model.runner import SliceRunner

BUCKETS = Buckets(prefill_chunks=(16, 64), decode_rows=(1, 2), attn_lens=(128, 256, 1024))


def runner(tree: dict, capacity: int = 384) -> SliceRunner:
    params = weights.to_runtime(tree, jnp.float32)
    return SliceRunner(TINY, params, 0, TINY.n_layers, KVConfig(lanes=2, capacity=capacity), BUCKETS)


def test_attn_buckets_run_up_to_the_capacity(tiny_tree):
    r = runner(tiny_tree)
    assert r.attn_buckets() == (128, 256, 384)     # 1024 > capacity: attn_for returns the capacity
    assert r.attn_buckets(200) == (128, 256)
    assert r.attn_buckets(1) == (128,)


def test_full_warmup_leaves_nothing_to_compile(tiny_tree):
    r = runner(tiny_tree)
    r.warmup(rows=(1, 2), attn_lens=r.attn_buckets())
    compiled = forward_jit._cache_size()
    ids = random_ids(300, TINY.vocab_size, seed=5)
    r.prefill(0, ids[:-1], 0, output="none")          # chunks of 64 across the 128/256/384 buckets
    for pos in range(299, 383, 7):                   # decode through the last buckets
        r.decode(np.array([0, 1]), ids[:2], np.array([pos, 3]))
        r.decode(np.array([0]), ids[:1], np.array([pos]))
    assert forward_jit._cache_size() == compiled
    calls = r.stats.calls
    n = len(r.stats.shapes)
    r.warmup(rows=(1, 2), attn_lens=r.attn_buckets())  # a second call finds every shape done
    assert len(r.stats.shapes) == n and r.stats.calls == calls


def test_request_warmup_covers_that_request(tiny_tree):
    r = runner(tiny_tree, capacity=320)
    pairs, decode = r.request_shapes(0, 140, 30)
    assert pairs == {(64, 128), (16, 256)}   # 64 + 64 (both end by 128) + 12 (ends at 140)
    assert decode == {256}
    r.warmup(rows=(1,), attn_lens=tuple(decode), pairs=pairs)
    compiled = forward_jit._cache_size()
    ids = random_ids(141, TINY.vocab_size, seed=6)
    r.prefill(1, ids[:-1], 0, output="none")
    for pos in range(140, 170):
        r.decode(np.array([1]), ids[-1:], np.array([pos]))
    assert forward_jit._cache_size() == compiled


def test_default_warmup_is_the_first_attention_bucket(tiny_tree):
    """The stage factory's call keeps its start time: only sequences up to the first bucket are covered."""
    r = runner(tiny_tree)
    r.warmup(rows=(1,))
    assert {attn for _shape, attn, _out in r.stats.shapes} == {128}
    assert len(r.stats.shapes) == 1 + len(BUCKETS.prefill_chunks)

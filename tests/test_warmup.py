"""Warm-up covers what traffic needs: after it, prefill and decode compile nothing, and a
quantised matmul traces one path (no timing here)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY, counting_compiles, random_ids
from skippy_zmq.config.model import Buckets, KVConfig, decode_shapes, widest_window
from skippy_zmq.model import quant, weights
from skippy_zmq.model.runner import WARM_RUN_TOKENS, SliceRunner
from skippy_zmq.stage.factory import warm_before_ready
from model_helpers import read_kv

BUCKETS = Buckets(prefill_chunks=(16, 64), decode_rows=(1, 2), attn_lens=(128, 256, 1024))


def runner(tree: dict, capacity: int = 384, lanes: int = 2) -> SliceRunner:
    params = weights.to_runtime(tree, jnp.float32)
    return SliceRunner(TINY, params, 0, TINY.n_layers, KVConfig(lanes=lanes, capacity=capacity), BUCKETS)


def test_attn_buckets_run_up_to_the_capacity(tiny_tree):
    r = runner(tiny_tree)
    assert r.attn_buckets() == (128, 256, 384)     # 1024 > capacity: attn_for returns the capacity
    assert r.attn_buckets(200) == (128, 256)
    assert r.attn_buckets(1) == (128,)


def test_full_warmup_leaves_nothing_to_compile(tiny_tree):
    r = runner(tiny_tree)
    r.warmup(rows=(1, 2), attn_lens=r.attn_buckets())
    ids = random_ids(300, TINY.vocab_size, seed=5)
    with counting_compiles() as compiles:
        r.prefill(0, ids[:-1], 0, output="none")          # chunks of 64 across the 128/256/384 buckets
        for pos in range(299, 383, 7):                   # decode through the last buckets
            r.decode(np.array([0, 1]), ids[:2], np.array([pos, 3]))
            r.decode(np.array([0]), ids[:1], np.array([pos]))
    assert compiles == []
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
    ids = random_ids(141, TINY.vocab_size, seed=6)
    with counting_compiles() as compiles:
        r.prefill(1, ids[:-1], 0, output="none")
        for pos in range(140, 170):
            r.decode(np.array([1]), ids[-1:], np.array([pos]))
    assert compiles == []


def test_warmup_runs_small_shapes_on_padding_and_changes_no_kv(tiny_tree):
    """Decode rows, windows and chunks up to WARM_RUN_TOKENS are run once (a compiled step's first run
    is slow on XLA:CPU), on padding positions: every lane's KV stays bit for bit what it was, and the
    runner's step counters do not count the warm-up."""
    from skippy_zmq.model.runner import WARM_RUN_TOKENS

    r = runner(tiny_tree)
    ids = random_ids(40, TINY.vocab_size, seed=9)
    r.prefill(0, ids, 0, output="none")
    r.prefill(1, ids[::-1].copy(), 0, output="none")
    before = [np.asarray(a).copy() for a in r.kv.k + r.kv.v]
    calls = r.stats.calls
    r.warmup(rows=(1, 2), windows=(4, 8), attn_lens=(128, 256))
    # it made every shape it lists (compiled, or loaded from model/exec_cache.py, which fires no compile
    # event: a machine that ran the suite before holds this tiny model's executables) and ran them all
    made = set(r.warm_shapes(rows=(1, 2), windows=(4, 8), attn_lens=(128, 256)))
    assert len(made) == 2 * (2 + 2 + len(BUCKETS.prefill_chunks)) and made <= r.stats.shapes
    assert max(16, 64) <= WARM_RUN_TOKENS
    assert r.stats.calls == calls and r.stats.ran == r.stats.shapes
    # a stage compiles before READY (run=False) and runs the same shapes while idle, compiling nothing
    r2 = runner(tiny_tree)
    r2.warmup(rows=(1,), windows=(4,), attn_lens=(128,), run=False)
    assert r2.stats.shapes and not r2.stats.ran
    with counting_compiles() as compiles:
        r2.warmup(rows=(1,), windows=(4,), attn_lens=(128,))
    assert r2.stats.ran == r2.stats.shapes and compiles == []
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, r.kv.k + r.kv.v))
    want = r.decode(np.array([0]), ids[-1:], np.array([40]))[0]
    fresh = runner(tiny_tree)
    fresh.prefill(0, ids, 0, output="none")
    np.testing.assert_array_equal(want, fresh.decode(np.array([0]), ids[-1:], np.array([40]))[0])


def test_default_warmup_is_the_first_attention_bucket(tiny_tree):
    """The stage factory's call keeps its start time: only sequences up to the first bucket are covered."""
    r = runner(tiny_tree)
    r.warmup(rows=(1,))
    assert {attn for _shape, attn, _out in r.stats.shapes} == {128}
    assert len(r.stats.shapes) == 1 + len(BUCKETS.prefill_chunks)


@pytest.mark.parametrize("quantize", ["int8", "q4"])
def test_stage_warmup_leaves_no_shape_it_serves_to_compile(tiny_tree, quantize):
    """What the factory compiles before READY: every prefill chunk and 1- and 2-row decode at every
    attention length up to the capacity, first and last stage, quantised weights."""
    params = weights.to_runtime(tiny_tree, jnp.float32, quantize=quantize)
    for start, end in ((0, 2), (2, TINY.n_layers)):
        part = {**params, "layers": params["layers"][start:end]}
        r = SliceRunner(TINY, part, start, end, KVConfig(lanes=2, capacity=384), BUCKETS)
        warm_before_ready(r)
        assert r.stats.calls == 0                    # compiled ahead of time, nothing run
        x = random_ids(300, TINY.vocab_size, seed=7) if start == 0 else \
            np.random.default_rng(7).standard_normal((300, TINY.d_model)).astype(np.float32)
        prefill_out = "hidden" if end < TINY.n_layers else "none"
        with counting_compiles() as compiles:
            for n in (10, 40, 300):                  # chunks 16, 64 and 64 + ... across 128/256/384
                r.prefill(0, x[:n], 0, output=prefill_out)
            for pos in (5, 130, 260, 383):           # decode at every attention bucket, 1 and 2 rows
                r.decode(np.array([0]), x[:1], np.array([pos]))
                r.decode(np.array([0, 1]), x[:2], np.array([pos, 1]))
        assert compiles == [], f"layers [{start}, {end}) compiled {len(compiles)} shape(s) after warm-up"


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantised_matmul_traces_one_path(bits):
    """dense chooses kernel or fallback while tracing (not jax.lax.platform_dependent, which traced
    both for every matmul): the kernel's trace holds the FFI call and no dot, the fallback's the
    reverse, and neither a cond."""
    w = np.random.default_rng(bits).standard_normal((64, 96)).astype(np.float32)
    x = jnp.ones((2, 64), jnp.float32)
    impls = ("kernel", "xla") if quant.kernel_available() else ("xla",)
    for impl in impls:
        t = jax.tree.map(jnp.asarray, quant.to_qtensor(w, impl, bits))
        text = str(jax.make_jaxpr(quant.dense)(x, t))
        kernel_calls = text.count(quant.KERNEL_TARGETS[bits])
        assert (kernel_calls, text.count("dot_general")) == ((1, 0) if impl == "kernel" else (0, 1)), text
        assert "cond[" not in text and "platform_index" not in text


def test_weights_on_another_device_take_the_xla_path():
    t = quant.to_qtensor(np.ones((64, 64), np.float32), "kernel", 4)
    params = {"layers": ({"wq": t, "attn_norm": np.ones(64, np.float32)},)}
    assert quant.for_device(params, jax.devices("cpu")[0]) is params
    moved = quant.for_device(params, types.SimpleNamespace(platform="gpu"))
    assert moved["layers"][0]["wq"].impl == "xla" and moved["layers"][0]["wq"].bits == 4
    assert moved["layers"][0]["attn_norm"] is params["layers"][0]["attn_norm"]


def test_verify_windows_warm_at_the_first_length_before_ready_and_the_rest_while_idle(tiny_tree):
    """A speculating stage compiles 1-row windows at the first attention length before READY and
    leaves the other lengths, more rows and windows of several rows to `idle_warmups` (the loop runs
    them while idle); after both, no shape a DECODE can reach compiles at any length."""
    from skippy_zmq.stage.factory import idle_warmups

    r = runner(tiny_tree, lanes=BUCKETS.decode_rows[-1])
    warm_before_ready(r, windows=(2, 4))
    windows = {(shape, attn) for shape, attn, out in r.stats.shapes if shape[1] > 1 and out == "logits"}
    assert windows == {((1, 2), 128), ((1, 4), 128)}
    shapes = decode_shapes(r.buckets.decode_rows, (2, 4))
    later = idle_warmups(r, shapes)
    small_chunks = [c for c in r.buckets.prefill_chunks if c <= WARM_RUN_TOKENS]
    assert r.kv_spans() == (128, 256, 384)
    assert len(later) == (len(shapes) + len(small_chunks)) * len(r.attn_buckets()) + len(r.kv_spans())
    for fn in later:
        fn()
    # the small prefill chunks were run once too (a compiled step's first run is slow)
    assert {((1, c), a, "none") for c in small_chunks for a in r.attn_buckets()} <= r.stats.ran
    ids = random_ids(64, TINY.vocab_size, seed=3)
    with counting_compiles() as compiles:
        for start in (5, 200, 379):
            for rows, t in shapes:
                r.step(np.arange(rows), ids[:rows * t], np.full(rows, start), np.full(rows, t))
        for length in (64, 129, 300, 384):   # a prefix recording, its restore, an n-choice fork
            k, v = read_kv(r, 0, length)
            r.write_kv(1, k, v)
            r.copy_lane(1, 2, length)
    assert compiles == []


@pytest.mark.parametrize("rows", [(1, 2, 4, 8), (1, 2, 4, 6), (1, 2, 3), (1, 2, 4, 8, 16)])
@pytest.mark.parametrize("windows", [(), (2,), (2, 4, 8), (2, 4, 8, 16)])
def test_decode_shapes_hold_every_batch_the_scheduler_can_draft(rows, windows):
    """For every group size a stage's lanes allow, the stage's bucket for those rows and every window
    the scheduler's rule lets that group carry (config.widest_window, up to max_draft's bucket) is
    one of config.decode_shapes: the idle warm-up compiles all that a DECODE can bring."""
    shapes = set(decode_shapes(rows, windows))
    buckets = Buckets(decode_rows=rows)
    for group in range(1, rows[-1] + 1):
        widest = widest_window(group, (1, 2, 4, 8, 16))
        reach = {1} | {t for t in windows if t <= widest}
        assert {(buckets.rows_for(group), t) for t in reach} <= shapes, (group, reach)

"""The idle warm-ups' compiles run behind (compile_behind: the gated child, then the thread for the
KV copies), not on the stage loop: the loop only runs, once each, what is compiled, so a request
that arrives meanwhile waits for no compile (issue 39). LOOP_COMPILES counts compiles on one thread."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import TINY, counting_compiles, random_ids
from skippy_zmq.config.model import Buckets, decode_shapes
from skippy_zmq.model.compile_behind import LoopCompiles
from skippy_zmq.stage.factory import idle_compiles, idle_warmups, warm_before_ready
from skippy_zmq.stage.loop import idle_warmup
from test_stopgap import make, unique

WINDOWS = (2, 4)
# fewer shapes than test_stopgap's BUCKETS (every test here compiles each one afresh: unique()): still
# decode of several rows, verify windows, two prefill chunks, and the KV spans of a context of 128
IDLE_BUCKETS = Buckets(prefill_chunks=(16, 64), decode_rows=(1, 2, 4), attn_lens=(128,))


def first_request(r, seed: int) -> None:
    """What a first chat request runs at a stage: a 40-token prefill, 8 one-row decode steps, its
    prefix recording's lane read."""
    x = random_ids(60, TINY.vocab_size, seed=seed)
    r.prefill(0, x[:40], 0, "none")
    for i in range(8):
        r.decode(np.array([0]), x[40 + i:41 + i], np.array([40 + i]))
    np.asarray(r.read_kv_device(0, 48)[0])


def stage(r) -> SimpleNamespace:
    """What idle_warmup reads of a StageWorker, as build_worker makes it (behind_idle)."""
    shapes = decode_shapes(r.buckets.decode_rows, WINDOWS)
    warm_before_ready(r, WINDOWS, idle_compiles(r, shapes), r.kv_spans())
    return SimpleNamespace(runner=r, warm_later=[r.join_behind] + idle_warmups(r, shapes))


def test_loop_compiles_counts_only_the_watched_threads_compiles(tiny_tree):
    """A compile on another thread is not counted; one on the watched thread is."""
    counter, r = LoopCompiles(), make(tiny_tree, unique())
    counter.watch()
    other = threading.Thread(target=r.warmup, kwargs=dict(rows=(1,), attn_lens=(128,), pairs=set(), run=False))
    other.start()
    other.join()
    assert counter.count == 0 and len(r.stats.shapes) == 1
    r.warmup(rows=(2,), attn_lens=(128,), pairs=set(), run=False)
    assert counter.count == 1


def test_the_idle_warmups_compile_behind_and_the_loop_only_runs_them(tiny_tree):
    """Every shape and KV span the idle warm-ups reach is compiled by compile_behind's thread (no
    child here: no cache folder); then the loop's idle warm-ups compile nothing, only run the small
    shapes once, and a request after them compiles nothing either."""
    r = make(tiny_tree, unique(), stopgap=True, buckets=IDLE_BUCKETS, capacity=128)
    worker = stage(r)
    r.join_behind()
    assert r.stats.copies == set(r.kv_spans())
    counter = LoopCompiles()
    counter.watch()
    with counting_compiles() as compiles:
        while idle_warmup(worker):
            pass
        first_request(r, seed=3)
    assert compiles == [] and counter.count == 0 and worker.warm_later == [] and r.stats.cold_steps == 0
    assert r.stats.reads == set(r.kv_spans())


@pytest.mark.slow
def test_a_request_while_idle_warmups_are_pending_runs_no_compile_on_the_loop(tiny_tree):
    """A request that comes while compile_behind still has the idle warm-ups' shapes to do (the
    stage busy: it waits) runs no compile on the loop thread, and neither do the idle warm-ups the
    loop runs once it is quiet again; every shape is there at the end, none cold."""
    r = make(tiny_tree, unique(), stopgap=True, buckets=IDLE_BUCKETS, capacity=128)
    r.behind_yield_s = 600.0          # longer than this test: the thread waits for quiet
    worker = stage(r)                 # its warm-up before READY compiles here: the watch starts after it
    counter = LoopCompiles()
    counter.watch()
    r.quiet.clear()                   # a request holds a lane (StageWorker.note_sessions)
    assert idle_warmup(worker) is False and r.compiling
    first_request(r, seed=4)
    pending = len(worker.warm_later)
    r.quiet.set()
    while worker.warm_later:
        idle_warmup(worker)
    assert pending > 1 and counter.count == 0 and r.stats.cold_steps == 0 and not r.compiling
    assert set(idle_compiles(r, decode_shapes(r.buckets.decode_rows, WINDOWS))) <= r.stats.shapes

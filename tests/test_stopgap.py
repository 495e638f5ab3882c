"""A stop-gap stage (SliceRunner.stopgap): before its whole-slice steps compile, it runs layer by
layer (model/layered.py) with the same results; warm_stopgap compiles one layer per shape before
READY and the whole-slice steps behind, and after the idle warm-ups the steps are whole-slice
again and nothing a request brings compiles (no timing here)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY, counting_compiles, random_ids
from skippy_zmq.config.model import Buckets, KVConfig, decode_shapes
from skippy_zmq.model import behind, direct, weights
from skippy_zmq.model.runner import SliceRunner
from skippy_zmq.config.speculative import SpeculativeConfig
from skippy_zmq.stage.factory import idle_warmups, likeliest_first, warm_before_ready

BUCKETS = Buckets(prefill_chunks=(16, 64, 128), decode_rows=(1, 2, 4), attn_lens=(128, 256))
# windowed layers beside global ones (Gemma, Qwen): the layered step compiles one layer per window kind
WINDOWED = dataclasses.replace(TINY, sliding_window=8, full_attention_layers=(0, 2))


def make(tree: dict, cfg=TINY, start: int = 0, end: int = TINY.n_layers, stopgap: bool = False,
         buckets: Buckets = BUCKETS, capacity: int = 256) -> SliceRunner:
    params = weights.to_runtime(tree, jnp.float32)
    part = {**params, "layers": params["layers"][start:end]}
    r = SliceRunner(cfg, part, start, end, KVConfig(lanes=4, capacity=capacity), buckets)
    r.stopgap = stopgap
    # the child's silence deadline (CHILD_SHAPE_S, 180 s of its running time) is what the tests that
    # set behind_child_s themselves check; elsewhere a child at load 20 on 2 cores (a shape's compile
    # then takes minutes) must not be given up for it, or the test would pass only on a quiet machine
    r.behind_child_s = 3600.0
    return r


def serve(r: SliceRunner, x: np.ndarray, prefill_out: str = "hidden") -> list[np.ndarray]:
    """A prompt of 40, one of 100 (chunks 64 + 64 across two attention lengths), decode of 1 and 3 rows
    and a verify window: every output."""
    outs = [r.prefill(0, x[:40], 0, prefill_out), r.prefill(1, x[:100], 0, prefill_out)]
    outs.append(r.decode(np.array([0]), x[40:41], np.array([40])))
    outs.append(r.decode(np.array([0, 1, 2]), x[41:44], np.array([41, 100, 0])))
    outs.append(r.step(np.array([1]), x[:4], np.array([130]), np.array([4])))
    return outs


@pytest.mark.parametrize("cfg", [TINY, WINDOWED], ids=["global", "windowed"])
@pytest.mark.parametrize("start,end", [(0, 2), (2, TINY.n_layers), (0, TINY.n_layers)])
def test_layer_by_layer_steps_match_the_whole_slice(tiny_tree, cfg, start, end):
    """Same inputs, same outputs and same KV, whichever step runs; the stop-gap runner compiled no
    whole-slice step and ran every shape layer by layer."""
    x = random_ids(200, TINY.vocab_size, seed=5) if start == 0 else \
        np.random.default_rng(5).standard_normal((200, TINY.d_model)).astype(np.float32)
    fused, layered = make(tiny_tree, cfg, start, end), make(tiny_tree, cfg, start, end, stopgap=True)
    for a, b in zip(serve(fused, x), serve(layered, x)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
    for ka, kb in zip(fused.kv.k + fused.kv.v, layered.kv.k + layered.kv.v):
        np.testing.assert_allclose(np.asarray(ka), np.asarray(kb), rtol=2e-5, atol=2e-5)
    assert layered.stats.shapes == set() and layered.stats.layered == fused.stats.shapes


def test_warm_stopgap_readies_layers_then_compiles_the_slice_behind(tiny_tree):
    """Before READY: the first requests' shapes layer by layer; behind: warm_before_ready's own
    shapes; then the idle warm-ups (which the loop holds while the thread compiles) run them once,
    and from there every shape a request brings runs the whole-slice step and compiles nothing."""
    r = make(tiny_tree, stopgap=True)
    warm_before_ready(r, windows=(2, 4))
    assert {(shape, attn) for shape, attn, _out in r.stats.layered} == {
        ((1, 1), 128), ((2, 1), 128), ((1, 2), 128), ((1, 4), 128), ((1, 16), 128), ((1, 64), 128)}
    r.join_behind()
    assert not r.compiling
    plain = make(tiny_tree)
    warm_before_ready(plain, windows=(2, 4))
    assert r.stats.shapes == plain.stats.shapes
    shapes = decode_shapes(r.buckets.decode_rows, (2, 4))
    for fn in idle_warmups(r, shapes):
        fn()
    x = random_ids(200, TINY.vocab_size, seed=9)
    layered_before = set(r.stats.layered)
    with counting_compiles() as compiles:
        outs = serve(r, x, "none")       # what a last stage's prefill asks for
    assert compiles == [] and r.stats.layered == layered_before
    for a, b in zip(outs[2:], serve(make(tiny_tree), x, "none")[2:]):    # the prefills return None
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_a_stopgap_shape_first_seen_compiles_one_layer_not_the_slice(tiny_tree):
    """A shape nothing warmed (a 4-row decode at the second attention length) runs layer by layer:
    its compiles are the layered step's parts, and a second step of it compiles nothing."""
    r = make(tiny_tree, stopgap=True)
    x = random_ids(8, TINY.vocab_size, seed=2)
    with counting_compiles() as first:
        r.decode(np.arange(4), x[:4], np.array([200, 201, 202, 203]))
    with counting_compiles() as second:
        r.decode(np.arange(4), x[:4], np.array([204, 205, 206, 207]))
    assert 0 < len(first) <= 3 and second == []     # inputs, one layer, output
    assert r.stats.layered == {((4, 1), 256, "logits")} and r.stats.shapes == set()


def test_a_first_request_after_ready_compiles_nothing_while_the_slice_waits(tiny_tree):
    """What a first chat request runs right after READY (a 40-token prefill, one-row decode, its
    prefix recording's lane read) was warmed before READY: no compile, no cold step; and the
    compile-behind thread, the stage being busy, has not started a shape meanwhile."""
    r = make(tiny_tree, stopgap=True)
    r.quiet.clear()              # a request holds a lane (StageWorker.note_sessions)
    r.behind_yield_s = 600.0     # longer than this test: the thread waits for quiet
    warm_before_ready(r, windows=(2, 4))
    x = random_ids(60, TINY.vocab_size, seed=4)
    with counting_compiles() as compiles:
        r.prefill(0, x[:40], 0, "none")
        for i in range(8):
            r.decode(np.array([0]), x[40 + i:41 + i], np.array([40 + i]))
        jax.block_until_ready(r.read_kv_device(0, 48))
    assert compiles == [] and r.stats.cold_steps == 0 and r.stats.shapes == set()
    r.quiet.set()
    r.join_behind()
    assert r.stats.behind_waits == 0 and ((1, 1), 128, "logits") in r.stats.shapes


def test_compile_behind_goes_on_after_its_wait_and_the_loop_runs_what_it_compiled(tiny_tree):
    """A stage that stays busy past behind_yield_s still gets its shapes compiled (counted as a
    wait); run_compiled then runs each compiled small shape once, and its steps are whole-slice."""
    r = make(tiny_tree, stopgap=True)
    shape = r.warm_shapes()[0]
    assert shape == ((1, 1), 128, "logits")
    r.quiet.clear()
    r.behind_yield_s = 0.01
    r.compile_behind([shape])
    r.join_behind()
    assert r.stats.behind_waits == 1 and r.stats.shapes == {shape} and r.stats.ran == set()
    with counting_compiles() as compiles:
        assert r.run_compiled() is True and r.stats.ran == {shape}
        assert r.run_compiled() is False
        r.decode(np.array([0]), random_ids(1, TINY.vocab_size, seed=3), np.array([0]))
    assert compiles == [] and r.stats.layered == set() and r.stats.cold_steps == 0


def test_a_busy_stage_runs_a_compiled_decode_shape_whole_slice_without_waiting_to_be_idle(tiny_tree):
    """A stage that a re-cut restarts under 8 running streams is never idle, so run_compiled never
    runs: a decode shape compile_behind has compiled is then run whole-slice by the request's own step
    (its first run), not layer by layer until every stream ends; the same tokens' logits as a plain
    runner, and the step compiles nothing."""
    r = make(tiny_tree, stopgap=True)
    shape = r.warm_shapes()[0]
    r.quiet.clear()              # requests hold lanes (StageWorker.note_sessions)
    r.behind_yield_s = 0.01
    r.compile_behind([shape])
    r.join_behind()
    assert r.stats.shapes == {shape} and r.stats.ran == set()
    x = random_ids(2, TINY.vocab_size, seed=6)
    with counting_compiles() as compiles:
        out = r.decode(np.array([0]), x[:1], np.array([0]))
    assert compiles == [] and r.stats.layered == set() and r.stats.ran == {shape} and r.stats.cold_steps == 0
    np.testing.assert_allclose(out, make(tiny_tree).decode(np.array([0]), x[:1], np.array([0])), rtol=2e-5, atol=2e-5)
    r.quiet.set()                # idle: a compiled shape nothing has run waits for run_compiled, as before
    other = ((2, 1), 128, "logits")
    r.compile_behind([other])
    r.join_behind()
    r.decode(np.array([0, 1]), x[:2], np.array([1, 0]))
    assert ((2, 1), 128, "logits") in r.stats.layered and other not in r.stats.ran


def test_a_busy_stage_compiles_behind_a_shape_it_ran_layer_by_layer_then_runs_it_whole_slice(tiny_tree):
    """Under load, a shape nothing warmed before the idle warm-ups (a 4-row decode: 8 streams over 2
    stages) runs layer by layer once, is compiled behind after wanted_yield_s (no waiting for an idle
    stage that 8 streams never leave), and its next steps run the whole-slice step, compiling nothing,
    with the plain runner's outputs. Idle (quiet), a layer-by-layer step asks for nothing (as before)."""
    r, plain = make(tiny_tree, stopgap=True), make(tiny_tree)
    x = random_ids(16, TINY.vocab_size, seed=8)
    shape = ((4, 1), 256, "logits")
    r.quiet.clear()
    r.wanted_yield_s = 0.2
    r.decode(np.arange(4), x[:4], np.array([200, 201, 202, 203]))
    r.join_behind()
    assert r.stats.layered == {shape} and r.stats.shapes == {shape} and r.stats.behind_waits == 0
    with counting_compiles() as compiles:
        out = r.decode(np.arange(4), x[4:8], np.array([204, 205, 206, 207]))
    assert compiles == [] and r.stats.ran == {shape}
    plain.decode(np.arange(4), x[:4], np.array([200, 201, 202, 203]))
    np.testing.assert_allclose(out, plain.decode(np.arange(4), x[4:8], np.array([204, 205, 206, 207])),
                               rtol=2e-5, atol=2e-5)
    idle = make(tiny_tree, stopgap=True)
    idle.decode(np.arange(4), x[:4], np.array([200, 201, 202, 203]))
    assert not idle.compiling and idle.stats.shapes == set()


def test_a_shape_a_short_request_runs_layer_by_layer_waits_for_quiet_to_compile(tiny_tree):
    """A first request's steps are not met by the compile of their own shape: while busy for less
    than wanted_yield_s nothing compiles; once quiet, the wanted shape compiles (no wait counted)."""
    r = make(tiny_tree, stopgap=True)
    r.wanted_yield_s = 600.0
    x, shape = random_ids(4, TINY.vocab_size, seed=8), ((4, 1), 256, "logits")
    r.quiet.clear()
    r.decode(np.arange(4), x, np.array([200, 201, 202, 203]))
    assert r.compiling and not r.quiet.wait(0.5) and r.stats.shapes == set()
    r.quiet.set()
    r.join_behind()
    assert r.stats.shapes == {shape} and r.stats.behind_waits == 0


def loaded(r: SliceRunner, shapes: list[tuple]) -> int:
    """How many of `shapes` the stage took from the child's stored executables (model/exec_cache.py)
    instead of a persistent-cache read: each is in the step table before it ever ran."""
    return sum(isinstance(r._steps.direct.get(s), direct.DirectStep) and s not in r.stats.ran for s in shapes)


@contextlib.contextmanager
def cache_events() -> Iterator[Counter]:
    """Persistent-cache events in this process inside the block: cache_hits (reads), cache_misses (writes)."""
    seen: Counter = Counter()

    def listener(name: str, **_: object) -> None:
        seen[name.rsplit("/", 1)[-1]] += 1

    jax.monitoring.register_event_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_listener(listener)


def children() -> set[int]:
    """The live child processes of this process (every thread's)."""
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):   # a thread that just ended
            pids.update(int(pid) for pid in (task / "children").read_text().split())
    return pids


def unique(cfg=TINY):
    """TINY with a rope base no other test uses: its steps' HLO, so their cache keys, are new to the cache."""
    return dataclasses.replace(cfg, rope_theta=10000.0 + time.time_ns() % 10**9 / 10**3)


@pytest.mark.slow
def test_a_child_process_compiles_behind_and_the_stage_reads_every_shape_from_the_cache(tiny_tree):
    """The child (model/behind.py) compiles every shape into the persistent cache; the stage's thread
    then compiles none itself: one cache read per shape, no write. The child is gone afterwards."""
    r = make(tiny_tree, unique(), stopgap=True)
    shapes = r.warm_shapes((1, 2), (16, 64), r.attn_buckets(1), windows=(2,))
    before = children()
    with cache_events() as events:
        r.compile_behind(shapes)
        r.join_behind()
    assert r.stats.behind_child == len(shapes) == 5 and r.stats.shapes == set(shapes)
    # read (XLA's cache, or the child's stored executable), not compiled here
    assert events["cache_hits"] + loaded(r, shapes) == len(shapes) and events["cache_misses"] == 0
    assert loaded(r, shapes) == len(shapes)   # new shapes: the child compiled and stored each (exec_cache)
    assert children() <= before


@pytest.mark.slow
def test_a_second_start_of_the_same_slice_finds_every_shape_marked_and_starts_no_child(tiny_tree, tmp_path):
    """The first start's child compiles every shape and the stage marks each one it read; a second
    start of the same slice on the same code finds them all marked: no child (its command would leave
    a file), each shape read in the stage's own thread (from the cache in a new process), none compiled."""
    cfg = unique()
    first = make(tiny_tree, cfg, stopgap=True)
    shapes = first.warm_shapes((1, 2), (16, 64), first.attn_buckets(1), windows=(2,))
    first.compile_behind(shapes)
    first.join_behind()
    assert first.stats.behind_child == len(shapes) == 5
    second = make(tiny_tree, cfg, stopgap=True)
    started = tmp_path / "child-started"
    second.behind_command = (sys.executable, "-c", f"open({str(started)!r}, 'w')")
    with cache_events() as events:
        second.compile_behind(shapes)
        second.join_behind()
    assert not started.exists() and second.stats.behind_child == 0 and second.stats.shapes == set(shapes)
    assert events["cache_misses"] == 0   # nothing compiled anew (in this one process: JAX's own memory hits)


@pytest.mark.slow
@pytest.mark.parametrize("script,child_shapes", [
    ("raise SystemExit(3)", 0),                                            # fails at once
    ("print('done 0', flush=True); raise SystemExit(2)", 1),               # one shape, then dies
    ("print('done 1', flush=True); import time; time.sleep(600)", 0),      # out of order, then hangs
    ("import time; time.sleep(600)", 0),                                   # hangs: given up after behind_child_s
], ids=["fails", "dies", "out-of-order", "hangs"])
def test_a_child_that_fails_or_hangs_leaves_the_rest_to_the_thread(tiny_tree, script, child_shapes):
    """Whatever the child does, every shape is compiled (the rest in the stage's own thread, as
    without a child) and the child is killed and reaped."""
    r = make(tiny_tree, unique(), stopgap=True)
    r.behind_command = (sys.executable, "-c", script)
    r.behind_child_s = 1.0
    shapes = r.warm_shapes((1,), (16,), r.attn_buckets(1))
    before = children()
    with cache_events() as events:
        r.compile_behind(shapes)
        r.join_behind()
    assert r.stats.behind_child == child_shapes and r.stats.shapes == set(shapes)
    assert events["cache_misses"] == len(shapes) and children() <= before   # all compiled (written) here


@pytest.mark.slow
def test_the_child_dies_with_its_stage():
    """A stage process that exits (here: at once, os._exit) takes its compile child with it: the
    child, waiting for its job on a pipe, is gone within seconds (liveness deadline, no timing)."""
    stage = subprocess.run([sys.executable, "-c", (
        "import os, subprocess, sys\n"
        "from skippy_zmq.model.behind import CHILD_COMMAND\n"
        "child = subprocess.Popen([*CHILD_COMMAND, str(os.getpid())], stdin=subprocess.PIPE)\n"
        "print(child.pid, flush=True)\n"
        "os._exit(0)\n")], capture_output=True, text=True, timeout=60, check=True)
    pid = int(stage.stdout.split()[0])
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:   # gone already
        return
    try:
        assert select.select([fd], [], [], 30)[0], f"compile child {pid} outlived its stage by 30 s"
    finally:
        os.close(fd)


def test_a_child_is_not_stopped_before_it_said_ready():
    """Until the child says `ready` (its death signal armed, its stdin watched) a busy stage does not
    stop it: a child stopped earlier outlived a stage that died, stopped for good."""
    job = behind.BehindJob(None, 0, 1, None, None, 0, (((1, 1), 256, "logits"),), "/tmp")
    with behind.Child(job, (sys.executable, "-c", "import time; time.sleep(60)")) as child:
        assert not child.gate(False, 600.0) and not child.ready and child.stopped_at is None
        assert proc_state(child.proc.pid) != "T"
    assert child.proc.poll() is not None


def test_a_busy_stage_stops_its_child_at_once_and_gate_continues_it():
    """pause() (a request just took a lane: the stage loop's thread) stops a ready child now, where
    gate() would at the compile thread's next tick; gate() continues it once quiet. A forced child
    runs on (gate's rule), and one whose context is left is not signalled any more."""
    job = behind.BehindJob(None, 0, 1, None, None, 0, (((1, 1), 256, "logits"),), "/tmp")
    with behind.Child(job, (sys.executable, "-c", "import time; time.sleep(60)")) as child:
        child.ready = True   # as its `ready` line would say
        child.pause()
        assert child.stopped_at is not None and wait_for(lambda: proc_state(child.proc.pid) == "T", 30)
        assert not child.gate(True, 600.0) and child.stopped_at is None
        assert wait_for(lambda: proc_state(child.proc.pid) != "T", 30)
        child.forced = True
        child.pause()
        assert child.stopped_at is None and proc_state(child.proc.pid) != "T"
        child.forced = False
    child.pause()   # closed: nothing to signal (it is reaped)
    assert child.stopped_at is None and child.proc.poll() is not None


class _SlowToUnpickle:
    """Unpickles as time.sleep(600): a job whose unpickling (the JAX and model imports) takes long."""

    def __reduce__(self):
        return (time.sleep, (600,))


@pytest.mark.slow
def test_a_child_says_ready_before_it_unpickles_its_job():
    """Unpickling the job imports JAX and the model (~1.4 CPU s): the child says `ready` before it, so a
    busy stage stops it then too (those imports ran beside a first request that came right after READY)."""
    job = behind.BehindJob(_SlowToUnpickle(), 0, 1, None, None, 0, (((1, 1), 256, "logits"),), "/tmp")
    with behind.Child(job) as child:
        deadline = time.monotonic() + 60   # a liveness bound: an interpreter's start
        for _ in child.reports(0.05):
            if child.ready or time.monotonic() > deadline:
                break
        assert child.ready and child.done == 0   # said while its job is still being unpickled
        assert not child.gate(False, 600.0) and child.stopped_at is not None
        assert wait_for(lambda: proc_state(child.proc.pid) == "T", 30)
    assert child.proc.poll() is not None


def wait_for(predicate, timeout: float) -> bool:
    """Poll `predicate` (a child's state the kernel keeps) until true or `timeout`: a liveness deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def proc_state(pid: int) -> str:
    """A process's state letter (/proc/PID/stat): 'T' stopped (SIGSTOP), 'S' sleeping, 'R' running."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def new_child(before: set[int]) -> int:
    """The compile child compile_behind started (the one child of ours not in `before`)."""
    assert wait_for(lambda: children() - before, 60), "no compile child started"
    (pid,) = children() - before
    return pid


@pytest.mark.slow
def test_the_child_is_stopped_while_a_request_holds_a_lane_and_a_wanted_shape_compiles_meanwhile(tiny_tree):
    """`quiet` clear: the child is stopped (SIGSTOP: state T) and delivers nothing, while a shape the
    busy stage ran layer by layer compiles in the stage's thread at once, not after the child; quiet
    again: the child runs on, every shape it compiled is read from the cache, and it is gone."""
    r = make(tiny_tree, unique(), stopgap=True)
    r.behind_yield_s, r.wanted_yield_s = 600.0, 0.2
    shapes = r.warm_shapes((1, 2), (16,), r.attn_buckets(1))
    wanted, x = ((4, 1), 256, "logits"), random_ids(4, TINY.vocab_size, seed=8)
    before = children()
    r.quiet.clear()
    r.compile_behind(shapes)
    pid = new_child(before)
    assert wait_for(lambda: proc_state(pid) == "T", 30), f"child {pid} not stopped: {proc_state(pid)}"
    r.decode(np.arange(4), x, np.array([200, 201, 202, 203]))   # layer by layer, busy: wanted
    assert wait_for(lambda: wanted in r.stats.shapes, 300), "the wanted shape waited for the child"
    assert proc_state(pid) == "T" and r.stats.behind_child == 0 and r.compiling
    with cache_events() as events:
        r.quiet.set()
        r.join_behind()
    assert r.stats.behind_child == len(shapes) and r.stats.shapes == {*shapes, wanted}
    # read (XLA's cache, or the child's stored executable), not compiled here
    assert events["cache_hits"] + loaded(r, shapes) == len(shapes) and events["cache_misses"] == 0
    assert r.stats.behind_waits == 0 and children() <= before


@pytest.mark.slow
def test_a_child_stopped_for_behind_yield_s_runs_on_and_is_counted(tiny_tree):
    """Steady traffic (`quiet` never set): the child, stopped behind_yield_s in a row, is continued
    until its next shape (each time counted in behind_waits), so every shape is still compiled
    there: the stage reads them all from the cache and compiles none itself."""
    r = make(tiny_tree, unique(), stopgap=True)
    r.behind_yield_s = 0.5
    shapes = r.warm_shapes((1,), (16,), r.attn_buckets(1))
    before = children()
    r.quiet.clear()
    with cache_events() as events:
        r.compile_behind(shapes)
        r.join_behind()
    assert r.stats.shapes == set(shapes) and r.stats.behind_child >= 1 and r.stats.behind_waits >= 1
    assert events["cache_hits"] + loaded(r, shapes) == len(shapes) and events["cache_misses"] == 0
    assert children() <= before


@pytest.mark.slow
def test_a_stopped_child_is_not_given_up_for_its_silence(tiny_tree):
    """The child's silence deadline (behind_child_s) counts only the time it is let run: stopped for
    three times it, it is still waited for; let run (quiet), it is given up after it, and every
    shape compiles in the stage's thread."""
    r = make(tiny_tree, unique(), stopgap=True)
    r.behind_command = (sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(600)")
    r.behind_child_s, r.behind_yield_s = 1.0, 600.0
    shapes = r.warm_shapes((1,), (16,), r.attn_buckets(1))
    before = children()
    r.quiet.clear()
    r.compile_behind(shapes)
    pid = new_child(before)
    assert wait_for(lambda: proc_state(pid) == "T", 30), f"child {pid} not stopped: {proc_state(pid)}"
    r._behind.join(3 * r.behind_child_s)
    assert r.compiling and proc_state(pid) == "T"
    with cache_events() as events:
        r.quiet.set()
        r.join_behind()
    assert r.stats.shapes == set(shapes) and r.stats.behind_child == 0
    assert events["cache_misses"] == len(shapes) and children() <= before


def test_the_drafters_first_window_is_compiled_first_then_the_nearest():
    """DraftPolicy starts at max(min_draft, max_draft // 2) drafts: 7 by default, an 8-token window."""
    assert likeliest_first((2, 4, 8, 16), SpeculativeConfig()) == (8, 4, 2, 16)
    assert likeliest_first((2, 4), SpeculativeConfig(max_draft=3)) == (2, 4)
    assert likeliest_first((), SpeculativeConfig()) == ()


def test_a_slice_of_a_few_layers_compiles_behind_in_its_thread_a_larger_one_in_a_child():
    """factory.behind_command: a child (an interpreter and a JAX import) only for slices of more
    than THREAD_COMPILE_LAYERS layers; where the layers start does not matter."""
    from types import SimpleNamespace

    from skippy_zmq.stage.factory import THREAD_COMPILE_LAYERS, behind_command

    assert behind_command(SimpleNamespace(start=0, end=THREAD_COMPILE_LAYERS)) is None
    assert behind_command(SimpleNamespace(start=26, end=26 + THREAD_COMPILE_LAYERS)) is None
    assert behind_command(SimpleNamespace(start=0, end=THREAD_COMPILE_LAYERS + 1)) == behind.CHILD_COMMAND
    assert behind_command(SimpleNamespace(start=15, end=30)) == behind.CHILD_COMMAND   # a SmolLM2 half


def test_the_child_compiles_what_a_first_request_runs_most_first(tiny_tree, monkeypatch):
    """compile_behind's list (the child's order): the 1-row decode, then the windows in the order
    given (likeliest_first), then the rest (2-row decode, prefill chunks, longer lengths)."""
    r = make(tiny_tree, stopgap=True)
    handed = []
    monkeypatch.setattr(r, "compile_behind", lambda shapes, spans=(): handed.append(list(shapes)))
    warm_before_ready(r, windows=(4, 2))
    [shapes] = handed
    first = r.attn_buckets(1)[0]
    assert shapes[:3] == [((1, 1), first, "logits"), ((1, 4), first, "logits"), ((1, 2), first, "logits")]
    assert ((2, 1), first, "logits") in shapes[3:] and len(shapes) == len(set(shapes))

"""SliceRunner's compile-behind thread (a mixin): after READY it compiles the whole-slice steps a
stop-gap stage still runs layer by layer, through a gated child process (model/behind.py) whose
entries the thread reads from the persistent cache while the stage is quiet, and what the child did
not do in the thread itself. Split from runner.py (its size); the stage loop never compiles here:
it only runs, once each, what this thread has made (SliceRunner.run_compiled, the idle warm-ups).

`LoopCompiles` counts XLA compiles and persistent-cache reads on one thread (the stage loop's): 0
while the thread and its child do them all (a request arriving meanwhile waits for none)."""

from __future__ import annotations

import gc
import threading
import time

import jax

from skippy_zmq.model import behind

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"   # jax._src.dispatch.BACKEND_COMPILE_EVENT


class LoopCompiles:
    """How many XLA compiles (a persistent-cache read included: XLA's compile event spans both) ran
    on the thread that called `watch`, from then on; one listener per process, whatever the calls."""

    def __init__(self) -> None:
        self.count, self._thread, self._registered = 0, None, False

    def watch(self) -> None:
        self._thread = threading.get_ident()
        if not self._registered:
            jax.monitoring.register_event_duration_secs_listener(self._seen)
            self._registered = True

    def _seen(self, name: str, _secs: float, **_: object) -> None:
        if name == COMPILE_EVENT and threading.get_ident() == self._thread:
            self.count += 1


LOOP_COMPILES = LoopCompiles()


class CompileBehind:
    """compile_behind and its helpers, for SliceRunner (which sets every attribute used here)."""

    def compile_behind(self, shapes: list[tuple], spans: tuple[int, ...] = ()) -> None:
        """Compile the whole-slice step for these (inputs shape, attention length, output) in a
        thread, in order, while the caller goes on (a `stopgap` stage after READY: its steps run
        layer by layer until their shape is here). XLA's compile releases the GIL; the thread
        only lowers (never runs a step), so it never touches the KV the caller's steps donate.

        A compile beside a request's steps made them several times slower (each of a layer-by-layer
        step's small dispatches waits for a core the compile holds; XLA:CPU compiles on its pool's
        threads, whatever this thread's priority). So a child process compiles first (model/behind.py;
        none when an earlier start marked every shape), stopped while a request holds a lane, and this
        thread reads each shape from the cache. What the child did not do compiles here, each
        once `quiet` or after behind_yield_s; `_wanted` shapes first (`_compile_wanted`). `spans`:
        then the KV lane copies of these spans (compile_kv_copies), each once quiet: the idle
        warm-ups' compiles, which on the stage loop held a request that came meanwhile (issue 39)."""
        def compile_all() -> None:
            todo = list(shapes[self._read_from_child(shapes):])
            while self._wanted or todo:
                self._compile_wanted(wait=not todo)
                if todo:
                    self._wait_quiet()
                    self._compile_wanted()
                    self._compile_behind(todo.pop(0))
            for span in spans:
                self._wait_quiet()
                self.compile_kv_copies(span)

        self._behind = threading.Thread(target=compile_all, name="compile-behind", daemon=True)
        self._behind.start()

    def _compile_behind(self, shape: tuple) -> None:
        self._compile(*shape, run=False)
        behind.mark(self._marks, shape)
        # its traces live as long as we do: out of the GC's full passes (ops/lifetime.settle_heap)
        gc.freeze()

    def _compile_wanted(self, wait: bool = False) -> None:
        """The `_wanted` shapes, not after the child's: once quiet or once the oldest waited
        wanted_yield_s (a first request's steps would meet the compile); `wait`: block till then."""
        while self._wanted:
            left = self._wanted_at + self.wanted_yield_s - time.monotonic()
            if not self.quiet.is_set() and left > 0:
                if not wait:
                    return
                self.quiet.wait(left)
            self._compile_behind(self._wanted.popleft())
            self._wanted_at = time.monotonic()

    def _wait_quiet(self) -> None:
        if not self.quiet.wait(self.behind_yield_s):
            self.stats.behind_waits += 1

    def _read_from_child(self, shapes: list[tuple]) -> int:
        """compile_behind through its child, gated by `quiet` (behind.Child.gate), serving `_wanted`
        between its reports: each shape it compiled is read from the cache here while quiet (or while
        it runs on past behind_yield_s). Returns how many of `shapes`, from the first, were read."""
        cache_dir = jax.config.jax_compilation_cache_dir
        if self.behind_command is None or not shapes or not cache_dir or self.device.platform != "cpu":
            return 0
        job = behind.BehindJob(self.cfg, self.start, self.end, behind.abstract(self.params),
                               behind.abstract(self.kv), self.capacity, tuple(shapes), str(cache_dir))
        self._marks = job   # each shape read or compiled here gets its mark (behind.mark)
        read = delivered = 0
        child = behind.start(job, self.behind_command, self.behind_child_s)
        if child is None:
            return 0
        self._child = child   # pause_behind() stops it at once
        with child:
            for event in child.reports():   # a shape's index, or None: a tick
                if event is not None and event != delivered:
                    break   # out of order: only a prefix is trusted
                delivered += event is not None
                while read < delivered and (self.quiet.is_set() or child.forced):   # before gate() ends forced
                    self._compile_behind(shapes[read])   # a persistent-cache read
                    read += 1
                    self.stats.behind_child += 1
                self.stats.behind_waits += child.gate(self.quiet.is_set(), self.behind_yield_s)
                self._compile_wanted()   # the child stopped first (gate) when a request holds a lane
        self._child = None
        return read

    def pause_behind(self) -> None:
        """A request just took a lane (the stage loop's thread): stop the compile child now, not at
        the compile thread's next tick (behind.Child.pause)."""
        child = self._child
        if child is not None:
            child.pause()

    def join_behind(self) -> None:
        """Wait for compile_behind's thread (a tool timing a stage's start; tests)."""
        if self._behind is not None:
            self._behind.join()

    @property
    def compiling(self) -> bool:
        """Whether compile_behind's thread is still compiling."""
        return self._behind is not None and self._behind.is_alive()


"""Host-side wrapper around the jitted slice step: bucket choice, padding,
chunking and device placement. The step itself stays pure and small.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from skippy_zmq.config.model import Buckets, KVConfig, ModelConfig
from skippy_zmq.model import behind, direct, exec_cache, fuse
from skippy_zmq.model.compile_behind import CompileBehind
from skippy_zmq.model.layered import forward_layered
from skippy_zmq.model.llama import KVCache, forward_jit
from skippy_zmq.model import quant
from skippy_zmq.model.quant import commit, for_device
from skippy_zmq.model.lanes import copy_lane, read_lane, write_lane

WARM_RUN_TOKENS = 64   # warm-up runs (not only compiles) shapes of at most this many tokens: SliceRunner._compile
# compile_behind starts its next shape only while the stage serves no request, or after this long waiting:
# progress under traffic that never stops, yet a request's steps rarely share the cores with an XLA compile
BEHIND_YIELD_S = 5.0
WANTED_YIELD_S = 2.0   # a `_wanted` shape waits this long for quiet: a first request's 48 tokens take ~1.5 s


def resolve_device(spec: str = "cpu") -> Any:
    """'cpu' | 'gpu:N' | 'tpu:N' -> a jax.Device (clear error if absent)."""
    kind, _, index = spec.partition(":")
    try:
        devices = jax.devices(kind)
    except RuntimeError as exc:
        raise RuntimeError(f"device {spec!r} is not available: {exc}") from exc
    i = int(index or 0)
    if i >= len(devices):
        raise RuntimeError(f"device {spec!r} is not available: only {len(devices)} {kind} device(s)")
    return devices[i]


@dataclass
class StepStats:
    calls: int = 0
    compute_s: float = 0.0
    shapes: set = field(default_factory=set)   # (inputs shape, attn_len, output) compiled: run or warmed
    ran: set = field(default_factory=set)      # of those, the ones run at least once (traffic or warm-up)
    layered: set = field(default_factory=set)  # shapes run layer by layer (SliceRunner.stopgap)
    copies: set = field(default_factory=set)   # KV spans whose lane copies are compiled (warm_kv_copies)
    reads: set = field(default_factory=set)    # KV spans whose lane read is compiled and run (warm_kv_copies)
    cold_steps: int = 0      # steps that compiled on the spot: a shape neither warmed nor compiled before
    behind_waits: int = 0    # compile_behind shapes started after BEHIND_YIELD_S with the stage still busy
    behind_child: int = 0    # compile_behind shapes its child process compiled (the stage read them from the cache)
    moe_layer_passes: int = 0     # MoE layers run by counted steps (steps x the slice's MoE layers)
    moe_experts_routed: int = 0   # distinct experts their real tokens chose, summed over those passes


class SliceRunner(CompileBehind):
    """Runs layers [start, end) of one model with a lane-indexed KV arena (compile_behind: CompileBehind)."""

    def __init__(self, cfg: ModelConfig, params: dict[str, Any], start: int, end: int,
                 kv_cfg: KVConfig = KVConfig(), buckets: Buckets = Buckets(), device: Any = None):
        # One committed device (None: JAX's default), so warm-up, KV, weights and every step's inputs
        # share one placement and so one compiled step per shape (the same one compile_behind's child
        # lowers from abstract shapes on that device: uncommitted weights lowered to another cache key).
        device = device if device is not None else jax.devices()[0]
        self.cfg, self.start, self.end = cfg, start, end
        # on the CPU, projections that read the same x run as one kernel call (model/fuse.py: the same bits)
        self.params = commit(fuse.fuse_params(params) if device.platform == "cpu" else for_device(params, device),
                             device)
        self.kv_cfg, self.buckets, self.device = kv_cfg, buckets, device
        self._host_put = direct.HostPut(device)   # a step's inputs to the device (direct.py)
        self.kv = KVCache.create(cfg, end - start, kv_cfg.lanes, kv_cfg.capacity,
                                 jnp.dtype(kv_cfg.dtype), device)
        self.stats = StepStats()
        self._steps = direct.Steps(forward_jit, forward_layered)   # fused shapes run past jit's checks
        self.moe_layers = sum(cfg.is_moe_layer(i) for i in range(start, end))
        # True: a shape whose whole-slice step is not compiled (and, if small, run once) yet runs
        # layer by layer (model/layered.py) instead of compiling the whole slice on the spot; a
        # stage sets it, so that it can say READY before compiling every layer of every shape
        self.stopgap = False
        self._behind: threading.Thread | None = None   # compile_behind's thread
        # set while the stage holds no session (StageWorker keeps it): compile_behind's thread waits for
        # it before each shape, up to behind_yield_s. Set by default: a runner nobody serves with never waits
        self.quiet = threading.Event()
        self.quiet.set()
        self.behind_yield_s = BEHIND_YIELD_S
        # shapes a busy stop-gap stage ran layer by layer that nothing compiles: compile_behind takes
        # them first, once quiet or after wanted_yield_s (a 4-row decode is only in the idle warm-ups,
        # which a stage restarted by a re-cut under 8 streams never reaches: layer by layer for good)
        self._wanted: collections.deque[tuple] = collections.deque()
        self.wanted_yield_s, self._wanted_at = WANTED_YIELD_S, 0.0
        # compile_behind's child process (model/behind.py) and how long it may stay silent while it
        # is let run; None: in-thread only
        self.behind_command: tuple[str, ...] | None = behind.CHILD_COMMAND
        self.behind_child_s = behind.CHILD_SHAPE_S
        self._marks: behind.BehindJob | None = None   # the child's job: a shape of it compiled here is marked
        self._child: behind.Child | None = None   # the child while it runs (pause_behind)
        self._exec: tuple[Any, exec_cache.ExecCache | None] = (None, None)   # (params it is for, cache)

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.end == self.cfg.n_layers

    @property
    def capacity(self) -> int:
        return self.kv_cfg.capacity

    def kernels(self) -> dict[str, str]:
        """Which native CPU kernels this runner's steps use: "matmul" (the quantised-matmul loops'
        instruction set, "xla" when none), "decode_attention" ("kernel" or "xla") and "matrices"
        ("kernel" when every matrix product runs in the kernel; else how many go through XLA:
        quant.matrix_paths counts them by path)."""
        on_cpu = (self.device or jax.devices()[0]).platform == "cpu"
        paths = quant.matrix_paths(self.params)   # (QTensor panels or GGUF blocks the kernel reads)
        isa = quant.kernel_isa() if on_cpu and any(p.startswith("kernel") for p in paths) else None
        fits = quant.decode_attention_fits(self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim)
        attention = "kernel" if on_cpu and fits and self.kv.dtype == "float32" else "xla"
        through_xla = sum(n for path, n in paths.items() if path.startswith("xla"))
        return {"matmul": isa or "xla", "decode_attention": attention,
                "matrices": f"{through_xla} of {sum(paths.values())} through XLA" if through_xla else "kernel"}

    def _put(self, a: np.ndarray) -> jax.Array:
        return jax.device_put(a, self.device)

    def _fused(self, shape: tuple) -> bool:
        """Whether `_step` runs this (inputs shape, attn_len, output) with the whole-slice step: always,
        unless `stopgap`; then once it is compiled and, when small (`_compile` runs those once: a
        compiled step's first run is slow), run, or while a request holds a lane here (`quiet` clear).
        The first run on padding happens only while the stage is idle (run_compiled), and a stage
        that a re-cut restarts under 8 running streams is never idle: its decode steps stayed layer
        by layer (a dozen small dispatches a layer, each waiting for a core the compile-behind
        thread holds) until every stream ended; one slow first run costs far less."""
        if not self.stopgap or shape in self.stats.ran:
            return True
        return shape in self.stats.shapes and (not _small(shape[0]) or not self.quiet.is_set())

    def _step(self, inputs: np.ndarray, positions: np.ndarray, lanes: np.ndarray, attn_len: int,
              output: str, meanwhile: Callable[[], Any] | None = None) -> jax.Array | None:
        t0 = time.perf_counter()
        shape = (inputs.shape, attn_len, output)
        fused = self._fused(shape)
        if shape not in (self.stats.shapes if fused else self.stats.layered):
            self.stats.cold_steps += 1   # this step compiles first (a warm-up missed its shape)
        out, self.kv, routed = self._steps.run(shape, fused, self.params, self.kv, self._host_put(
            (inputs, positions, lanes)), dict(cfg=self.cfg, start=self.start, end=self.end,
                                              attn_len=attn_len, output=output))
        if meanwhile is not None:   # the step is dispatched and computes: the caller's work overlaps it
            meanwhile()
        if out is not None:
            out = np.asarray(out)
        else:
            jax.block_until_ready(self.kv.k[-1])
        if self.moe_layers:   # a scalar the step computed with its output: no extra wait
            self.stats.moe_layer_passes += self.moe_layers
            self.stats.moe_experts_routed += int(routed)
        self.stats.calls += 1
        self.stats.compute_s += time.perf_counter() - t0
        if fused:
            self.stats.shapes.add(shape)
            self.stats.ran.add(shape)
        else:
            self.stats.layered.add(shape)
            if not self.quiet.is_set() and shape not in self.stats.shapes:
                self._want(shape)
        return out

    def _want(self, shape: tuple) -> None:
        """Have compile_behind's thread compile `shape` next (starting one when none runs; each step asks)."""
        if shape not in self._wanted:
            self._wanted_at = self._wanted_at if self._wanted else time.monotonic()
            self._wanted.append(shape)
        if not self.compiling:
            self.compile_behind([])

    def _pad_inputs(self, inputs: np.ndarray, rows: int, length: int) -> np.ndarray:
        """Pad [B, T(, D)] inputs to [rows, length(, D)] with zeros."""
        pad = [(0, rows - inputs.shape[0]), (0, length - inputs.shape[1])] + [(0, 0)] * (inputs.ndim - 2)
        return np.pad(inputs, pad)

    def _check_positions(self, last_position: int) -> None:
        if last_position >= self.capacity:
            raise ValueError(f"position {last_position} exceeds the KV capacity of {self.capacity} tokens")

    def prefill(self, lane: int, inputs: np.ndarray, start_pos: int, output: str = "hidden") -> np.ndarray | None:
        """Write KV for `inputs` (ids [n] or activations [n, D]) at [start_pos, start_pos + n).

        Returns activations [n, D] when output == "hidden", else None.
        """
        n = inputs.shape[0]
        self._check_positions(start_pos + n - 1)
        dtype = np.int32 if self.first else np.float32
        inputs = np.asarray(inputs, dtype)
        outs = []
        done = 0
        while done < n:
            take = min(n - done, self.buckets.prefill_chunks[-1])
            size = self.buckets.chunk_for(take)
            chunk = self._pad_inputs(inputs[None, done:done + take], 1, size)
            pos = np.full((1, size), self.capacity, np.int32)
            pos[0, :take] = np.arange(start_pos + done, start_pos + done + take, dtype=np.int32)
            attn_len = self.buckets.attn_for(start_pos + done + take, self.capacity)
            out = self._step(chunk, pos, np.array([lane], np.int32), attn_len, output)
            if out is not None:
                outs.append(out[0, :take])
            done += take
        return np.concatenate(outs) if outs else None

    def step(self, lanes: np.ndarray, inputs: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
             output: str | None = None, meanwhile: Callable[[], Any] | None = None) -> np.ndarray:
        """Rows of work in one jitted call: row i is lengths[i] tokens in lane lanes[i] at positions
        [starts[i], starts[i] + lengths[i]). `inputs` holds the rows end to end: ids [n] or
        activations [n, D] (n = sum of lengths). Rows pad to the [rows bucket, window bucket] shape.

        Returns, for every token in input order, logits [n, V] (final stage: every position of a
        verify window is scored) or activations [n, D]. `meanwhile` runs once the step is dispatched,
        while it computes.
        """
        output = output or ("logits" if self.last else "hidden")
        lengths = np.asarray(lengths, np.int64)
        starts = np.asarray(starts, np.int64)
        b, t = len(lanes), int(lengths.max())
        self._check_positions(int(np.max(starts + lengths)) - 1)
        rows, width = self.buckets.rows_for(b), self.buckets.window_for(t)
        dtype = np.int32 if self.first else np.float32
        inputs = np.asarray(inputs, dtype)
        x = np.zeros((rows, width) + inputs.shape[1:], dtype)
        pos = np.full((rows, width), self.capacity, np.int32)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for i in range(b):
            n = int(lengths[i])
            x[i, :n] = inputs[offsets[i]:offsets[i + 1]]
            pos[i, :n] = np.arange(starts[i], starts[i] + n)
        lane_arr = np.zeros(rows, np.int32)
        lane_arr[:b] = lanes
        attn_len = self.buckets.attn_for(int(np.max(starts + lengths)), self.capacity)
        out = self._step(x, pos, lane_arr, attn_len, output, meanwhile)
        if t == 1:
            return out[:b, 0]
        return np.concatenate([out[i, :int(lengths[i])] for i in range(b)])

    def decode(self, lanes: np.ndarray, inputs: np.ndarray, positions: np.ndarray,
               output: str | None = None) -> np.ndarray:
        """One token per row. Returns logits [B, V] (final stage) or activations [B, D]."""
        return self.step(lanes, inputs, positions, np.ones(len(lanes), np.int64), output)

    def attn_buckets(self, upto: int | None = None) -> tuple[int, ...]:
        """The attention lengths a step can use for sequences of up to `upto` positions (default:
        the capacity), smallest first: every bucket attn_for can return on the way there."""
        return self.buckets.attn_sizes(self.capacity, upto)

    def request_shapes(self, start_pos: int, n_prefill: int, n_decode: int,
                       rows: int = 1) -> tuple[set[tuple[int, int]], set[int]]:
        """What one request compiles: ({(prefill chunk, attention length)}, {decode attention length})
        for a prefill of n_prefill tokens from start_pos (chunked as `prefill` chunks it) followed by
        n_decode one-token steps (positions start_pos + n_prefill, ...), `rows` rows a step."""
        chunks, done = set(), 0
        while done < n_prefill:
            take = min(n_prefill - done, self.buckets.prefill_chunks[-1])
            chunks.add((self.buckets.chunk_for(take), self.buckets.attn_for(start_pos + done + take, self.capacity)))
            done += take
        first = start_pos + n_prefill
        last = min(first + n_decode, self.capacity)
        decode = {a for a in self.attn_buckets(last) if n_decode > 0 and a >= self.buckets.attn_for(first + 1,
                                                                                                 self.capacity)}
        return chunks, decode

    def warmup(self, rows: tuple[int, ...] = (1,), chunks: tuple[int, ...] | None = None,
               attn_lens: tuple[int, ...] | None = None,
               pairs: set[tuple[int, int]] | None = None, windows: tuple[int, ...] = (),
               shapes: tuple[tuple[int, int], ...] = (), run: bool = True, layered: bool = False) -> float:
        """Compile the step for the shapes traffic can bring, ahead of it; shapes of at most
        WARM_RUN_TOKENS tokens are also run once, on padding positions that change no KV (`_compile`).

        The decode step for every row bucket in `rows` and every prefill chunk in `chunks` (default:
        all), each at every attention length in `attn_lens`. Default: the first bucket only, which
        covers sequences up to 256 positions; `attn_lens=self.attn_buckets()` covers every length up
        to the capacity, so no request compiles. `pairs` ({(chunk, attention length)}) replaces the
        chunks x attn_lens grid for prefill (see `request_shapes`). Each shape is traced, lowered and
        compiled (or read from the persistent cache); larger shapes are not executed: an 8B stage's
        256-token prefill alone computes for seconds. Shapes this runner has already compiled (and
        run, where small) are skipped, so a second call, or one after traffic, costs nothing. `windows`: one-row verify windows of
        these lengths (window buckets), scored like decode rows; `shapes`: any (rows, tokens) a DECODE
        can bring (config.decode_shapes: several rows, each a window). `run=False` compiles only,
        even the small shapes `_compile` would run (a stage before READY). `layered`: warm the
        layer-by-layer step instead (`stopgap`; small shapes only, each run once). Returns the seconds spent.
        """
        t0 = time.perf_counter()
        for shape, attn, output in self.warm_shapes(rows, chunks, attn_lens, pairs, windows, shapes):
            if layered:
                self._run_layered(shape, attn, output)
            else:
                self._compile(shape, attn, output, run)
        return time.perf_counter() - t0

    def warm_shapes(self, rows: tuple[int, ...] = (1,), chunks: tuple[int, ...] | None = None,
                    attn_lens: tuple[int, ...] | None = None, pairs: set[tuple[int, int]] | None = None,
                    windows: tuple[int, ...] = (), shapes: tuple[tuple[int, int], ...] = ()) -> list[tuple]:
        """The (inputs shape, attention length, output) list `warmup` compiles, in its order: by
        attention length, decode rows, then windows and shapes, then the prefill chunks."""
        chunks = chunks if chunks is not None else self.buckets.prefill_chunks
        attn_lens = attn_lens if attn_lens is not None else self.attn_buckets(1)
        pairs = pairs if pairs is not None else {(c, a) for c in chunks for a in attn_lens}
        width = () if self.first else (self.cfg.d_model,)
        decode_out = "logits" if self.last else "hidden"
        prefill_out = "none" if self.last else "hidden"
        out = []
        for attn in sorted(attn_lens):
            out += [((r, 1) + width, attn, decode_out) for r in rows]
            out += [((r, t) + width, attn, decode_out) for r, t in [(1, t) for t in windows] + list(shapes)]
        out += [((1, c) + width, attn, prefill_out) for c, attn in sorted(pairs, key=lambda p: (p[1], p[0]))]
        return out

    def _compile(self, shape: tuple[int, ...], attn_len: int, output: str, run: bool = True) -> None:
        """Compile the step `_step` would run for inputs of this shape (same placements, so the
        later call finds it compiled). Shapes of at most WARM_RUN_TOKENS tokens (decode rows,
        verify windows, short chunks) are also run once, on padding positions that write no KV:
        a compiled step's first run on XLA:CPU took 90-200 ms more than its later ones (SmolLM2
        q4 verify windows, measured), which a fresh `generate` or a server's first windows
        otherwise paid mid-answer. Larger shapes are compiled only: an 8B stage's 256-token
        prefill alone computes for seconds. With `run` False a small shape is compiled only too,
        and a later call with `run` runs it (a stage compiles before READY, runs while idle)."""
        key = (shape, attn_len, output)
        small = _small(shape)
        if key in self.stats.shapes and (key in self.stats.ran or not (run and small)):
            return
        static = dict(cfg=self.cfg, start=self.start, end=self.end, attn_len=attn_len, output=output)
        args = self._padding(shape)
        step = self._steps.direct.get(key) if self._steps.params is self.params else None
        if step is None and key not in self.stats.shapes:
            step = self._load_or_compile(key, args, static)
        if run and small:
            out, self.kv, _ = (step or forward_jit)(self.params, self.kv, *args, **static)
            jax.block_until_ready((out, self.kv))   # every position is padding: no lane changes
            self.stats.ran.add(key)
        self.stats.shapes.add(key)

    def _load_or_compile(self, key: tuple, args: tuple[jax.Array, ...], static: dict[str, Any]) -> Any:
        """The stored executable of this step (model/exec_cache.py), adopted by the step table so its
        first run neither traces nor lowers; else (None returned) compile it through jit's caches and
        store it. self.kv may be donated away meanwhile (compile_behind's thread): lowering and the
        cache's key read only its avals."""
        cache = self._exec_cache()
        path = cache.path(self.kv, args, static) if cache is not None else None
        step = cache.load(path, self.params, self.kv, args) if path is not None else None
        if step is not None:
            self._steps.adopt(key, step, self.params)
            return step
        compiled, fresh = exec_cache.compile_fresh(forward_jit.lower(self.params, self.kv, *args, **static))
        if path is not None and fresh:
            cache.store(path, compiled)
        return None

    def _exec_cache(self) -> exec_cache.ExecCache | None:
        """The executable cache for the current params (a tool may swap them for another tree)."""
        if self._exec[0] is not self.params:
            self._exec = (self.params, exec_cache.ExecCache.for_runner(self.device, self.cfg, self.params))
        return self._exec[1]

    def _run_layered(self, shape: tuple[int, ...], attn_len: int, output: str) -> None:
        """Run the layer-by-layer step once on padding (it compiles one layer per window kind), so a
        stop-gap step of this shape compiles nothing; larger shapes are left to their first use."""
        key = (shape, attn_len, output)
        if key in self.stats.layered or not _small(shape):
            return
        out, self.kv, _ = forward_layered(self.params, self.kv, *self._padding(shape), cfg=self.cfg,
                                          start=self.start, end=self.end, attn_len=attn_len, output=output)
        jax.block_until_ready((out, self.kv))
        self.stats.layered.add(key)

    def _padding(self, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Step inputs of this shape whose every position is padding (position == capacity)."""
        dtype = np.int32 if self.first else np.float32
        rows, length = shape[:2]
        return (self._put(np.zeros(shape, dtype)), self._put(np.full((rows, length), self.capacity, np.int32)),
                self._put(np.zeros(rows, np.int32)))

    def run_compiled(self) -> bool:
        """Run once, on padding, one small shape compile_behind has compiled but nothing has run
        (`_compile`: a compiled step's first run is slow), so that steps of it switch to the
        whole-slice step before compile_behind is done; False when there is none. The loop thread
        only (it donates the KV), while the stage is idle."""
        for key in sorted(self.stats.shapes - self.stats.ran, key=lambda k: (k[1], k[0])):
            if _small(key[0]):
                self._compile(*key)
                return True
        return False

    def kv_spans(self) -> tuple[int, ...]:
        """Every span `_span` can return: the KV copies' compiled lengths."""
        return tuple(sorted({self._span(n) for n in range(128, self.capacity, 128)} | {self._span(self.capacity)}))

    def warm_kv_copies(self, span: int, writes: bool = True) -> float:
        """Compile the lane copies (prefix recording, restore, an n-choice fork) for one span and run
        the read once (it changes nothing), so a server's first recordings neither compile nor pay a
        first run: a 64-token prompt's recording cost the next request 100-190 ms (SmolLM2, measured).
        The writes are compiled only (a run would change a lane); `writes` False: the read alone (what
        a first request's recording needs, before READY). Already done: free. Seconds spent."""
        if span in self.stats.reads and (span in self.stats.copies or not writes):
            return 0.0
        t0 = time.perf_counter()
        if span not in self.stats.reads:   # compiled here unless compile_kv_copies came first: then a run
            jax.block_until_ready(read_lane(self.kv, np.int32(0), span=span))
            self.stats.reads.add(span)
        if writes:
            self.compile_kv_copies(span)
        return time.perf_counter() - t0

    def compile_kv_copies(self, span: int) -> None:
        """Compile the lane read, write and copy of one span, running none (compile_behind's thread
        may: lowering reads only the KV's avals, which the loop's donations leave as they are)."""
        if span in self.stats.copies:
            return
        lane = np.int32(0)     # as read_kv_device, write_kv and copy_lane pass theirs: one compiled copy each
        arena = self.kv.k[0].shape     # [lanes, kvh, positions, hd]
        block = self._put(np.zeros((len(self.kv.k), span, arena[1], arena[3]), jnp.dtype(self.kv.dtype)))
        read_lane.lower(self.kv, lane, span=span).compile()
        write_lane.lower(self.kv, lane, block, block).compile()
        copy_lane.lower(self.kv, lane, lane, span=span).compile()
        self.stats.copies.add(span)

    def _span(self, length: int) -> int:
        """Length bucket (a multiple of 128) for KV copies, so they compile once per bucket, not per length."""
        self._check_positions(length - 1)
        return min(-(-length // 128) * 128, self.capacity)

    def read_kv_device(self, lane: int, length: int) -> tuple[jax.Array, jax.Array]:
        """Dispatch a device copy of this lane's K and V, [layers, span >= length, kvh, hd]; returns at once."""
        return read_lane(self.kv, np.int32(lane), span=self._span(length))

    def copy_lane(self, src: int, dst: int, length: int) -> None:
        """Copy lane src's KV at positions [0, length) into lane dst, on the device (a fork: n
        choices share one prefill). Positions past `length` in dst are beyond its session."""
        if length > 0:
            self.kv = copy_lane(self.kv, np.int32(src), np.int32(dst), span=self._span(length))

    def write_kv(self, lane: int, k: np.ndarray, v: np.ndarray) -> None:
        """Restore K and V blocks [layers, length, kvh, hd] into positions [0, length) of a lane, zero-padded
        to the bucketed span (positions past `length` are never attended to before they are rewritten)."""
        span = self._span(k.shape[1])
        pad = [(0, 0), (0, span - k.shape[1]), (0, 0), (0, 0)]
        self.kv = write_lane(self.kv, np.int32(lane), self._put(np.pad(k, pad)), self._put(np.pad(v, pad)))


def _small(shape: tuple[int, ...]) -> bool:
    """Whether a step of this inputs shape is cheap enough for a warm-up to run (WARM_RUN_TOKENS)."""
    return shape[0] * shape[1] <= WARM_RUN_TOKENS

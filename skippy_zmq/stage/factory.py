"""The one place a stage is built: its model slice, KV arena, runner, prefix
store and device placement, from the topology, a device and a memory budget.

The stage loop (sockets) and tests call `build_worker`; nothing else puts a
stage's arrays on a device. A stage with a `memory` budget that placement.py
predicts it would exceed fails here, before anything is allocated, rather than
being OOM-killed mid-request.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Callable

import jax
from loguru import logger

from skippy_zmq.ops import placement
from skippy_zmq.config.model import Buckets, KVConfig, ModelConfig, decode_shapes
from skippy_zmq.config.speculative import SpeculativeConfig
from skippy_zmq.kv.prefix_store import PrefixStore, StoreIdentity
from skippy_zmq.checkpoint import checkpoint, loader
from skippy_zmq.model import behind, fuse
from skippy_zmq.model.kernel import prepare_kernel
from skippy_zmq.model.runner import WARM_RUN_TOKENS, SliceRunner, resolve_device
from skippy_zmq.stage.sessions import SessionTable
from skippy_zmq.stage.worker import StageInfo, StageWorker
from skippy_zmq.config.topology import StageConfig, Topology


@dataclass(frozen=True)
class Placement:
    """Where a stage's arrays live and how many bytes it may take (a device today; a mesh later)."""

    device: str = "cpu"          # cpu | gpu:N | tpu:N
    memory: int | None = None    # byte budget of the whole stage process; None: unbounded

    @classmethod
    def of(cls, stage: StageConfig) -> Placement:
        return cls(stage.device, stage.memory)


def stage_settings(topology: Topology, stage: StageConfig) -> placement.StageSettings:
    """What placement.py needs to size this stage, read from the topology and the checkpoint."""
    cache = 0 if stage.cache.mode == "disabled" else stage.cache.max_bytes
    weights = checkpoint.resolve_weights(topology.model_path, stage.weights)    # "auto": what it stores
    return placement.StageSettings(weights, stage.dtype, stage.kv_dtype, topology.driver.max_context,
                                   stage.kv_lanes, cache, checkpoint.stored_weights(topology.model_path),
                                   topology.driver.prefill_chunk, max_draft(topology),
                                   checkpoint.kept_types(topology.model_path, stage.device) if weights == "gguf" else None)


def predict(topology: Topology, stage: StageConfig) -> placement.StageNeed:
    cfg = ModelConfig.load(topology.model_path / "model.json")
    return placement.stage_need(cfg, stage.start, stage.end, stage_settings(topology, stage))


def check_budget(topology: Topology, stage: StageConfig, budget: int | None) -> placement.StageNeed | None:
    """Raise PlacementError when the stage's predicted bytes exceed its budget (before loading anything)."""
    if not (topology.model_path / "model.json").is_file():
        return None     # load_slice says what is missing
    need = predict(topology, stage)
    if budget is not None and need.total > budget:
        raise placement.PlacementError(placement.budget_error(stage.id, need, budget))
    return need


def memory_report(worker: StageWorker, need: placement.StageNeed | None, budget: int | None) -> dict[str, Any]:
    """Bytes the stage holds (weights, KV) and was predicted to need; READY and heartbeats carry it."""
    # by identity: a gguf stage's tied head and embedding are the very same blocks
    weight_bytes = sum(leaf.nbytes for leaf in {id(a): a for a in jax.tree.leaves(worker.runner.params)}.values())
    return {"weight_bytes": int(weight_bytes), "kv_bytes": int(worker.runner.kv.nbytes),
            "predicted_bytes": need.total if need else 0, "memory_budget_bytes": budget or 0}


def stage_buckets(topology: Topology, lanes: int, capacity: int | None = None) -> Buckets:
    """Prefill chunks up to the driver's chunk, decode rows up to the stage's lanes (Buckets.for_stage)."""
    return Buckets.for_stage(topology.driver.prefill_chunk, lanes, capacity or topology.driver.prefill_chunk)


def max_draft(topology: Topology) -> int:
    """The most tokens the driver drafts a window (0: it does not speculate)."""
    spec = topology.driver.speculative
    return spec.max_draft if spec.enabled else 0


def spec_windows(topology: Topology, buckets: Buckets) -> tuple[int, ...]:
    """The one-row verify windows the driver can send (window buckets up to max_draft + 1), or ()
    with speculation off."""
    return buckets.spec_windows(max_draft(topology))


# A slice of this many layers or fewer compiles its whole-slice steps behind in its own thread (each
# shape waits for the stage to be quiet, as the child's do), not in a child process (model/behind.py):
# the child costs an interpreter and a JAX import (~2-3 CPU s, tens of seconds on a loaded machine) and
# lowers every shape twice (it compiles, then the stage lowers again to read the cache entry), while
# such a slice's compile is a fraction of a second a shape, short next to the requests it could delay.
THREAD_COMPILE_LAYERS = 4


def behind_command(stage: StageConfig) -> tuple[str, ...] | None:
    """The command of the child that compiles this stage's whole-slice steps behind (model/behind.py),
    or None: its own thread compiles them (a slice of THREAD_COMPILE_LAYERS layers or fewer)."""
    return None if stage.end - stage.start <= THREAD_COMPILE_LAYERS else behind.CHILD_COMMAND


def likeliest_first(windows: tuple[int, ...], spec: SpeculativeConfig) -> tuple[int, ...]:
    """The verify windows in the order a new stream's drafter reaches them: the window of its first
    k (`spec.first_draft` drafts; 8 tokens by default), then the
    nearest sizes (k doubles on a window all accepted, halves on a rejection)."""
    start = max([w for w in windows if w <= spec.first_draft + 1] or [0])
    return tuple(sorted(windows, key=lambda w: (abs(w - start), w)))


def reachable_shapes(topology: Topology, buckets: Buckets) -> tuple[tuple[int, int], ...]:
    """Every (rows, tokens) a DECODE can reach this stage with: each row bucket, with the verify
    windows the driver lets that many rows carry when it speculates (config.decode_shapes)."""
    return decode_shapes(buckets.decode_rows, spec_windows(topology, buckets))


def idle_warmups(runner: SliceRunner, shapes: tuple[tuple[int, int], ...]) -> list[Callable[[], float]]:
    """One compile per (decode shape, attention length) that the warm-up before READY left out, for
    the stage loop to run while idle after READY, shortest lengths and smallest shapes first. Before
    READY they would lengthen every restart (a SmolLM2 stage of 8 lanes reaches 13 shapes at each of
    4 lengths); after them, no DECODE a driver can send compiles, and the stage has reached the
    memory its plan counts (placement.py: compiled shapes). Shapes compiled before READY are
    in the list too: each is run once here (runner._compile: a compiled step's first run is slow),
    which costs a step's compute, not a compile; so are the prefill chunks small enough to run
    (without it a server's first prompts paid 100-150 ms each in prefill, SmolLM2 64-token prompts),
    and the lane copies of every KV span (`warm_kv_copies`: the first prefix recordings)."""
    return [functools.partial(runner.warmup, rows=(), shapes=(shape,), attn_lens=(a,), pairs=set())
            for a in runner.attn_buckets() for shape in shapes] + [   # a shape already done costs nothing
        functools.partial(runner.warmup, rows=(), attn_lens=(), pairs={(c, a)})
        for a in runner.attn_buckets() for c in runner.buckets.prefill_chunks if c <= WARM_RUN_TOKENS] + [
        functools.partial(runner.warm_kv_copies, span) for span in runner.kv_spans()]


def idle_compiles(runner: SliceRunner, shapes: tuple[tuple[int, int], ...]) -> list[tuple]:
    """What `idle_warmups` would compile, as compile_behind's (inputs shape, attention length,
    output) list: each decode shape and each small prefill chunk at every attention length."""
    small = {(c, a) for a in runner.attn_buckets() for c in runner.buckets.prefill_chunks if c <= WARM_RUN_TOKENS}
    return runner.warm_shapes(rows=(), attn_lens=runner.attn_buckets(), pairs=small, shapes=shapes)


def warm_before_ready(runner: SliceRunner, windows: tuple[int, ...] = (), later: list[tuple] = (),
                      spans: tuple[int, ...] = ()) -> float:
    """Compile what a stage serves before it says READY, so no request pays a compile: decode
    with 1 and 2 rows and every prefill chunk, each at every attention length up to the capacity.
    Compiled ahead of time and not run, each shape costs its trace and lowering plus XLA's compile
    or a persistent-cache read (scripts/stage_start.py splits them): about 0.3 s a shape with the
    cache warm, so 1- and 2-row decode at every length is cheap enough to do before READY. `windows`:
    one-row verify windows at the first attention length (contexts up to 256 tokens); the other
    lengths, more rows and windows of several rows are `idle_warmups`, run after READY. Compiled
    only (run=False): running the small shapes once too is left to the idle warm-ups, so it does
    not lengthen the time to READY (half an 8B: 23 s of a 30 s bound). `later`, `spans`: a stop-gap
    runner compiles these shapes and KV spans behind too (`idle_compiles`, warm_stopgap)."""
    rows = runner.buckets.decode_rows[:2]
    if runner.stopgap:
        return warm_stopgap(runner, windows, later, spans)
    spent = runner.warmup(rows=rows, chunks=runner.buckets.prefill_chunks, attn_lens=runner.attn_buckets(),
                          run=False)
    return spent + runner.warmup(rows=(), windows=windows, attn_lens=runner.attn_buckets(1), pairs=set(), run=False)


def warm_stopgap(runner: SliceRunner, windows: tuple[int, ...] = (), later: list[tuple] = (),
                 spans: tuple[int, ...] = ()) -> float:
    """warm_before_ready for a `stopgap` runner: before READY only the layer-by-layer step of what a
    first request runs (1- and 2-row decode, the verify windows and the chunks of at most
    WARM_RUN_TOKENS, at the first attention length), run once on padding: one layer compiled per
    shape instead of the slice's every layer (SmolLM2's cold start: 24 whole-slice shapes took 24 s
    of XLA compile). Then warm_before_ready's own shapes compile in a child (compile_behind), the
    first attention length first, 1-row decode and the verify windows ahead of the rest, and each
    shape's steps switch to the whole-slice step as it is there; the stage loop holds its idle
    warm-ups until that thread is done, and meanwhile runs each small shape the thread has compiled
    once, while no request is in flight (runner.run_compiled).
    Also the lane read of the shortest KV span: a first chat's prefix recording (at its STOP) compiled
    it on the loop thread, in front of the next request. `later` (the idle warm-ups' shapes) and
    `spans` (their KV copies) compile behind after the rest, in the gated child and the thread, so
    the idle warm-ups on the loop only run what is compiled: one of them compiling there held a
    request that came meanwhile (1.24 s against 0.45 warm, empty caches; issue 39)."""
    rows, first = runner.buckets.decode_rows[:2], runner.attn_buckets(1)
    small = tuple(c for c in runner.buckets.prefill_chunks if c <= WARM_RUN_TOKENS)
    spent = runner.warmup(rows=rows, chunks=small, attn_lens=first, windows=windows, layered=True)
    spent += runner.warm_kv_copies(runner.kv_spans()[0], writes=False)
    chunks, rest = runner.buckets.prefill_chunks, runner.attn_buckets()[len(first):]
    # what a stream runs most first: 1-row decode, then the windows in `windows`' order (likeliest_first)
    lead = runner.warm_shapes((1,), (), first, windows=windows)
    todo = lead + [s for s in runner.warm_shapes(rows, chunks, first, windows=windows)
                   + runner.warm_shapes(rows, chunks, rest) if s not in lead]
    runner.compile_behind(todo + [s for s in dict.fromkeys(later) if s not in todo], spans)
    return spent


def make_store(topology: Topology, stage: StageConfig) -> PrefixStore | None:
    """This stage's prefix store; identity ties entries to the model, layer range and KV dtype."""
    c = stage.cache
    if c.mode == "disabled":
        return None
    identity = StoreIdentity(loader.model_digest(topology.model_path), stage.start, stage.end, stage.kv_dtype)
    return PrefixStore(identity, c)


def build_worker(topology: Topology, stage: StageConfig, where: Placement | None = None,
                 behind_idle: bool = True) -> StageWorker:
    """Check the budget, restore only this stage's layers onto its device, compile what it serves.
    `behind_idle`: the idle warm-ups' compiles go behind (warm_stopgap's `later`); False (a re-cut's
    stage, which runs them itself before its go, and must say `prepared` without them): the loop's."""
    where = where or Placement.of(stage)
    need = check_budget(topology, stage, where.memory)
    t0 = time.perf_counter()
    if where.device == "cpu":
        prepare_kernel()     # built (a cold machine: seconds of compiler) while the weights restore
    device = resolve_device(where.device)
    cfg, params = loader.load_slice(topology.model_path, stage.start, stage.end, stage.dtype, device,
                                    fmt=stage.weights)
    if where.device == "cpu":   # fused here, layer by layer, so the load holds one copy (SliceRunner's: a no-op)
        params = fuse.fuse_params(params, consume=True)
    topology.check_model(cfg.n_layers)
    capacity = min(topology.driver.max_context, cfg.max_seq_len)
    buckets = stage_buckets(topology, stage.kv_lanes, capacity)
    runner = SliceRunner(cfg, params, stage.start, stage.end,
                         KVConfig(lanes=stage.kv_lanes, capacity=capacity, dtype=stage.kv_dtype), buckets, device)
    runner.stopgap = True    # READY before the whole-slice steps compile (warm_stopgap)
    runner.behind_command = behind_command(stage)
    t1 = time.perf_counter()
    idle = stage.idle_warmups and behind_idle
    warm_before_ready(runner, likeliest_first(spec_windows(topology, buckets), topology.driver.speculative),
                      idle_compiles(runner, reachable_shapes(topology, buckets)) if idle else [],
                      runner.kv_spans() if idle else ())
    logger.info("stage {} layers [{}, {}) on {}: restored in {:.1f}s, compiled in {:.1f}s", stage.id,
                stage.start, stage.end, where.device, t1 - t0, time.perf_counter() - t1)
    info = StageInfo(stage.id, first=stage.start == 0, last=stage.end == cfg.n_layers, width=cfg.d_model,
                     ring=topology.ring)
    worker = StageWorker(info, runner, SessionTable(stage.kv_lanes), make_store(topology, stage))
    worker.memory.update(memory_report(worker, need, where.memory))
    # first, compile_behind's end (the loop reaches it once that thread is done: a wait of nothing)
    worker.warm_later = [runner.join_behind] + (
        idle_warmups(runner, reachable_shapes(topology, buckets)) if stage.idle_warmups else [])
    if info.last:
        worker.tokenizer_source = (topology.model_path, cfg.vocab_size)
        prepare_constraints(worker)
    return worker


def prepare_constraints(worker: StageWorker) -> None:
    """Build the constraint engine's tokenizer view before READY: it holds the GIL for about a
    second (0.8 s for SmolLM2's 49k tokens, measured), and built on a serving stage's first
    constrained request it stalled the heartbeat thread past dead_after. A vocabulary the engine
    cannot read stays unbuilt: constrained requests then get the error they always got."""
    try:
        worker.constraint_info()
    except Exception as exc:   # the engine's own errors: reported per request, as before
        logger.warning("stage {}: constrained decoding is unavailable: {}", worker.info.stage_id, exc)

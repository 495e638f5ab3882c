"""Builders for in-process pipelines over a model tree (tiny or real)."""

from __future__ import annotations

import jax.numpy as jnp

from skippy_zmq.protocol import wire
from skippy_zmq.config.model import Buckets, KVConfig, ModelConfig
from skippy_zmq.engine.prefix_index import PrefixIndex
from skippy_zmq.engine.scheduler import Scheduler, SchedulerConfig
from skippy_zmq.config.cache import CacheConfig
from skippy_zmq.kv.prefix_store import PrefixStore, StoreIdentity
from skippy_zmq.engine.inproc import InprocChain
from skippy_zmq.model import weights
from skippy_zmq.model.runner import SliceRunner
from skippy_zmq.stage.sessions import SessionTable
from skippy_zmq.stage.worker import StageInfo, StageWorker
from model_helpers import slice_tree


CACHE = CacheConfig(mode="lookup-record", max_bytes=64 << 20, max_entries=64, stride=16, min_tokens=8)


def make_worker(cfg: ModelConfig, tree: dict, start: int, end: int, lanes: int = 4, capacity: int = 256,
                stage_id: str | None = None, cache: CacheConfig | None = None, ring: bool = False) -> StageWorker:
    params = weights.to_runtime(slice_tree(tree, cfg, start, end), jnp.float32)
    buckets = Buckets(prefill_chunks=(16, 64), decode_rows=(1, 2, 4, 8))
    runner = SliceRunner(cfg, params, start, end, KVConfig(lanes=lanes, capacity=capacity), buckets)
    info = StageInfo(stage_id or f"s{start}", first=start == 0, last=end == cfg.n_layers, width=cfg.d_model,
                     ring=ring)
    store = PrefixStore(StoreIdentity("test", start, end, "float32"), cache) if cache else None
    return StageWorker(info, runner, SessionTable(lanes), store)


def make_chain(cfg: ModelConfig, tree: dict, cuts: list[int], lanes: int = 4, capacity: int = 256,
               dtype: wire.WireDType = wire.WireDType.F32, cache: CacheConfig | None = None,
               ring: bool = False) -> InprocChain:
    bounds = [0, *cuts, cfg.n_layers]
    workers = [make_worker(cfg, tree, a, b, lanes, capacity, f"s{i}", cache, ring)
               for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    return InprocChain(workers, dtype)


def make_scheduler(n_stages: int, eos: frozenset[int] = frozenset({2}), cache: CacheConfig | None = None,
                   **kw) -> Scheduler:
    cfg = dict(n_stages=n_stages, max_sessions=4, max_queue=16, prefill_chunk=64, max_context=256)
    cfg.update(kw)
    index = PrefixIndex([cache] * n_stages) if cache else None
    return Scheduler(SchedulerConfig(**cfg), eos, index)

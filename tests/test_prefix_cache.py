"""Prefix KV stores at every stage and the restore routes, driven through the real scheduler."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TINY, random_ids
from pipeline_helpers import CACHE, make_chain, make_scheduler, make_worker
from skippy_zmq.engine.request import GenRequest
from skippy_zmq.engine.inproc import run_requests, tokens_of
from skippy_zmq.config.cache import CacheConfig
from skippy_zmq.stage.types import DRIVER, NEXT
from skippy_zmq.protocol.wire import Kind, Message

SYSTEM = random_ids(40, TINY.vocab_size, seed=11).tolist()


def gen(sched, chain, prompts, ns=None, max_tokens=8):
    reqs = [GenRequest(f"r{i}", tuple(p), max_tokens=max_tokens, ignore_eos=True, cache_key=ns)
            for i, p in enumerate(prompts)]
    events = run_requests(sched, chain, reqs)
    return [tokens_of(events[r.request_id]) for r in reqs], [events[r.request_id][0] for r in reqs]


@pytest.mark.parametrize("cuts", [[], [2], [1, 3]], ids=["1stage", "2stage", "3stage"])
def test_restore_equals_recompute(tiny_tree, cuts):
    n = len(cuts) + 1
    exact = SYSTEM + [5, 6, 7]
    tails = [SYSTEM + random_ids(9, TINY.vocab_size, seed=s).tolist() for s in (1, 2)]
    cold, _ = gen(make_scheduler(n), make_chain(TINY, tiny_tree, cuts), [exact] + tails)
    sched, chain = make_scheduler(n, cache=CACHE), make_chain(TINY, tiny_tree, cuts, cache=CACHE)
    first, events = gen(sched, chain, [exact])
    assert events[0].cached_tokens == 0 and first[0] == cold[0]
    again, events = gen(sched, chain, [exact])                    # fused: restore prompt[:-1] + decode
    assert again[0] == cold[0] and events[0].cached_tokens == len(exact) - 1
    shared, events = gen(sched, chain, tails)                     # shared system prompt, new tails
    assert shared == cold[1:]
    assert [e.cached_tokens for e in events] == [32, 32]          # the stride-16 grid point inside SYSTEM
    assert sched.prefix_counts["hit"] == 3 and sched.prefix_counts["miss"] == 1


def test_miss_at_the_middle_stage_of_three_falls_back(tiny_tree):
    sched, chain = make_scheduler(3, cache=CACHE), make_chain(TINY, tiny_tree, [1, 3], cache=CACHE)
    prompt = SYSTEM + [9, 9, 9]
    cold, _ = gen(sched, chain, [prompt])
    chain.workers[1].store.store.clear()                           # the middle stage evicted everything
    replies = []
    send = chain.send

    def recording_send(message):
        out = send(message)
        replies.extend(out)
        return out

    chain.send = recording_send
    warm, events = gen(sched, chain, [prompt])
    assert warm == cold and events[0].cached_tokens == 0
    miss = [(sid, m) for sid, m in replies if m.kind == Kind.ACK and "restore" in m.extras.get("stats", {})]
    assert [(sid, m.extras["stats"]["restore"]["status"]) for sid, m in miss] == [("s1", "miss")]
    assert sched.prefix_counts["miss"] == 2


def test_routes_at_first_middle_and_last_stage(tiny_tree):
    chain = make_chain(TINY, tiny_tree, [1, 3], cache=CACHE)
    prompt = np.asarray(SYSTEM + [4], np.int32)
    for w in chain.workers:                                       # every stage holds SYSTEM
        w.handle(Message(Kind.PREFILL, 1, 50, tokens=prompt[:-1]) if w.info.first else
                 Message(Kind.PREFILL, 1, 50, tokens=prompt[:-1],
                         activation=np.zeros((len(prompt) - 1, TINY.d_model), np.float32)))
        w.record(w.sessions.get(50), "ns")
        w.store.flush()
        w.handle(Message(Kind.STOP, 2, 50))
    msg = Message(Kind.TRY_RESTORE_PREFILL_DECODE, 3, 60, tokens=prompt, extras={"namespace": "ns"})
    [fwd] = chain.workers[0].handle(msg)                           # ForwardHit at the first stage
    assert fwd.to == NEXT and fwd.message.kind == Kind.TRY_RESTORE_PREFILL_DECODE
    assert fwd.message.activation.shape == (1, TINY.d_model) and len(fwd.message.tokens) == len(prompt)
    [fwd2] = chain.workers[1].handle(fwd.message)                 # ForwardHit in the middle
    assert fwd2.to == NEXT and fwd2.message.kind == Kind.TRY_RESTORE_PREFILL_DECODE
    [hit] = chain.workers[2].handle(fwd2.message)                 # DirectHit at the last stage
    assert hit.to == DRIVER and hit.message.kind == Kind.PREDICTED_TOKENS
    assert hit.message.extras["restore"]["route"] == "direct_hit"
    for w in chain.workers:                                       # DirectMiss anywhere: ACK(miss) to the driver
        [miss] = w.handle(Message(Kind.TRY_RESTORE_PREFILL_DECODE, 4, 61, tokens=prompt, extras={"namespace": "other"},
                                  activation=None if w.info.first else np.zeros((1, TINY.d_model), np.float32)))
        assert miss.to == DRIVER and miss.message.kind == Kind.ACK
        assert miss.message.extras["stats"]["restore"]["status"] == "miss"
    [err] = chain.workers[0].handle(Message(Kind.TRY_RESTORE_PREFILL_DECODE, 5, 62, tokens=prompt[:1]))
    assert "at least one prefix token plus the current token" in err.message.extras["error"]


def test_namespaces_do_not_leak(tiny_tree):
    sched, chain = make_scheduler(2, cache=CACHE), make_chain(TINY, tiny_tree, [2], cache=CACHE)
    prompt = SYSTEM + [3, 3]
    gen(sched, chain, [prompt], ns="alice")
    _, events = gen(sched, chain, [prompt], ns="bob")
    assert events[0].cached_tokens == 0
    _, events = gen(sched, chain, [prompt], ns="alice")
    assert events[0].cached_tokens == len(prompt) - 1


def test_eviction_keeps_every_store_under_budget(tiny_tree):
    small = CacheConfig(mode="lookup-record", max_bytes=200_000, max_entries=32, stride=16, min_tokens=8)
    sched, chain = make_scheduler(2, cache=small), make_chain(TINY, tiny_tree, [2], cache=small)
    rng = np.random.default_rng(0)
    for i in range(30):
        prompt = random_ids(int(rng.integers(10, 120)), TINY.vocab_size, seed=100 + i).tolist()
        gen(sched, chain, [prompt], max_tokens=2)
        for w in chain.workers:
            assert w.store.store.nbytes <= small.max_bytes
    assert all(w.store.stats()["evictions"] > 0 for w in chain.workers)
    # prompts recorded early were evicted: asking for one is a miss, never an error, and still right
    prompt = random_ids(int(np.random.default_rng(0).integers(10, 120)), TINY.vocab_size, seed=100).tolist()
    cold, _ = gen(make_scheduler(2), make_chain(TINY, tiny_tree, [2]), [prompt], max_tokens=2)
    warm, _ = gen(sched, chain, [prompt], max_tokens=2)
    assert warm == cold


class OnlyTheHost:
    """A RestoreHost and nothing else: restore reaching for any other part of a worker fails here."""

    def __init__(self, entry, last: bool):
        from skippy_zmq.stage.types import StageInfo

        self.info = StageInfo("s9", first=True, last=last, width=8)
        self.entry, self.restored = entry, []

    def lookup_prefix(self, namespace, prefix):
        return self.entry

    def restore_session(self, session_id, request_id, entry, prefix):
        self.restored.append((session_id, request_id, entry.length, prefix.tolist()))
        return object()

    def make_sampler(self, extras, prompt):
        raise AssertionError("TRY_RESTORE_PREFILL configures no sampler")

    def on_decode(self, msg):
        raise AssertionError("TRY_RESTORE_PREFILL runs no rows")

    def record_later(self, session, namespace):
        raise AssertionError("TRY_RESTORE_PREFILL records nothing")

    def restore_telemetry(self):
        return {"lock_wait_ms": 0.5, "lock_hold_ms": 1.5, "evictions": 3}


@pytest.mark.parametrize("last", [False, True], ids=["forward", "direct"])
def test_restore_routes_use_only_their_host(last):
    from types import SimpleNamespace

    from skippy_zmq.stage.restore import RestoreRoutes

    msg = Message(Kind.TRY_RESTORE_PREFILL, 7, 4, tokens=np.arange(10, dtype=np.int32), extras={"namespace": "ns"})
    [miss] = RestoreRoutes(OnlyTheHost(None, last)).on_try_restore_prefill(msg)
    stats = miss.message.extras["stats"]["restore"]
    assert miss.to == DRIVER and stats["status"] == "miss" and stats["matched"] == 0
    assert (stats["stage"], stats["lock_wait_ms"], stats["lock_hold_ms"], stats["evictions"]) == ("s9", 0.5, 1.5, 3)
    host = OnlyTheHost(SimpleNamespace(length=6), last)
    [hit] = RestoreRoutes(host).on_try_restore_prefill(msg)
    assert host.restored == [(4, 7, 6, list(range(10)))]
    if last:
        assert hit.to == DRIVER and hit.message.extras["stats"]["restore"]["matched"] == 6
    else:
        assert hit.to == NEXT and hit.message is msg


def test_driver_index_is_bounded_by_the_stores():
    """The driver's index remembers at most KEYS_PER_ENTRY prefixes per entry a store can hold, oldest
    forgotten first, so its memory stops growing once the stores are full."""
    from skippy_zmq.engine.prefix_index import KEYS_PER_ENTRY, PrefixIndex

    configs = [CacheConfig(max_entries=8, stride=16, min_tokens=4), CacheConfig(max_entries=4, stride=16, min_tokens=4)]
    index = PrefixIndex(configs)
    prompts = [[1000 + i] * 40 for i in range(50)]
    for p in prompts:
        index.add("ns", p)
    assert len(index._keys) == KEYS_PER_ENTRY * 8 == index.max_keys
    assert index.longest("ns", prompts[-1], 40) == 40
    assert index.longest("ns", prompts[0], 40) == 0

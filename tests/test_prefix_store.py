"""PrefixStore: keys, stride grid, LRU under byte and entry budgets, modes, copies."""

import numpy as np
import pytest

from skippy_zmq.config.cache import CacheConfig
from skippy_zmq.kv.prefix_store import PrefixStore, StoreIdentity, prefix_key

IDENT = StoreIdentity(model_digest="abc123", layer_start=0, layer_end=2, kv_dtype="float32")
LAYERS, HEADS, HEAD_DIM = 2, 2, 4
BYTES_PER_TOKEN = 2 * LAYERS * HEADS * HEAD_DIM * 4  # k + v, float32


def kv(n: int, seed: int = 0, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (LAYERS, n, HEADS, HEAD_DIM)
    return rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)


def toks(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 32000, n, dtype=np.int64)


def store(**overrides) -> PrefixStore:
    cfg = dict(mode="lookup-record", max_bytes=1 << 30, max_entries=1000, stride=128, min_tokens=64)
    return PrefixStore(IDENT, CacheConfig(**{**cfg, **overrides}))


def test_record_lookup_roundtrip_bit_exact():
    s, t = store(), toks(100)
    k, v = kv(100)
    assert s.record("ns", t, k, v) == [100]
    e = s.lookup("ns", list(t))  # list or array: same key
    assert e is not None and e.length == 100 and e.namespace == "ns"
    assert e.k.dtype == np.float32 and e.k.tobytes() == k.tobytes() and e.v.tobytes() == v.tobytes()
    assert e.nbytes == 100 * BYTES_PER_TOKEN
    assert s.stats()["hits"] == 1


def test_namespace_isolation():
    s, t = store(), toks(100)
    s.record("alice", t, *kv(100))
    assert s.lookup("bob", t) is None
    assert s.lookup("alice", t) is not None
    assert s.stats()["misses"] == 1


def test_key_identity_and_token_sensitivity():
    t = toks(50)
    base = prefix_key(IDENT, "ns", t)
    assert base == prefix_key(IDENT, "ns", [int(x) for x in t]) and len(base) == 16
    others = [
        StoreIdentity("abc124", 0, 2, "float32"),
        StoreIdentity("abc123", 2, 4, "float32"),
        StoreIdentity("abc123", 0, 3, "float32"),
        StoreIdentity("abc123", 0, 2, "bfloat16"),
    ]
    keys = {prefix_key(i, "ns", t) for i in others}
    keys |= {prefix_key(IDENT, "ns2", t), prefix_key(IDENT, "ns", t[:-1])}
    keys |= {prefix_key(IDENT, "ns", np.concatenate([t[:-1], [t[-1] + 1]]))}
    assert base not in keys and len(keys) == 7


def test_identity_isolation_between_stores():
    t, (k, v) = toks(100), kv(100)
    a = PrefixStore(IDENT, CacheConfig(max_bytes=1 << 20, max_entries=10))
    b = PrefixStore(StoreIdentity("abc123", 2, 4, "float32"), CacheConfig(max_bytes=1 << 20, max_entries=10))
    a.record("ns", t, k, v)
    b.record("ns", t, k, v)
    assert a.lookup("ns", t).key != b.lookup("ns", t).key


def test_stride_grid():
    s, t = store(), toks(300)
    k, v = kv(300)
    assert s.record("ns", t, k, v) == [128, 256, 300]
    for n in (128, 256):
        e = s.lookup("ns", t[:n])
        assert e is not None and e.length == n
        assert np.array_equal(e.k, k[:, :n]) and np.array_equal(e.v, v[:, :n])
        assert e.k.flags.c_contiguous and e.k.base is None  # own copy, does not pin k
    assert s.lookup("ns", t[:200]) is None


def test_a_shared_system_prompt_hits_its_grid_entry_by_exact_lookup():
    s, t = store(), toks(300)
    s.record("ns", t, *kv(300))
    other = np.concatenate([t[:260], toks(50, seed=9)])
    assert s.lookup("ns", other) is None
    e = s.lookup("ns", other[:256])   # the grid point the driver's index predicts
    assert e is not None and e.length == 256
    assert s.lookup("ns", other[:260]) is None   # only the grid and the exact prompt are stored
    assert s.lookup("ns", t).length == 300
    assert s.lookup("other", t[:256]) is None


def test_grid_keeps_only_longest_points_and_respects_min_tokens():
    s = store(stride=16, min_tokens=40, max_grid_entries_per_record=3)
    t = toks(130)
    assert s.record("ns", t, *kv(130)) == [96, 112, 128, 130]
    assert store(min_tokens=200).record("ns", toks(150), *kv(150)) == []
    assert store(max_grid_entries_per_record=0).record("ns", t, *kv(130)) == [130]


def test_bytes_within_budget_over_random_prompts():
    budget = 60_000  # ~468 tokens: long prompts exceed it and are rejected
    s = store(max_bytes=budget, max_entries=50, stride=32, min_tokens=16)
    rng = np.random.default_rng(1)
    shared = toks(64, seed=2)
    for i in range(200):
        n = int(rng.integers(1, 600))
        t = toks(n, seed=100 + i)
        if i % 3 == 0:  # some prompts share a system prompt
            t[: min(n, 64)] = shared[: min(n, 64)]
        if i % 5 == 4:  # and some repeat the previous prompt exactly
            n, t = len(prev), prev
        s.record("ns", t, *kv(n, seed=i))
        prev = t
        st = s.stats()
        assert st["bytes"] <= budget and st["entries"] <= 50
    st = s.stats()
    assert st["evictions"] > 0 and st["rejected_too_large"] > 0 and st["refreshes"] > 0
    assert st["records"] - st["evictions"] == st["entries"]


def test_max_entries():
    s = store(max_entries=3)
    for i in range(5):
        s.record("ns", toks(70, seed=i), *kv(70, seed=i))
    assert s.stats()["entries"] == 3 and s.stats()["evictions"] == 2
    assert s.lookup("ns", toks(70, seed=0)) is None and s.lookup("ns", toks(70, seed=4)) is not None


def test_oversize_entry_never_stored_and_evicts_nothing():
    s = store(max_bytes=100 * BYTES_PER_TOKEN)
    s.record("ns", toks(80), *kv(80))
    assert s.record("ns", toks(101, seed=5), *kv(101)) == []
    st = s.stats()
    assert st["rejected_too_large"] == 1 and st["evictions"] == 0 and st["entries"] == 1


def test_lru_order():
    s = store(max_bytes=2 * 70 * BYTES_PER_TOKEN)
    a, b, c = toks(70, 1), toks(70, 2), toks(70, 3)
    s.record("ns", a, *kv(70))
    s.record("ns", b, *kv(70))
    assert s.lookup("ns", a) is not None  # touch A
    s.record("ns", c, *kv(70))
    assert s.lookup("ns", b) is None
    assert s.lookup("ns", a) is not None and s.lookup("ns", c) is not None


def test_re_record_refreshes_without_copy():
    s = store(max_bytes=2 * 70 * BYTES_PER_TOKEN)
    a, b, c = toks(70, 1), toks(70, 2), toks(70, 3)
    s.record("ns", a, *kv(70))
    first = s.lookup("ns", a)
    s.record("ns", b, *kv(70))
    assert s.record("ns", a, *kv(70, seed=7)) == [70]  # refresh A, keep its block
    s.record("ns", c, *kv(70))
    assert s.lookup("ns", b) is None and s.lookup("ns", a) is first
    assert s.stats()["refreshes"] == 1


def test_clear_drops_entries_not_counts():
    s = store(max_bytes=10 * 70 * BYTES_PER_TOKEN)
    for i in range(5):
        s.record("ns", toks(70, i), *kv(70))
    s.clear()
    stats = s.stats()
    assert stats["entries"] == 0 and stats["bytes"] == 0 and stats["evictions"] == 0 and stats["records"] == 5


def test_disabled_and_record_modes():
    t, (k, v) = toks(100), kv(100)
    off = store(mode="disabled")
    assert off.record("ns", t, k, v) == [] and len(off) == 0
    assert off.lookup("ns", t) is None
    rec = store(mode="record")
    assert rec.record("ns", t, k, v) == [100] and len(rec) == 1
    assert rec.lookup("ns", t) is None
    st = rec.stats()
    assert st["hits"] == 0 and st["misses"] == 0 and st["lookups_disabled"] == 1
    with pytest.raises(ValueError, match="mode"):
        CacheConfig(mode="lookup")


def test_record_does_not_alias_caller_buffers():
    s, t = store(), toks(300)
    k, v = kv(300)
    k0, v0 = k.copy(), v.copy()
    s.record("ns", t, k, v)
    k[:] = 0.0
    v[:] = 0.0
    for n in (128, 256, 300):
        e = s.lookup("ns", t[:n])
        assert np.array_equal(e.k, k0[:, :n]) and np.array_equal(e.v, v0[:, :n])
        assert not np.shares_memory(e.k, k) and not e.k.flags.writeable


def test_record_validates_shapes():
    s = store()
    k, v = kv(100)
    with pytest.raises(ValueError, match="100 positions but 99 tokens"):
        s.record("ns", toks(99), k, v)
    with pytest.raises(ValueError):
        s.record("ns", toks(100), k, v[:, :99])


def test_other_dtypes_roundtrip():
    s, t = store(), toks(100)
    k, v = kv(100, dtype=np.float16)
    s.record("ns", t, k, v)
    e = s.lookup("ns", t)
    assert e.k.dtype == np.float16 and e.k.tobytes() == k.tobytes() and e.nbytes == k.nbytes + v.nbytes

"""Stored whole-slice executables (model/exec_cache.py): a loaded step is the compiled one, bit for
bit, its load traces nothing, and a file that does not load falls back to compiling."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import compilation_cache

from conftest import TINY, random_ids
from skippy_zmq.config.model import Buckets, KVConfig
from skippy_zmq.model import direct, exec_cache, weights
from skippy_zmq.model.runner import SliceRunner
from model_helpers import slice_tree

DECODE = ((1, 1), 256, "logits")
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"


def runner(tree: dict) -> SliceRunner:
    params = weights.to_runtime(slice_tree(tree, TINY, 0, TINY.n_layers), jnp.float32)
    return SliceRunner(TINY, params, 0, TINY.n_layers, KVConfig(lanes=2, capacity=256), Buckets())


def greedy(r: SliceRunner, prompt: np.ndarray, n: int) -> list[int]:
    """n greedy tokens after `prompt` (lane 1): each step's argmax is the next step's input."""
    logits = r.prefill(1, prompt, 0, output="logits")
    out = [int(np.argmax(logits[-1]))]
    for i in range(n - 1):
        out.append(int(np.argmax(r.decode(np.array([1]), np.array(out[-1:]), np.array([len(prompt) + i]))[0])))
    return out


@pytest.fixture
def cache_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The executables' folder, with XLA's cache emptied and jit's forgotten: only what XLA compiles
    here and now is stored (exec_cache.compile_fresh), and the steps compile here."""
    monkeypatch.setattr(exec_cache, "folder", lambda: tmp_path)
    before = jax.config.jax_compilation_cache_dir
    jax.clear_caches()
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla"))
    compilation_cache.reset_cache()
    yield tmp_path
    jax.config.update("jax_compilation_cache_dir", before)
    compilation_cache.reset_cache()


def test_loaded_steps_trace_nothing_and_give_the_same_greedy_tokens(tiny_tree, cache_in, monkeypatch):
    prompt = random_ids(9, TINY.vocab_size, seed=3)
    writer = runner(tiny_tree)
    writer.warmup(rows=(1,), chunks=(16,), run=False)   # compiled, and stored
    assert len(list(cache_in.glob("*.exe"))) == 2
    traces: list[float] = []
    listener = (lambda name, secs, **_: traces.append(secs) if name == TRACE_EVENT else None)
    reader = runner(tiny_tree)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        reader.warmup(rows=(1,), chunks=(16,), run=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert traces == []   # loaded, not traced
    assert isinstance(reader._steps.direct[DECODE], direct.DirectStep)
    got = greedy(reader, prompt, 12)
    monkeypatch.setattr(exec_cache, "folder", lambda: None)
    plain = runner(tiny_tree)   # no cache: jit compiles (or reads XLA's cache) as before
    plain.warmup(rows=(1,), chunks=(16,), run=False)
    assert DECODE not in plain._steps.direct
    assert got == greedy(plain, prompt, 12)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "other_format"])
def test_a_file_that_does_not_load_falls_back_to_compiling(tiny_tree, cache_in, monkeypatch, damage):
    prompt = random_ids(9, TINY.vocab_size, seed=4)
    runner(tiny_tree).warmup(rows=(1,), chunks=(16,), run=False)
    for path in cache_in.glob("*.exe"):
        blob = path.read_bytes()
        path.write_bytes({"truncate": blob[:len(blob) // 2], "garbage": b"\x80\x04not a pickle",
                          "other_format": b"\x80\x04K\x00."}[damage])
    warned: list[str] = []
    monkeypatch.setattr(exec_cache.logger, "warning", lambda msg, *a: warned.append(msg.format(*a)))
    jax.clear_caches()   # the fallback compiles anew (a fresh executable: stored over the bad file)
    jax.config.update("jax_compilation_cache_dir", str(cache_in / "xla-2"))
    compilation_cache.reset_cache()
    fallen = runner(tiny_tree)
    fallen.warmup(rows=(1,), chunks=(16,), run=False)
    assert len(warned) == 2 and all("did not load" in w for w in warned)
    assert DECODE not in fallen._steps.direct   # compiled through jit, as without the cache
    got = greedy(fallen, prompt, 8)
    monkeypatch.setattr(exec_cache, "folder", lambda: None)
    assert got == greedy(runner(tiny_tree), prompt, 8)
    monkeypatch.setattr(exec_cache, "folder", lambda: cache_in)
    again = runner(tiny_tree)   # the fallback rewrote the files: they load now, whole
    again.warmup(rows=(1,), chunks=(16,), run=False)
    assert isinstance(again._steps.direct[DECODE], direct.DirectStep) and len(warned) == 2
    assert greedy(again, prompt, 8) == got

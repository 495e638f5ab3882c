"""Real stage processes on free loopback ports for end-to-end tests."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from skippy_zmq.harness import free_base_port, running_pipeline, write_topology  # noqa: F401


def free_endpoint() -> str:
    """A loopback TCP endpoint on a port the OS just handed out (for endpoints that refer to each other)."""
    return f"tcp://127.0.0.1:{free_base_port(1)}"


@contextmanager
def serving(topology_path: Path, run_dir: Path) -> Iterator:
    """running_pipeline plus the OpenAI HTTP server in a thread: yields (engine, tokenizer, topology, url)."""
    from skippy_zmq.driver.main import build_app
    from skippy_zmq.driver.server import start_in_thread

    with running_pipeline(topology_path, run_dir) as (engine, tokenizer, topology, _):
        handle = start_in_thread(build_app(topology, engine, tokenizer))
        try:
            yield engine, tokenizer, topology, handle.url
        finally:
            handle.stop()

"""Real stage processes on free loopback ports for end-to-end tests."""

from skippy_zmq.harness import free_base_port, running_pipeline, write_topology  # noqa: F401


def free_endpoint() -> str:
    """A loopback TCP endpoint on a port the OS just handed out (for endpoints that refer to each other)."""
    return f"tcp://127.0.0.1:{free_base_port(1)}"

"""Real stage processes on free loopback ports for end-to-end tests."""

from skippy_zmq.launch import free_base_port, running_pipeline, write_topology  # noqa: F401

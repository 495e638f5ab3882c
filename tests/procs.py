"""Real stage processes on free loopback ports for end-to-end tests."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from skippy_zmq.devtools import harness
from skippy_zmq.devtools.harness import free_base_port, running_pipeline  # noqa: F401

# Every test pipeline holds 512 positions a session (the shipped default is 2048): its stages compile
# every prefill chunk and 1- and 2-row decode at each attention length before READY, and verify windows
# at each after it, so two lengths (256, 512) instead of four halve a stage's start. Every prompt the
# suite sends is far shorter; a test that needs more context says so.
TEST_CONTEXT = 512


def write_topology(tmp: Path, model_dir: Path | str, n_stages: int, name: str = "topo",
                   n_layers: int | None = None, **overrides) -> Path:
    """harness.write_topology with the suite's context (TEST_CONTEXT) unless `driver__max_context` is
    given, and no idle warm-ups unless `idle_warmups=True` is: after READY a stage compiles (and runs
    once) every shape a request could reach at every attention length, CPU that a test whose speed
    nothing measures takes from the other worker's tests; the few shapes a test reaches compile on use."""
    overrides.setdefault("driver__max_context", TEST_CONTEXT)
    overrides.setdefault("idle_warmups", False)
    return harness.write_topology(tmp, model_dir, n_stages, name, n_layers, **overrides)


def upstream_socket(topology: Any, stage_id: str) -> Any:
    """A PUSH into `stage_id`'s PULL as its legitimate upstream opens one (the driver for the first
    stage, else the previous stage): with CURVE (the default) it carries that party's key, the only
    one the stage admits. For tests that play a hostile or buggy upstream; what they send must also
    carry the driver's chain view (`engine.view.stamp(msg)`) or a secured stage drops it unread."""
    import zmq

    from skippy_zmq.protocol import transport
    from skippy_zmq.protocol.security import security_for

    i = topology.index(stage_id)
    upstream = security_for(topology, "driver" if i == 0 else topology.stages[i - 1].id)
    return transport.make_socket(transport.context(), zmq.PUSH, topology.stage(stage_id).connect, bind=False,
                                 security=upstream.client(stage_id) if upstream is not None else None)


def ring_socket(topology: Any) -> Any:
    """A PUSH into the first stage's PULL under the last stage's key, as a ring's last stage opens
    one (stage/run_on.py); the first stage takes from it only the steps it expects."""
    import zmq

    from skippy_zmq.protocol import transport
    from skippy_zmq.protocol.security import security_for

    last = security_for(topology, topology.last.id)
    return transport.make_socket(transport.context(), zmq.PUSH, topology.first.connect, bind=False,
                                 security=last.client(topology.first.id) if last is not None else None)


def stage_dealer(topology: Any, stage_id: str, identity: bytes) -> Any:
    """A DEALER into the driver's ROUTER under `stage_id`'s key (CURVE: the ROUTER admits only
    stage keys), with routing `identity`: the driver acts only on what names the key's own stage."""
    import zmq

    from skippy_zmq.protocol import transport
    from skippy_zmq.protocol.security import security_for

    stage = security_for(topology, stage_id)
    return transport.make_socket(transport.context(), zmq.DEALER, topology.driver.return_connect, bind=False,
                                 identity=identity,
                                 security=stage.client("driver") if stage is not None else None)


def free_endpoint(beside: Path | None = None) -> str:
    """A loopback TCP endpoint on a free port (for endpoints that refer to each other); `beside`: a
    topology file whose ports (not bound yet, so free too) it must not take (one collided with
    driver.http in a suite run on a narrow port slice)."""
    import re

    taken = {int(p) for p in re.findall(r":(\d{4,5})\b", beside.read_text())} if beside is not None else set()
    while (port := free_base_port(1)) in taken:
        pass
    return f"tcp://127.0.0.1:{port}"


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
    from skippy_zmq.api.main import build_app
    from skippy_zmq.api.server import start_in_thread

    with running_pipeline(topology_path, run_dir) as (engine, tokenizer, topology, procs):
        handle = start_in_thread(build_app(topology, engine, tokenizer))
        try:
            yield Served(engine, tokenizer, topology, procs, handle.url)
        finally:
            handle.stop()


# The configuration of the shared pipelines (conftest.shared_pipelines): 8 lanes and sessions for
# concurrency tests, speculation on as in the shipped topologies (requests opt out per call).
# No idle warm-ups (write_topology's default, as for every other test pipeline): the shapes the
# shared modules reach compile on use (with empty caches the unit alone took 300 s and 507 CPU s
# with them, 248 s and 393 without; with warm caches 242 CPU s either way).
# Heartbeats every 0.2 s (0.5 by default): after each test, conftest.shared_lanes_are_freed waits for
# the stages' next report of their lanes.
# weights auto: what a user's stage runs, the checkpoint's own (a fresh `make model` keeps the GGUF's Q4_1
# blocks, run by the CPU kernel); tests that compare with a single process use the same weights.
SHARED = dict(kv_lanes=8, weights="auto", driver__max_sessions=8, driver__speculative={"method": "ngram", "max_draft": 8},
              driver__heartbeat_s=0.2)

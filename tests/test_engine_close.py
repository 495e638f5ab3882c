"""Closing a PipelineEngine ends the requests it accepted: a reader gets EngineError("engine_closed")
at once instead of waiting for tokens no loop will send (a bench process once outlived its pytest by
an hour, two request threads parked in generate_blocking after the engine had closed)."""

from __future__ import annotations

import threading

from skippy_zmq.config.topology_yaml import load_topology
from skippy_zmq.devtools.harness import write_topology
from skippy_zmq.engine.pipeline import PipelineEngine
from skippy_zmq.engine.request import EngineError, GenRequest
from skippy_zmq.protocol import transport, wire


def test_closing_the_engine_fails_the_requests_it_accepted(tmp_path):
    # the stages are test sockets: READY from each, and nothing ever answers a step
    topology = load_topology(write_topology(tmp_path, tmp_path / "model", 2, n_layers=6, security="none",
                                            driver__dead_after_s=600.0))
    engine = PipelineEngine(topology, [0], model_name="closing").start()
    socks = [transport.open_heartbeat_socket(transport.context(), topology.driver.return_connect, s.id)
             for s in topology.stages]
    outcome: list[object] = []

    def read() -> None:
        try:
            outcome.extend(engine.generate_blocking(GenRequest("r1", (1, 2, 3), max_tokens=8)))
        except EngineError as exc:
            outcome.append(exc)

    try:
        for sock, stage in zip(socks, topology.stages):
            transport.send_message(sock, wire.Message.ready(stage.id, 7, {}))
        assert engine.wait_ready(30), engine.not_ready_reason()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        waited = 0
        while not (engine.scheduler.running or engine.scheduler.queue) and waited < 1500:   # 30 s
            threading.Event().wait(0.02)
            waited += 1
        assert engine.scheduler.running or engine.scheduler.queue   # accepted, never answered
    finally:
        engine.close()
        for sock in socks:
            sock.close(linger=0)
    reader.join(timeout=30)
    assert not reader.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], EngineError), outcome
    assert (outcome[0].code, outcome[0].status, outcome[0].message) == ("engine_closed", 503, "the engine was closed")

"""CURVE on every link of a real pipeline: traffic flows with the topology's keys, a rogue peer gets nothing."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import yaml
import zmq

from procs import running_pipeline, write_topology
from skippy_zmq.protocol import transport, wire
from skippy_zmq.engine.request import GenRequest


def test_curve_pipeline_serves_and_rejects_rogue_peers(small_model_dir, tmp_path):
    """The 4-layer random model of SmolLM2's shape: what is checked is the links, not the tokens (the
    real model's tokens through 2 and 3 plain-TCP stages are tests/test_pipeline.py's)."""
    topo = write_topology(tmp_path, small_model_dir, 2, name="curve")
    data = yaml.safe_load(topo.read_text())
    data.update(security="curve", keys_dir=str(tmp_path / "keys"))
    topo.write_text(yaml.safe_dump(data, sort_keys=False))
    subprocess.run([sys.executable, "-m", "skippy_zmq.cli", "keys", "--topology", str(topo)], check=True, timeout=60)
    assert sorted(p.name for p in (tmp_path / "keys").iterdir()) == sorted(
        f"{n}.key{s}" for n in ("driver", "s0", "s1") for s in ("", "_secret"))
    with running_pipeline(topo, tmp_path / "run") as (engine, _, topology, procs):
        prompt = tuple(range(100, 140))
        events = list(engine.generate_blocking(GenRequest("c", prompt, max_tokens=12, ignore_eos=True)))
        tokens = [e.token_id for e in events if e.token_id is not None]
        assert len(tokens) == 12 and events[-1].finish_reason == "length"
        replies = []
        engine.on_reply_hooks.append(lambda sid, m: replies.append(m) if m.kind == wire.Kind.ERROR else None)
        ctx = zmq.Context()                       # a rogue process: plain TCP, no keys
        rogue = transport.make_socket(ctx, zmq.PUSH, topology.first.connect, bind=False)
        try:
            frames = [bytes(f) for f in wire.encode(wire.Message(wire.Kind.PREFILL, 9, 9,
                                                                   tokens=np.arange(3, dtype=np.int32)))]
            frames[0] = frames[0][:4] + bytes([9]) + frames[0][5:]   # protocol version 9: an ERROR if it lands
            for _ in range(20):
                rogue.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass                                   # never connected: nothing to queue into
        finally:
            rogue.close(linger=0)
            ctx.term()
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline and not replies:
            time.sleep(0.05)
        assert replies == []                      # a message that got through would be answered with ERROR
        assert all(p.poll() is None for p in procs)
        events = list(engine.generate_blocking(GenRequest("d", prompt, max_tokens=4, ignore_eos=True)))
        assert [e.token_id for e in events if e.token_id is not None] == tokens[:4]   # greedy: the same again

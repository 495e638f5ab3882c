"""Issue 38's "the wire trusts anyone" attacks, replayed against live stage processes and driver
with the default security (CURVE, keys made on first launch): each must fail, change no token of
a request running during or after it, and stall nothing.

The attackers: a peer with no key (plain TCP), and a peer holding a legitimate key of another
party (a stolen stage key, the driver's key used by someone else). Nothing sleeps: what the
pipeline refused is awaited through the driver's hooks and the stages' heartbeats (every 0.2 s).
"""

from __future__ import annotations

import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import zmq

from procs import running_pipeline, write_topology
from skippy_zmq.protocol import keystore, transport
from skippy_zmq.engine.request import GenRequest
from skippy_zmq.protocol.security import SocketSecurity
from skippy_zmq.protocol.wire import Kind, Message

pytestmark = pytest.mark.slow

PROMPT = tuple(range(100, 140))
NEW_TOKENS = 48
WAIT_S = 30.0          # bound on what must happen (heartbeats every 0.2 s; returns as soon as it does)
REQUEST_DEADLINE_S = 120.0
SESSIONS = range(0, 32)   # a blind spray; the attacks also aim at the live request's own session (live_sessions)


@pytest.fixture(scope="module")
def live(small_model_dir, tmp_path_factory) -> Iterator:
    """2 stage processes + the driver engine, default security; and the greedy tokens of a clean run."""
    tmp = tmp_path_factory.mktemp("wire-attacks")
    topo = write_topology(tmp, small_model_dir, 2, name="attacked", driver__heartbeat_s=0.2)
    with running_pipeline(topo, tmp / "run") as (engine, _, topology, procs):
        assert topology.security == "curve" and engine.security is not None
        folder = keystore.keys_dir_of(topology)   # made by the launch, before any stage started
        assert folder.parent == keystore.keys_home() and stat.S_IMODE(folder.stat().st_mode) == 0o700
        yield engine, topology, procs, generate(engine, "clean")


def generate(engine, name: str) -> list[int]:
    events = list(engine.generate_blocking(GenRequest(name, PROMPT, max_tokens=NEW_TOKENS, ignore_eos=True,
                                                      timeout_s=REQUEST_DEADLINE_S)))
    assert events[-1].finish_reason == "length"
    return [e.token_id for e in events if e.token_id is not None]


@contextmanager
def request_during(engine) -> Iterator[tuple[list[list[int]], list[int]]]:
    """A greedy request running while the block attacks: (its tokens once the block is done, the
    sessions it decodes in, known once its first token came back: the attacker's best guess)."""
    out: list[list[int]] = []
    sessions: list[int] = []
    first_token = threading.Event()

    def hook(_sid: str, msg: Message) -> None:
        if msg.kind == Kind.PREDICTED_TOKENS and not first_token.is_set():
            sessions.extend(int(s) for s in msg.session_ids)
            first_token.set()

    engine.on_reply_hooks.append(hook)
    worker = threading.Thread(target=lambda: out.append(generate(engine, "during")), daemon=True)
    worker.start()
    try:
        assert first_token.wait(REQUEST_DEADLINE_S), "the request under attack never produced a token"
        yield out, sessions
    finally:
        engine.on_reply_hooks.remove(hook)
        worker.join(REQUEST_DEADLINE_S)
    assert not worker.is_alive(), "the request stalled while the pipeline was attacked"


class Rogue:
    """Sockets of an attacker process: a context of its own; `key` is a party's stolen identity."""

    def __init__(self, topology, key: str | None = None):
        self.ctx = zmq.Context()
        self.folder = keystore.keys_dir_of(topology)
        self.identity = keystore.load_identity(self.folder, key) if key else None
        self.sockets: list[zmq.Socket] = []   # held until close: a collected socket (linger 0) drops its queue

    def socket(self, kind: int, endpoint: str, server: str, identity: bytes | None = None) -> zmq.Socket:
        security = None
        if self.identity is not None:
            server_key = keystore.load_public_keys(self.folder, [server])[server]
            security = SocketSecurity("curve", self.identity.public, self.identity.secret, server=False,
                                      server_key=server_key)
        self.sockets.append(transport.make_socket(self.ctx, kind, endpoint, bind=False, identity=identity,
                                                  security=security, hwm=0))   # no high-water mark: all queued
        return self.sockets[-1]

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def send_all(sock: zmq.Socket, messages: list[Message]) -> None:
    for msg in messages:
        try:
            transport.send_message(sock, msg, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass   # a peer that never connected has nowhere to queue: also a failed attack


def forged_replies(stage_id: str, live: list[int]) -> list[Message]:
    """In `stage_id`'s name: a READY of a new incarnation, a goodbye, and an ERROR and a token for
    the live sessions and a spray of others."""
    out = [Message.ready(stage_id, 0xBAD, {"state": "serving"}),
           Message.heartbeat(stage_id, 0xBAD, {"state": "stopping"})]
    for sid in [*live, *SESSIONS]:
        out.append(Message.error(sid, sid, "forged", "internal_error"))
        out.append(Message.predicted_tokens(sid, [sid], [7]))
    return out


def poison_work(live: list[int]) -> list[Message]:
    """CONFIGURE_GENERATION for the live sessions and a spray of others (a logit bias that writes
    token 7 everywhere), and a PREFILL of the test's prompt that asks the stage to record it."""
    bias = {"sampling": {"temperature": 0.0, "logit_bias": {"7": 100.0}}}
    out = [Message(Kind.CONFIGURE_GENERATION, sid, sid, tokens=np.array(PROMPT, np.int32), extras=bias)
           for sid in [*live, *SESSIONS]]
    out.append(Message(Kind.PREFILL, 9, 9, tokens=np.array(PROMPT[:-1], np.int32), extras={"record": "poison"}))
    return out


def heartbeat_info(engine, stage_id: str, until) -> dict:
    """The first heartbeat info of `stage_id` for which `until(info)` holds (bounded by WAIT_S)."""
    got: dict = {}
    seen = threading.Event()

    def hook(sid: str, msg: Message) -> None:
        info = msg.extras.get("info", {})
        if sid == stage_id and msg.kind == Kind.HEARTBEAT and not seen.is_set() and until(info):
            got.update(info)
            seen.set()

    engine.on_reply_hooks.append(hook)
    try:
        assert seen.wait(WAIT_S), f"no heartbeat of {stage_id} showed it within {WAIT_S:g} s"
    finally:
        engine.on_reply_hooks.remove(hook)
    return got


def assert_unharmed(engine, clean: list[int], procs, incarnations: dict[str, int]) -> None:
    """Same tokens as a clean run, every stage its old self, still ready."""
    assert generate(engine, "after") == clean
    assert {sid: s.incarnation for sid, s in engine.stages.items()} == incarnations
    assert engine.is_ready() and all(p.poll() is None for p in procs)


def incarnations_of(engine) -> dict[str, int]:
    return {sid: s.incarnation for sid, s in engine.stages.items()}


def test_a_peer_without_a_key_reaches_nothing(live):
    engine, topology, procs, clean = live
    before, rejected0 = incarnations_of(engine), engine.wire_rejected
    replies: list[Message] = []
    engine.on_reply_hooks.append(lambda sid, m: replies.append(m) if m.kind == Kind.ERROR else None)
    rogue = Rogue(topology)
    try:
        with request_during(engine) as (during, live_sessions):
            for stage_id in ("s0", "s1"):
                send_all(rogue.socket(zmq.DEALER, topology.driver.return_connect, "driver", stage_id.encode()),
                         forged_replies(stage_id, live_sessions))
                send_all(rogue.socket(zmq.PUSH, topology.stage(stage_id).connect, stage_id), poison_work(live_sessions))
    finally:
        rogue.close()
    assert during == [clean]
    assert_unharmed(engine, clean, procs, before)
    assert replies == [] and engine.wire_rejected == rejected0   # nothing even arrived to be refused


def test_a_stolen_stage_key_cannot_speak_for_another_stage(live):
    """s1's key, claiming s0's routing identity: a forged READY, a goodbye, ERRORs and tokens for
    every session; then s1's own identity with a READY that names s0. All dropped and counted."""
    engine, topology, procs, clean = live
    before, rejected0 = incarnations_of(engine), engine.wire_rejected
    done, claims = threading.Event(), []
    expected = len(forged_replies("s0", [0])) + 1

    def on_rejected(claimed: str, why: str) -> None:
        claims.append((claimed, why))
        if len(claims) >= expected:
            done.set()

    engine.on_rejected_hooks.append(on_rejected)
    rogue = Rogue(topology, key="s1")
    try:
        with request_during(engine) as (during, live_sessions):
            send_all(rogue.socket(zmq.DEALER, topology.driver.return_connect, "driver", b"s0"),
                     forged_replies("s0", live_sessions[:1]))
            send_all(rogue.socket(zmq.DEALER, topology.driver.return_connect, "driver", b"s1#rogue"),
                     [Message.ready("s0", 0xBAD, {"state": "serving"})])
            assert done.wait(WAIT_S), f"the driver refused {len(claims)} of {expected} forged messages"
    finally:
        engine.on_rejected_hooks.remove(on_rejected)
        rogue.close()
    assert during == [clean]
    assert {c for c, _ in claims} == {"s0", "s1"} and engine.wire_rejected - rejected0 == expected
    assert any("under the key of 's1'" in why for _, why in claims)
    assert any("a READY naming stage 's0'" in why for _, why in claims)
    assert_unharmed(engine, clean, procs, before)


@pytest.mark.parametrize(("key", "target"), [("s0", "s0"), ("s1", "s1"), ("driver", "s1")])
def test_work_under_a_key_that_is_not_the_upstreams_is_refused_at_the_handshake(live, key, target):
    """A stage's own key spraying CONFIGURE_GENERATION and a recording PREFILL at its own upstream
    slot; the driver's key at stage 1 (whose upstream is s0). The stage's authenticator refuses the
    key: nothing is configured, nothing recorded."""
    engine, topology, procs, clean = live
    before = incarnations_of(engine)
    start = heartbeat_info(engine, target, lambda info: True)
    rogue = Rogue(topology, key=key)
    try:
        with request_during(engine) as (during, live_sessions):
            send_all(rogue.socket(zmq.PUSH, topology.stage(target).connect, target), poison_work(live_sessions))
            refused = heartbeat_info(engine, target, lambda info: info["zap_rejected"] > start["zap_rejected"])
    finally:
        rogue.close()
    assert during == [clean]
    assert refused["peer_rejected"] == start["peer_rejected"] == 0   # nothing got past the handshake
    assert_unharmed(engine, clean, procs, before)


def test_the_last_stages_key_at_the_first_stage_runs_only_steps_it_expects(live):
    """The ring (stage/run_on.py): stage 0 admits the last stage's key, and takes from it only a
    DECODE step it expects. Poison work under that key (configures, a recording prefill, a decode
    of a live session the driver never asked to run on) runs nothing and answers nothing."""
    engine, topology, procs, clean = live
    before = incarnations_of(engine)
    start = heartbeat_info(engine, "s0", lambda info: True)
    rogue = Rogue(topology, key="s1")
    try:
        with request_during(engine) as (during, live_sessions):
            step = engine.view.stamp(Message(Kind.DECODE, 1 << 40, live_sessions[0], position=3,
                                             tokens=np.array([7], np.int32), positions=np.array([3], np.int32),
                                             sessions=np.array(live_sessions[:1], np.uint64),
                                             extras={"run_on": 4, "ring": True}))
            work = [*poison_work(live_sessions), step]
            send_all(rogue.socket(zmq.PUSH, topology.first.connect, "s0"), work)
            dropped = heartbeat_info(engine, "s0",
                                     lambda i: i["run_on_dropped"] >= start["run_on_dropped"] + len(work))
    finally:
        rogue.close()
    assert during == [clean]
    assert (dropped["zap_rejected"], dropped["peer_rejected"]) == (start["zap_rejected"], start["peer_rejected"])
    assert dropped["cache_records"] == start["cache_records"] and dropped["errors"] == start["errors"]
    assert_unharmed(engine, clean, procs, before)


def test_the_drivers_key_without_the_chains_view_gets_no_work_done(live):
    """The driver's own key (stage 0's legitimate upstream) in other hands: it connects, but its
    work carries no chain view stamp naming stage 0's incarnation, so stage 0 drops every message:
    no sampler replaced, no prefix recorded."""
    engine, topology, procs, clean = live
    before = incarnations_of(engine)
    start = heartbeat_info(engine, "s0", lambda info: True)
    work = poison_work([1])
    stamped_elsewhere = Message(Kind.PREFILL, 9, 9, tokens=np.array(PROMPT[:-1], np.int32),
                                extras={"record": "poison", "view": {"driver": 1, "epoch": 1 << 40, "stages": {}}})
    rogue = Rogue(topology, key="driver")
    try:
        send_all(rogue.socket(zmq.PUSH, topology.first.connect, "s0"), [*work, stamped_elsewhere])
        dropped = heartbeat_info(engine, "s0", lambda i: i["unstamped"] >= start["unstamped"] + len(work) + 1)
    finally:
        rogue.close()
    assert dropped["cache_records"] == start["cache_records"] and dropped["messages"] > start["messages"]
    assert dropped["errors"] == start["errors"]   # dropped silently: no ERROR for the driver to act on
    assert_unharmed(engine, clean, procs, before)


def test_a_driver_pass_stalled_past_dead_after_marks_no_stage_down(live):
    """The driver's own stall is not the stages' silence: one pass of its loop held past dead_after_s
    (here a command that sleeps; in the field another driver thread holding the GIL, as the first
    constrained request's grammar build did beside two CPU hogs) judges liveness up to the moment it
    last read its socket, so both stages, beating all along, stay up and the next request runs."""
    engine, topology, procs, clean = live
    before, faults = incarnations_of(engine), len(engine.faults)
    stalled, passed = threading.Event(), threading.Event()
    engine.call(lambda: (time.sleep(topology.driver.dead_after_s + 1.0), stalled.set()))
    assert stalled.wait(WAIT_S)
    engine.call(passed.set)   # runs in the next pass: the stalled pass has judged liveness by then
    assert passed.wait(WAIT_S)
    assert engine.faults[faults:] == []
    assert_unharmed(engine, clean, procs, before)


def test_without_curve_the_same_forged_ready_takes_over_a_stage(small_model_dir, tmp_path):
    """The control: with `security: none` asked for, a peer with no key sends one READY in stage
    s0's name and the driver adopts it (the real s0 is fenced off): the attacks above are real."""
    topo = write_topology(tmp_path, small_model_dir, 2, name="unsecured", security="none")
    with running_pipeline(topo, tmp_path / "run") as (engine, _, topology, _procs):
        real = engine.stages["s0"].incarnation
        adopted = threading.Event()
        engine.on_reply_hooks.append(lambda sid, m: adopted.set() if m.kind == Kind.READY and sid == "s0"
                                     and m.extras.get("incarnation") == 0xBAD else None)
        rogue = Rogue(topology)
        try:
            send_all(rogue.socket(zmq.DEALER, topology.driver.return_connect, "driver", b"s0"),
                     [Message.ready("s0", 0xBAD, {"state": "serving"})])
            assert adopted.wait(WAIT_S)
        finally:
            rogue.close()
        assert engine.stages["s0"].incarnation == 0xBAD != real and engine.view.stages["s0"] == 0xBAD

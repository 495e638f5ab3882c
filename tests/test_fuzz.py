"""Property-based fuzzing: the wire decoder, the stage worker, live stage processes, the HTTP layer.

Nothing a peer sends may crash a stage or the driver: bad frames become ERROR
replies, bad HTTP bodies become 4xx. Crashes found by this file and not yet
fixed were pinned here (KNOWN_STAGE_CRASHES, KNOWN_HTTP_500S) and now have
tests of their own that expect an ERROR reply or a 400.

Run with `-s` to see the counts the live tests print.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Callable

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TINY, first_mismatch
from procs import ring_socket, stage_dealer, upstream_socket
from pipeline_helpers import make_worker
from skippy_zmq.protocol import transport, wire
from skippy_zmq.engine.request import EngineError, GenRequest
from skippy_zmq.devtools.harness import wait_warmed
from skippy_zmq.stage.sessions import SessionTable
from skippy_zmq.protocol.wire import HEADER, MAGIC, Kind, Message, WireDType

LIMITS = wire.WireLimits()
ANY_HEALTH = list(HealthCheck)
FUZZ_ID = 1 << 40          # fuzz request/session ids sit far above the driver's counters
SENTINEL_ID = 1 << 50      # request id of the "are you done yet?" probes

# Header byte offsets and struct formats ("<4sBBHB3xQQiIII").
FIELDS = {"version": (4, "<B"), "kind": (5, "<B"), "flags": (6, "<H"), "dtype": (8, "<B"),
          "request_id": (12, "<Q"), "session_id": (20, "<Q"), "position": (28, "<i"),
          "n_tokens": (32, "<I"), "n_rows": (36, "<I"), "width": (40, "<I")}
EXTREMES = {"<B": [0, 1, 2, 7, 8, 31, 37, 99, 255], "<H": [0, 1, 0xFFFF],
            "<Q": [0, 1, 2**63, 2**64 - 1], "<i": [-(2**31), -1, 0, 1, 2047, 2048, 2**31 - 1],
            "<I": [0, 1, 2, 255, 256, 257, 8192, 8193, 65536, 65537, 2**31, 2**32 - 1]}


# ---------------------------------------------------------------- strategies

json_leaves = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
               | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(json_leaves, lambda c: st.lists(c, max_size=4)
                           | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=10)


@st.composite
def messages(draw, kinds=st.sampled_from(list(Kind)), widths=st.integers(1, 8), ids=st.integers(0, 2**64 - 1),
             positions=st.integers(-(2**31), 2**31 - 1), token_ids=st.integers(-(2**31), 2**31 - 1),
             extras=st.dictionaries(st.text(max_size=8), json_values, max_size=3), max_tokens: int = 6):
    """A valid message (any kind, dtype, rows) and the wire dtype to encode it with."""
    kind = draw(kinds)
    rows = draw(st.integers(1, 4))
    n = rows if kind == Kind.DECODE and rows > 1 else draw(st.integers(0, max_tokens))
    dtype = draw(st.sampled_from(list(WireDType)))
    activation = None
    if dtype != WireDType.NONE:
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        activation = rng.standard_normal((wire.activation_rows(kind, n), draw(widths))).astype(np.float32)
    msg = Message(kind, draw(ids), draw(ids), position=draw(positions),
                  tokens=np.array([draw(token_ids) for _ in range(n)], np.int32),
                  positions=np.array([draw(positions) for _ in range(n)], np.int32) if draw(st.booleans()) else None,
                  sessions=np.array([draw(ids) for _ in range(rows)], np.uint64) if rows > 1 else None,
                  activation=activation, extras=draw(extras), flags=draw(st.integers(0, 0xFFFF)))
    return msg, dtype if dtype != WireDType.NONE else None


def _set_field(frames: list[bytes], name: str, value: int) -> list[bytes]:
    offset, fmt = FIELDS[name]
    header = bytearray(frames[0])
    if len(header) >= offset + struct_size(fmt):
        header[offset:offset + struct_size(fmt)] = value.to_bytes(struct_size(fmt), "little", signed=fmt == "<i")
    return [bytes(header), *frames[1:]]


def struct_size(fmt: str) -> int:
    return {"<B": 1, "<H": 2, "<Q": 8, "<i": 4, "<I": 4}[fmt]


EXTRAS_JUNK = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),           # valid JSON, often not an object
    st.binary(max_size=64),                                       # often not UTF-8
    st.sampled_from([b"[" * 5000, b'{"a":' * 3000, b"9" * 5000, b"NaN", b"\xff\xfe{}", b'{"a": 1,}',
                     b"{}" + b" " * 70000, json.dumps({"x": "y" * 70000}).encode()]))


@st.composite
def mutate(draw, frames: list[bytes], min_frames: int = 0) -> list[bytes]:
    """One to three damaging edits of an encoded message."""
    frames = list(frames)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "field", "truncate", "extend", "drop", "duplicate", "swap",
                                   "insert", "extras", "magic"]))
        i = draw(st.integers(0, max(0, len(frames) - 1)))
        if op == "flip" and frames and frames[i]:
            j = draw(st.integers(0, len(frames[i]) - 1))
            b = bytearray(frames[i])
            b[j] ^= draw(st.integers(1, 255))
            frames[i] = bytes(b)
        elif op == "field" and frames:
            name = draw(st.sampled_from(sorted(FIELDS)))
            frames = _set_field(frames, name, draw(st.sampled_from(EXTREMES[FIELDS[name][1]])))
        elif op == "truncate" and frames:
            frames[i] = frames[i][: draw(st.integers(0, max(0, len(frames[i]) - 1)))]
        elif op == "extend" and frames:
            frames[i] = frames[i] + draw(st.binary(min_size=1, max_size=64))
        elif op == "drop" and len(frames) > min_frames:
            del frames[i]
        elif op == "duplicate" and frames:
            frames.insert(i, frames[i])
        elif op == "swap" and len(frames) > 1:
            j = draw(st.integers(0, len(frames) - 1))
            frames[i], frames[j] = frames[j], frames[i]
        elif op == "insert":
            frames.insert(i, draw(st.binary(max_size=48)))
        elif op == "extras" and len(frames) == wire.N_FRAMES:
            frames[5] = draw(EXTRAS_JUNK)
        elif op == "magic" and frames and len(frames[0]) >= 4:
            frames[0] = draw(st.binary(min_size=4, max_size=4)) + frames[0][4:]
    return frames if len(frames) >= min_frames else frames + [b""] * (min_frames - len(frames))


@st.composite
def mutated_messages(draw, base=messages(), min_frames: int = 0) -> list[bytes]:
    msg, dtype = draw(base)
    return draw(mutate([bytes(f) for f in wire.encode(msg, dtype)], min_frames))


@st.composite
def header_shaped(draw) -> list[bytes]:
    """Right magic and version, every other header field and frame random."""
    header = HEADER.pack(MAGIC, wire.VERSION, draw(st.integers(0, 255)), draw(st.integers(0, 0xFFFF)),
                         draw(st.integers(0, 255)), draw(st.integers(0, 2**64 - 1)), draw(st.integers(0, 2**64 - 1)),
                         draw(st.integers(-(2**31), 2**31 - 1)), *(draw(st.sampled_from(EXTREMES["<I"]))
                                                                  for _ in range(3)))
    return [header, *draw(st.lists(st.binary(max_size=64), min_size=5, max_size=5))]


random_frames = st.lists(st.binary(max_size=96), min_size=0, max_size=9)


# ---------------------------------------------------------------- a) the decoder


def check_decode(frames: list[bytes]) -> Message | None:
    """decode raises WireError and nothing else, leaves its input alone, and whatever it
    accepts re-encodes (as f32) to a message that decodes to the same thing."""
    before = [bytes(f) for f in frames]
    try:
        msg = wire.decode(frames, LIMITS)
    except wire.WireError as exc:
        assert exc.code and exc.reason
        assert exc.as_reply().extras == {"error": exc.reason, "code": exc.code}
        return None
    finally:
        assert [bytes(f) for f in frames] == before
    again = wire.decode(wire.encode(msg, WireDType.F32 if msg.activation is not None else None), LIMITS)
    assert (again.kind, again.request_id, again.session_id, again.position, again.flags) == \
        (msg.kind, msg.request_id, msg.session_id, msg.position, msg.flags)
    assert again.tokens.tobytes() == msg.tokens.tobytes()
    assert again.session_ids.tobytes() == msg.session_ids.tobytes()
    assert (again.positions is None) == (msg.positions is None)
    if msg.activation is not None:
        assert again.activation.tobytes() == np.ascontiguousarray(msg.activation, np.float32).tobytes()
    assert json.dumps(again.extras) == json.dumps(msg.extras)
    return msg


@settings(max_examples=1200, deadline=None, suppress_health_check=ANY_HEALTH)
@given(frames=random_frames | header_shaped())
def test_decode_of_random_frames_only_raises_wire_error(frames):
    check_decode(frames)


@settings(max_examples=2500, deadline=None, suppress_health_check=ANY_HEALTH)
@given(frames=mutated_messages())
def test_decode_of_mutated_messages_only_raises_wire_error(frames):
    check_decode(frames)


@pytest.mark.parametrize("name, value", [(n, v) for n, (_, fmt) in FIELDS.items() for v in EXTREMES[fmt]])
def test_decode_of_extreme_header_fields(name, value):
    msg = Message(Kind.PREFILL, 1, 2, tokens=np.arange(3, dtype=np.int32),
                  activation=np.ones((3, 4), np.float32), extras={"k": 1})
    check_decode(_set_field([bytes(f) for f in wire.encode(msg)], name, value))


def test_decode_still_works_after_fuzzing():
    msg = Message(Kind.DECODE, 5, 6, tokens=np.array([1, 2], np.int32), positions=np.array([7, 8], np.int32),
                  sessions=np.array([6, 9], np.uint64), activation=np.eye(2, 3, dtype=np.float32), extras={"a": [1]})
    out = check_decode([bytes(f) for f in wire.encode(msg, WireDType.BF16)])
    assert out.session_ids.tolist() == [6, 9] and out.activation.shape == (2, 3) and out.extras == {"a": [1]}


# ---------------------------------------------------------------- the worker (in process, tiny model)
#
# Each entry: well-formed messages (sent to the 2-layer s0 / 2-layer s1 of a 4-layer
# tiny model, capacity 256) that make StageWorker.handle raise something other than
# StageFault. StageLoop.handle_frames has no catch-all, so each one kills a live stage.

def _cfg(sid: int, tokens=(), **sampling) -> Message:
    return Message(Kind.CONFIGURE_GENERATION, 1, sid, tokens=np.array(tokens, np.int32), extras={"sampling": sampling})


def _dec(sid: int, token: int = 5, activation=None) -> Message:
    return Message(Kind.DECODE, 2, sid, tokens=np.array([token], np.int32), activation=activation)


KNOWN_STAGE_CRASHES: dict[str, tuple[str, list[Message]]] = {
    "trace_not_a_list": ("s0", [Message(Kind.PREFILL, 1, 11, tokens=np.array([5, 6], np.int32),
                                        extras={"trace": 5})]),
    "logit_bias_outside_vocab": ("s1", [_cfg(12, logit_bias={"99999": 1.0}),
                                        _dec(12, activation=np.zeros((1, 64), np.float32))]),
    "repetition_penalty_with_token_outside_vocab": ("s1", [_cfg(13, [10**6], repetition_penalty=1.5),
                                                           _dec(13, activation=np.zeros((1, 64), np.float32))]),
    "prefill_past_kv_capacity": ("s0", [Message(Kind.PREFILL, 1, 14, tokens=np.full(300, 5, np.int32))]),
    "decode_rows_beyond_largest_bucket": ("s0", [Message(Kind.DECODE, 2, 15, tokens=np.full(9, 5, np.int32),
                                                         positions=np.zeros(9, np.int32),
                                                         sessions=np.full(9, 15, np.uint64))]),
    "nan_activation_with_temperature": ("s1", [_cfg(16, temperature=1.0),
                                               _dec(16, activation=np.full((1, 64), np.nan, np.float32))]),
}


@pytest.fixture(scope="module")
def tiny_workers(tiny_tree):
    return {"s0": make_worker(TINY, tiny_tree, 0, 2, stage_id="s0"),
            "s1": make_worker(TINY, tiny_tree, 2, 4, stage_id="s1")}


def feed(workers: dict, target: str, msg: Message) -> list:
    """Handle msg at `target` and carry NEXT outputs down the chain; returns every outbound."""
    outs, queue = [], [(target, msg)]
    while queue:
        stage, m = queue.pop(0)
        for o in workers[stage].handle(m):
            wire.encode(o.message)                  # every reply must be sendable
            assert o.to == "driver" or stage == "s0"
            outs.append(o)
            if o.to == "next":
                queue.append(("s1", o.message))
        workers[stage].run_deferred()
    return outs


@pytest.mark.parametrize("name", sorted(KNOWN_STAGE_CRASHES))
def test_worker_answers_former_crash_triggers(name, tiny_workers):
    """Each of these once killed the stage; now each is answered with an ERROR reply."""
    target, msgs = KNOWN_STAGE_CRASHES[name]
    for w in tiny_workers.values():
        w.sessions = SessionTable(w.sessions.lanes)
    outs = [o for msg in msgs for o in feed(tiny_workers, target, msg)]
    errors = [o.message for o in outs if o.message.kind == Kind.ERROR]
    assert all(e.extras["error"] and e.extras["code"] for e in errors)
    assert errors or name == "trace_not_a_list"        # a bad trace is dropped and the message served


# Hostile but clear of KNOWN_STAGE_CRASHES: trace is always a list, sampling stays greedy or
# is wrong by type, tokens per message <= 6 at positions far below the capacity, <= 4 rows.
SAFE_EXTRAS = st.sampled_from([{}, {"trace": []}, {"trace": [{"stage": "x"}]}, {"namespace": "fuzz"},
                               {"sampling": {}}, {"sampling": {"temperature": 0}}, {"sampling": "hot"},
                               {"sampling": {"temperature": "hot"}}, {"sampling": {"bogus": 1}},
                               {"sampling": None}, {"sampling": [1, 2]}, {"record": "fuzz"}, {"x": [1, {"y": None}]}])
SESSION_POOL = st.sampled_from([FUZZ_ID + i for i in range(4)])


def hostile(width: int, vocab: int) -> st.SearchStrategy:
    work = st.sampled_from([Kind.PREFILL, Kind.DECODE, Kind.CONFIGURE_GENERATION, Kind.TRY_RESTORE_PREFILL_DECODE])
    return messages(kinds=st.sampled_from(list(Kind)) | work, widths=st.sampled_from([width, width, 1, width + 1]),
                    ids=SESSION_POOL | st.integers(FUZZ_ID, FUZZ_ID + 2**20),
                    positions=st.sampled_from([0, 0, 0, 1, 2, 3, 5, -1, 2**31 - 1, -(2**31)]),
                    token_ids=st.integers(0, vocab - 1) | st.sampled_from([-1, vocab, 2**31 - 1]),
                    extras=SAFE_EXTRAS)


@settings(max_examples=300, deadline=None, suppress_health_check=ANY_HEALTH)
@given(steps=st.lists(st.tuples(st.sampled_from(["s0", "s1"]), hostile(TINY.d_model, TINY.vocab_size)),
                      min_size=1, max_size=5))
def test_worker_answers_hostile_messages_without_raising(tiny_workers, steps):
    for w in tiny_workers.values():
        w.sessions = SessionTable(w.sessions.lanes)
    for target, (msg, dtype) in steps:
        frames = wire.encode(msg, dtype)
        try:
            decoded = wire.decode(frames)
        except wire.WireError as exc:   # refused at the door (the stage answers exc.as_reply())
            assert exc.as_reply().kind == Kind.ERROR
            continue
        feed(tiny_workers, target, decoded)   # as the stage would see it


# ---------------------------------------------------------------- b) live stage processes


@pytest.fixture(scope="module")
def live(shared_pipelines):
    return shared_pipelines(2)


def vm_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(l for l in f if l.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def greedy(engine, ids, n=16, timeout=60.0) -> list[int]:
    """Greedy tokens through the engine, failing (not hanging) after `timeout` seconds."""
    result: list = []
    failure: list[BaseException] = []

    def run() -> None:
        req = GenRequest("fuzz", tuple(ids), max_tokens=n, ignore_eos=True, timeout_s=timeout)
        try:
            result.extend(e.token_id for e in engine.generate_blocking(req) if e.token_id is not None)
        except BaseException as exc:  # handed to the test thread below
            failure.append(exc)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout + 5)
    assert not t.is_alive(), f"generation hung for {timeout} s"
    if failure:
        raise failure[0]
    return result


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)     # polling replies recorded by the driver thread, bounded
    return True


def sentinel(rid: int) -> list[bytes]:
    """A message every stage rejects (bad version) with an ERROR carrying `rid`."""
    return [HEADER.pack(MAGIC, 99, Kind.STOP, 0, 0, rid, 0, 0, 0, 1, 0), b"\0" * 8, b"", b"", b"", b""]


def stamped_frames(engine, msg: Message, frames: list) -> list:
    """`msg` re-encoded with the driver's current chain view stamp (what a stage with CURVE on
    requires before it acts), or the frames as they were when the message cannot be re-encoded."""
    try:
        return [bytes(f) for f in wire.encode(engine.view.stamp(msg))]
    except (wire.WireError, TypeError, ValueError, OverflowError):
        return frames


def live_frames(width: int, vocab: int) -> st.SearchStrategy:
    return (mutated_messages(hostile(width, vocab), min_frames=1) | header_shaped()
            | random_frames.filter(bool) | hostile(width, vocab).map(lambda m: [bytes(f) for f in wire.encode(*m)]))


def test_live_stages_survive_a_malformed_barrage(live, parity):
    engine, topology, procs = live.engine, live.topology, live.procs
    case = parity["prompts"][0]
    before = greedy(engine, case["prompt_ids"])
    assert first_mismatch(before, case["transformers_fp32_ids"]) == 16
    # The stages compile their decode shapes while idle after READY (~10 s): measured before those
    # compiles end, the RSS check below would count them (200 MB) as what the barrage left behind.
    wait_warmed(engine, 120)
    rss_before = [vm_rss_mb(p.pid) for p in procs]
    limits = wire.WireLimits(max_message_bytes=topology.wire.max_message_bytes)
    errors: list[tuple[str, int, dict]] = []
    replies: collections.Counter = collections.Counter()

    def hook(stage_id: str, m: Message) -> None:
        replies[m.kind.name] += 1
        if m.kind == Kind.ERROR:
            errors.append((stage_id, m.request_id, m.extras))
    engine.on_reply_hooks.append(hook)
    # Each stage's legitimate upstream key, the last stage's key into the first stage (the ring:
    # it takes only steps it expects from there), and a stage's key to the driver (CURVE admits no
    # other) under an identity that names no stage: the driver ignores all of it, as it did unkeyed.
    socks = {s.id: upstream_socket(topology, s.id) for s in topology.stages}
    socks["ring"] = ring_socket(topology)
    socks["driver"] = stage_dealer(topology, topology.last.id, b"fuzz")
    answers = {**{s.id: s.id for s in topology.stages}, "ring": topology.first.id}   # who replies to what
    sent, expected, sessions, decodable = collections.Counter(), collections.Counter(), set(), [0]
    stage_ids = [s.id for s in topology.stages]
    t0 = time.monotonic()

    @settings(max_examples=600, deadline=None, database=None, suppress_health_check=ANY_HEALTH)
    @given(target=st.sampled_from([*stage_ids, *stage_ids, "ring", "driver"]), frames=live_frames(576, 49152))
    def barrage(target, frames):
        try:
            decoded = wire.decode(frames, limits)
            if target != "driver":   # a secured stage acts only on work carrying the driver's chain view
                frames = stamped_frames(engine, decoded, frames)
            # a lane may be taken for the header's session as well as each row's (CONFIGURE and the
            # restore kinds act on the header's session whatever rows the message lists)
            sessions.update([*decoded.session_ids.tolist(), decoded.session_id])
            decodable[0] += 1
        except wire.WireError as exc:
            expected[(answers.get(target, target), exc.code)] += 1
        socks[target].send_multipart(frames)
        sent[target] += 1

    try:
        barrage()
        # Stage 0 forwards to stage 1, so ask the ring's connection to stage 0 first, then stage 0,
        # then stage 1, whether they are done.
        socks["ring"].send_multipart(sentinel(SENTINEL_ID - 1))
        assert wait_for(lambda: any(rid == SENTINEL_ID - 1 for _, rid, _ in errors), 60), "the ring's did not"
        for i, stage in enumerate(topology.stages):
            socks[stage.id].send_multipart(sentinel(SENTINEL_ID + i))
            assert wait_for(lambda: any(rid == SENTINEL_ID + i for _, rid, _ in errors), 60), \
                f"{stage.id} did not answer within 60 s"
        received = collections.Counter((sid, e.get("code")) for sid, _, e in errors)
        missing = {k: v - received[k] for k, v in expected.items() if k[0] != "driver" and received[k] < v}
        # Free every lane the decodable fuzz messages took (STOP is forwarded down the chain).
        ids = sorted(sessions)
        for chunk in (ids[i:i + 256] for i in range(0, len(ids), 256)):
            transport.send_message(socks[topology.first.id], engine.view.stamp(
                Message(Kind.STOP, FUZZ_ID, chunk[0], sessions=np.array(chunk, np.uint64))))
        # The STOPs reach stage 0 on this socket's own connection, which its PULL fair-queues with the
        # driver's: wait until it has handled them (a probe behind them on the same connection answers),
        # or the next request may overtake them and find every lane of stage 1 still taken.
        stopped_id = SENTINEL_ID + len(topology.stages)
        socks[topology.first.id].send_multipart(sentinel(stopped_id))
        assert wait_for(lambda: any(rid == stopped_id for _, rid, _ in errors), 60), "the STOPs were not handled"
        fuzz_s = time.monotonic() - t0
    finally:
        engine.on_reply_hooks.remove(hook)
        for s in socks.values():
            s.close(linger=0)

    assert [p.poll() for p in procs] == [None] * len(procs), "a stage process died"
    assert engine.is_ready()
    t1 = time.monotonic()
    after = greedy(engine, case["prompt_ids"])
    gen_s = time.monotonic() - t1
    rss_after = [vm_rss_mb(p.pid) for p in procs]
    n_sent, n_expected = sum(sent.values()), sum(v for k, v in expected.items() if k[0] != "driver")
    print(f"\nlive fuzz: sent {n_sent} messages {dict(sent)} ({decodable[0]} well-formed) in {fuzz_s:.1f} s; "
          f"wire rejections expected {n_expected}; replies {dict(replies)}; ERROR codes "
          f"{dict(collections.Counter(c for _, c in received.elements()))}; "
          f"RSS MB before {[round(r) for r in rss_before]} after {[round(r) for r in rss_after]}; "
          f"post-barrage generation {gen_s:.2f} s")
    assert after == before
    assert not missing, f"wire rejections without an ERROR reply: {missing}"
    stage_sent = n_sent - sent["driver"]
    assert n_expected >= stage_sent // 2      # most of the barrage is malformed on the wire
    for stage_id, a, b in zip([s.id for s in reversed(topology.stages)], rss_before, rss_after):
        assert b - a < 200, f"{stage_id} RSS grew from {a:.0f} MB to {b:.0f} MB"
    assert all("error" in e and "code" in e for _, _, e in errors)


def _live_probe(engine, topology, name: str, n: int = 0) -> list[list[bytes]]:
    """KNOWN_STAGE_CRASHES adapted to the real model on a two-stage pipeline (sent to the first),
    stamped with the driver's chain view as a secured stage requires."""
    sid = FUZZ_ID + 100 + n
    capacity = topology.driver.max_context
    msgs = {
        "trace_not_a_list": [Message(Kind.PREFILL, sid, sid, tokens=np.array([5, 6], np.int32), extras={"trace": 5})],
        "logit_bias_outside_vocab": [_cfg(sid, logit_bias={"999999": 1.0}), _dec(sid)],
        "repetition_penalty_with_token_outside_vocab": [_cfg(sid, [10**6], repetition_penalty=1.5), _dec(sid)],
        "prefill_past_kv_capacity": [Message(Kind.PREFILL, sid, sid, tokens=np.full(capacity + 1, 5, np.int32))],
        "decode_rows_beyond_largest_bucket": [Message(Kind.DECODE, sid, sid, tokens=np.full(9, 5, np.int32),
                                                      positions=np.zeros(9, np.int32),
                                                      sessions=np.full(9, sid, np.uint64))],
    }[name]
    return [[bytes(f) for f in wire.encode(engine.view.stamp(m))] for m in msgs]


LIVE_PROBES = ["trace_not_a_list", "logit_bias_outside_vocab", "repetition_penalty_with_token_outside_vocab",
               "prefill_past_kv_capacity", "decode_rows_beyond_largest_bucket"]


def test_live_stage_survives_well_formed_hostile_messages(shared_pipelines):
    live = shared_pipelines(2)
    engine, topology, procs = live.engine, live.topology, live.procs
    replies: list[int] = []

    def hook(_: str, m: Message) -> None:
        replies.append(m.request_id)
    engine.on_reply_hooks.append(hook)
    push = upstream_socket(topology, topology.first.id)   # the driver's key (CURVE): stage 0 admits no other
    died = []
    try:
        for n, name in enumerate(LIVE_PROBES):
            for frames in _live_probe(engine, topology, name, n):
                push.send_multipart(frames)
            push.send_multipart(sentinel(SENTINEL_ID + n))
            if not wait_for(lambda: SENTINEL_ID + n in replies or dead(procs), 60) or dead(procs):
                died.append(name)
                break
        probes = np.arange(FUZZ_ID + 100, FUZZ_ID + 100 + len(LIVE_PROBES), dtype=np.uint64)
        transport.send_message(push, engine.view.stamp(Message(Kind.STOP, FUZZ_ID, int(probes[0]),
                                                               sessions=probes)))   # free lanes
    finally:
        push.close(linger=2000)   # the STOP above still goes out
        engine.on_reply_hooks.remove(hook)
    print(f"\nwell-formed hostile probes: a stage died on {died or 'none'}")
    assert not died, f"a stage process died on {died[0]} (exit codes {[p.poll() for p in procs]})"
    # the last stage took the probes that reach it (sampling ones) before this request: it still answers
    events = list(engine.generate_blocking(GenRequest("after", (5, 6, 7), max_tokens=2, ignore_eos=True)))
    assert len([e for e in events if e.token_id is not None]) == 2 and not dead(procs)


def test_the_driver_loop_survives_its_own_bugs(shared_pipelines):
    """A reply or a command the driver mishandles (here: a hook that raises, a command that raises)
    fails that reply's request alone, with a 500 that says so; the loop goes on beating and serving."""
    live = shared_pipelines(2)
    engine = live.engine
    before = engine.internal_errors
    request = GenRequest("victim", (5, 6, 7), max_tokens=4, ignore_eos=True, speculative=False)
    bad = []

    def hook(_: str, m: Message) -> None:
        if m.kind == Kind.PREDICTED_TOKENS and not bad:
            bad.append(m.request_id)
            raise RuntimeError("an injected driver bug")
    engine.on_reply_hooks.append(hook)
    try:
        with pytest.raises(EngineError) as failed:
            list(engine.generate_blocking(request))
    finally:
        engine.on_reply_hooks.remove(hook)
    assert (failed.value.status, failed.value.code) == (500, "driver_error")
    assert "PREDICTED_TOKENS reply from s1" in str(failed.value)
    engine.call(lambda: 1 / 0)
    assert wait_for(lambda: engine.internal_errors == before + 2, 30)
    assert engine.is_ready()
    events = list(engine.generate_blocking(GenRequest("after", (5, 6, 7), max_tokens=4, ignore_eos=True)))
    assert len([e for e in events if e.token_id is not None]) == 4
    metrics = httpx.get(live.url + "/metrics", timeout=30).text
    assert f"skippy_driver_internal_errors_total {float(before + 2)}" in metrics


def dead(procs) -> bool:
    return any(p.poll() is not None for p in procs)


# ---------------------------------------------------------------- c) malformed HTTP


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, timeout=60) as client:   # the shared pipeline's own server
        yield client, live.topology


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
JSON = {"content-type": "application/json"}
HELLO = [{"role": "user", "content": "hi"}]


def _chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": HELLO, "max_tokens": 2, **fields}).encode()


def _completion(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2, **fields}).encode()


# (name, path, body, headers, status); every one must be answered, with exactly that 4xx.
HTTP_CASES = [
    ("malformed_json", CHAT, b'{"messages": [', JSON, 400),
    ("trailing_comma", CHAT, b'{"messages": [],}', JSON, 400),
    ("not_utf8", CHAT, b'{"messages": "\xff\xfe"}', JSON, 400),
    ("empty_body", CHAT, b"", JSON, 400),
    ("json_null", COMPLETIONS, b"null", JSON, 400),
    ("json_array", COMPLETIONS, b"[1, 2]", JSON, 400),
    ("json_string", COMPLETIONS, b'"prompt"', JSON, 400),
    ("huge_integer_literal", COMPLETIONS, b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", JSON, 400),
    ("text_plain", CHAT, _chat(), {"content-type": "text/plain"}, 415),
    ("form", COMPLETIONS, b"prompt=hi", {"content-type": "application/x-www-form-urlencoded"}, 415),
    ("multipart", COMPLETIONS, b"--x\r\n\r\n--x--", {"content-type": "multipart/form-data; boundary=x"}, 415),
    ("xml", CHAT, b"<messages/>", {"content-type": "application/xml"}, 415),
    ("max_tokens_negative", CHAT, _chat(max_tokens=-1), JSON, 400),
    ("max_tokens_zero", COMPLETIONS, _completion(max_tokens=0), JSON, 400),
    ("max_tokens_string", CHAT, _chat(max_tokens="lots"), JSON, 400),
    ("max_tokens_bool", CHAT, _chat(max_tokens=True), JSON, 400),
    ("max_tokens_float", COMPLETIONS, _completion(max_tokens=1e9), JSON, 400),
    ("temperature_negative", CHAT, _chat(temperature=-1), JSON, 400),
    ("temperature_huge", CHAT, _chat(temperature=1e308), JSON, 400),
    ("temperature_nan", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', JSON, 400),
    ("temperature_infinity", COMPLETIONS, b'{"prompt": "hi", "temperature": Infinity}', JSON, 400),
    ("top_p_zero", CHAT, _chat(top_p=0), JSON, 400),
    ("top_p_two", CHAT, _chat(top_p=2), JSON, 400),
    ("top_k_float", CHAT, _chat(top_k=1.5), JSON, 400),
    ("min_p_two", CHAT, _chat(min_p=2), JSON, 400),
    ("presence_penalty_huge", CHAT, _chat(presence_penalty=50), JSON, 400),
    ("repetition_penalty_zero", CHAT, _chat(repetition_penalty=0), JSON, 400),
    ("seed_negative", CHAT, _chat(seed=-1), JSON, 400),
    ("seed_string", CHAT, _chat(seed="x"), JSON, 400),
    ("n_zero", CHAT, _chat(n=0), JSON, 400),
    ("n_above_the_lanes", CHAT, _chat(n=999), JSON, 400),
    ("prompts_not_all_prompts", COMPLETIONS, _completion(prompt=["a", 5]), JSON, 400),
    ("top_logprobs_too_many", CHAT, _chat(logprobs=True, top_logprobs=21), JSON, 400),
    ("top_logprobs_without_logprobs", CHAT, _chat(top_logprobs=2), JSON, 400),
    ("completion_logprobs_bool", COMPLETIONS, _completion(logprobs=True), JSON, 400),
    ("tools_not_a_list", CHAT, _chat(tools={"type": "function"}), JSON, 400),
    ("tools_bad_parameters", CHAT, _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": 5}}]),
     JSON, 400),
    ("tool_choice_unknown_function", CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                 tool_choice={"type": "function", "function": {"name": "g"}}),
     JSON, 400),
    ("tool_message_without_call", CHAT, _chat(messages=[{"role": "tool", "tool_call_id": "x", "content": "1"}]),
     JSON, 400),
    ("tools_on_completions", COMPLETIONS, _completion(tools=[{"type": "function", "function": {"name": "f"}}]),
     JSON, 400),
    ("functions", CHAT, _chat(functions=[{"name": "f"}]), JSON, 400),
    ("response_format_unknown", CHAT, _chat(response_format={"type": "xml"}), JSON, 400),
    ("response_format_string", CHAT, _chat(response_format="json"), JSON, 400),
    ("response_format_bad_schema", CHAT, _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}), JSON, 400),
    ("grammar_bad", COMPLETIONS, _completion(grammar="root ::= ("), JSON, 400),
    ("grammar_and_json", CHAT, _chat(grammar='root ::= "a"', response_format={"type": "json_object"}), JSON, 400),
    ("stream_string", CHAT, _chat(stream="yes"), JSON, 400),
    ("stream_options_without_stream", CHAT, _chat(stream_options={"include_usage": True}), JSON, 400),
    ("stop_too_many", CHAT, _chat(stop=[str(i) for i in range(50)]), JSON, 400),
    ("stop_nested", CHAT, _chat(stop=[["x"]]), JSON, 400),
    ("logit_bias_key_text", CHAT, _chat(logit_bias={"abc": 1}), JSON, 400),
    ("logit_bias_value_text", CHAT, _chat(logit_bias={"1": "x"}), JSON, 400),
    ("logit_bias_outside_vocab", CHAT, _chat(logit_bias={"999999": 1}), JSON, 400),
    ("logit_bias_negative_id", CHAT, _chat(logit_bias={"-5": 1}), JSON, 400),
    ("messages_missing", CHAT, _completion(), JSON, 400),
    ("messages_empty", CHAT, _chat(messages=[]), JSON, 400),
    ("messages_string", CHAT, _chat(messages="hi"), JSON, 400),
    ("role_unknown", CHAT, _chat(messages=[{"role": "robot", "content": "hi"}]), JSON, 400),
    ("content_number", CHAT, _chat(messages=[{"role": "user", "content": 5}]), JSON, 400),
    ("content_bad_parts", CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image"}]}]), JSON, 400),
    ("prompt_missing", COMPLETIONS, _chat(), JSON, 400),
    ("prompt_empty", COMPLETIONS, _completion(prompt=""), JSON, 400),
    ("prompt_empty_list", COMPLETIONS, _completion(prompt=[]), JSON, 400),
    ("prompt_id_outside_vocab", COMPLETIONS, _completion(prompt=[10**9]), JSON, 400),
    ("prompt_id_negative", COMPLETIONS, _completion(prompt=[-1]), JSON, 400),
    ("prompt_id_float", COMPLETIONS, _completion(prompt=[1.5]), JSON, 400),
    ("prompt_batch_of_empty", COMPLETIONS, _completion(prompt=["a", []]), JSON, 400),
    ("prompt_past_context", COMPLETIONS, _completion(prompt=[5] * 5000), JSON, 400),
    ("model_number", CHAT, _chat(model=5), JSON, 400),
    ("embeddings_without_input", "/v1/embeddings", _chat(), JSON, 400),
    ("unknown_path", "/v1/audio/speech", _chat(), JSON, 404),
]


def test_http_malformed_requests_get_4xx_and_the_server_stays_up(http):
    client, topology = http
    limit = topology.driver.max_body_bytes
    got = {}
    for name, path, body, headers, _ in HTTP_CASES:
        got[name] = client.post(path, content=body, headers=headers).status_code
    got["oversized_declared"] = client.post(CHAT, content=b"{" + b" " * limit + b"}", headers=JSON).status_code
    chunks = (b" " * 65536 for _ in range(limit // 65536 + 2))     # no Content-Length: chunked transfer
    got["oversized_chunked"] = client.post(CHAT, content=chunks, headers=JSON).status_code
    got["get_on_post"] = client.get(CHAT).status_code
    want = {name: status for name, *_, status in HTTP_CASES} | {
        "oversized_declared": 413, "oversized_chunked": 413, "get_on_post": 405}
    print(f"\nHTTP: {len(got)} malformed requests, statuses {dict(collections.Counter(got.values()))}")
    assert got == want
    assert client.get("/health").status_code == 200 and client.get("/readyz").status_code == 200
    ok = client.post(COMPLETIONS, content=_completion(max_tokens=3, temperature=0), headers=JSON)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


KNOWN_HTTP_500S = {
    "deeply_nested_json": (CHAT, b"[" * 100_000),                 # RecursionError is not a ValueError
    "lone_surrogate_prompt": (COMPLETIONS, b'{"prompt": "\\ud800", "max_tokens": 1}'),   # tokenizer TypeError
    "unhashable_role": (CHAT, _chat(messages=[{"role": ["user"], "content": "hi"}])),    # ROLE_ALIASES.get([..])
}


@pytest.mark.parametrize("name", sorted(KNOWN_HTTP_500S))
def test_http_former_500s_are_400s(http, name):
    client, _ = http
    path, body = KNOWN_HTTP_500S[name]
    assert client.post(path, content=body, headers=JSON).status_code == 400


# Roles are hashable here (unhashable ones: KNOWN_HTTP_500S); hypothesis text has no lone surrogates.
ROLES = st.sampled_from(["user", "system", "assistant", "developer", "tool", "robot", "", None, 5, 1.5, True])
CONTENT = st.text(max_size=30) | st.none() | st.integers() | st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image", 5]), "text": json_leaves}), max_size=3)
FIELD_VALUES = {
    "temperature": st.floats(-1, 3) | st.sampled_from([float("nan"), float("inf"), "0.5", None]),
    "top_p": st.floats(-1, 2) | st.none(), "top_k": st.integers(-5, 10**30) | st.floats(0, 5),
    "min_p": st.floats(-1, 2), "seed": st.integers(-5, 2**70) | st.text(max_size=4),
    "presence_penalty": st.floats(-5, 5), "frequency_penalty": st.floats(-5, 5),
    "repetition_penalty": st.floats(-1, 3), "stop": st.text(max_size=4) | st.lists(json_leaves, max_size=6),
    "stream": st.booleans() | json_leaves, "stream_options": json_values, "ignore_eos": json_leaves,
    "logit_bias": st.dictionaries(st.text(max_size=6) | st.integers(-3, 10**6).map(str), json_leaves, max_size=3),
    "n": st.integers(-1, 3), "logprobs": json_leaves, "prompt_cache_key": json_leaves,
    "model": json_leaves, "response_format": json_values, "tools": json_values,
}


@st.composite
def http_requests(draw) -> tuple[str, dict]:
    """Half the time a plausible request with a couple of odd fields, else anything goes."""
    plausible = draw(st.booleans())
    keys = draw(st.lists(st.sampled_from(sorted(FIELD_VALUES)), max_size=2 if plausible else 6, unique=True))
    body = {k: draw(FIELD_VALUES[k]) for k in keys}
    if draw(st.booleans()):
        path = CHAT
        text_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                        "content": st.text(min_size=1, max_size=30)}),
                                 min_size=1, max_size=2)
        body["messages"] = draw(text_messages if plausible else st.lists(
            st.fixed_dictionaries({"role": ROLES, "content": CONTENT}), max_size=3) | json_values)
    else:
        path = COMPLETIONS
        body["prompt"] = draw(st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 49151), min_size=1,
                                                                           max_size=8) if plausible else
                              st.text(max_size=40) | st.lists(st.integers(-2, 60000), max_size=8) | json_values)
    # Valid requests stay short: a missing or huge max_tokens means "up to the context" (~2000 tokens).
    body["max_tokens"] = draw(st.integers(1, 3) if plausible else st.integers(1, 3) | st.sampled_from(
        [0, -1, True, "3", 1.5, [], {}, 10**30 * 1.0]))
    return path, body


def test_http_fuzzed_bodies_never_get_5xx(http):
    client, _ = http
    statuses: collections.Counter = collections.Counter()

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=ANY_HEALTH)
    @given(request=http_requests())
    def fuzz(request):
        path, body = request
        response = client.post(path, content=json.dumps(body).encode(), headers=JSON)
        statuses[response.status_code] += 1
        assert response.status_code < 500, (body, response.text)
        if response.status_code >= 400:
            assert response.json()["error"]["message"]

    fuzz()
    print(f"\nHTTP fuzz: statuses {dict(statuses)}")
    assert client.get("/readyz").status_code == 200

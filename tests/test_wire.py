"""Wire format: roundtrips, activation dtypes, validation, zero-copy."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skippy_zmq.protocol import wire
from skippy_zmq.protocol.wire import HEADER, Kind, Message, WireDType, WireError, WireLimits

RNG = np.random.default_rng(0)


def roundtrip(msg: Message, dtype: WireDType | None = None, limits: WireLimits = WireLimits()) -> Message:
    return wire.decode([bytes(f) for f in wire.encode(msg, dtype)], limits)


def valid_frames(n: int = 2, width: int = 8, dtype: WireDType = WireDType.F32) -> list[bytes]:
    msg = Message(Kind.PREFILL, request_id=7, session_id=11, position=3,
                  tokens=np.arange(n, dtype=np.int32), positions=np.arange(3, 3 + n, dtype=np.int32),
                  activation=RNG.standard_normal((n, width)).astype(np.float32), extras={"a": 1})
    return [bytes(f) for f in wire.encode(msg, dtype)]


def with_header(frames: list[bytes], **changes: int) -> list[bytes]:
    names = ["magic", "version", "kind", "flags", "dtype", "request_id", "session_id",
             "position", "n_tokens", "n_rows", "width"]
    fields = dict(zip(names, HEADER.unpack(frames[0])))
    fields.update(changes)
    return [HEADER.pack(*fields.values()), *frames[1:]]


# ---------------------------------------------------------------- roundtrips


# EMBEDDING has a fixed shape (one row, one token, an f32 vector): tests/test_embeddings.py checks it
@pytest.mark.parametrize("kind", [k for k in Kind if k != Kind.EMBEDDING])
def test_every_kind_roundtrips(kind: Kind) -> None:
    msg = Message(kind, request_id=2**64 - 1, session_id=2**63, position=-1,
                  tokens=np.array([5, -6, 7], dtype=np.int32), positions=np.array([9, 10, 11], dtype=np.int32),
                  extras={"temperature": 0.5, "stop": ["x"]}, flags=3)
    frames = wire.encode(msg)
    assert len(frames) == wire.N_FRAMES == 6
    out = wire.decode(frames)
    assert out.kind is kind
    assert (out.request_id, out.session_id, out.position, out.flags) == (2**64 - 1, 2**63, -1, 3)
    assert out.tokens.tolist() == [5, -6, 7] and out.positions.tolist() == [9, 10, 11]
    assert out.session_ids.tolist() == [2**63]
    assert out.extras == {"temperature": 0.5, "stop": ["x"]}
    assert out.activation is None


def test_empty_message_has_empty_frames() -> None:
    frames = wire.encode(Message(Kind.STOP, session_id=4))
    assert [len(bytes(f)) for f in frames] == [HEADER.size, 8, 0, 0, 0, 0]
    out = wire.decode(frames)
    assert out.tokens.size == 0 and out.positions is None and out.extras == {}


def test_multi_row_decode() -> None:
    sessions = np.array([3, 9, 12], dtype=np.uint64)
    act = RNG.standard_normal((3, 16)).astype(np.float32)
    msg = Message(Kind.DECODE, request_id=1, session_id=3, tokens=np.array([1, 2, 3], dtype=np.int32),
                  positions=np.array([40, 7, 100], dtype=np.int32), sessions=sessions, activation=act)
    out = roundtrip(msg)
    assert out.session_ids.tolist() == [3, 9, 12]
    assert out.positions.tolist() == [40, 7, 100]
    np.testing.assert_array_equal(out.activation, act)


def test_reply_constructors() -> None:
    err = roundtrip(Message.error(5, 6, "boom", "bad_thing"))
    assert (err.kind, err.request_id, err.session_id) == (Kind.ERROR, 5, 6)
    assert err.extras == {"error": "boom", "code": "bad_thing"}
    ready = roundtrip(Message.ready("s1", 2, {"layers": [0, 15]}))
    assert ready.kind is Kind.READY and ready.extras == {"stage_id": "s1", "incarnation": 2, "info": {"layers": [0, 15]}}
    assert roundtrip(Message.heartbeat("s1", 2)).kind is Kind.HEARTBEAT
    ack = roundtrip(Message.ack(5, 6, {"hit": False}))
    assert ack.kind is Kind.ACK and ack.extras == {"stats": {"hit": False}}
    pred = roundtrip(Message.predicted_tokens(5, [6, 8], [100, 200], {"finish": [None, "stop"]}))
    assert pred.kind is Kind.PREDICTED_TOKENS and pred.session_id == 6
    assert pred.session_ids.tolist() == [6, 8] and pred.tokens.tolist() == [100, 200]
    assert WireError("r", "c", 1, 2).as_reply().extras == {"error": "r", "code": "c"}


# ---------------------------------------------------------------- activations


def test_bytes_per_token_table() -> None:
    table = {d: wire.bytes_per_token(d, 576) for d in WireDType}
    assert table == {WireDType.NONE: 0, WireDType.F32: 2304, WireDType.F16: 1152,
                     WireDType.BF16: 1152, WireDType.Q8: 580}


def test_parse_dtype() -> None:
    assert WireDType.parse("BF16") is WireDType.BF16
    with pytest.raises(ValueError, match="f32, f16, bf16, q8"):
        WireDType.parse("int4")


@pytest.mark.parametrize("dtype", [WireDType.F32, WireDType.F16, WireDType.BF16, WireDType.Q8])
def test_activation_roundtrip_error_bounds(dtype: WireDType) -> None:
    x = (RNG.standard_normal((5, 576)) * np.array([[1e-3], [1.0], [30.0], [0.0], [1e3]])).astype(np.float32)
    buf = wire.encode_activation(x, dtype)
    assert memoryview(buf).nbytes == 5 * wire.bytes_per_token(dtype, 576)
    y = wire.decode_activation(buf, 5, 576, dtype)
    assert y.dtype == np.float32 and y.shape == x.shape
    if dtype == WireDType.F32:
        np.testing.assert_array_equal(y, x)
    elif dtype in (WireDType.F16, WireDType.BF16):
        rel = 2**-11 if dtype == WireDType.F16 else 2**-8  # half an ulp of the mantissa
        np.testing.assert_allclose(y, x, rtol=rel, atol=1e-7 if dtype == WireDType.F16 else 0)
    else:
        scale = np.abs(x).max(axis=1, keepdims=True) / 127
        assert (np.abs(y - x) <= scale / 2 * (1 + 1e-5) + 1e-30).all()
        assert (y[3] == 0).all()


def test_bf16_rounds_to_nearest_even_and_keeps_nan() -> None:
    bits = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x7F800001, 0x7F7FFFFF], dtype=np.uint32)
    y = wire.decode_activation(wire.encode_activation(bits.view(np.float32)[None, :], WireDType.BF16), 1, 5,
                               WireDType.BF16)
    out = y.view(np.uint32)[0] >> 16
    # tie stays even, tie rounds up to even, above tie rounds up, NaN stays NaN, max finite rounds to inf
    assert out[:3].tolist() == [0x3F80, 0x3F82, 0x3F81]
    assert np.isnan(y[0, 3]) and np.isposinf(y[0, 4])


def test_q8_rejects_non_finite() -> None:
    with pytest.raises(ValueError, match="non-finite"):
        wire.encode_activation(np.array([[np.inf, 1.0]], dtype=np.float32), WireDType.Q8)


@pytest.mark.parametrize("dtype", [WireDType.F16, WireDType.BF16, WireDType.Q8])
def test_message_carries_wire_dtype(dtype: WireDType) -> None:
    frames = valid_frames(3, 32, dtype)
    out = wire.decode(frames)
    assert out.wire_dtype is dtype and out.activation.shape == (3, 32)
    # A forwarded message re-encodes in the dtype it arrived in.
    assert HEADER.unpack(bytes(wire.encode(out)[0]))[4] == dtype


# ---------------------------------------------------------------- zero-copy


def test_encode_is_zero_copy() -> None:
    tokens = np.arange(4, dtype=np.int32)
    act = RNG.standard_normal((4, 8)).astype(np.float32)
    frames = wire.encode(Message(Kind.PREFILL, tokens=tokens, positions=tokens, activation=act))
    assert np.shares_memory(np.asarray(frames[2]), tokens)
    assert np.shares_memory(np.asarray(frames[3]), tokens)
    assert np.shares_memory(np.asarray(frames[4]), act)


def test_decode_is_zero_copy() -> None:
    frames = [bytearray(f) for f in valid_frames(4, 8)]
    out = wire.decode(frames)
    for array, frame in [(out.sessions, frames[1]), (out.tokens, frames[2]), (out.positions, frames[3]),
                         (out.activation, frames[4])]:
        assert np.shares_memory(array, np.frombuffer(frame, dtype=np.uint8))


def test_decode_accepts_objects_with_buffer() -> None:
    class FakeFrame:
        def __init__(self, data: bytes) -> None:
            self.buffer = memoryview(data)

    out = wire.decode([FakeFrame(f) for f in valid_frames()])
    assert out.request_id == 7


# ---------------------------------------------------------------- validation


def reject(frames: list, code: str, *needles: str, limits: WireLimits = WireLimits(), ids: tuple = (7, 11)) -> None:
    with pytest.raises(WireError) as info:
        wire.decode(frames, limits)
    err = info.value
    assert err.code == code, err.reason
    for needle in needles:
        assert needle in err.reason, err.reason
    assert (err.request_id, err.session_id) == ids


def test_rejects_wrong_frame_count() -> None:
    reject(valid_frames()[:3], "bad_frame_count", "expected 6 frames, got 3")
    reject([], "bad_frame_count", "got 0", ids=(0, 0))
    reject([*valid_frames(), b""], "bad_frame_count", "got 7")


def test_rejects_bad_header() -> None:
    frames = valid_frames()
    reject([frames[0][:-1], *frames[1:]], "bad_header", "43 bytes", ids=(0, 0))
    reject([b"XXXX" + frames[0][4:], *frames[1:]], "bad_magic", "XXXX", ids=(0, 0))
    reject(with_header(frames, version=9), "bad_version", "wrong protocol version 9 (expected 1)")
    reject(with_header(frames, kind=99), "unknown_kind", "unknown message kind 99")
    reject(with_header(frames, dtype=17), "bad_dtype", "17")


def test_rejects_counts_over_limits() -> None:
    frames = valid_frames(2, 8)
    reject(frames, "too_large", "2 tokens", "limit of 1", limits=WireLimits(max_tokens=1))
    reject(frames, "too_large", "width 8", "limit of 4", limits=WireLimits(max_width=4))
    reject(with_header(frames, n_rows=300), "too_large", "300 rows", "256")
    total = sum(len(f) for f in frames)
    reject(frames, "too_large", f"{total} bytes", "100 byte limit", limits=WireLimits(max_message_bytes=100))
    reject(with_header(frames, n_rows=0), "bad_rows", "n_rows is 0")


def test_rejects_size_mismatches() -> None:
    frames = valid_frames(2, 576)
    reject([*frames[:4], b"\0" * 100, frames[5]], "size_mismatch",
           "activation frame is 100 bytes but 2 tokens × 576 width × f32 needs 4608")
    reject([frames[0], b"\0" * 9, *frames[2:]], "size_mismatch", "sessions frame is 9 bytes", "1 rows need 8")
    reject([*frames[:2], b"\0" * 4, *frames[3:]], "size_mismatch", "tokens frame is 4 bytes", "need 8")
    reject([*frames[:3], b"\0" * 4, *frames[4:]], "size_mismatch", "positions frame is 4 bytes", "0 or 8")
    reject(with_header(frames, dtype=WireDType.NONE), "size_mismatch", "4608 bytes", "none")
    reject(with_header(frames, dtype=WireDType.Q8), "size_mismatch", "q8 needs 1160")
    reject(with_header(frames, width=0), "size_mismatch", "width is 0")


def test_positions_may_be_empty() -> None:
    frames = valid_frames()
    assert wire.decode([*frames[:3], b"", *frames[4:]]).positions is None


def test_rejects_multi_row_decode_with_wrong_token_count() -> None:
    msg = Message(Kind.DECODE, request_id=7, session_id=11, tokens=np.array([1, 2, 3], dtype=np.int32),
                  sessions=np.array([11, 12], dtype=np.uint64))
    reject(wire.encode(msg), "bad_rows", "2 rows", "3 tokens")


def test_rejects_bad_extras() -> None:
    frames = valid_frames()
    for extras, needle in [(b"\xff\xfe", "UTF-8"), (b"{nope", "JSON"), (b"[1, 2]", "got list"),
                           (b"[" * 50_000, "JSON")]:
        reject([*frames[:5], extras], "bad_extras", needle)
    big = json.dumps({"x": "y" * 100}).encode()
    reject([*frames[:5], big], "too_large", f"{len(big)} bytes", "64 byte limit",
           limits=WireLimits(max_extras_bytes=64))


def test_encode_rejects_inconsistent_messages() -> None:
    with pytest.raises(ValueError, match="does not match 2 rows"):
        wire.encode(Message(Kind.PREFILL, tokens=np.arange(2), activation=np.zeros((3, 4), np.float32)))
    with pytest.raises(ValueError, match="positions"):
        wire.encode(Message(Kind.PREFILL, tokens=np.arange(2), positions=np.arange(3)))
    with pytest.raises(ValueError, match="out of range"):
        wire.encode(Message(Kind.PREFILL, position=2**31))


# ---------------------------------------------------------------- property


def _mutate(frames: list[bytes], data: st.DataObject) -> list[bytes]:
    frames = list(frames)
    action = data.draw(st.sampled_from(["flip", "truncate", "extend", "drop", "add", "replace"]))
    i = data.draw(st.integers(0, len(frames) - 1))
    if action == "drop":
        del frames[i]
    elif action == "add":
        frames.insert(i, data.draw(st.binary(max_size=64)))
    elif action == "replace":
        frames[i] = data.draw(st.binary(max_size=128))
    elif action == "truncate":
        frames[i] = frames[i][: data.draw(st.integers(0, max(0, len(frames[i]) - 1)))]
    elif action == "extend":
        frames[i] = frames[i] + data.draw(st.binary(min_size=1, max_size=64))
    elif frames[i]:
        pos = data.draw(st.integers(0, len(frames[i]) - 1))
        frames[i] = frames[i][:pos] + bytes([frames[i][pos] ^ data.draw(st.integers(1, 255))]) + frames[i][pos + 1:]
    return frames


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), dtype=st.sampled_from([WireDType.F32, WireDType.BF16, WireDType.Q8]))
def test_mutated_frames_only_raise_wire_error(data: st.DataObject, dtype: WireDType) -> None:
    frames = valid_frames(2, 4, dtype)
    for _ in range(data.draw(st.integers(1, 3))):
        frames = _mutate(frames, data)
    try:
        msg = wire.decode(frames, WireLimits(max_tokens=64, max_rows=8, max_width=64))
    except WireError:
        return
    assert msg.tokens.size <= 64 and msg.session_ids.size <= 8


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=8))
def test_random_frames_only_raise_wire_error(frames: list[bytes]) -> None:
    try:
        wire.decode(frames)
    except WireError:
        pass

"""Wire format: message kinds, the fixed header, encode/decode, validation.

A message is always exactly six ZeroMQ frames::

    0 header      HEADER (44 bytes, little-endian, layout below)
    1 sessions    uint64 x n_rows
    2 tokens      int32  x n_tokens
    3 positions   int32  x n_tokens, or empty (positions are implied by `position`)
    4 activation  n_tokens x bytes_per_token(dtype, width), or empty (dtype NONE)
    5 extras      UTF-8 JSON object, or empty meaning {}

Header fields, in order (`HEADER.format`): magic b"SKZM", version u8, kind u8,
flags u16, wire dtype u8, 3 pad bytes, request_id u64, session_id u64,
position i32 (absolute position of the first token), n_tokens u32, n_rows u32,
width u32.

Arrays travel as their own buffers, never pickled: encoding hands out views of
contiguous arrays and decoding returns `np.frombuffer` views of the received
frames, so neither side copies token ids or f32 activations. This module
imports numpy only (no zmq, no jax) so both the JAX stages and the driver can
use it, and so it can be tested without sockets.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAGIC = b"SKZM"
VERSION = 1
N_FRAMES = 6
HEADER = struct.Struct("<4sBBHB3xQQiIII")

POOLINGS = ("mean", "last")   # a PREFILL's extras["pool"]: how the final stage pools an embedding's prompt
Buffer = bytes | bytearray | memoryview
_Fail = Callable[[str, str], "WireError"]


class Kind(enum.IntEnum):
    """One-byte message kind. Requests flow down the chain; replies go to the driver."""

    PREFILL = 1
    DECODE = 2
    CONFIGURE_GENERATION = 3
    STOP = 4
    TRIM_SESSION = 5
    TRY_RESTORE_PREFILL = 6
    TRY_RESTORE_PREFILL_DECODE = 7
    FORK_SESSION = 8      # copy session_id's KV [0, position) into each of `sessions` (n > 1 choices)
    READY = 32
    HEARTBEAT = 33
    ACK = 34
    PREDICTED_TOKENS = 35
    ERROR = 36
    EMBEDDING = 37        # a pooled prompt: tokens [n pooled], activation [1, width] f32 (the vector)


class WireDType(enum.IntEnum):
    """How an activation is laid out on the wire (always f32 in memory)."""

    NONE = 0
    F32 = 1
    F16 = 2
    BF16 = 3
    Q8 = 4

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> WireDType:
        """Parse a config string such as "bf16"."""
        choices = {d.label: d for d in cls if d is not cls.NONE}
        try:
            return choices[text.strip().lower()]
        except KeyError:
            raise ValueError(f"unknown wire dtype {text!r} (choose one of {', '.join(choices)})") from None


def bytes_per_token(dtype: WireDType, width: int) -> int:
    """Activation bytes for one token row. Q8 is a f32 scale plus one int8 per element."""
    return {
        WireDType.NONE: 0,
        WireDType.F32: 4 * width,
        WireDType.F16: 2 * width,
        WireDType.BF16: 2 * width,
        WireDType.Q8: 4 + width,
    }[WireDType(dtype)]


class WireError(Exception):
    """A message that must be rejected. `code` is a stable snake_case tag for
    metrics and clients; ids are filled whenever the header parsed, so the
    receiver can address its ERROR reply."""

    def __init__(self, reason: str, code: str, request_id: int = 0, session_id: int = 0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code
        self.request_id = request_id
        self.session_id = session_id

    def as_reply(self) -> Message:
        return Message.error(self.request_id, self.session_id, self.reason, self.code)


@dataclass(frozen=True)
class WireLimits:
    max_tokens: int = 8192
    max_rows: int = 256
    max_width: int = 65536
    max_message_bytes: int = 256 * 1024 * 1024
    max_extras_bytes: int = 64 * 1024


def _empty_tokens() -> np.ndarray:
    return np.empty(0, dtype=np.int32)


# eq=False: the fields hold numpy arrays, whose == is elementwise.
@dataclass(frozen=True, eq=False)
class Message:
    """One decoded (or to-be-encoded) message.

    `sessions` None means the single row `[session_id]`. `activation` is f32
    `[n_tokens, width]`. `wire_dtype` is the activation dtype a decoded message
    arrived in, and the one `encode` uses when not told otherwise.
    """

    kind: Kind
    request_id: int = 0
    session_id: int = 0
    position: int = 0
    tokens: np.ndarray = field(default_factory=_empty_tokens)
    positions: np.ndarray | None = None
    sessions: np.ndarray | None = None
    activation: np.ndarray | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    flags: int = 0
    wire_dtype: WireDType = WireDType.F32

    @property
    def session_ids(self) -> np.ndarray:
        """The session of every row (uint64)."""
        if self.sessions is None:
            return np.array([self.session_id], dtype=np.uint64)
        return self.sessions

    @property
    def row_lengths(self) -> np.ndarray:
        """Tokens in each row (int64), rows laid end to end in `tokens`.

        A PREFILL is one row of all its tokens. Rows of DECODE and PREDICTED_TOKENS default to one
        token each; a verify window is a row of k+1 (extras "lengths" lists every row's length).
        """
        rows = self.session_ids.shape[0]
        if "lengths" in self.extras:
            return np.asarray(self.extras["lengths"], dtype=np.int64)
        if self.kind in (Kind.DECODE, Kind.PREDICTED_TOKENS) and rows > 1:
            return np.ones(rows, dtype=np.int64)
        return np.array([self.tokens.shape[0]], dtype=np.int64)

    # Reply constructors. Extras layouts are part of the protocol; keep them here.

    @classmethod
    def error(cls, request_id: int, session_id: int, reason: str, code: str) -> Message:
        return cls(Kind.ERROR, request_id, session_id, extras={"error": reason, "code": code})

    @classmethod
    def ready(cls, stage_id: str, incarnation: int, info: dict[str, Any]) -> Message:
        return cls(Kind.READY, extras={"stage_id": stage_id, "incarnation": incarnation, "info": info})

    @classmethod
    def heartbeat(cls, stage_id: str, incarnation: int, info: dict[str, Any] | None = None) -> Message:
        return cls(Kind.HEARTBEAT, extras={"stage_id": stage_id, "incarnation": incarnation, "info": info or {}})

    @classmethod
    def ack(cls, request_id: int, session_id: int, stats: dict[str, Any]) -> Message:
        return cls(Kind.ACK, request_id, session_id, extras={"stats": stats})

    @classmethod
    def predicted_tokens(
        cls, request_id: int, sessions: Sequence[int] | np.ndarray, tokens: Sequence[int] | np.ndarray,
        extras: dict[str, Any] | None = None, lengths: Sequence[int] | None = None,
    ) -> Message:
        """The target's token at every position of every row; `lengths` when a row has more than one."""
        rows = np.asarray(sessions, dtype=np.uint64).reshape(-1)
        extras = dict(extras or {})
        if lengths is not None and any(int(n) != 1 for n in lengths):
            extras["lengths"] = [int(n) for n in lengths]
        return cls(Kind.PREDICTED_TOKENS, request_id, int(rows[0]) if rows.size else 0,
                   tokens=np.asarray(tokens, dtype=np.int32).reshape(-1), sessions=rows, extras=extras)

    @classmethod
    def embedding(cls, request_id: int, session_id: int, vector: np.ndarray, pooled: int,
                  extras: dict[str, Any] | None = None) -> Message:
        """The final stage's pooled vector of a session's prompt (`pooled` tokens went into it)."""
        return cls(Kind.EMBEDDING, request_id, session_id, tokens=np.array([pooled], np.int32),
                   activation=np.asarray(vector, np.float32).reshape(1, -1), extras=dict(extras or {}))


# ---------------------------------------------------------------- activations


def _byte_view(array: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array, without copying."""
    return memoryview(array.reshape(-1).view(np.uint8))


def encode_activation(x: np.ndarray, dtype: WireDType) -> memoryview:
    """f32 `[n, w]` -> wire bytes. F32 is zero-copy for contiguous f32 input.

    Q8 layout: all n f32 scales first, then the n x w int8 rows, so the rows
    stay one contiguous block.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"activation must be 2-D [n_tokens, width], got shape {x.shape}")
    if dtype == WireDType.F32:
        return _byte_view(x)
    if dtype == WireDType.F16:
        return _byte_view(x.astype(np.float16))
    if dtype == WireDType.BF16:
        return _byte_view(_f32_to_bf16_bits(x))
    if dtype == WireDType.Q8:
        return _encode_q8(x)
    raise ValueError(f"cannot encode an activation as {WireDType(dtype).label}")


def decode_activation(buf: Buffer, n: int, w: int, dtype: WireDType) -> np.ndarray:
    """Wire bytes -> f32 `[n, w]`. F32 returns a read-only view of `buf`."""
    view = memoryview(buf).cast("B")
    need = n * bytes_per_token(dtype, w)
    if dtype == WireDType.NONE or view.nbytes != need:
        raise WireError(f"activation buffer is {view.nbytes} bytes but {n} tokens × {w} width × "
                        f"{WireDType(dtype).label} needs {need}", "size_mismatch")
    if dtype == WireDType.F32:
        return np.frombuffer(view, dtype=np.float32).reshape(n, w)
    if dtype == WireDType.F16:
        return np.frombuffer(view, dtype=np.float16).astype(np.float32).reshape(n, w)
    if dtype == WireDType.BF16:
        bits = np.frombuffer(view, dtype=np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(n, w)
    scales = np.frombuffer(view[: 4 * n], dtype=np.float32)
    rows = np.frombuffer(view[4 * n:], dtype=np.int8).reshape(n, w)
    return rows.astype(np.float32) * scales[:, None]


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Upper 16 bits of f32 with round-to-nearest-even; NaN stays a quiet NaN
    (plain rounding could carry a NaN's low mantissa bits into an infinity)."""
    bits = x.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    return np.where(np.isnan(x), np.uint32(0x7FC0), rounded).astype(np.uint16)


def _encode_q8(x: np.ndarray) -> memoryview:
    """Symmetric per-token int8: scale = max|row| / 127 (1 for an all-zero row)."""
    if not np.isfinite(x).all():
        raise ValueError("q8 cannot encode non-finite activations")
    n, w = x.shape
    scales = np.abs(x).max(axis=1, initial=0.0) / np.float32(127)
    scales[scales == 0] = 1.0
    out = np.empty(n * (4 + w), dtype=np.uint8)
    out[: 4 * n] = scales.astype(np.float32).view(np.uint8)
    q = np.clip(np.rint(x / scales[:, None]), -127, 127).astype(np.int8)
    out[4 * n:] = q.reshape(-1).view(np.uint8)
    return memoryview(out)


# ---------------------------------------------------------------- messages


def _array_frame(array: np.ndarray | None, dtype: type, what: str, length: int | None = None) -> memoryview:
    if array is None:
        return memoryview(b"")
    flat = np.ascontiguousarray(array, dtype=dtype)  # no copy when already contiguous `dtype`
    if flat.ndim != 1 or (length is not None and flat.size != length):
        raise ValueError(f"{what} must be 1-D with {length} entries, got shape {flat.shape}")
    return _byte_view(flat)


def activation_rows(kind: Kind, n_tokens: int) -> int:
    """Rows of activation a message carries: one per token, except TRY_RESTORE_PREFILL_DECODE,
    whose tokens are prefix + [current] and whose activation is the current token's alone."""
    return min(n_tokens, 1) if kind == Kind.TRY_RESTORE_PREFILL_DECODE else n_tokens


def encode(msg: Message, dtype: WireDType | None = None) -> list[Buffer]:
    """Message -> the six frames. `dtype` defaults to `msg.wire_dtype`."""
    tokens = _array_frame(msg.tokens, np.int32, "tokens")
    n_tokens = tokens.nbytes // 4
    sessions = _array_frame(msg.session_ids, np.uint64, "sessions")
    positions = _array_frame(msg.positions, np.int32, "positions", n_tokens)
    if msg.activation is None:
        wire_dtype, width, activation = WireDType.NONE, 0, memoryview(b"")
    else:
        wire_dtype = WireDType(msg.wire_dtype if dtype is None else dtype)
        rows = activation_rows(Kind(msg.kind), n_tokens)
        if msg.activation.ndim != 2 or msg.activation.shape[0] != rows:
            raise ValueError(f"activation shape {msg.activation.shape} does not match {rows} rows")
        width = msg.activation.shape[1]
        activation = encode_activation(msg.activation, wire_dtype)
    extras = json.dumps(msg.extras, separators=(",", ":")).encode() if msg.extras else b""
    try:
        header = HEADER.pack(MAGIC, VERSION, Kind(msg.kind), msg.flags, wire_dtype, msg.request_id,
                             msg.session_id, msg.position, n_tokens, sessions.nbytes // 8, width)
    except struct.error as exc:
        raise ValueError(f"header field out of range: {exc}") from None
    return [header, sessions, tokens, positions, activation, extras]


def _frame_view(frame: Any) -> memoryview:
    """bytes-like, or a zmq.Frame (which exposes `.buffer`; we never import zmq here)."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        frame = frame.buffer
    return memoryview(frame).cast("B")


def decode(frames: Sequence[Any], limits: WireLimits = WireLimits()) -> Message:
    """Six frames -> Message, checking every field against `limits` before
    allocating anything. Raises WireError (and nothing else) on bad input."""
    views = [_frame_view(f) for f in frames]
    header = views[0] if views else memoryview(b"")
    fields = HEADER.unpack(header) if header.nbytes == HEADER.size else None
    magic, version, kind, flags, dtype, request_id, session_id, position, n_tokens, n_rows, width = (
        fields or (b"", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
    # Ids are trusted for the ERROR reply only once the header's size and magic check out.
    ids = (request_id, session_id) if magic == MAGIC else (0, 0)

    def fail(reason: str, code: str) -> WireError:
        return WireError(reason, code, *ids)

    if len(views) != N_FRAMES:
        raise fail(f"expected {N_FRAMES} frames, got {len(views)}", "bad_frame_count")
    if fields is None:
        raise fail(f"header frame is {header.nbytes} bytes (expected {HEADER.size})", "bad_header")
    if magic != MAGIC:
        raise fail(f"bad magic {magic!r} (expected {MAGIC!r})", "bad_magic")
    if version != VERSION:
        raise fail(f"wrong protocol version {version} (expected {VERSION})", "bad_version")
    total = sum(v.nbytes for v in views)
    if total > limits.max_message_bytes:
        raise fail(f"message is {total} bytes, over the {limits.max_message_bytes} byte limit", "too_large")
    if kind not in Kind._value2member_map_:
        raise fail(f"unknown message kind {kind}", "unknown_kind")
    if dtype not in WireDType._value2member_map_:
        raise fail(f"unknown wire dtype {dtype}", "bad_dtype")
    kind, dtype = Kind(kind), WireDType(dtype)
    _check_counts(kind, dtype, n_tokens, n_rows, width, limits, fail)
    if kind == Kind.EMBEDDING and dtype != WireDType.F32:
        raise fail(f"EMBEDDING carries its vector as f32, got wire dtype {dtype.label}", "bad_dtype")
    _, v_sessions, v_tokens, v_positions, v_activation, v_extras = views
    rows = activation_rows(kind, n_tokens)
    _check_frame_sizes(dtype, n_tokens, rows, n_rows, width, v_sessions, v_tokens, v_positions, v_activation, fail)
    extras = _decode_extras(v_extras, limits, fail)
    _check_lengths(kind, extras, n_tokens, n_rows, fail)
    return Message(
        kind=kind, request_id=request_id, session_id=session_id, position=position,
        tokens=np.frombuffer(v_tokens, dtype=np.int32),
        positions=np.frombuffer(v_positions, dtype=np.int32) if v_positions.nbytes else None,
        sessions=np.frombuffer(v_sessions, dtype=np.uint64),
        activation=None if dtype == WireDType.NONE else decode_activation(v_activation, rows, width, dtype),
        extras=extras, flags=flags, wire_dtype=WireDType.F32 if dtype == WireDType.NONE else dtype,
    )


def _check_counts(kind: Kind, dtype: WireDType, n_tokens: int, n_rows: int, width: int,
                  limits: WireLimits, fail: _Fail) -> None:
    if n_tokens > limits.max_tokens:
        raise fail(f"{n_tokens} tokens exceeds the limit of {limits.max_tokens}", "too_large")
    if n_rows > limits.max_rows:
        raise fail(f"{n_rows} rows exceeds the limit of {limits.max_rows}", "too_large")
    if n_rows < 1:
        raise fail("n_rows is 0 (every message names at least one session)", "bad_rows")
    if dtype != WireDType.NONE and width > limits.max_width:
        raise fail(f"activation width {width} exceeds the limit of {limits.max_width}", "too_large")
    if dtype != WireDType.NONE and width < 1:
        raise fail(f"activation width is 0 with wire dtype {dtype.label}", "size_mismatch")


def _check_lengths(kind: Kind, extras: dict[str, Any], n_tokens: int, n_rows: int, fail: _Fail) -> None:
    """Rows of more than one token (verify windows) list their lengths; without the list, a DECODE
    with several rows carries one token per row. A PREFILL is one session's row (a stage writes it
    into one lane), so it names exactly one session."""
    if kind == Kind.PREFILL and n_rows != 1:
        raise fail(f"PREFILL names {n_rows} sessions; a prefill carries one session's tokens "
                   "(send one PREFILL per session)", "bad_rows")
    if kind == Kind.EMBEDDING and (n_rows != 1 or n_tokens != 1):
        raise fail(f"EMBEDDING carries one session's vector and its pooled token count, got {n_rows} rows "
                   f"and {n_tokens} tokens", "bad_rows")
    if "lengths" not in extras:
        if kind == Kind.DECODE and n_rows > 1 and n_tokens != n_rows:
            raise fail(f"{kind.name} with {n_rows} rows must carry one token per row, got {n_tokens} tokens "
                       "(or list the row lengths)", "bad_rows")
        return
    lengths = extras["lengths"]
    if kind not in (Kind.DECODE, Kind.PREDICTED_TOKENS):
        raise fail(f"{kind.name} does not take row lengths", "bad_rows")
    if (not isinstance(lengths, list) or len(lengths) != n_rows
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths)):
        raise fail(f"lengths must list {n_rows} positive integers, one per row", "bad_rows")
    if sum(lengths) != n_tokens:
        raise fail(f"row lengths add up to {sum(lengths)} tokens but the message carries {n_tokens}", "bad_rows")


def _check_frame_sizes(dtype: WireDType, n_tokens: int, act_rows: int, n_rows: int, width: int, sessions: memoryview,
                       tokens: memoryview, positions: memoryview, activation: memoryview, fail: _Fail) -> None:
    if sessions.nbytes != 8 * n_rows:
        raise fail(f"sessions frame is {sessions.nbytes} bytes but {n_rows} rows need {8 * n_rows}",
                   "size_mismatch")
    if tokens.nbytes != 4 * n_tokens:
        raise fail(f"tokens frame is {tokens.nbytes} bytes but {n_tokens} tokens need {4 * n_tokens}",
                   "size_mismatch")
    if positions.nbytes not in (0, 4 * n_tokens):
        raise fail(f"positions frame is {positions.nbytes} bytes but {n_tokens} tokens need 0 or "
                   f"{4 * n_tokens}", "size_mismatch")
    need = act_rows * bytes_per_token(dtype, width)
    if activation.nbytes != need:
        if dtype == WireDType.NONE:
            raise fail(f"activation frame is {activation.nbytes} bytes but wire dtype is none", "size_mismatch")
        raise fail(f"activation frame is {activation.nbytes} bytes but {act_rows} tokens × {width} width × "
                   f"{dtype.label} needs {need}", "size_mismatch")


def _decode_extras(view: memoryview, limits: WireLimits, fail: _Fail) -> dict[str, Any]:
    if view.nbytes > limits.max_extras_bytes:
        raise fail(f"extras frame is {view.nbytes} bytes, over the {limits.max_extras_bytes} byte limit",
                   "too_large")
    if not view.nbytes:
        return {}
    try:
        extras = json.loads(bytes(view).decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise fail(f"extras frame is not valid UTF-8 JSON: {exc}", "bad_extras") from None
    if not isinstance(extras, dict):
        raise fail(f"extras must be a JSON object, got {type(extras).__name__}", "bad_extras")
    return extras

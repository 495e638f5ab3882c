"""The values a rows message passes through in a stage (StageWorker.on_rows): check the rows,
place them in sessions, run the slice, sample and score, reply. Data classes (Row, RowsToRun, Ran,
Scored), functions of them (`parse_rows`, `narrow`, `logprob_entry`, a prefill's `top_of_prompt` and
`prompt_logprobs`), and `RuntimeLock`, the lock that
serialises runtime use and times its waits and holds; the worker owns the steps."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from skippy_zmq.sampling import check_top_logprobs, token_logprobs
from skippy_zmq.stage.types import Outbound, StageFault
from skippy_zmq.protocol.wire import Message


@dataclass
class RuntimeLock:
    """Serialises runtime use and measures wait and hold (telemetry)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    wait_ms: float = 0.0
    hold_ms: float = 0.0

    def run(self, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        with self.lock:
            t1 = time.perf_counter()
            try:
                return fn()
            finally:
                t2 = time.perf_counter()
                self.wait_ms, self.hold_ms = 1000 * (t1 - t0), 1000 * (t2 - t1)

    def times(self) -> dict[str, float]:
        """The last use's wait and hold, for a trace entry or a telemetry event."""
        return {"lock_wait_ms": round(self.wait_ms, 3), "lock_hold_ms": round(self.hold_ms, 3)}


# A logprob JSON can carry: -inf (a masked token, only ever at a window position past a refused
# draft, whose output the driver never uses) goes out as this, vLLM's value for it.
LOGPROB_FLOOR = -9999.0


def logprob_entry(entry: tuple[float, list[tuple[int, float]]]) -> list[Any]:
    """token_logprobs' (logprob, [(id, logprob), ...]) as compact JSON: [lp, [[id, lp], ...]]."""
    logprob, top = entry
    return [max(logprob, LOGPROB_FLOOR), [[token, value] for token, value in top]]


def top_of_prompt(msg: Message) -> int | None:
    """A prefill's "prompt_logprobs" (top alternatives per prompt token), checked; None without."""
    top = msg.extras.get("prompt_logprobs")
    try:
        return None if top is None else check_top_logprobs(top)
    except ValueError as exc:
        raise StageFault(f"bad prompt_logprobs: {exc}", "bad_sampling") from exc


def prompt_logprobs(session: Any, logits: np.ndarray, start: int, top_n: int) -> dict[str, Any]:
    """Logprobs of the prompt tokens a prefill chunk's logits predict: the logits at position p
    score the prompt token at p + 1 (raw logits: no penalties or bias apply to the prompt).
    {"start": the first scored position, "entries": [[lp, [[id, lp], ...]], ...]}."""
    prompt = session.sampler.history.prompt if session.sampler is not None else []
    entries = []
    for j in range(min(logits.shape[0], len(prompt) - 1 - start)):
        entries.append(logprob_entry(token_logprobs(logits[j], prompt[start + j + 1], top_n)))
    return {"start": start + 1, "entries": entries}


@dataclass(frozen=True)
class Row:
    """One row of a rows message: a session's tokens [offset, offset + length) of the message,
    at absolute positions [start, start + length)."""

    session_id: int
    start: int
    offset: int
    length: int


@dataclass(frozen=True)
class RowsToRun:
    """Rows that run together: the message (narrowed to these rows) and their inputs."""

    msg: Message
    x: np.ndarray                       # token ids at the first stage, activations elsewhere
    rows: list[Row]
    score: bool                         # decode / verify rows: the final stage samples every position
    prompt_top: int | None              # a final-stage prefill's "prompt_logprobs"
    lanes: np.ndarray | None = None     # the rows' lanes, once placed in their sessions
    pool: tuple[str, bool] | None = None   # a final-stage prefill pooled for an embedding: (how, last chunk)


@dataclass(frozen=True)
class Ran:
    """A batch run through this stage's slice."""

    result: Any                         # activations, logits (final stage, scored) or None
    extras: dict[str, Any]              # the message's extras with this stage's trace entry


@dataclass
class Scored:
    """The final stage's scores of a batch: the tokens (and logprob entries) of the rows sampled,
    the ERRORs of rows whose sampling failed, or a prefill's prompt logprobs."""

    answered: list[Row] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)   # per token: [logprob, [[id, logprob], ...]] or None
    errors: list[Outbound] = field(default_factory=list)
    sample_ms: float = 0.0
    prompt_logprobs: dict[str, Any] | None = None
    pooled: Any = None                  # an embedding prefill's stage.pooling.Pool, after this chunk


def narrow(batch: RowsToRun, keep: list[Row]) -> RowsToRun:
    """The batch of the rows `keep` alone: tokens, inputs, positions and sessions compacted and
    the rows' offsets renumbered (the message goes on down the chain as if it named only these)."""
    if len(keep) == len(batch.rows):
        return batch
    msg = batch.msg
    idx = np.concatenate([np.arange(row.offset, row.offset + row.length) for row in keep])
    sessions = np.array([row.session_id for row in keep], np.uint64)
    extras = {k: v for k, v in msg.extras.items() if k != "lengths"}
    if any(row.length != 1 for row in keep):
        extras["lengths"] = [row.length for row in keep]
    msg = replace(msg, sessions=sessions, session_id=int(sessions[0]), tokens=msg.tokens[idx],
                  positions=msg.positions[idx] if msg.positions is not None else None,
                  position=keep[0].start, extras=extras)
    offsets = np.concatenate([[0], np.cumsum([row.length for row in keep])])
    rows = [replace(row, offset=int(offsets[i])) for i, row in enumerate(keep)]
    return replace(batch, msg=msg, x=batch.x[idx], rows=rows)


def parse_rows(msg: Message) -> list[Row]:
    """Every row of the message, checked: its session, start position, offset into tokens, length."""
    sessions, lengths = msg.session_ids.tolist(), msg.row_lengths
    n = int(msg.tokens.shape[0])
    if n == 0 or (lengths < 1).any():
        raise StageFault(f"every row of a {msg.kind.name} needs at least one token", "bad_rows")
    if len(lengths) != len(sessions) or int(lengths.sum()) != n:
        raise StageFault(f"{len(sessions)} rows with lengths {lengths.tolist()} do not cover {n} tokens",
                         "bad_rows")
    if len(set(sessions)) != len(sessions):
        raise StageFault(f"a {msg.kind.name} names the same session in more than one row", "bad_rows")
    positions = msg.positions
    if positions is not None and positions.shape[0] != n:
        raise StageFault(f"{msg.kind.name} needs one position per token ({n} tokens)", "bad_rows")
    rows, offset = [], 0
    for sid, length in zip(sessions, lengths.tolist()):
        start = int(positions[offset]) if positions is not None else msg.position + offset
        if positions is not None and not np.array_equal(positions[offset:offset + length],
                                                        np.arange(start, start + length)):
            raise StageFault(f"row of session {sid} has positions that are not consecutive", "bad_rows")
        rows.append(Row(sid, start, offset, length))
        offset += length
    return rows

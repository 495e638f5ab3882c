"""Embeddings at the final stage: a prompt's prefill chunks carry `extras["pool"]` ("mean" or
"last"); their final-norm hidden states are pooled into the session's Pool chunk by chunk, and
the chunk marked `extras["pool_last"]` is answered with the pooled vector (wire Kind.EMBEDDING)
instead of an ACK. Normalisation is the driver's (it is a property of the request, not the model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from skippy_zmq.stage.types import StageFault
from skippy_zmq.protocol.wire import POOLINGS


@dataclass
class Pool:
    """One session's running pool: the sum of its tokens' normed hidden states (float64, so the
    mean does not depend on how the prompt was chunked), how many, and the last one."""

    how: str
    total: np.ndarray
    count: int = 0
    last: np.ndarray | None = None
    end: int = 0          # the position after the last token pooled

    def add(self, hidden: np.ndarray, start: int) -> None:
        """A chunk's [n, D] hidden states at positions [start, start + n); a chunk that starts
        before what was pooled (a re-prefill from 0) starts the pool again."""
        if start != self.end:
            raise StageFault(f"pooling chunk starts at position {start} but the pool ends at {self.end}",
                             "kv_gap")
        self.total += hidden.sum(axis=0, dtype=np.float64)
        self.count += int(hidden.shape[0])
        self.last = np.array(hidden[-1], np.float32)
        self.end = start + int(hidden.shape[0])

    def vector(self) -> np.ndarray:
        if self.how == "last":
            return self.last
        return (self.total / max(self.count, 1)).astype(np.float32)


def pool_request(extras: dict[str, Any]) -> tuple[str, bool] | None:
    """A prefill's pooling ask, checked: (pooling, last chunk) or None when it asks none."""
    how = extras.get("pool")
    if how is None:
        return None
    last = extras.get("pool_last", False)
    if how not in POOLINGS or not isinstance(last, bool):
        raise StageFault(f"pool must be one of {', '.join(POOLINGS)} and pool_last a boolean, got "
                         f"{how!r:.40} and {last!r:.40}", "bad_pooling")
    return how, last


def pool_chunk(session: Any, how: str, hidden: np.ndarray, start: int) -> Pool:
    """Add a chunk to the session's pool (a new one when the chunk starts the prompt)."""
    if start == 0 or getattr(session, "pool", None) is None or session.pool.how != how:
        session.pool = Pool(how, np.zeros(hidden.shape[1], np.float64))
    session.pool.add(np.asarray(hidden, np.float32), start)
    return session.pool

"""Request work off the event loop: a bounded pool of worker threads, and JSON written in parts.

The event loop only moves bytes. Parsing a body, validating tool schemas, rendering the template,
tokenising and assembling a big response run in an `OffLoop` pool instead; how many may wait is
capped (past it a request gets 503 with Retry-After, as when the engine's queue is full). A worker
runs Python code that gives the GIL back every few milliseconds, and the tokenizer releases it
(TextTokenizer.encode), so /health stays quick while they run.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from skippy_zmq.engine.request import EngineError

T = TypeVar("T")
# json.dumps holds the GIL for its whole call: a list longer than this is written a slice at a time
# so no single call stalls the loop (a 500k-entry logprobs list in one call: ~0.2 s).
JSON_SLICE = 512


class OffLoop:
    """A pool of `workers` threads; at most `max_waiting` jobs queued or running at once.

    Two workers by default: Python work holds the GIL, and every extra busy thread is one more the
    event loop waits behind for it (with 4 workers, /health answered in up to 2.3 s under the
    worst requests on a loaded 2-CPU machine; with 2, within 1 s)."""

    def __init__(self, workers: int = 2, max_waiting: int = 64) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="request-work")
        self._max_waiting, self._waiting = max_waiting, 0

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a worker, in the caller's context (its log request id); the caller's
        cancellation does not stop a job already running (each is bounded by its own caps)."""
        if self._waiting >= self._max_waiting:
            raise EngineError(f"the server is busy: {self._waiting} requests are being prepared", 503,
                              "overloaded", retry_after=1)
        self._waiting += 1
        try:
            context = contextvars.copy_context()
            return await asyncio.wrap_future(self._pool.submit(context.run, fn, *args))
        finally:
            self._waiting -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def dumps_in_parts(value: Any) -> bytes:
    """json.dumps(value, ensure_ascii=False, separators=(",", ":")), built from calls on pieces no
    longer than JSON_SLICE list items, so other threads (the event loop) run in between."""
    parts: list[str] = []
    _write(value, parts)
    return "".join(parts).encode()


def _write(value: Any, parts: list[str]) -> None:
    if isinstance(value, dict) and value:
        for i, (key, item) in enumerate(value.items()):
            parts.append(("{" if i == 0 else ",") + _dumps(str(key)) + ":")
            _write(item, parts)
        parts.append("}")
    elif isinstance(value, (list, tuple)) and len(value) > JSON_SLICE:
        parts.append("[")
        for start in range(0, len(value), JSON_SLICE):
            chunk = _dumps(list(value[start:start + JSON_SLICE]))
            parts.append(("," if start else "") + chunk[1:-1])
        parts.append("]")
    elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        parts.append("[")
        for i, item in enumerate(value):
            parts.append("," if i else "")
            _write(item, parts)
        parts.append("]")
    else:
        parts.append(_dumps(value))


def _dumps(value: Any) -> str:
    # as Starlette's JSONResponse renders (NaN refused)
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))

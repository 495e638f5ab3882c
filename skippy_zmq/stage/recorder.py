"""Prefix recording off the decode path.

The device-side copy of a lane's KV is dispatched at once, so it is ordered
before the next step that donates the KV arena; turning it into host arrays
and inserting them into the store happens on one background thread. The
store is shared with lookups on the loop thread, so every use takes a lock.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np
from loguru import logger

from skippy_zmq.kv.prefix_store import Entry, PrefixStore


class Recorder:
    def __init__(self, store: PrefixStore, stage_id: str = ""):
        self.store, self.stage_id = store, stage_id
        self.lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recorder")
        self._pending: list[Future] = []

    @property
    def config(self) -> Any:
        return self.store.config

    def submit(self, namespace: str, tokens: Sequence[int], kv_device: tuple[Any, Any], length: int) -> None:
        tokens = list(tokens)
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._pool.submit(self._insert, namespace, tokens, kv_device, length))

    def _insert(self, namespace: str, tokens: list[int], kv_device: tuple[Any, Any], length: int) -> None:
        t0 = time.perf_counter()
        k, v = (np.asarray(a)[:, :length] for a in kv_device)
        with self.lock:
            lengths = self.store.record(namespace, tokens, k, v)
        logger.debug("stage {} recorded {} tokens as {} in {:.1f} ms", self.stage_id, length, lengths,
                     1000 * (time.perf_counter() - t0))

    def lookup(self, namespace: str, tokens: Sequence[int]) -> Entry | None:
        with self.lock:
            return self.store.lookup(namespace, tokens)

    def stats(self) -> dict[str, int]:
        with self.lock:
            return self.store.stats()

    def flush(self, timeout: float = 60.0) -> None:
        """Wait for pending records (tests and the in-process twin need determinism)."""
        for future in self._pending:
            future.result(timeout=timeout)
        self._pending = []

"""The worst HTTP request of each kind the driver must survive, and a /health prober to measure it.

Each kind is the heaviest request of its sort that the caps (driver/limits.py) still let in, or
the attack of issue 38 that they refuse: the server must keep answering /health and streaming
other requests while it works on them. Used by tests/test_http_input_safety.py (a liveness
deadline) and scripts/health_latency.py (the latency figures).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

TIMEOUT_S = 120.0   # bound on one worst request (a hang), not a speed


@dataclass(frozen=True)
class WorstRequest:
    name: str
    endpoint: str
    body: Callable[[], bytes]   # built when sent: some are megabytes


def _tools(count: int, properties: int, description: str = "") -> list[dict[str, Any]]:
    field = {"type": "string", **({"description": description} if description else {})}
    schema = {"type": "object", "properties": {f"p{i}": field for i in range(properties)}}
    return [{"type": "function", "function": {"name": f"tool_{t}", "parameters": schema}} for t in range(count)]


def _chat(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 4, **fields}).encode()


def worst_requests(vocab_size: int) -> list[WorstRequest]:
    """The kinds, as bodies for a model with this vocabulary."""
    hi = [{"role": "user", "content": "hi"}]
    ids = [(7 * i) % vocab_size for i in range(1000)]
    return [
        # issue 38's schema bomb (100 tools x 1000 properties, 3 MB): refused by the tools caps
        WorstRequest("tools-100x1000", "/v1/chat/completions", lambda: _chat(messages=hi, tools=_tools(100, 1000))),
        # the most schema the caps let through: 100 tools of 22 described properties (~125 KB) to validate
        WorstRequest("tools-at-cap", "/v1/chat/completions",
                     lambda: _chat(messages=hi, tools=_tools(100, 22, "x" * 8))),
        # 2048 messages of ~1.9 KB: a ~4 MB render and tokenisation (then too long for the context)
        WorstRequest("messages-4mb", "/v1/chat/completions",
                     lambda: _chat(messages=[{"role": "user", "content": "lorem ipsum " * 160}] * 2048)),
        # echo + logprobs 20 + n: just under the logprob-entry cap, assembled and serialised whole
        WorstRequest("echo-logprobs-n", "/v1/completions",
                     lambda: json.dumps({"model": "m", "prompt": ids, "echo": True, "logprobs": 20, "n": 24,
                                         "max_tokens": 4}).encode()),
        # a client template (refused) and a 3 MB prompt_cache_key (refused)
        WorstRequest("client-template", "/v1/chat/completions", lambda: _chat(
            messages=hi, chat_template_kwargs={"chat_template": "{% for i in range(100000) %}"
                                               "{% for j in range(100000) %}{% endfor %}{% endfor %}"})),
        WorstRequest("cache-key-3mb", "/v1/chat/completions",
                     lambda: _chat(messages=hi, prompt_cache_key="k" * 3_000_000)),
    ]


class HealthProbe:
    """Polls GET /health every `interval_s` in a thread; `latencies` are the answer times (s)."""

    def __init__(self, url: str, interval_s: float = 0.05) -> None:
        self.url, self.interval_s = url, interval_s
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="health-probe", daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join(30)

    def _poll(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    status = client.get("/health").status_code
                except httpx.HTTPError as err:
                    self.failures.append(repr(err))
                else:
                    self.latencies.append(time.perf_counter() - start)
                    if status != 200:
                        self.failures.append(f"status {status}")
                self._stop.wait(self.interval_s)

    def summary(self) -> dict[str, float]:
        ordered = sorted(self.latencies) or [float("nan")]
        pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
        return {"polls": len(self.latencies), "p50_ms": 1000 * statistics.median(ordered),
                "p99_ms": 1000 * pick(0.99), "max_ms": 1000 * ordered[-1]}


def send(url: str, request: WorstRequest, body: bytes | None = None) -> tuple[int, str]:
    """(status, the start of the answer) of one worst request (`body`: built already)."""
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        response = client.post(request.endpoint, content=request.body() if body is None else body,
                               headers={"content-type": "application/json"})
    return response.status_code, response.text[:300]

"""Prometheus metrics for the HTTP layer, on a registry owned by one app.

Each `ServerMetrics` owns its own `CollectorRegistry` (never the global one),
so several apps can live in one process (tests) and the scheduler can add its
own collectors next to these through `.registry` / `register()`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.registry import Collector

NAMESPACE = "skippy"

# Latency buckets: TTFT spans a cold prefill of a long prompt; inter-token
# latency is a pipeline round trip (milliseconds); durations span whole streams.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Per-request accepted / drafted drafts of speculative decoding.
ACCEPTANCE_BUCKETS = tuple(round(0.1 * i, 1) for i in range(1, 11))
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# errors_total{kind}: a small fixed vocabulary keyed by HTTP status.
ERROR_KINDS = {
    400: "invalid_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
    408: "request_timeout", 413: "payload_too_large", 415: "unsupported_media_type", 421: "misdirected",
    429: "rate_limited", 431: "headers_too_large",
    503: "unavailable", 504: "timeout",
}


def error_kind(status: int) -> str:
    return ERROR_KINDS.get(status, "server_error" if status >= 500 else "client_error")


class ServerMetrics:
    """The HTTP layer's counters, histograms and gauges."""

    def __init__(self, registry: CollectorRegistry | None = None, namespace: str = NAMESPACE) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        common = {"namespace": namespace, "registry": self.registry}
        self.requests_total = Counter(
            "requests_total", "HTTP requests by endpoint and status.", ["endpoint", "status"], **common
        )
        self.errors_total = Counter("errors_total", "Failed requests by kind.", ["kind"], **common)
        self.prompt_tokens_total = Counter("prompt_tokens_total", "Prompt tokens admitted.", **common)
        self.generated_tokens_total = Counter("generated_tokens_total", "Tokens generated.", **common)
        self.cached_prompt_tokens_total = Counter(
            "cached_prompt_tokens_total", "Prompt tokens served from the prefix cache.", **common
        )
        self.time_to_first_token_seconds = Histogram(
            "time_to_first_token_seconds", "Request arrival to first token.", buckets=TTFT_BUCKETS, **common
        )
        self.inter_token_latency_seconds = Histogram(
            "inter_token_latency_seconds", "Gap between consecutive tokens.", buckets=ITL_BUCKETS, **common
        )
        self.request_duration_seconds = Histogram(
            "request_duration_seconds", "Whole request, streams included.", ["endpoint"],
            buckets=DURATION_BUCKETS, **common,
        )
        self.requests_in_flight = Gauge(
            "requests_in_flight", "Generation requests being served.", **common
        )
        self.spec_acceptance_rate = Histogram(
            "spec_acceptance_rate", "Speculative decoding: accepted / drafted draft tokens of a finished request "
            "(requests that drafted at least one token).", buckets=ACCEPTANCE_BUCKETS, **common,
        )

    def register(self, collector: Collector) -> None:
        """Hook for the engine/scheduler to publish its own metrics here."""
        self.registry.register(collector)

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests_total.labels(endpoint=endpoint, status=str(status)).inc()
        self.request_duration_seconds.labels(endpoint=endpoint).observe(seconds)

    def count_error(self, kind: str) -> None:
        self.errors_total.labels(kind=kind).inc()

    def observe_prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens_total.inc(prompt_tokens)
        self.cached_prompt_tokens_total.inc(cached_tokens)

    def observe_token(self, seconds_since_previous: float, first: bool) -> None:
        """One generated token; the first one's gap is measured from request arrival."""
        self.generated_tokens_total.inc()
        histogram = self.time_to_first_token_seconds if first else self.inter_token_latency_seconds
        histogram.observe(seconds_since_previous)

    def observe_speculation(self, spec: Mapping[str, Any] | None) -> None:
        """A request's final `stats["speculative"]` ({windows, drafted, accepted}); None or nothing drafted: skipped."""
        if spec and spec.get("drafted", 0) > 0:
            self.spec_acceptance_rate.observe(spec.get("accepted", 0) / spec["drafted"])

    def in_flight(self, tracked: bool = True) -> AbstractContextManager[object]:
        return self.requests_in_flight.track_inprogress() if tracked else nullcontext()

    def render(self) -> tuple[bytes, str]:
        """Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

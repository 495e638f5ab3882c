"""Pipeline metrics next to the HTTP ones: scheduler load, per-stage state from
heartbeats, per-stage compute and lock wait from the traces replies carry,
speculative decoding's drafts and accepted runs."""

from __future__ import annotations

import threading
from typing import Any, Iterator

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from skippy_zmq.protocol import wire
from skippy_zmq.engine.metrics import NAMESPACE, ServerMetrics

COMPUTE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
ACCEPTED_LENGTH_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16)

STAGE_COUNTERS = {"messages": "messages handled", "errors": "error replies sent", "tokens": "tokens computed",
                  "bytes_forwarded": "activation bytes sent to the next stage",
                  "cache_hits": "prefix-store lookups that hit", "cache_misses": "prefix-store lookups that missed",
                  "cache_evictions": "prefix-store entries evicted", "cache_records": "prefix-store records",
                  "fenced": "requests dropped as meant for a dead predecessor or an older chain view",
                  "unstamped": "requests dropped for want of the driver's chain view stamp (security on)",
                  "zap_rejected": "connections its authenticator refused (a key that is not its upstream's)",
                  "peer_rejected": "messages dropped as sent under a key that is not its upstream's",
                  "run_on_dropped": "steps run on (its own, or the last stage's on a ring) that ran nothing: the "
                                    "driver had moved on from the session, or never asked",
                  "cold_steps": "steps that compiled on the spot (a shape no warm-up had reached)",
                  "behind_waits": "shapes its compile thread started, after waiting, while a request held a lane",
                  "behind_child": "whole-slice shapes its compile child process compiled (read from the cache)",
                  "loop_compiles": "XLA compiles and compile-cache reads on its loop thread after READY (a "
                                   "request arriving meanwhile waits for each)",
                  "constraint_mask_seconds": "seconds computing structured-output token masks (final stage; "
                                             "per token: rate of this / rate of constraint_masks)",
                  "constraint_masks": "structured-output token masks computed (final stage)",
                  "moe_layer_passes": "mixture-of-experts layers its steps ran (steps x its MoE layers; 0: dense)",
                  "moe_experts_routed": "distinct experts the real tokens of those MoE layer passes chose, summed "
                                        "(experts per layer and step: rate of this / rate of moe_layer_passes; a "
                                        "one-row decode step routes to n_experts_used)"}
STAGE_GAUGES = {"cache_bytes": "bytes held by the prefix store", "cache_entries": "prefix-store entries",
                "lanes_in_use": "KV lanes held by sessions",
                "weight_bytes": "bytes of the weights it holds", "kv_bytes": "bytes of its KV arena",
                "rss_bytes": "resident set of the stage process (heartbeats)",
                "predicted_bytes": "bytes placement.py predicts it needs (0: not predicted)",
                "memory_budget_bytes": "its topology memory budget (0: none)",
                "warmups_pending": "shape compiles it still runs while idle after READY (0: every decode shape a "
                                   "driver can send is compiled, and its memory has reached what the plan counts)"}


class PipelineCollector(Collector):
    """Read at scrape time: nothing to keep in sync."""

    def __init__(self, engine: Any):
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        load = self.engine.scheduler.load
        for key, help_text in (("running", "sessions generating"), ("queued", "requests waiting for admission"),
                               ("batches_in_flight", "decode micro-batches in the pipeline")):
            yield GaugeMetricFamily(f"{NAMESPACE}_{key}", f"Scheduler: {help_text}.", value=load[key])
        prefix = CounterMetricFamily(f"{NAMESPACE}_prefix_cache_requests", "Requests by prefix-cache status.",
                                     labels=["status"])
        for status, count in self.engine.scheduler.prefix_counts.items():
            prefix.add_metric([status], float(count))
        yield prefix
        faults = CounterMetricFamily(f"{NAMESPACE}_stage_failures", "Stage failures detected.", value=len(self.engine.faults))
        yield faults
        yield CounterMetricFamily(f"{NAMESPACE}_kv_gap_heals", "Sessions re-prefilled after a stage reported a KV gap.",
                                  value=self.engine.scheduler.heals)
        yield CounterMetricFamily(f"{NAMESPACE}_wire_rejected",
                                  "Replies the driver dropped: sent under another stage's key, or naming another stage.",
                                  value=self.engine.wire_rejected)
        yield CounterMetricFamily(f"{NAMESPACE}_driver_internal_errors",
                                  "Driver bugs its loop survived (a reply or command that raised; see the log).",
                                  value=self.engine.internal_errors)
        if self.engine.faults:
            last = self.engine.faults[-1]
            for key in ("detect_s", "resume_s"):
                if key in last:
                    yield GaugeMetricFamily(f"{NAMESPACE}_last_failure_{key[:-2]}_seconds",
                                            f"Last stage failure: time to {key[:-2]}.", value=last[key])
        up = GaugeMetricFamily(f"{NAMESPACE}_stage_up", "1 when the stage is ready and heartbeating.", labels=["stage"])
        gauges = {k: GaugeMetricFamily(f"{NAMESPACE}_stage_{'kv_' if k == 'lanes_in_use' else ''}{k}",
                                       f"Stage: {h}.", labels=["stage"]) for k, h in STAGE_GAUGES.items()}
        counters = {k: CounterMetricFamily(f"{NAMESPACE}_stage_{k}", f"Stage: {h}.", labels=["stage"])
                    for k, h in STAGE_COUNTERS.items()}
        for state in self.engine.stages.values():
            up.add_metric([state.stage_id], 1.0 if state.ready else 0.0)
            for key, family in {**gauges, **counters}.items():
                family.add_metric([state.stage_id], float(state.info.get(key, 0)))
        yield up
        kernel = GaugeMetricFamily(f"{NAMESPACE}_stage_kernel_info", "Stage: the native CPU kernels its steps use "
                                   "(matmul: the quantised-matmul loops' instruction set, xla when none; "
                                   "decode_attention: kernel or xla); always 1.", labels=["stage", "matmul",
                                                                                        "decode_attention"])
        for state in self.engine.stages.values():
            if "kernel_matmul" in state.info:
                kernel.add_metric([state.stage_id, str(state.info["kernel_matmul"]),
                                   str(state.info.get("kernel_decode_attention", ""))], 1.0)
        yield kernel
        yield from gauges.values()
        yield from counters.values()


def speculation_enabled(engine: Any) -> bool:
    """The driver topology's driver.speculative (the scheduler's copy when there is no topology)."""
    topology = getattr(engine, "topology", None)
    spec = topology.driver.speculative if topology is not None else engine.scheduler.cfg.speculative
    return bool(spec.enabled)


class SpecCollector(Collector):
    """Speculative decoding: the scheduler's cumulative counts, read at scrape time, and a
    histogram of accepted drafts per verify window, fed by draining `spec_accepted_lengths`
    (the pipeline thread appends one int per window) on every scrape."""

    def __init__(self, engine: Any):
        self.engine = engine
        self._lock = threading.Lock()   # two scrapes at once: one drains, both read consistent buckets
        self.accepted_length = Histogram("spec_accepted_length", "Speculative decoding: draft tokens accepted per "
                                         "verify window.", namespace=NAMESPACE, registry=None,
                                         buckets=ACCEPTED_LENGTH_BUCKETS)

    def drain(self) -> None:
        sched = self.engine.scheduler
        taken, sched.spec_accepted_lengths = sched.spec_accepted_lengths, []   # one swap: atomic under the GIL
        for n in taken:
            self.accepted_length.observe(n)

    def collect(self) -> Iterator[Any]:
        # Drain first, then read the counts: the scheduler counts a window before it appends its
        # length, so a scrape never shows more histogram observations than windows.
        with self._lock:
            self.drain()
            lengths = list(self.accepted_length.collect())
        counts = dict(self.engine.scheduler.spec_counts)
        yield GaugeMetricFamily(f"{NAMESPACE}_spec_enabled", "1 when the driver's topology has speculative "
                                "decoding on (driver.speculative.method is not off).",
                                value=1.0 if speculation_enabled(self.engine) else 0.0)
        for name, value, help_text in (
                ("drafted_tokens", counts["drafted"], "draft tokens sent for verification"),
                ("accepted_tokens", counts["accepted"], "draft tokens the target accepted"),
                ("rejected_tokens", counts["drafted"] - counts["accepted"], "draft tokens the target rejected "
                 "(drafted - accepted)"),
                ("windows", counts["windows"], "verify windows that carried at least one draft; windows per "
                 "second: rate(skippy_spec_windows_total[1m])"),
                ("plain_steps", counts["plain_steps"], "decode steps of speculating sessions that carried no "
                 "draft"),
                ("ahead_windows", counts["ahead_sent"], "windows sent ahead of one still in flight (pipelined "
                 "windows)"),
                ("ahead_retired", counts["ahead_retired"], "windows sent ahead whose earlier window was not fully "
                 "accepted (their work was wasted)")):
            yield CounterMetricFamily(f"{NAMESPACE}_spec_{name}", f"Speculative decoding: {help_text}.",
                                      value=float(value))
        yield from lengths


class TraceMetrics:
    """Histograms fed by the per-stage trace that PREDICTED_TOKENS and ACK replies carry."""

    def __init__(self, metrics: ServerMetrics):
        common = {"namespace": NAMESPACE, "registry": metrics.registry}
        self.compute = Histogram("stage_compute_seconds", "Stage compute per message.", ["stage"],
                                 buckets=COMPUTE_BUCKETS, **common)
        self.lock_wait = Histogram("stage_lock_wait_seconds", "Stage runtime lock wait per message.", ["stage"],
                                   buckets=COMPUTE_BUCKETS, **common)
        self.rows = Histogram("decode_batch_rows", "Sessions per decode message.", buckets=ROW_BUCKETS, **common)

    def on_reply(self, stage_id: str, msg: wire.Message) -> None:
        if msg.kind == wire.Kind.PREDICTED_TOKENS:
            trace = msg.extras.get("trace", [])
            self.rows.observe(len(msg.tokens))
        elif msg.kind == wire.Kind.ACK:
            trace = msg.extras.get("stats", {}).get("trace", [])
        else:
            return
        for hop in trace:
            self.compute.labels(stage=hop["stage"]).observe(hop["compute_ms"] / 1000)
            self.lock_wait.labels(stage=hop["stage"]).observe(hop.get("lock_wait_ms", 0.0) / 1000)


def attach(engine: Any, metrics: ServerMetrics) -> None:
    metrics.register(PipelineCollector(engine))
    metrics.register(SpecCollector(engine))
    engine.on_reply_hooks.append(TraceMetrics(metrics).on_reply)

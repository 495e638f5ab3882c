"""Speculative decoding on /metrics: the scheduler's counts, accepted runs per window, per-request acceptance.

A real Scheduler with n-gram speculation drives an in-process chain of the tiny random model (its greedy
output loops, so drafts are proposed, accepted and rejected); the collectors are read through a
CollectorRegistry as a scrape would.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conftest import TINY, random_ids
from pipeline_helpers import make_chain, make_scheduler
from skippy_zmq.engine import pipeline_metrics
from skippy_zmq.engine.request import GenRequest
from skippy_zmq.engine.metrics import ACCEPTANCE_BUCKETS, ServerMetrics
from skippy_zmq.engine.pipeline_metrics import ACCEPTED_LENGTH_BUCKETS
from skippy_zmq.config.speculative import SpeculativeConfig
from skippy_zmq.engine.inproc import run_requests
from skippy_zmq.sampling import SamplingParams
from model_helpers import random_params

SPEC = SpeculativeConfig(method="ngram", max_draft=8, min_match=1, shared=False)
_TREE: dict = {}


def tree() -> dict:
    if not _TREE:
        _TREE.update(random_params(TINY, seed=0))
    return _TREE


def requests(tag: str, max_tokens: int = 40) -> list[GenRequest]:
    looped = (random_ids(6, TINY.vocab_size, seed=3).tolist() * 4)[:21]
    prompts = [looped, random_ids(30, TINY.vocab_size, seed=30).tolist(),
               random_ids(9, TINY.vocab_size, seed=9).tolist()]
    return [GenRequest(f"{tag}{i}", tuple(p), SamplingParams(), max_tokens=max_tokens, ignore_eos=True)
            for i, p in enumerate(prompts)]


def engine_with(spec: SpeculativeConfig) -> SimpleNamespace:
    """What the collectors read of a PipelineEngine."""
    sched = make_scheduler(2, speculative=spec)
    return SimpleNamespace(scheduler=sched, topology=SimpleNamespace(driver=SimpleNamespace(speculative=spec)),
                           stages={}, faults=[], on_reply_hooks=[], internal_errors=0, wire_rejected=0)


def scrape(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def final_stats(events: dict[str, list]) -> list[dict]:
    return [ev[-1].stats["speculative"] for ev in events.values()]


def test_counters_and_accepted_length_histogram_follow_the_scheduler():
    engine, metrics = engine_with(SPEC), ServerMetrics()
    pipeline_metrics.attach(engine, metrics)
    sched = engine.scheduler
    events = run_requests(sched, make_chain(TINY, tree(), [2]), requests("a"))
    lengths = list(sched.spec_accepted_lengths)
    counts = dict(sched.spec_counts)
    assert counts["windows"] > 0 and 0 < counts["accepted"] < counts["drafted"]   # accepts and rejects both
    assert len(lengths) == counts["windows"] and sum(lengths) == counts["accepted"]

    got = scrape(metrics)
    assert got[("skippy_spec_enabled", ())] == 1.0
    assert got[("skippy_spec_drafted_tokens_total", ())] == counts["drafted"]
    assert got[("skippy_spec_accepted_tokens_total", ())] == counts["accepted"]
    assert got[("skippy_spec_rejected_tokens_total", ())] == counts["drafted"] - counts["accepted"]
    assert got[("skippy_spec_windows_total", ())] == counts["windows"]
    assert got[("skippy_spec_plain_steps_total", ())] == counts["plain_steps"]
    assert got[("skippy_spec_ahead_windows_total", ())] == counts["ahead_sent"]
    assert got[("skippy_spec_ahead_retired_total", ())] == counts["ahead_retired"]
    assert got[("skippy_spec_accepted_length_count", ())] == counts["windows"]
    assert got[("skippy_spec_accepted_length_sum", ())] == counts["accepted"]
    for bound in ACCEPTED_LENGTH_BUCKETS:
        assert got[("skippy_spec_accepted_length_bucket", (("le", f"{float(bound)}"),))] == \
            sum(1 for n in lengths if n <= bound)
    assert sched.spec_accepted_lengths == []   # drained

    # The final events carry each session's policy counts; they miss at most the window each
    # request finished in (see test_final_event_stats_include_the_last_window).
    stats = final_stats(events)
    for key in ("windows", "drafted", "accepted"):
        assert 0 < sum(s[key] for s in stats) == counts[key]

    # A second scrape counts nothing twice; more requests add to the same series.
    assert scrape(metrics) == got
    run_requests(sched, make_chain(TINY, tree(), [2]), requests("b"))
    again = scrape(metrics)
    assert again[("skippy_spec_windows_total", ())] == sched.spec_counts["windows"] > counts["windows"]
    assert again[("skippy_spec_accepted_length_count", ())] == sched.spec_counts["windows"]
    assert again[("skippy_spec_accepted_length_sum", ())] == sched.spec_counts["accepted"]


def test_acceptance_rate_is_observed_per_finished_request():
    engine, metrics = engine_with(SPEC), ServerMetrics()
    events = run_requests(engine.scheduler, make_chain(TINY, tree(), [2]), requests("a"))
    stats = final_stats(events)
    for s in stats:
        metrics.observe_speculation(s)
    metrics.observe_speculation(None)                                         # speculation off for it
    metrics.observe_speculation({"windows": 0, "drafted": 0, "accepted": 0})   # never drafted: no rate
    rates = [s["accepted"] / s["drafted"] for s in stats if s["drafted"]]
    assert rates
    got = scrape(metrics)
    assert got[("skippy_spec_acceptance_rate_count", ())] == len(rates)
    assert abs(got[("skippy_spec_acceptance_rate_sum", ())] - sum(rates)) < 1e-9
    for bound in ACCEPTANCE_BUCKETS:
        assert got[("skippy_spec_acceptance_rate_bucket", (("le", f"{bound}"),))] == \
            sum(1 for r in rates if r <= bound)
    assert got[("skippy_spec_acceptance_rate_bucket", (("le", "1.0"),))] == len(rates)


def test_speculation_off_exposes_zeros():
    off = SpeculativeConfig()
    engine, metrics = engine_with(off), ServerMetrics()
    pipeline_metrics.attach(engine, metrics)
    events = run_requests(engine.scheduler, make_chain(TINY, tree(), [2]), requests("a", max_tokens=8))
    assert all("speculative" not in ev[-1].stats for ev in events.values())
    got = scrape(metrics)
    assert got[("skippy_spec_enabled", ())] == 0.0
    for name in ("drafted_tokens", "accepted_tokens", "rejected_tokens", "windows", "plain_steps"):
        assert got[(f"skippy_spec_{name}_total", ())] == 0.0
    assert got[("skippy_spec_accepted_length_count", ())] == 0.0
    assert got[("skippy_spec_acceptance_rate_count", ())] == 0.0


def test_final_event_stats_include_the_last_window():
    engine = engine_with(SPEC)
    events = run_requests(engine.scheduler, make_chain(TINY, tree(), [2]), requests("a"))
    stats = final_stats(events)
    for key in ("windows", "drafted", "accepted"):
        assert sum(s[key] for s in stats) == engine.scheduler.spec_counts[key]

"""The soak benchmark's request mix (skippy_zmq/devtools/soak.py): kinds, turns, and one short mixed soak
against the shared 2-stage pipeline with the official client."""

from __future__ import annotations

import argparse
import json

import pytest

from skippy_zmq.devtools import soak


def test_mix_parses_names_and_all():
    assert soak.parse_mix("all") == tuple(soak.KINDS)
    assert soak.parse_mix("plain, n2") == ("plain", "n2")
    for bad in ("plain,nope", "", "plain,plain"):
        with pytest.raises(argparse.ArgumentTypeError, match="give 'all' or distinct names"):
            soak.parse_mix(bad)
    with pytest.raises(SystemExit):
        soak.build_parser().parse_args(["--url", "http://x/v1", "--mix", "nope"])
    assert soak.build_parser().parse_args(["--url", "http://x/v1"]).mix == ("plain",)


def test_clients_start_staggered_so_every_kind_runs_at_once():
    mix = tuple(soak.KINDS)
    first = [soak.kind_for(i, 0, mix) for i in range(len(mix))]
    assert sorted(first) == sorted(mix)
    assert [soak.kind_for(2, n, mix) for n in range(len(mix))] == list(mix[2:] + mix[:2])


def test_memory_verdict_compares_after_the_warm_up():
    rec = soak.MinuteTally(start=0.0)
    for t in range(0, 300, 10):      # grows through minute 1, flat from minute 2
        rec.rss.append({"t": float(t), "rss_mb": {"s0": 100.0 + min(t, 60)}})
    verdict = soak.memory_verdict(rec, 300.0, warmup_min=2.0, flat_pct=5.0)
    assert verdict["judged"] and verdict["flat"] is True and verdict["warmup_end_min"] == 2.0
    assert verdict["processes"]["s0"] == {"baseline_mb": 160.0, "last_mb": 160.0, "growth_pct": 0.0}
    rec.rss.append({"t": 295.0, "rss_mb": {"s0": 400.0}})
    assert soak.memory_verdict(rec, 300.0, warmup_min=2.0, flat_pct=5.0)["flat"] is False


def test_warm_up_lasts_until_the_prefix_stores_are_full():
    """A stage's RSS that grows with its prefix store until minute 5 and is flat after: the warm-up
    ends at minute 5 (not 2), and the run is flat; if the store still fills at the end, no verdict."""
    rec = soak.MinuteTally(start=0.0)
    for t in range(0, 600, 10):
        cache = min(t, 300) / 3.0
        rec.rss.append({"t": float(t), "rss_mb": {"s0": 500.0 + cache, "driver": 200.0}, "cache_mb": {"s0": cache}})
    assert soak.store_full_s(rec) == 300.0     # the first sample at >= 98% of the 100 MB peak
    verdict = soak.memory_verdict(rec, 600.0, warmup_min=2.0, flat_pct=5.0)
    assert verdict["warmup_end_min"] == 5.0 and verdict["flat"] is True
    assert verdict["processes"]["s0"]["growth_pct"] == 0.0
    early = soak.MinuteTally(start=0.0, rss=[s for s in rec.rss if s["t"] < 240])
    assert soak.memory_verdict(early, 240.0, warmup_min=2.0, flat_pct=5.0)["judged"] is False


def test_a_short_mixed_soak_has_no_errors(shared_pipelines, tmp_path):
    served = shared_pipelines(2)
    run = tmp_path / "run"
    run.mkdir()
    for i, proc in enumerate(served.procs):
        (run / f"s{i}.pid").write_text(f"{proc.pid}\n")
    rc = soak.main(["--url", served.url + "/v1", "--run-dir", str(run), "--out", str(tmp_path / "out"),
                    "--streams", str(len(soak.KINDS)), "--minutes", "0.1", "--max-tokens", "8",
                    "--mix", "all", "--sample-s", "2", "--request-timeout", "300"])
    result = json.loads((tmp_path / "out" / "soak.json").read_text())
    summary = result["summary"]
    assert summary["errors"] == 0, result["error_samples"]
    assert set(summary["requests_by_kind"]) == set(soak.KINDS), summary["requests_by_kind"]
    assert summary["tokens"] > 0 and rc == 0
    stages = {f"s{i}" for i in range(len(served.procs))}
    assert {name for s in result["rss_samples"] for name in s["rss_mb"]} == stages
    assert set(result["rss_samples"][-1]["cache_mb"]) == stages      # the prefix stores, from /metrics
    assert soak.stage_gauges(served.url + "/v1", "warmups_pending") == dict.fromkeys(stages, 0.0)

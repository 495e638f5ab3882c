"""Serving under concurrency through the real 2-stage pipeline and HTTP server."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import re
import time

import httpx
import openai
import pytest

from procs import TEST_CONTEXT

from skippy_zmq.model import quant


QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "Name three primes.",
             "Why is the sky blue?", "Say hello in Spanish.", "What is 7 times 8?", "Describe a cat.",
             "Give me a fruit name."]


@pytest.fixture(scope="module")
def served(shared_pipelines):
    shared = shared_pipelines(2)
    return shared.engine, shared.url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


def ask(url: str, question: str, stream: bool) -> str:
    kwargs = dict(model="m", messages=[{"role": "user", "content": question}], max_tokens=20, temperature=0)
    if not stream:
        return client(url).chat.completions.create(**kwargs).choices[0].message.content
    chunks = client(url).chat.completions.create(stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(rf"^{name}{{?{re.escape(labels)}}}? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def test_eight_concurrent_streams_equal_solo_runs(served):
    _, url = served
    solo = [ask(url, q, stream=False) for q in QUESTIONS]
    with cf.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda q: ask(url, q, stream=True), QUESTIONS))
    assert together == solo
    assert all(solo)
    text = httpx.get(url + "/metrics").text
    rows = re.search(r"^skippy_decode_batch_rows_sum ([0-9.e+]+)$", text, re.M)
    count = re.search(r"^skippy_decode_batch_rows_count ([0-9.e+]+)$", text, re.M)
    assert float(rows.group(1)) / float(count.group(1)) > 1.0     # rows were batched across requests


def test_disconnect_frees_lanes_on_every_stage(served):
    _, url = served
    body = {"model": "m", "prompt": "Count to one thousand:", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()     # keep a reference: a collected iterator closes the connection
        for i, _line in enumerate(lines):
            if i > 4:
                break
        assert metric(url, "skippy_running") == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lanes = [metric(url, "skippy_stage_kv_lanes_in_use", f'stage="s{i}"') for i in (0, 1)]
        if lanes == [0.0, 0.0] and metric(url, "skippy_running") == 0:
            break
        time.sleep(0.1)
    assert lanes == [0.0, 0.0]
    assert metric(url, "skippy_stage_bytes_forwarded_total", 'stage="s0"') > 0


def test_overload_returns_429_instead_of_queueing(served):
    engine, url = served
    original = engine.scheduler.cfg
    engine.scheduler.cfg = dataclasses.replace(original, max_sessions=1, max_queue=0)
    body = {"model": "m", "prompt": "Tell a long story:", "max_tokens": 300, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            next(lines)
            with pytest.raises(openai.RateLimitError) as exc:
                client(url).completions.create(model="m", prompt="hi", max_tokens=4)
            assert exc.value.response.headers.get("retry-after")
    finally:
        engine.scheduler.cfg = original
    assert "rate_limited" in httpx.get(url + "/metrics").text


def test_repeated_prompt_reports_cached_tokens_and_cache_metrics(served):
    _, url = served
    system = "You are a careful assistant. " * 20
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Say something kind."}]
    replies = [client(url).chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
               for _ in range(2)]
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    assert replies[0].usage.prompt_tokens_details.cached_tokens == 0
    assert replies[1].usage.prompt_tokens_details.cached_tokens == replies[1].usage.prompt_tokens - 1
    assert metric(url, "skippy_prefix_cache_requests_total", 'status="hit"') >= 1
    def stage_stats():
        return (metric(url, "skippy_stage_cache_bytes", 'stage="s0"'),
                metric(url, "skippy_stage_cache_hits_total", 'stage="s1"'))

    deadline = time.monotonic() + 5          # stage stats arrive with the next heartbeats
    while not (stage_stats()[0] > 0 and stage_stats()[1] >= 1) and time.monotonic() < deadline:
        time.sleep(0.1)
    held, hits = stage_stats()
    assert held > 0 and hits >= 1


def test_metrics_show_each_stage_weight_kv_and_rss_bytes(served):
    _, url = served
    # the checkpoint's own blocks (weights: auto): a layer's matrices (wq/wo 576², wk/wv 576x192, 3 x 576x1536)
    # in Q4_1 (20 bytes a block of 32), its 2 norms of 576 in f32; the tied embedding in Q8_0 (34 bytes a
    # block of 32) sits on both stages (the last one's head), the final norm on the last
    layer = 3_538_944 // 32 * 20 + 4 * 2 * 576
    embed, norm = 49_152 * 576 // 32 * 34, 4 * 576
    expected = {"s0": 15 * layer + embed, "s1": 15 * layer + embed + norm}
    for stage, weight_bytes in expected.items():
        label = f'stage="{stage}"'
        assert metric(url, "skippy_stage_weight_bytes", label) == weight_bytes
        kv = 2 * 15 * 3 * 64 * (TEST_CONTEXT + 1) * 8 * 4   # K+V, f32, 8 lanes, the capacity and the spare slot
        assert metric(url, "skippy_stage_kv_bytes", label) == kv
        assert metric(url, "skippy_stage_rss_bytes", label) > weight_bytes + kv
        assert metric(url, "skippy_stage_predicted_bytes", label) > weight_bytes + kv + 256 * 2**20
        assert metric(url, "skippy_stage_memory_budget_bytes", label) == 0
        # the quantised matmuls and decode attention run in the CPU kernel, its loops this CPU's best
        kernels = f'decode_attention="kernel",matmul="{quant.kernel_isa()}",{label}'   # the exposition sorts labels
        assert metric(url, "skippy_stage_kernel_info", kernels) == 1.0


def running_choices(engine) -> list[int]:
    """The choice index of every job the driver is running, read on its loop thread."""
    import queue

    out: queue.Queue = queue.Queue(maxsize=1)
    engine.call(lambda: out.put(sorted(j.choice for j in engine.scheduler.running.values())))
    return out.get(timeout=60)


def test_a_stop_string_ends_one_choice_job_at_once_while_the_other_decodes(served):
    """n = 2 on real stages with the official client: choice 1's stop string (in its first words,
    not in choice 0's text) ends choice 1's job while choice 0 still has dozens of tokens to go;
    choice 0's text is the same as without the stop, and every lane is free at the end."""
    engine, url = served
    kwargs = dict(model="m", prompt="Once upon a time, in a small village,", n=2, max_tokens=96,
                  temperature=1.0, seed=11, extra_body={"ignore_eos": True, "speculative": False})
    free = {c.index: c.text for c in client(url).completions.create(**kwargs).choices}
    words = [w for w in re.findall(r"[A-Za-z]{4,}", free[1][:80]) if w not in free[0]]
    assert words, free           # the seed gives choice 1 a word of its own early on
    stop = words[0]
    texts, finish, seen_running = {0: "", 1: ""}, {}, None
    for chunk in client(url).completions.create(stream=True, stop=[stop], **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
            if c.index == 1 and c.finish_reason and seen_running is None:
                deadline = time.monotonic() + 60   # bound on a hang: the cancel is the loop's next command
                while (seen_running := running_choices(engine)) != [0] and time.monotonic() < deadline:
                    time.sleep(0.05)
    assert seen_running == [0]   # choice 1's job was gone while choice 0 decoded on
    assert finish == {0: "length", 1: "stop"}
    assert texts[1] == free[1][:free[1].index(stop)] and texts[0] == free[0]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lanes = [metric(url, "skippy_stage_kv_lanes_in_use", f'stage="s{i}"') for i in (0, 1)]
        if lanes == [0.0, 0.0]:
            break
        time.sleep(0.1)
    assert lanes == [0.0, 0.0]

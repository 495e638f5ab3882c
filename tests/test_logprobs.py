"""Logprobs computed on the final stage: values, transport, speculation, and the OpenAI shapes.

Fast: in-process chains of real StageWorkers on the tiny random model, checked against a float64
log-softmax of an independent whole-sequence forward. Slow (marked): one real 2-stage SmolLM2
pipeline with speculation on, against `forward_reference` on weights from `load_slice`, and the
official `openai` client over HTTP.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import TINY, random_ids
from pipeline_helpers import CACHE, make_chain, make_scheduler
from skippy_zmq.engine.request import GenRequest, TokenEvent
from skippy_zmq.config.speculative import SpeculativeConfig
from skippy_zmq.engine.inproc import run_requests, tokens_of
from skippy_zmq.sampling import SamplingParams, TokenHistory, adjust_logits
from model_helpers import forward_reference, random_params

SPEC = SpeculativeConfig(method="ngram", max_draft=8, min_match=1, shared=False)
TOL = 1e-4


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def reference_logprobs(params_tree, cfg, prompt: list[int], generated: list[int],
                       sampling: SamplingParams) -> np.ndarray:
    """[len(generated), V] float64 log-softmax of the adjusted logits that chose each generated
    token, from one whole-sequence forward (no cache, no windows, no pipeline)."""
    import jax.numpy as jnp

    ids = np.asarray(prompt + generated[:-1], np.int32)
    logits = np.asarray(forward_reference(params_tree, jnp.asarray(ids)[None], cfg))[0]
    rows = []
    for j in range(len(generated)):
        row = logits[len(prompt) - 1 + j]
        if sampling.has_adjustments:
            row = adjust_logits(row, sampling, TokenHistory(prompt, generated[:j]))
        rows.append(log_softmax64(row))
    return np.stack(rows)


def check_events(events: list, want: np.ndarray, top_n: int, tol: float = TOL) -> None:
    tokens = [e for e in events if isinstance(e, TokenEvent) and e.token_id is not None]
    assert len(tokens) == want.shape[0]
    for j, event in enumerate(tokens):
        ref = want[j]
        assert event.logprob is not None and abs(event.logprob - ref[event.token_id]) <= tol, (j, event)
        assert len(event.top_logprobs) == top_n
        values = [v for _, v in event.top_logprobs]
        assert values == sorted(values, reverse=True)
        best = np.sort(ref)[::-1][:top_n]
        for (tid, value), expect in zip(event.top_logprobs, best):
            assert abs(value - ref[tid]) <= tol and abs(value - expect) <= tol


# ---------------------------------------------------------------- fast: the tiny model, in process

_TREE: dict = {}


def tiny_tree_of() -> dict:
    if not _TREE:
        _TREE.update(random_params(TINY, seed=0))
    return _TREE


def tiny_runtime():
    import jax.numpy as jnp

    from skippy_zmq.model import weights
    return weights.to_runtime(tiny_tree_of(), jnp.float32)


def looped_prompt() -> list[int]:
    return (random_ids(6, TINY.vocab_size, seed=3).tolist() * 4)[:21]


@pytest.mark.parametrize("sampling", [
    SamplingParams(),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=4),
    SamplingParams(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.3, logit_bias={5: 2.0}),
], ids=["greedy", "sampled", "penalties"])
def test_inproc_logprobs_with_speculation_match_a_float64_reference(sampling):
    prompt = looped_prompt()
    req = GenRequest("r", tuple(prompt), sampling, max_tokens=30, ignore_eos=True, logprobs=5)
    sched = make_scheduler(2, speculative=SPEC)
    on = run_requests(sched, make_chain(TINY, tiny_tree_of(), [2]), [req])["r"]
    assert sched.spec_counts["windows"] > 0
    if sampling.temperature == 0:   # windows were accepted: their entries were used
        assert sched.spec_counts["accepted"] > 0
    off = run_requests(make_scheduler(2), make_chain(TINY, tiny_tree_of(), [2]), [req])["r"]
    assert tokens_of(on) == tokens_of(off)
    generated = tokens_of(on)
    ref = reference_logprobs(tiny_runtime(), TINY, prompt, generated, sampling)
    check_events(on, ref, 5)
    check_events(off, ref, 5)


def test_rows_without_logprobs_beside_rows_with_them():
    prompts = [looped_prompt(), random_ids(9, TINY.vocab_size, seed=9).tolist()]
    reqs = [GenRequest("with", tuple(prompts[0]), max_tokens=16, ignore_eos=True, logprobs=0),
            GenRequest("without", tuple(prompts[1]), max_tokens=16, ignore_eos=True)]
    events = run_requests(make_scheduler(2, speculative=SPEC), make_chain(TINY, tiny_tree_of(), [2]), reqs)
    tokens = [e for e in events["with"] if e.token_id is not None]
    assert all(e.logprob is not None and e.top_logprobs == [] for e in tokens)
    assert all(e.logprob is None and e.top_logprobs is None for e in events["without"])
    ref = reference_logprobs(tiny_runtime(), TINY, prompts[0], tokens_of(events["with"]), SamplingParams())
    check_events(events["with"], ref, 0)


def test_logprobs_after_a_fused_prefix_restore_and_a_resume():
    prompt = looped_prompt()
    req = GenRequest("a", tuple(prompt), max_tokens=20, ignore_eos=True, logprobs=3)
    sched = make_scheduler(2, cache=CACHE, speculative=SPEC)
    chain = make_chain(TINY, tiny_tree_of(), [2], cache=CACHE)
    run_requests(sched, chain, [req])
    again = run_requests(sched, chain, [dataclasses.replace(req, request_id="b")])["b"]
    assert again[0].cached_tokens == len(prompt) - 1 and sched.prefix_counts["hit"] == 1
    ref = reference_logprobs(tiny_runtime(), TINY, prompt, tokens_of(again), SamplingParams())
    check_events(again, ref, 3)


def test_constrained_logprobs_are_over_the_masked_logits():
    """With a constraint the values are the log-softmax of the masked logits: what the stage could
    choose from sums to probability one, and nothing masked shows up."""
    import numpy as np

    from skippy_zmq.sampling import Sampler

    class EvenOnly:   # a stand-in matcher: only even token ids are allowed
        def allows(self, token): return token % 2 == 0
        def advance(self, token): pass
        def rollback(self, n): pass
        def mask(self): return np.arange(TINY.vocab_size) % 2 == 0

    logits = np.random.default_rng(0).normal(0, 2, TINY.vocab_size).astype(np.float32)
    s = Sampler(SamplingParams(), [1, 2], matcher=EvenOnly(), logprobs=20)
    token, (lp, top) = s.choose_logprobs(logits, 1, 20)
    assert token % 2 == 0 and all(t % 2 == 0 for t, _ in top) and len(top) == 20
    masked = np.where(np.arange(TINY.vocab_size) % 2 == 0, logits, -np.inf)
    ref = log_softmax64(masked)
    assert lp == pytest.approx(ref[token], abs=1e-12)
    assert np.exp(ref[::2]).sum() == pytest.approx(1.0)


# ---------------------------------------------------------------- fast: the OpenAI shapes (scripted engine)

FAKE_REPLY = "Hello there! 日本語 and more."


@pytest.fixture(scope="module")
def fake_server():
    from fake_engine import FakeEngine

    from skippy_zmq.api.server import create_app, start_in_thread
    from skippy_zmq.text.tokenizer import TextTokenizer

    from conftest import MODEL_DIR
    if not (MODEL_DIR / "tokenizer.json").is_file():
        pytest.skip(f"no tokenizer at {MODEL_DIR}")
    tok = TextTokenizer.load(MODEL_DIR)
    engine = FakeEngine([*tok.encode(FAKE_REPLY), tok.eos_ids[0]], tok.eos_ids, max_context=256)
    handle = start_in_thread(create_app(engine, tok, model_name="fake"))
    yield handle, tok, engine
    handle.stop()


def openai_client(url: str):
    import openai
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)


def check_chat_content(content, text: str, top_n: int) -> None:
    assert b"".join(bytes(e.bytes) for e in content).decode() == text
    for e in content:
        assert e.token == bytes(e.bytes).decode("utf-8", errors="replace")
        assert isinstance(e.logprob, float) and e.logprob <= 0
        assert len(e.top_logprobs) == top_n
        assert all(t.token == bytes(t.bytes).decode("utf-8", errors="replace") for t in e.top_logprobs)


def test_chat_logprobs_shape_streamed_and_not(fake_server):
    handle, tok, engine = fake_server
    client = openai_client(handle.url)
    msgs = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(model="fake", messages=msgs, logprobs=True, top_logprobs=2)
    choice = reply.choices[0]
    assert choice.message.content == FAKE_REPLY and engine.requests[-1].logprobs == 2
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens - 1   # the EOS that ended it is not in the text
    check_chat_content(content, FAKE_REPLY, 2)
    assert content[0].top_logprobs[0].logprob == content[0].logprob
    streamed, text = [], ""
    for chunk in client.chat.completions.create(model="fake", messages=msgs, logprobs=True, top_logprobs=2,
                                                stream=True):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        text += c.delta.content or ""
        if c.delta.content:
            assert c.logprobs is not None and c.logprobs.content
            # each chunk's tokens are exactly its text (no character is split at a chunk boundary)
            assert b"".join(bytes(e.bytes) for e in c.logprobs.content).decode() == c.delta.content
        if c.logprobs is not None:
            streamed += c.logprobs.content
    assert text == FAKE_REPLY
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    # logprobs without top_logprobs: empty alternatives; off: null
    plain = client.chat.completions.create(model="fake", messages=msgs, logprobs=True)
    assert plain.choices[0].logprobs.content and all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    off = client.chat.completions.create(model="fake", messages=msgs)
    assert off.choices[0].logprobs is None and engine.requests[-1].logprobs is None


def test_completions_logprobs_shape_streamed_and_not(fake_server):
    handle, tok, engine = fake_server
    client = openai_client(handle.url)
    reply = client.completions.create(model="fake", prompt="hi", logprobs=3)
    choice = reply.choices[0]
    assert choice.text == FAKE_REPLY and engine.requests[-1].logprobs == 3
    lp = choice.logprobs
    n = len(lp.tokens)
    assert n == reply.usage.completion_tokens - 1 == len(lp.token_logprobs) == len(lp.top_logprobs)
    # text_offset: the characters complete before each token's first byte
    raw = [tok.token_bytes(t) for t in tok.encode(FAKE_REPLY)]
    assert lp.text_offset == [len(b"".join(raw[:i]).decode("utf-8", "ignore")) for i in range(n)]
    assert lp.tokens == [r.decode("utf-8", "replace") for r in raw]
    assert all(FAKE_REPLY[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens) if "\ufffd" not in t)
    assert all(len(top) <= 4 and lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs))
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(model="fake", prompt="hi", logprobs=3, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for key in streamed:
                streamed[key] += getattr(chunk.choices[0].logprobs, key)
    assert streamed["tokens"] == lp.tokens and streamed["token_logprobs"] == lp.token_logprobs
    assert streamed["top_logprobs"] == lp.top_logprobs
    assert streamed["text_offset"] == lp.text_offset


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": 2, "echo": "yes"}, "echo"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
])
def test_bad_logprobs_requests_are_400_naming_the_param(fake_server, path, extra, param):
    import httpx

    handle, _, _ = fake_server
    body = {"model": "fake", **({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
                                else {"prompt": "hi"}), **extra}
    r = httpx.post(handle.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


# ---------------------------------------------------------------- slow: the real model, a real pipeline

COPY = ("Repeat the following text exactly, then stop: The committee met on Tuesday to review the budget for "
        "the new library. After a long discussion, members agreed to fund the children's section first and to "
        "delay the renovation of the reading room until next spring.")


@pytest.fixture(scope="module")
def real_pipeline(shared_pipelines):
    # Speculation on, as the shipped topologies: logprobs of accepted window positions are used.
    return shared_pipelines(2)


@pytest.fixture(scope="module")
def real_reference(model_dir):
    """Weights of the whole model in f32 (loader.load_slice), for an independent forward."""
    from skippy_zmq.checkpoint import loader
    return loader.load_slice(model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [
    SamplingParams(),
    SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.2, seed=7,
                   logit_bias={13: -2.0}),
], ids=["greedy", "sampled_penalties"])
def test_real_pipeline_logprobs_match_a_float64_reference_forward(real_pipeline, real_reference, sampling):
    engine, tokenizer = real_pipeline[0], real_pipeline[1]
    cfg, params = real_reference
    prompt = tokenizer.encode_chat([{"role": "user", "content": COPY}])
    req = GenRequest("lp", tuple(prompt), sampling, max_tokens=40, ignore_eos=True, logprobs=5)
    events = list(engine.generate_blocking(req))
    generated = tokens_of(events)
    assert len(generated) == 40
    if sampling.temperature == 0:   # the copy prompt's windows are mostly accepted
        spec = events[-1].stats["speculative"]
        assert spec["windows"] >= 3 and spec["accepted"] > 0, spec
    ref = reference_logprobs(params, cfg, prompt, generated, sampling)
    check_events(events, ref, 5)
    worst = max(abs(e.logprob - ref[j][e.token_id]) for j, e in enumerate(e for e in events if e.token_id is not None))
    print(f"max |logprob - reference| over {len(generated)} tokens: {worst:.2e}")


@pytest.mark.slow
def test_openai_client_logprobs_on_the_real_pipeline(real_pipeline):
    from skippy_zmq.api.server import create_app, start_in_thread

    engine, tokenizer = real_pipeline[0], real_pipeline[1]
    handle = start_in_thread(create_app(engine, tokenizer, model_name="smollm2"))
    try:
        client = openai_client(handle.url)
        msgs = [{"role": "user", "content": COPY}]
        kw = dict(model="smollm2", messages=msgs, max_tokens=32, temperature=0, logprobs=True, top_logprobs=3)
        reply = client.chat.completions.create(**kw)
        text = reply.choices[0].message.content
        content = reply.choices[0].logprobs.content
        assert text and len(content) == reply.usage.completion_tokens - (reply.choices[0].finish_reason == "stop")
        check_chat_content(content, text, 3)
        for e in content:   # greedy: the chosen token is the most likely one
            assert e.top_logprobs[0].token == e.token and abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6
        streamed, streamed_text = [], ""
        for chunk in client.chat.completions.create(**kw, stream=True):
            if chunk.choices:
                streamed_text += chunk.choices[0].delta.content or ""
                if chunk.choices[0].logprobs is not None:
                    streamed += chunk.choices[0].logprobs.content
        assert streamed_text == text and [e.token for e in streamed] == [e.token for e in content]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) <= TOL

        done = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=16,
                                         temperature=0, logprobs=2)
        lp = done.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
        assert "".join(lp.tokens) == done.choices[0].text
        assert all(len(top) == 2 and lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs))
        assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
        chunks = list(client.completions.create(model="smollm2", prompt="The capital of France is",
                                                max_tokens=16, temperature=0, logprobs=2, stream=True))
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert tokens == lp.tokens
    finally:
        handle.stop()


# ---------------------------------------------------------------- echo (completions): prompt logprobs


def test_echo_shapes_streamed_and_not(fake_server):
    handle, tok, engine = fake_server
    client = openai_client(handle.url)
    prompt = "Once upon a time"
    n_prompt = len(tok.encode(prompt))
    plain = client.completions.create(model="fake", prompt=prompt, echo=True)
    assert plain.choices[0].text == prompt + FAKE_REPLY and plain.choices[0].logprobs is None
    reply = client.completions.create(model="fake", prompt=prompt, echo=True, logprobs=1)
    assert engine.requests[-1].prompt_logprobs == 1
    choice = reply.choices[0]
    lp = choice.logprobs
    assert choice.text == prompt + FAKE_REPLY
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None   # nothing predicts the first token
    assert all(isinstance(v, float) for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens[:n_prompt]) == prompt and lp.text_offset[n_prompt] == len(prompt)
    raw = [tok.token_bytes(t) for t in tok.encode(prompt) + tok.encode(FAKE_REPLY)]
    assert lp.text_offset == [len(b"".join(raw[:i]).decode("utf-8", "ignore")) for i in range(len(raw))]
    chunks = [c.choices[0] for c in client.completions.create(model="fake", prompt=prompt, echo=True, logprobs=1,
                                                              stream=True) if c.choices]
    assert chunks[0].text == prompt and "".join(c.text for c in chunks) == prompt + FAKE_REPLY
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for c in chunks:
        for key in streamed:
            streamed[key] += getattr(c.logprobs, key) if c.logprobs else []
    assert streamed == {key: getattr(lp, key) for key in streamed}
    assert engine.requests[-1].prompt_logprobs == 1
    client.completions.create(model="fake", prompt=prompt, logprobs=1)
    assert engine.requests[-1].prompt_logprobs is None


def test_echo_on_chat_is_a_400():
    from skippy_zmq.api.openai_schema import RequestError, parse_chat

    with pytest.raises(RequestError) as err:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "echo": True}, 100)
    assert err.value.param == "echo"


@pytest.mark.parametrize("cuts", [[], [2]], ids=["1stage", "2stage"])
def test_inproc_prompt_logprobs_match_a_float64_reference(cuts):
    """echo: the last stage scores every prefill position; chunks of 64 (make_scheduler), so a
    prompt of 150 tokens arrives in three ACKs. The prefix cache is bypassed for it."""
    import jax.numpy as jnp

    prompt = random_ids(150, TINY.vocab_size, seed=5).tolist()
    req = GenRequest("e", tuple(prompt), max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=3)
    sched = make_scheduler(len(cuts) + 1, cache=CACHE, speculative=SPEC)
    chain = make_chain(TINY, tiny_tree_of(), cuts, cache=CACHE)
    run_requests(sched, chain, [dataclasses.replace(req, request_id="warm", prompt_logprobs=None)])
    events = run_requests(sched, chain, [req])["e"]
    assert events[0].cached_tokens == 0   # bypassed, though the prompt is in the store
    scored = events[0].prompt_logprobs
    assert len(scored) == len(prompt) and scored[0] is None
    assert all(e.prompt_logprobs is None for e in events[1:])
    logits = np.asarray(forward_reference(tiny_runtime(), jnp.asarray(np.asarray(prompt, np.int32))[None], TINY))[0]
    ref = log_softmax64(logits)
    for p in range(1, len(prompt)):
        lp, top = scored[p]
        assert abs(lp - ref[p - 1][prompt[p]]) <= TOL
        assert [t for t, _ in top] == list(np.argsort(-ref[p - 1], kind="stable")[:3])


@pytest.mark.slow
def test_real_pipeline_echo_prompt_logprobs_match_the_reference(real_pipeline, real_reference):
    import jax.numpy as jnp

    from skippy_zmq.api.server import create_app, start_in_thread

    engine, tokenizer = real_pipeline[0], real_pipeline[1]
    cfg, params = real_reference
    prompt = tokenizer.encode(COPY)
    events = list(engine.generate_blocking(GenRequest("echo", tuple(prompt), max_tokens=2, ignore_eos=True,
                                                      logprobs=5, prompt_logprobs=5)))
    logits = np.asarray(forward_reference(params, jnp.asarray(np.asarray(prompt, np.int32))[None], cfg))[0]
    ref = log_softmax64(logits)
    scored = events[0].prompt_logprobs
    assert len(scored) == len(prompt) and scored[0] is None
    worst = 0.0
    for p in range(1, len(prompt)):
        lp, top = scored[p]
        worst = max(worst, abs(lp - ref[p - 1][prompt[p]]))
        best = np.sort(ref[p - 1])[::-1][:5]
        assert len(top) == 5 and all(abs(v - ref[p - 1][t]) <= TOL and abs(v - b) <= TOL
                                     for (t, v), b in zip(top, best))
    assert worst <= TOL
    print(f"echo: max |prompt logprob - reference| over {len(prompt) - 1} tokens: {worst:.2e}")
    handle = start_in_thread(create_app(engine, tokenizer, model_name="smollm2"))
    try:
        client = openai_client(handle.url)
        reply = client.completions.create(model="smollm2", prompt=COPY, max_tokens=8, temperature=0, echo=True,
                                          logprobs=1)
        lp = reply.choices[0].logprobs
        assert reply.choices[0].text.startswith(COPY) and "".join(lp.tokens) == reply.choices[0].text
        assert lp.token_logprobs[0] is None
        assert max(abs(a - scored[i][0]) for i, a in enumerate(lp.token_logprobs[1:len(prompt)], 1)) <= TOL
        only = client.completions.create(model="smollm2", prompt=COPY, max_tokens=0, echo=True, logprobs=0)
        assert only.choices[0].text == COPY and only.usage.completion_tokens == 0
        assert len(only.choices[0].logprobs.tokens) == len(prompt)
        assert max(abs(a - b) for a, b in zip(only.choices[0].logprobs.token_logprobs[1:],
                                              lp.token_logprobs[1:len(prompt)])) <= TOL
    finally:
        handle.stop()


@pytest.mark.slow
def test_real_pipeline_constrained_logprobs_are_over_the_masked_logits(real_pipeline, real_reference):
    """Under a constraint the values are a log-softmax over what the mask allows: never below the
    unmasked model's logprob of the same token, and output tokens still parse."""
    import json

    from skippy_zmq.text.constrain import ConstraintSpec

    engine, tokenizer = real_pipeline[0], real_pipeline[1]
    cfg, params = real_reference
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Give me a JSON object describing a cat."}])
    spec = ConstraintSpec.from_openai({"type": "json_object"}, None)
    req = GenRequest("c", tuple(prompt), max_tokens=48, logprobs=3, constraint=spec.to_dict())
    events = list(engine.generate_blocking(req))
    generated = tokens_of(events)
    if events[-1].finish_reason == "stop":
        json.loads(tokenizer.decode(generated, skip_special=True))
    ref = reference_logprobs(params, cfg, prompt, generated, SamplingParams())
    tokens = [e for e in events if e.token_id is not None]
    assert all(e.logprob >= ref[j][e.token_id] - TOL for j, e in enumerate(tokens))
    assert any(e.logprob > ref[j][e.token_id] + 1e-3 for j, e in enumerate(tokens))   # the mask did something


def test_echo_with_max_tokens_zero_scores_the_prompt_only(fake_server):
    """Evaluation harnesses send echo + logprobs + max_tokens 0: the prompt and its logprobs, no
    completion (one token is generated and dropped). max_tokens 0 without echo stays a 400."""
    import openai

    handle, tok, engine = fake_server
    client = openai_client(handle.url)
    prompt = "Once upon a time"
    n_prompt = len(tok.encode(prompt))
    for stream in (False, True):
        if stream:
            chunks = [c.choices[0] for c in client.completions.create(
                model="fake", prompt=prompt, echo=True, logprobs=0, max_tokens=0, stream=True) if c.choices]
            text = "".join(c.text for c in chunks)
            tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
            finish = chunks[-1].finish_reason
        else:
            reply = client.completions.create(model="fake", prompt=prompt, echo=True, logprobs=0, max_tokens=0)
            choice = reply.choices[0]
            text, tokens, finish = choice.text, choice.logprobs.tokens, choice.finish_reason
            assert reply.usage.completion_tokens == 0
            assert reply.choices[0].logprobs.token_logprobs[0] is None
        assert text == prompt and len(tokens) == n_prompt and finish == "length"
        assert engine.requests[-1].max_tokens == 1 and engine.requests[-1].prompt_logprobs == 0
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="fake", prompt=prompt, max_tokens=0)
    assert err.value.body["param"] == "max_tokens"

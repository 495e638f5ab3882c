"""OpenAI HTTP layer: the real app on uvicorn, a scripted FakeEngine, the real tokenizer,
driven by the official `openai` client (and httpx for raw HTTP cases)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
from fake_engine import FakeEngine
from loguru import logger
from prometheus_client.parser import text_string_to_metric_families

from skippy_zmq.engine.request import EngineError
from skippy_zmq.text.stop_strings import StopMatcher
from skippy_zmq.api.server import create_app, start_in_thread
from skippy_zmq.text.tokenizer import TextTokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"
GGUF_PATH = REPO_ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = "smol-test"
REPLY = "Hello there! The quick fox says STOP now, then 日本語 and more."
MAX_CONTEXT = 256
BODY_LIMIT = 64 * 1024
API_KEY = "sekrit"
MESSAGES = [{"role": "user", "content": "Say hello."}]


def _load_tokenizer() -> TextTokenizer:
    if (TOKENIZER_DIR / "tokenizer.json").is_file():
        return TextTokenizer.load(TOKENIZER_DIR)
    if GGUF_PATH.is_file():
        return TextTokenizer.from_gguf(GGUF_PATH)
    pytest.skip(f"no tokenizer: neither {TOKENIZER_DIR} nor {GGUF_PATH} exists")


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return _load_tokenizer()


@pytest.fixture(scope="module")
def engine(tok: TextTokenizer) -> FakeEngine:
    script = [*tok.encode(REPLY), tok.eos_ids[0]]
    return FakeEngine(script, tok.eos_ids, model_name="engine-name", max_context=MAX_CONTEXT)


@pytest.fixture(scope="module")
def server(engine: FakeEngine, tok: TextTokenizer):
    handle = start_in_thread(create_app(engine, tok, model_name=MODEL, max_body_bytes=BODY_LIMIT))
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def locked_server(engine: FakeEngine, tok: TextTokenizer):
    handle = start_in_thread(create_app(engine, tok, model_name=MODEL, api_key=API_KEY))
    yield handle
    handle.stop()


@pytest.fixture(autouse=True)
def fresh_engine(engine: FakeEngine) -> FakeEngine:
    engine.reset()
    return engine


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=10) as session:
        yield session


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=10) as session:
        yield session


def _chat(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(model=kwargs.pop("model", MODEL), messages=MESSAGES, **kwargs)


def _sse_payloads(lines) -> list:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


# ---------------------------------------------------------------- basics

def test_models_health_and_readyz(client, http, engine):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http.get("/health").status_code == 200
    engine.ready = False
    not_ready = http.get("/readyz")
    assert (not_ready.status_code, not_ready.json()) == (503, {"ready": False})
    with pytest.raises(openai.InternalServerError) as err:
        _chat(client)
    assert err.value.status_code == 503
    engine.ready = True
    assert (http.get("/readyz").status_code, http.get("/readyz").json()) == (200, {"ready": True})


def test_chat_non_streaming(client, engine, tok):
    engine.cached_tokens = 7
    resp = _chat(client, model="whatever", temperature=0.5, top_p=0.9, seed=3, max_tokens=100,
                 frequency_penalty=0.5, logit_bias={"42": 2.0}, prompt_cache_key="ns-1",
                 extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1})
    prompt_ids = tok.encode_chat(MESSAGES)
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion" and resp.model == MODEL
    assert resp.choices[0].message.content == REPLY and resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.role == "assistant"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(prompt_ids), len(engine.script))
    assert resp.usage.total_tokens == len(prompt_ids) + len(engine.script)
    assert resp.usage.prompt_tokens_details.cached_tokens == 7
    sent = engine.requests[-1]
    assert sent.prompt_ids == tuple(prompt_ids) and sent.cache_key == "ns-1" and sent.max_tokens == 100
    s = sent.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.5, 0.9, 5, 0.1, 3)
    assert (s.frequency_penalty, s.repetition_penalty, s.logit_bias) == (0.5, 1.1, ((42, 2.0),))


def test_chat_streaming_with_usage(client, engine):
    engine.cached_tokens = 3
    chunks = list(_chat(client, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY and "\ufffd" not in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(engine.script)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])


def test_completions(client, engine, tok):
    resp = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=50)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert resp.choices[0].text == REPLY and resp.choices[0].finish_reason == "stop"
    assert engine.requests[-1].prompt_ids == tuple(tok.encode("Once upon"))
    # token-id prompt, streamed
    chunks = list(client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], stream=True,
                                            stream_options={"include_usage": True}))
    assert engine.requests[-1].prompt_ids == (1, 2, 3, 4)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == REPLY
    assert chunks[-1].usage.prompt_tokens == 4
    # special tokens in a text prompt are recognised
    client.completions.create(model=MODEL, prompt="<|im_start|>user")
    assert engine.requests[-1].prompt_ids[0] == tok.encode("<|im_start|>")[0]


def test_max_tokens_gives_length_and_is_clamped(client, engine, tok):
    resp = _chat(client, max_tokens=3)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 3
    assert resp.choices[0].message.content == tok.decode(engine.script[:3])
    room = MAX_CONTEXT - len(tok.encode_chat(MESSAGES))
    _chat(client, max_completion_tokens=100_000)
    assert engine.requests[-1].max_tokens == room
    _chat(client)
    assert engine.requests[-1].max_tokens == room
    # ignore_eos runs past the script's EOS to max_tokens
    long = _chat(client, max_tokens=len(engine.script) + 5, extra_body={"ignore_eos": True})
    assert long.choices[0].finish_reason == "length" and engine.requests[-1].ignore_eos


def test_accepted_noop_parameters_and_content_parts(client, engine):
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]}]
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, n=1, logprobs=False, response_format={"type": "text"},
        tool_choice="none", user="someone", max_tokens=50, max_completion_tokens=4,
        extra_body={"some_vendor_knob": 1, "top_k": -1},
    )
    assert resp.usage.completion_tokens == 4 and engine.requests[-1].sampling.top_k == 0
    assert engine.requests[-1].sampling.temperature == 1.0  # OpenAI's default


def test_request_id_is_bound_in_logs(http):
    seen: list[str | None] = []
    sink = logger.add(lambda message: seen.append(message.record["extra"].get("request_id")), level="DEBUG")
    try:
        http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"x-request-id": "log-me"})
    finally:
        logger.remove(sink)
    assert seen and set(seen) == {"log-me"}


# ---------------------------------------------------------------- stop strings

def test_stop_string_spanning_two_tokens(client, engine, tok):
    assert not any("STOP" in tok.decode([t]) for t in engine.script)  # it really spans tokens
    expected = REPLY[: REPLY.index(" STOP")]
    resp = _chat(client, stop=[" STOP", "never"])
    assert resp.choices[0].message.content == expected and resp.choices[0].finish_reason == "stop"
    assert engine.cancelled == [engine.requests[-1].request_id]  # the iterator was closed early
    chunks = list(_chat(client, stop="STOP", stream=True))
    pieces = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(pieces) == REPLY[: REPLY.index("STOP")]
    assert not any("S" in piece for piece in pieces)  # no partial stop string ever leaked
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_string_after_multibyte_text(client):
    resp = client.completions.create(model=MODEL, prompt="x", stop=["語 and"], stream=False)
    assert resp.choices[0].text == REPLY[: REPLY.index("語 and")]


@pytest.mark.parametrize(
    ("stops", "pieces", "emitted", "hit"),
    [
        (("STOP",), ["ab S", "TO", "P x"], ["ab ", "", ""], True),
        (("STOP",), ["ab S", "TX"], ["ab ", "STX"], False),
        (("ab", "b c"), ["xa", "b c"], ["x", ""], True),
        (("<end>",), ["a<e", "nd", "!"], ["a", "", "<end!"], False),
    ],
)
def test_stop_matcher(stops, pieces, emitted, hit):
    matcher, out, stopped = StopMatcher(stops), [], False
    for piece in pieces:
        text, stopped = matcher.push(piece)
        out.append(text)
        if stopped:
            break
    assert out == emitted[: len(out)] and stopped == hit


# ---------------------------------------------------------------- validation

BAD_REQUESTS = [
    ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format"),
    ({"response_format": {"type": "json_object"},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "response_format"),
    ({"extra_body": {"grammar": "root ::= undefined_rule"}}, "grammar"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"seed": -1}, "seed"),
    ({"extra_body": {"top_k": "many"}}, "top_k"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize(("kwargs", "param"), BAD_REQUESTS, ids=[p for _, p in BAD_REQUESTS])
def test_bad_parameters_are_400_naming_the_param(client, engine, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, **kwargs)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error"
    assert err.value.body["message"].startswith(param)
    assert engine.requests == []


def test_n_choices_and_batched_prompts(client, engine, tok):
    """n choices (one engine request, GenRequest.n) and a list of prompts (one engine request each,
    one choice per prompt and choice), streamed and not; usage counts each prompt once."""
    engine.reset()
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, max_tokens=4)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    script = [*tok.encode(REPLY), tok.eos_ids[0]]
    assert [c.message.content for c in reply.choices] == [tok.decode(script[c:c + 4]) for c in range(3)]
    assert len(engine.requests) == 1 and engine.requests[0].n == 3
    assert reply.usage.prompt_tokens == len(engine.requests[0].prompt_ids)
    assert reply.usage.completion_tokens == 12
    parts: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=4, stream=True):
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
    assert parts == {c: tok.decode(script[c:c + 4]) for c in range(2)}
    engine.reset()
    batch = client.completions.create(model=MODEL, prompt=["one two", [5, 6, 7]], n=2, max_tokens=3)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3] and len(engine.requests) == 2
    assert batch.usage.prompt_tokens == sum(len(r.prompt_ids) for r in engine.requests)
    assert batch.usage.completion_tokens == 12
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=["ok", [49152]])
    assert err.value.body["param"] == "prompt" and "prompt[1] token id 49152" in err.value.body["message"]
    for messages in ([], [{"role": "robot", "content": "hi"}], [{"role": "user", "content": 5}]):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=messages)
        assert err.value.body["param"] == "messages"
    for prompt, kwargs in (([49152], {}), ("x", {"echo": "yes"}), ("x", {"suffix": "y"})):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt=prompt, **kwargs)
        assert err.value.body["param"] in ("prompt", "echo", "suffix")


def test_prompt_too_long(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[5] * MAX_CONTEXT)
    assert err.value.body["param"] == "prompt"
    assert str(MAX_CONTEXT) in err.value.body["message"] and "256 tokens" in err.value.body["message"]
    long_chat = [{"role": "user", "content": "word " * MAX_CONTEXT}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=long_chat)
    assert err.value.body["param"] == "messages"


def test_body_limits_json_and_content_type(http):
    big = json.dumps({"model": MODEL, "prompt": "x" * (BODY_LIMIT + 10)}).encode()
    resp = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["type"] == "invalid_request_error"
    chunked = http.post("/v1/completions", content=iter([big[:40_000], big[40_000:]]),  # no Content-Length
                        headers={"content-type": "application/json"})
    assert chunked.status_code == 413
    bad = http.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]["message"]
    json_type = {"content-type": "application/json"}
    assert http.post("/v1/completions", content=b"[1, 2]", headers=json_type).status_code == 400
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):   # none: no longer assumed JSON
        plain = http.post("/v1/completions", content=b"hello", headers={"content-type": content_type} if content_type else {})
        assert plain.status_code == 415 and "Content-Type must be application/json" in plain.json()["error"]["message"]
    missing = http.get("/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()


# ---------------------------------------------------------------- engine errors

def test_engine_errors_map_to_http(client, engine):
    engine.fail = EngineError("too busy", 429, "rate_limited", retry_after=2.5)
    with pytest.raises(openai.RateLimitError) as err:
        _chat(client)
    assert err.value.response.headers["retry-after"] == "3"
    assert err.value.body["type"] == "rate_limit_exceeded" and err.value.body["message"] == "too busy"
    for status in (504, 503):
        engine.fail = EngineError(f"failed {status}", status, "engine_error")
        with pytest.raises(openai.APIStatusError) as err:
            _chat(client, stream=True)  # errors before the first token still get a real status
        assert err.value.status_code == status and err.value.body["type"] == "server_error"


def test_engine_error_mid_stream_is_an_sse_event(http, engine):
    engine.fail_after = 2
    body = {"model": MODEL, "messages": MESSAGES, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        payloads = _sse_payloads(resp.iter_lines())
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error["message"] == "stage 1 went away" and error["type"] == "server_error"


# ---------------------------------------------------------------- headers, auth, metrics

def test_request_id_echoed_or_generated(http, engine):
    given = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"x-request-id": "abc-123"})
    assert given.headers["x-request-id"] == "abc-123" and engine.requests[-1].request_id == "abc-123"
    made = http.get("/health").headers["x-request-id"]
    assert re.fullmatch(r"req-[0-9a-f]{32}", made)
    assert re.fullmatch(r"req-[0-9a-f]{32}", http.get("/nope").headers["x-request-id"])


def test_api_key(locked_server):
    base = f"{locked_server.url}/v1"
    with openai.OpenAI(base_url=base, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as err:
            wrong.models.list()
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    with openai.OpenAI(base_url=base, api_key=API_KEY, max_retries=0) as right:
        assert right.chat.completions.create(model=MODEL, messages=MESSAGES).choices[0].message.content == REPLY
    for path in ("/health", "/readyz"):
        assert httpx.get(f"{locked_server.url}{path}").status_code == 200
    assert httpx.get(f"{locked_server.url}/metrics").status_code == 401   # the key covers /metrics too
    assert httpx.get(f"{locked_server.url}/metrics", headers={"x-api-key": API_KEY}).status_code == 200


def _metric_samples(http) -> dict[tuple[str, tuple], float]:
    text = http.get("/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples
    }


def test_metrics_move(client, http, engine):
    engine.cached_tokens = 4
    before = _metric_samples(http)
    _chat(client, max_tokens=5)
    after = _metric_samples(http)
    ok_chat = ("skippy_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))

    def moved(key) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved(ok_chat) == 1
    assert moved(("skippy_generated_tokens_total", ())) == 5
    assert moved(("skippy_cached_prompt_tokens_total", ())) == 4
    assert moved(("skippy_prompt_tokens_total", ())) == engine.requests[-1].prompt_ids.__len__()
    assert moved(("skippy_time_to_first_token_seconds_count", ())) == 1
    assert moved(("skippy_inter_token_latency_seconds_count", ())) == 4
    assert moved(("skippy_request_duration_seconds_count", (("endpoint", "/v1/chat/completions"),))) == 1
    assert after[("skippy_requests_in_flight", ())] == 0
    with pytest.raises(openai.BadRequestError):
        _chat(client, n=0)
    assert _metric_samples(http)[("skippy_errors_total", (("kind", "invalid_request"),))] >= 1


# ---------------------------------------------------------------- disconnects

def test_client_disconnect_mid_stream_cancels(http, engine):
    engine.delay_s = 0.02
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "max_tokens": 200, "ignore_eos": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        first = next(resp.iter_lines())
        assert first.startswith("data: ")
    assert engine.wait_cancelled(timeout_s=5.0)
    assert engine.cancelled == [engine.requests[-1].request_id]


def test_client_disconnect_non_streaming_cancels(server, engine):
    engine.delay_s = 0.02
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 200, "ignore_eos": True}
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.3)
    assert engine.wait_cancelled(timeout_s=5.0)
    assert time.monotonic() - started < 4.0 and engine.finished == []



@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 150}),
    ("/v1/messages", {"messages": MESSAGES, "max_tokens": 150}),
    ("/v1/responses", {"input": "Say hello.", "max_output_tokens": 150}),
])
def test_every_api_shape_cancels_when_its_client_leaves(server, http, engine, tok, path, body):
    """The respond flow the API shapes share (streaming.respond): a client gone before the whole
    answer cancels the engine request and counts a client_disconnect."""
    saved, engine.script = engine.script, [*tok.encode("word " * 200), tok.eos_ids[0]]   # 3 s at 20 ms a token
    engine.delay_s = 0.02
    key = ("skippy_errors_total", (("kind", "client_disconnect"),))
    before = _metric_samples(http).get(key, 0.0)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=0.3)
        assert engine.wait_cancelled(timeout_s=5.0)
    finally:
        engine.script = saved
    assert engine.cancelled == [engine.requests[-1].request_id] and engine.finished == []
    # the handler counts the disconnect after the engine saw the cancel: wait (bounded) for the count
    deadline = time.monotonic() + 5.0
    while _metric_samples(http).get(key, 0.0) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _metric_samples(http)[key] == before + 1


# ---------------------------------------------------------------- structured output and tools (fake engine)

FN = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}


@pytest.fixture
def scripted(engine: FakeEngine):
    """Tests that script the engine's output put the module's script back afterwards."""
    saved = engine.script
    yield
    engine.script = saved


def _script(engine: FakeEngine, tok: TextTokenizer, text: str) -> None:
    engine.script = [*tok.encode(text), tok.eos_ids[0]]


def test_response_format_and_grammar_reach_the_engine(client, engine, tok, scripted):
    _script(engine, tok, '{"a": 1}')
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    resp = _chat(client, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert resp.choices[0].message.content == '{"a": 1}'
    assert engine.requests[-1].constraint == {"kind": "json_schema", "schema": schema}
    client.completions.create(model=MODEL, prompt="x", extra_body={"grammar": 'root ::= "a"'})
    assert engine.requests[-1].constraint == {"kind": "grammar", "grammar": 'root ::= "a"', "syntax": "gbnf"}
    _chat(client, response_format={"type": "text"})
    assert engine.requests[-1].constraint is None


def test_tool_calls_in_responses_and_deltas(client, engine, tok, scripted):
    _script(engine, tok, 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 3}}\n</tool_call>')
    resp = _chat(client, tools=[FN])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("f", {"x": 3})
    assert engine.requests[-1].constraint is None                  # auto: free text, parsed
    chunks = list(_chat(client, tools=[FN], stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    [streamed] = [tc for d in deltas for tc in d.tool_calls or []]
    assert streamed.index == 0 and streamed.function.name == "f" and streamed.id.startswith("call_")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_tool_choice_constrains_after_the_opening_tag(client, engine, tok, scripted):
    _script(engine, tok, '{"name": "f", "arguments": {"x": 5}}')
    resp = _chat(client, tools=[FN], tool_choice="required")
    assert resp.choices[0].finish_reason == "tool_calls" and resp.choices[0].message.content is None
    request = engine.requests[-1]
    assert tok.decode(list(request.prompt_ids)).endswith("<|im_start|>assistant\n<tool_call>\n")
    assert request.constraint["kind"] == "json_schema"
    assert request.constraint["schema"]["properties"]["name"] == {"const": "f"}
    assert "# Tools" in tok.decode(list(request.prompt_ids))


def test_tool_traffic_messages_are_rendered(client, engine, tok, scripted):
    _script(engine, tok, "It is sunny.")
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, tools=[FN])
    assert resp.choices[0].message.content == "It is sunny." and resp.choices[0].finish_reason == "stop"
    prompt = tok.decode(list(engine.requests[-1].prompt_ids))
    assert '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt


def test_the_driver_prepares_a_chat_request_before_it_serves(tok: TextTokenizer):
    """warm_request_path renders and tokenises a chat once (the driver, before READY), so a first request
    finds what it did lazily done: here the vocabulary's longest piece, which the prompt-size check reads.
    Nothing reaches the engine; a template that refuses the sample chat raises nothing."""
    from skippy_zmq.api.context import ServerContext
    from skippy_zmq.api.openai_schema import parse_chat
    from skippy_zmq.api.request_prep import warm_request_path
    from skippy_zmq.engine.metrics import ServerMetrics

    fresh = TextTokenizer(tok.tokenizer, tok.meta)
    engine = FakeEngine([1], tok.eos_ids, max_context=MAX_CONTEXT)
    assert "_max_token_chars" not in fresh.__dict__
    warm_request_path(ServerContext(engine, fresh, MODEL, ServerMetrics(), None, BODY_LIMIT).prep_context(), parse_chat)
    assert fresh.__dict__["_max_token_chars"] == fresh.max_token_chars > 1 and engine.requests == []
    refusing = TextTokenizer(tok.tokenizer, {**tok.meta, "chat_template": "{{ raise_exception('a system turn first') }}"})
    warm_request_path(ServerContext(engine, refusing, MODEL, ServerMetrics(), None, BODY_LIMIT).prep_context(), parse_chat)
    assert "_max_token_chars" not in refusing.__dict__ and engine.requests == []


def test_the_driver_builds_the_grammar_tokenizer_before_a_constrained_request(tok: TextTokenizer):
    """build_constraints_behind (the driver, while its stages start) leaves constraint_info built, so a
    first constrained request does not build it (a GIL hold of seconds on a large vocabulary); a
    tokenizer the grammar engine refuses (here: no end-of-generation id) raises nothing there, and a
    request still meets the refusal as a 400's text."""
    from skippy_zmq.api.context import ServerContext
    from skippy_zmq.api.openai_schema import RequestError
    from skippy_zmq.engine.metrics import ServerMetrics

    engine = FakeEngine([1], tok.eos_ids, max_context=MAX_CONTEXT)
    ctx = ServerContext(engine, TextTokenizer(tok.tokenizer, tok.meta), MODEL, ServerMetrics(), None, BODY_LIMIT)
    assert ctx._constraint_info is None
    ctx.build_constraints_behind().join(timeout=60)
    built = ctx._constraint_info
    assert built is not None and built.vocab_size == tok.vocab_size and ctx.constraint_info() is built
    no_eos = TextTokenizer(tok.tokenizer, {**tok.meta, "eos_id": -1, "eos_ids": []})
    refusing = ServerContext(engine, no_eos, MODEL, ServerMetrics(), None, BODY_LIMIT)
    refusing.build_constraints_behind().join(timeout=60)
    assert refusing._constraint_info is None and engine.requests == []
    with pytest.raises(RequestError, match="structured output is not available: .*end-of-generation"):
        refusing.constraint_info()

"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) driven by the unmodified
`anthropic` SDK: first against the real app with a scripted engine and SmolLM2's real tokenizer
and template (what is sent to the engine, what comes back, event order, errors), then against the
real 2-stage SmolLM2 pipeline, where greedy answers must be the chat completions answers token
for token and a forced tool call makes a full tool_use / tool_result round trip."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from fake_engine import FakeEngine
from scripted_server import engine, fresh_engine, scripted, server, sse_events, tok  # noqa: F401 (fixtures)

from skippy_zmq.engine.request import EngineError
from skippy_zmq.api.server import create_app, start_in_thread
from skippy_zmq.text.tokenizer import TextTokenizer

REPLY = "Hello there! The quick fox says STOP now, then 日本語 and more."
ASK = [{"role": "user", "content": "Say hello."}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                            "required": ["city"], "additionalProperties": False}}
OPENAI_WEATHER = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                   "parameters": WEATHER["input_schema"]}}
EVENTS = ["message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
          "message_stop"]


@pytest.fixture
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=20) as session:
        yield session


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=20) as session:
        yield session


SAMPLING = ("temperature", "top_p", "top_k", "seed")


def create(client, **kwargs):
    """messages.create; this SDK release has no sampling parameters, so they go in extra_body
    (as a client written for it sends them)."""
    extra = {key: kwargs.pop(key) for key in SAMPLING if key in kwargs}
    if extra:
        kwargs["extra_body"] = {**kwargs.get("extra_body", {}), **extra}
    kwargs.setdefault("model", "smol")
    kwargs.setdefault("max_tokens", 100)
    kwargs.setdefault("messages", ASK)
    return client.messages.create(**kwargs)


def raw_events(url: str, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event of a streamed /v1/messages request, pings included."""
    return sse_events(url + "/v1/messages", body)


# ---------------------------------------------------------------- scripted engine

def test_text_message_and_what_the_engine_is_sent(client, engine, tok):
    engine.cached_tokens = 7
    msg = create(client, temperature=0.5, top_p=0.9, top_k=5, seed=3, metadata={"user_id": "u1"})
    prompt = tok.encode_chat(ASK)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "smol" and msg.id.startswith("msg_")
    assert [(b.type, b.text) for b in msg.content] == [("text", REPLY)]
    assert (msg.stop_reason, msg.stop_sequence) == ("end_turn", None)
    assert (msg.usage.input_tokens, msg.usage.cache_read_input_tokens, msg.usage.cache_creation_input_tokens,
            msg.usage.output_tokens) == (len(prompt) - 7, 7, 0, len(engine.script))
    sent = engine.requests[-1]
    assert list(sent.prompt_ids) == prompt and sent.max_tokens == 100 and sent.constraint is None
    assert (sent.sampling.temperature, sent.sampling.top_p, sent.sampling.top_k, sent.sampling.seed) == (0.5, 0.9, 5, 3)


def test_prompt_equals_the_chat_completions_prompt(client, oai, engine):
    """System (string or blocks), multi-turn, text blocks: the engine gets the chat completions prompt."""
    turns = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2+2?"}]}]
    for system in ("Be brief.", [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]):
        msg = create(client, system=system, messages=turns, temperature=0)
        chat = oai.chat.completions.create(model="smol", max_tokens=100, temperature=0, messages=[
            {"role": "system", "content": "Be brief."}, *turns[:2],
            {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2+2?"}]}])
        assert engine.requests[-2].prompt_ids == engine.requests[-1].prompt_ids
        assert msg.content[0].text == chat.choices[0].message.content == REPLY
        assert msg.usage.output_tokens == chat.usage.completion_tokens


def test_stop_sequences_and_max_tokens(client, engine):
    msg = create(client, stop_sequences=["nope", "STOP", "fox says STOP"])
    assert (msg.content[0].text, msg.stop_reason, msg.stop_sequence) == ("Hello there! The quick ", "stop_sequence",
                                                                         "fox says STOP")
    assert engine.cancelled   # the rest of the answer was not generated
    with client.messages.stream(model="smol", max_tokens=100, messages=ASK, stop_sequences=["STOP"]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello there! The quick fox says " == final.content[0].text
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "STOP")
    short = create(client, max_tokens=3)
    assert (short.stop_reason, short.stop_sequence, short.usage.output_tokens) == ("max_tokens", None, 3)
    unmatched = create(client, stop_sequences=["zzz"])
    assert (unmatched.content[0].text, unmatched.stop_reason, unmatched.stop_sequence) == (REPLY, "end_turn", None)


def test_stream_event_order(client, server, engine, tok):
    events = [e.type for e in create(client, stream=True)]
    assert events[:2] == EVENTS[:2] and events[-3:] == EVENTS[-3:]
    assert set(events[2:-3]) == {"content_block_delta"} and len(events) - 5 >= 2
    raw = raw_events(server.url, {"model": "smol", "max_tokens": 100, "messages": ASK})
    names = [name for name, _ in raw]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-3:] == EVENTS[-3:]
    assert all(name == data["type"] for name, data in raw)
    start, block = raw[0][1], raw[2][1]
    assert start["message"]["content"] == [] and start["message"]["stop_reason"] is None
    assert start["message"]["usage"]["input_tokens"] == len(tok.encode_chat(ASK))
    assert block == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(d["delta"]["text"] for n, d in raw if n == "content_block_delta") == REPLY
    delta = raw[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(engine.script)
    with client.messages.stream(model="smol", max_tokens=100, messages=ASK) as stream:
        assert "".join(stream.text_stream) == REPLY
        assert stream.get_final_message().usage.output_tokens == len(engine.script)


def test_empty_answer_still_has_a_text_block(client, engine, tok):
    engine.script = [tok.eos_ids[0]]
    msg = create(client)
    assert [(b.type, b.text) for b in msg.content] == [("text", "")] and msg.stop_reason == "end_turn"
    assert [e.type for e in create(client, stream=True)] == ["message_start", "content_block_start",
                                                             "content_block_stop", "message_delta", "message_stop"]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_tool_use_blocks_streamed_and_not(client, oai, engine, tok):
    engine.script = scripted(tok, "Checking.\n" + CALL)
    msg = create(client, tools=[WEATHER])
    assert [b.type for b in msg.content] == ["text", "tool_use"] and msg.content[0].text == "Checking."
    use = msg.content[1]
    assert use.id.startswith("toolu_") and (use.name, use.input) == ("get_weather", {"city": "Oslo"})
    assert msg.stop_reason == "tool_use"
    chat = oai.chat.completions.create(model="smol", max_tokens=100, messages=ASK, tools=[OPENAI_WEATHER])
    assert engine.requests[-2].prompt_ids == engine.requests[-1].prompt_ids   # the same tool prompt
    assert chat.choices[0].finish_reason == "tool_calls"
    with client.messages.stream(model="smol", max_tokens=100, messages=ASK, tools=[WEATHER]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    json_deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"
                   and e.delta.type == "input_json_delta"]
    assert starts == ["text", "tool_use"] and json.loads("".join(json_deltas)) == {"city": "Oslo"}
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.stop_reason == "tool_use"
    assert final.content[1].input == {"city": "Oslo"}


@pytest.mark.parametrize("choice, mode", [({"type": "any"}, "required"),
                                          ({"type": "tool", "name": "get_weather"}, "named"),
                                          ({"type": "none"}, "none"), ({"type": "auto"}, "auto")])
def test_tool_choice_maps_onto_the_chat_tool_choice(client, oai, engine, tok, choice, mode):
    forced = mode in ("required", "named")
    engine.script = scripted(tok, CALL.split("\n", 1)[1] if forced else "Fine.")
    msg = create(client, tools=[WEATHER], tool_choice=choice)
    sent = engine.requests[-1]
    openai_choice = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}},
                     "none": "none", "auto": "auto"}[mode]
    oai.chat.completions.create(model="smol", max_tokens=100, messages=ASK, tools=[OPENAI_WEATHER],
                                tool_choice=openai_choice)
    assert sent.prompt_ids == engine.requests[-1].prompt_ids and sent.constraint == engine.requests[-1].constraint
    if forced:
        assert tok.decode(list(sent.prompt_ids)).endswith("<tool_call>\n") and sent.constraint["kind"] == "json_schema"
        assert [(b.type, b.input) for b in msg.content] == [("tool_use", {"city": "Oslo"})]
        assert msg.stop_reason == "tool_use"
    else:
        assert sent.constraint is None and msg.content[0].text == "Fine." and msg.stop_reason == "end_turn"


def test_tool_result_round_trip_renders_as_chat_tool_messages(client, oai, engine):
    history = [*ASK, {"role": "assistant", "content": [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "Here it is."},   # text before the result: the result still comes first
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": [{"type": "text", "text": "sunny"}]}]}]
    msg = create(client, tools=[WEATHER], messages=history)
    oai.chat.completions.create(model="smol", max_tokens=100, tools=[OPENAI_WEATHER], messages=[
        *ASK, {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_01", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_01", "content": "sunny"},
        {"role": "user", "content": "Here it is."}])
    assert engine.requests[-2].prompt_ids == engine.requests[-1].prompt_ids
    assert msg.content[0].text == REPLY and msg.stop_reason == "end_turn"


THINKING_TEMPLATE = "{# a reasoning model writes <think>...</think> #}"


def test_thinking_blocks_from_a_reasoning_template(tok):
    thinker = TextTokenizer(tok.tokenizer, {**tok.meta, "chat_template": tok.meta["chat_template"] + THINKING_TEMPLATE})
    engine = FakeEngine(scripted(tok, "<think>Two and two.</think>\n\nFour."), tok.eos_ids, max_context=512)
    handle = start_in_thread(create_app(engine, thinker, model_name="m"))
    try:
        with anthropic.Anthropic(base_url=handle.url, api_key="x", max_retries=0, timeout=20) as client:
            msg = create(client, thinking={"type": "enabled", "budget_tokens": 1024})
            assert [b.type for b in msg.content] == ["thinking", "text"]
            thought, answer = msg.content
            assert (thought.thinking, thought.signature, answer.text) == ("Two and two.", "", "Four.")
            raw = raw_events(handle.url, {"model": "m", "max_tokens": 100, "messages": ASK})
            deltas = [d["delta"]["type"] for n, d in raw if n == "content_block_delta"]
            assert deltas[0] == "thinking_delta" and deltas[-1] == "text_delta"
            assert deltas.index("signature_delta") < deltas.index("text_delta")
            assert [d["index"] for n, d in raw if n == "content_block_start"] == [0, 1]
    finally:
        handle.stop()


def test_output_config_format_is_the_chat_response_format(client, oai, engine, tok):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    engine.script = scripted(tok, '{"ok": true}')
    msg = create(client, output_config={"effort": "low", "format": {"type": "json_schema", "schema": schema}})
    oai.chat.completions.create(model="smol", max_tokens=100, messages=ASK, response_format={
        "type": "json_schema", "json_schema": {"name": "output", "schema": schema}})
    assert engine.requests[-2].constraint == engine.requests[-1].constraint
    assert engine.requests[-1].constraint["kind"] == "json_schema" and msg.content[0].text == '{"ok": true}'


def test_count_tokens(client, tok):
    assert client.messages.count_tokens(model="smol", messages=ASK).input_tokens == len(tok.encode_chat(ASK))
    with_system = client.messages.count_tokens(model="smol", messages=ASK, system="Be brief.").input_tokens
    assert with_system == len(tok.encode_chat([{"role": "system", "content": "Be brief."}, *ASK]))
    assert client.messages.count_tokens(model="smol", messages=ASK, tools=[WEATHER]).input_tokens > with_system


@pytest.mark.parametrize("body, message", [
    ({"messages": ASK}, "max_tokens: Field required"),
    ({"max_tokens": 0, "messages": ASK}, "max_tokens: must be an integer >= 1"),
    ({"max_tokens": 5, "messages": []}, "messages: must be a non-empty list"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role: must be"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     "messages[0].content[0].type: 'image' blocks are not supported"),
    ({"max_tokens": 5, "messages": [*ASK, {"role": "assistant", "content": "The answer is"}]},
     "messages[1].role: a final assistant message (prefill) is not supported"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "sunny"}]}]},
     "messages[0].content[0].tool_use_id: 'toolu_x' answers no tool_use block"),
    ({"max_tokens": 5, "messages": ASK, "stop_sequences": "STOP"}, "stop_sequences: must be a list of strings"),
    ({"max_tokens": 5, "messages": ASK, "stop_sequences": list("abcde")}, "stop_sequences: at most 4"),
    ({"max_tokens": 5, "messages": ASK, "temperature": -1}, "temperature"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{"name": "x"}]}, "tools[0].input_schema: Field required"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{**WEATHER, "name": "bad name"}]}, "tools[0].name: must match"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{**WEATHER, "input_schema": {"type": "array"}}]},
     "tools[0].input_schema.type"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0].type: only client tools"),
    ({"max_tokens": 5, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice.name: 'nope' is not one of the tools"),
    ({"max_tokens": 5, "messages": ASK, "tool_choice": {"type": "any"}}, "tool_choice.type: 'any' needs"),
    ({"max_tokens": 5, "messages": ASK, "thinking": {"type": "sometimes"}}, "thinking: must be"),
    ({"max_tokens": 5, "messages": ASK, "output_config": {"format": {"type": "json_object"}}},
     "output_config.format: must be"),
    ({"max_tokens": 5, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "output_config.format: cannot be combined with tools"),
])
def test_invalid_requests_are_400_invalid_request_error(client, engine, body, message):
    with pytest.raises(anthropic.BadRequestError) as err:
        client.post("/v1/messages", body={"model": "smol", **body}, cast_to=anthropic.types.Message)
    assert err.value.status_code == 400
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    assert err.value.body["error"]["message"].startswith(message), err.value.body
    assert not engine.requests   # nothing reached the engine


def test_sdk_error_classes_for_missing_max_tokens_and_server_states(client, server, engine):
    with pytest.raises(anthropic.BadRequestError) as err:   # the SDK's own typed call, max_tokens left out
        client.messages.create(model="smol", messages=ASK, max_tokens=anthropic.omit)
    assert err.value.body["error"] == {"type": "invalid_request_error", "message": "max_tokens: Field required"}
    engine.ready = False
    with pytest.raises(anthropic.InternalServerError) as err:
        create(client)
    assert err.value.status_code == 503 and err.value.body["error"]["type"] == "overloaded_error"
    engine.ready = True
    engine.fail = EngineError("too many requests queued", 429, "queue_full", retry_after=2.0)
    with pytest.raises(anthropic.RateLimitError) as err:
        create(client)
    assert err.value.body["error"]["type"] == "rate_limit_error" and err.value.response.headers["retry-after"] == "2"
    engine.fail = None
    long = [{"role": "user", "content": "word " * 600}]
    with pytest.raises(anthropic.BadRequestError) as err:   # the API's wording, which Claude Code reads
        create(client, messages=long)
    n = client.messages.count_tokens(model="smol", messages=long).input_tokens
    assert err.value.body["error"]["message"] == f"prompt is too long: {n} tokens > 511 maximum"
    resp = httpx.post(server.url + "/v1/messages", content=b"{not json", timeout=10,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    assert resp.json()["error"]["message"].startswith("malformed JSON body")


def test_engine_failure_mid_stream_is_an_error_event(client, server, engine):
    engine.fail_after = 3
    raw = raw_events(server.url, {"model": "smol", "max_tokens": 100, "messages": ASK})
    assert [n for n, _ in raw][:3] == ["message_start", "ping", "content_block_start"]
    assert raw[-1] == ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "stage 1 went away"},
                                 "request_id": raw[-1][1]["request_id"]})
    with pytest.raises(anthropic.APIStatusError) as err:
        list(create(client, stream=True))
    assert "stage 1 went away" in str(err.value)


def test_client_gone_mid_stream_cancels_the_request(server, engine):
    engine.delay_s = 0.05
    body = {"model": "smol", "max_tokens": 100, "messages": ASK, "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=20) as resp:
        lines = resp.iter_lines()
        assert next(lines) == "event: message_start"
    assert engine.wait_cancelled(10) and engine.cancelled


# ---------------------------------------------------------------- the real SmolLM2 pipeline

@pytest.fixture(scope="module")
def served(shared_pipelines):
    return shared_pipelines(2).url


@pytest.fixture(scope="module")
def real(served):
    with anthropic.Anthropic(base_url=served, api_key="x", max_retries=0, timeout=300) as session:
        yield session


@pytest.fixture(scope="module")
def real_oai(served):
    with openai.OpenAI(base_url=served + "/v1", api_key="x", max_retries=0, timeout=300) as session:
        yield session


def test_real_greedy_answers_equal_chat_completions(real, real_oai):
    system = "You are a terse assistant who answers in one word. " * 6   # over the prefix store's 64-token floor
    turns = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Apple."},
             {"role": "user", "content": "Name a color."}]
    msg = create(real, model="m", max_tokens=24, temperature=0, system=system, messages=turns)
    chat = real_oai.chat.completions.create(model="m", max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": system}, *turns])
    assert msg.content[0].text == chat.choices[0].message.content and msg.content[0].text
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    prompt = chat.usage.prompt_tokens
    assert (msg.usage.input_tokens, msg.usage.cache_read_input_tokens) == (prompt, 0)
    assert {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason] == msg.stop_reason
    with real.messages.stream(model="m", max_tokens=24, system=system, messages=turns,
                              extra_body={"temperature": 0}) as stream:
        assert "".join(stream.text_stream) == msg.content[0].text
        again = stream.get_final_message()
    # The same prompt again: all but its last token are read from the prefix store.
    assert (again.usage.input_tokens, again.usage.cache_read_input_tokens) == (1, prompt - 1)
    assert real.messages.count_tokens(model="m", system=system, messages=turns).input_tokens == prompt
    words = msg.content[0].text.split()
    stop = words[1] if len(words) > 1 else msg.content[0].text[1:]
    cut = create(real, model="m", max_tokens=24, temperature=0, system=system, messages=turns, stop_sequences=[stop])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert msg.content[0].text.startswith(cut.content[0].text + stop)


def test_real_structured_output(real, real_oai):
    """output_config.format json_schema: the grammar engine constrains the text as for response_format."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    ask = [{"role": "user", "content": "Invent a person."}]
    msg = create(real, model="m", max_tokens=60, temperature=0, messages=ask,
                 output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(msg.content[0].text), schema)
    chat = real_oai.chat.completions.create(model="m", max_tokens=60, temperature=0, messages=ask, response_format={
        "type": "json_schema", "json_schema": {"name": "output", "schema": schema}})
    assert msg.content[0].text == chat.choices[0].message.content and msg.stop_reason == "end_turn"


def test_real_tool_round_trip(real, real_oai):
    """tool_choice "tool" forces the call (constrained decoding); the result goes back as a
    tool_result block; the final greedy answer equals chat completions' for the same history."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = create(real, model="m", max_tokens=100, temperature=0, messages=ask, tools=[WEATHER],
                                 tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"]
    use = first.content[0]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    history = [*ask, {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]}]
    final = create(real, model="m", max_tokens=30, temperature=0, messages=history, tools=[WEATHER],
                                 tool_choice={"type": "none"})
    chat = real_oai.chat.completions.create(model="m", max_tokens=30, temperature=0, tools=[OPENAI_WEATHER],
                                            tool_choice="none", messages=[
        *ask, {"role": "assistant", "content": None, "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny, 21 C"}])
    assert final.content[0].type == "text" and final.content[0].text == chat.choices[0].message.content
    assert final.usage.output_tokens == chat.usage.completion_tokens

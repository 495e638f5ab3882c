"""The OpenAI Responses API (/v1/responses) driven by the unmodified `openai` SDK's
`client.responses` and by the OpenAI Agents SDK: first against the real app with a scripted
engine and SmolLM2's real tokenizer and template (what is sent to the engine, what comes back,
event order, the store, errors), then against the real 2-stage SmolLM2 pipeline, where greedy
answers must be the chat completions answers token for token, a forced function call makes a
full function_call / function_call_output round trip, and an Agents SDK run calls its tool."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from fake_engine import FakeEngine
from scripted_server import engine, fresh_engine, scripted, server, sse_events, tok  # noqa: F401 (fixtures)

from skippy_zmq.api.responses_output import ResponseStore
from skippy_zmq.api.server import create_app, start_in_thread
from skippy_zmq.text.tokenizer import TextTokenizer

REPLY = "Hello there! The quick fox says 日本語 and more."
ASK = [{"role": "user", "content": "Say hello."}]
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
              "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
           "parameters": PARAMETERS, "strict": True}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                 "parameters": PARAMETERS, "strict": True}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=20) as session:
        yield session


def create(client, **kwargs):
    kwargs.setdefault("model", "smol")
    kwargs.setdefault("input", "Say hello.")
    return client.responses.create(**kwargs)


def raw_events(url: str, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event of a streamed /v1/responses request."""
    return sse_events(url + "/v1/responses", {"model": "smol", **body})


# ---------------------------------------------------------------- scripted engine

def test_plain_response_and_what_the_engine_is_sent(oai, engine, tok):
    engine.cached_tokens = 7
    resp = create(oai, temperature=0.5, top_p=0.9, max_output_tokens=100, extra_body={"seed": 3})
    prompt = tok.encode_chat(ASK)
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == "smol"
    assert resp.status == "completed" and resp.incomplete_details is None and resp.error is None
    assert resp.output_text == REPLY and [item.type for item in resp.output] == ["message"]
    message = resp.output[0]
    assert (message.role, message.status, message.content[0].type) == ("assistant", "completed", "output_text")
    usage = resp.usage
    assert (usage.input_tokens, usage.input_tokens_details.cached_tokens, usage.output_tokens,
            usage.output_tokens_details.reasoning_tokens, usage.total_tokens) == (
        len(prompt), 7, len(engine.script), 0, len(prompt) + len(engine.script))
    sent = engine.requests[-1]
    assert list(sent.prompt_ids) == prompt and sent.max_tokens == 100 and sent.constraint is None
    assert (sent.sampling.temperature, sent.sampling.top_p, sent.sampling.seed) == (0.5, 0.9, 3)
    assert (resp.temperature, resp.top_p, resp.max_output_tokens, resp.store) == (0.5, 0.9, 100, True)


def test_items_and_instructions_give_the_chat_completions_prompt(oai, engine):
    items = [{"role": "user", "content": "Hi."},
             {"type": "message", "role": "assistant", "content": [
                 {"type": "output_text", "text": "Hello!", "annotations": []}]},
             {"role": "developer", "content": "Answer with a number."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is 2+2?"}]}]
    resp = create(oai, instructions="Be brief.", input=items, reasoning={"effort": "low"})
    chat = oai.chat.completions.create(model="smol", messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello!"}, {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 2+2?"}])
    assert engine.requests[-2].prompt_ids == engine.requests[-1].prompt_ids
    assert resp.output_text == chat.choices[0].message.content == REPLY
    assert resp.usage.output_tokens == chat.usage.completion_tokens and resp.reasoning.effort == "low"


def test_max_output_tokens_makes_an_incomplete_response(oai, server):
    resp = create(oai, max_output_tokens=3)
    assert (resp.status, resp.incomplete_details.reason, resp.usage.output_tokens) == ("incomplete",
                                                                                       "max_output_tokens", 3)
    assert resp.output[0].status == "incomplete"
    raw = raw_events(server.url, {"input": "Say hello.", "max_output_tokens": 3})
    assert raw[-1][0] == "response.incomplete" and raw[-1][1]["response"]["status"] == "incomplete"


def test_stream_event_order_and_sequence_numbers(oai, server, engine, tok):
    raw = raw_events(server.url, {"input": "Say hello."})
    names = [name for name, _ in raw]
    deltas = names.count("response.output_text.delta")
    assert deltas >= 2 and names == ["response.created", "response.in_progress", *TEXT_EVENTS[:2],
                                     *["response.output_text.delta"] * deltas, *TEXT_EVENTS[3:],
                                     "response.completed"]
    assert [data["sequence_number"] for _, data in raw] == list(range(len(raw)))
    assert all(name == data["type"] for name, data in raw)
    created, done = raw[0][1]["response"], raw[-1][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["id"] == done["id"]
    assert "".join(d["delta"] for n, d in raw if n == "response.output_text.delta") == REPLY
    assert done["output"][0]["content"][0]["text"] == REPLY == raw[-4][1]["text"]
    assert done["usage"]["output_tokens"] == len(engine.script)
    with oai.responses.stream(model="smol", input="Say hello.") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == REPLY == final.output_text and final.status == "completed"


def test_function_call_items_streamed_and_not(oai, engine, tok):
    engine.script = scripted(tok, "Checking.\n" + CALL)
    resp = create(oai, tools=[WEATHER])
    assert [item.type for item in resp.output] == ["message", "function_call"]
    call = resp.output[1]
    assert (call.name, json.loads(call.arguments), call.status) == ("get_weather", {"city": "Oslo"}, "completed")
    assert call.call_id.startswith("call") and call.id.startswith("fc_")
    assert resp.output[0].content[0].text == "Checking."
    oai.chat.completions.create(model="smol", messages=ASK, tools=[CHAT_WEATHER])
    assert engine.requests[-2].prompt_ids == engine.requests[-1].prompt_ids   # the same tool prompt
    with oai.responses.stream(model="smol", input="Say hello.", tools=[WEATHER]) as stream:
        names = [e.type for e in stream]
        final = stream.get_final_response()
    calls = names[names.index("response.output_item.done") + 1:]
    assert calls == ["response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert json.loads(final.output[1].arguments) == {"city": "Oslo"}


@pytest.mark.parametrize("choice, chat_choice", [
    ("required", "required"), ({"type": "function", "name": "get_weather"},
                               {"type": "function", "function": {"name": "get_weather"}}),
    ("none", "none"), ("auto", "auto")])
def test_tool_choice_maps_onto_the_chat_tool_choice(oai, engine, tok, choice, chat_choice):
    forced = choice not in ("none", "auto")
    engine.script = scripted(tok, CALL.split("\n", 1)[1] if forced else "Fine.")
    resp = create(oai, tools=[WEATHER], tool_choice=choice)
    sent = engine.requests[-1]
    oai.chat.completions.create(model="smol", messages=ASK, tools=[CHAT_WEATHER], tool_choice=chat_choice)
    assert sent.prompt_ids == engine.requests[-1].prompt_ids and sent.constraint == engine.requests[-1].constraint
    if forced:
        assert sent.constraint["kind"] == "json_schema"
        assert [(i.type, json.loads(i.arguments)) for i in resp.output] == [("function_call", {"city": "Oslo"})]
    else:
        assert sent.constraint is None and resp.output_text == "Fine."


def test_function_call_output_round_trip_renders_as_chat_tool_messages(oai, engine):
    items = [{"role": "user", "content": "Say hello."},
             {"type": "function_call", "call_id": "call_01", "name": "get_weather", "arguments": '{"city": "Oslo"}',
              "id": "fc_01", "status": "completed"},
             {"type": "function_call_output", "call_id": "call_01", "output": "sunny"}]
    resp = create(oai, tools=[WEATHER], input=items)
    oai.chat.completions.create(model="smol", tools=[CHAT_WEATHER], messages=[
        *ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_01", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_01", "content": "sunny"}])
    assert engine.requests[-2].prompt_ids == engine.requests[-1].prompt_ids
    assert resp.output_text == REPLY


def test_text_format_is_the_chat_response_format(oai, engine, tok):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    engine.script = scripted(tok, '{"ok": true}')
    resp = create(oai, text={"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}})
    oai.chat.completions.create(model="smol", messages=ASK, response_format={
        "type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}})
    assert engine.requests[-2].constraint == engine.requests[-1].constraint
    assert engine.requests[-1].constraint["kind"] == "json_schema" and json.loads(resp.output_text) == {"ok": True}
    assert resp.text.format.type == "json_schema"
    create(oai, text={"format": {"type": "json_object"}})
    assert engine.requests[-1].constraint["kind"] == "json_object"


THINKING_TEMPLATE = "{# a reasoning model writes <think>...</think> #}"


def test_reasoning_items_from_a_reasoning_template(tok):
    thinker = TextTokenizer(tok.tokenizer, {**tok.meta, "chat_template": tok.meta["chat_template"] + THINKING_TEMPLATE})
    engine = FakeEngine(scripted(tok, "<think>Two and two.</think>\n\nFour."), tok.eos_ids, max_context=512)
    handle = start_in_thread(create_app(engine, thinker, model_name="m"))
    try:
        with openai.OpenAI(base_url=handle.url + "/v1", api_key="x", max_retries=0, timeout=20) as client:
            resp = create(client, model="m", reasoning={"effort": "high"})
            assert [item.type for item in resp.output] == ["reasoning", "message"]
            thought = resp.output[0]
            assert [(c.type, c.text) for c in thought.content] == [("reasoning_text", "Two and two.")]
            assert resp.output_text == "Four." and thought.id.startswith("rs_")
            thought_tokens = len(tok.encode("<think>Two and two.</think>\n\n", add_bos=False))
            assert 0 < resp.usage.output_tokens_details.reasoning_tokens <= thought_tokens
            names = [n for n, _ in raw_events(handle.url, {"model": "m", "input": "Say hello."})]
            assert names.index("response.reasoning_text.done") < names.index("response.output_text.delta")
            assert names.count("response.output_item.added") == 2
    finally:
        handle.stop()


def test_store_get_delete_and_previous_response_id(oai, server, engine, tok):
    first = create(oai, instructions="Be brief.")
    assert oai.responses.retrieve(first.id).output_text == REPLY
    second = create(oai, previous_response_id=first.id, input="And again?")
    chat_prompt = tok.encode_chat([*ASK, {"role": "assistant", "content": REPLY},
                                   {"role": "user", "content": "And again?"}])   # instructions not inherited
    assert list(engine.requests[-1].prompt_ids) == chat_prompt and second.previous_response_id == first.id
    unstored = create(oai, store=False)
    with pytest.raises(openai.NotFoundError) as err:
        oai.responses.retrieve(unstored.id)
    assert err.value.body["message"] == f"Response with id {unstored.id!r} not found."
    with pytest.raises(openai.NotFoundError) as err:
        create(oai, previous_response_id=unstored.id)
    assert err.value.body["param"] == "previous_response_id"
    oai.responses.delete(first.id)
    assert httpx.get(f"{server.url}/v1/responses/{first.id}", timeout=10).status_code == 404


def test_store_is_bounded_least_recently_used_first():
    store = ResponseStore(max_responses=3, max_bytes=1400)   # a small entry is ~130 bytes of JSON
    for i in range(4):
        assert store.put({"id": f"r{i}", "text": "x" * 100}, [])
    assert len(store) == 3 and store.get("r0") is None
    store.get("r1")   # used: r2, then r3, are now the oldest
    assert store.put({"id": "big", "text": "x" * 1200}, [])   # r2 goes for the count, r3 for the bytes
    assert [key for key in ("r1", "r2", "r3", "big") if store.get(key)] == ["r1", "big"]
    assert not store.put({"id": "huge", "text": "x" * 3000}, []) and store.get("huge") is None


@pytest.mark.parametrize("body, message", [
    ({"input": []}, "input: must be a string or a non-empty list"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input[0].content[0].type: 'input_image' parts are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type: 'input_file' parts are not supported"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "sunny"}]},
     "input[0].call_id: 'call_x' answers no function_call item"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type: 'item_reference' items"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type: 'web_search' tools are not supported"),
    ({"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type: 'file_search'"),
    ({"input": "hi", "tools": [{**WEATHER, "parameters": {"type": "array"}}]}, "tools[0].parameters.type"),
    ({"input": "hi", "tools": [{**WEATHER, "name": "bad name"}]}, "tools[0].name: must match"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name: 'nope' is not one of the tools"),
    ({"input": "hi", "tool_choice": {"type": "web_search"}}, "tool_choice: must be"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens: must be an integer >= 1"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format: must be"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort: must be one of"),
    ({"input": "hi", "background": True}, "background: background responses are not supported"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": "required",
      "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "text.format: cannot be combined with tools"),
])
def test_invalid_requests_are_400_naming_the_field(oai, engine, body, message):
    with pytest.raises(openai.BadRequestError) as err:
        oai.post("/responses", body={"model": "smol", **body}, cast_to=httpx.Response)
    assert err.value.status_code == 400 and err.value.body["type"] == "invalid_request_error"
    assert err.value.body["message"].startswith(message), err.value.body
    assert not engine.requests   # nothing reached the engine


def test_engine_failure_mid_stream_is_response_failed(oai, server, engine):
    engine.fail_after = 3
    raw = raw_events(server.url, {"input": "Say hello."})
    assert [n for n, _ in raw][:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    name, data = raw[-1]
    assert name == "response.failed" and data["response"]["status"] == "failed"
    assert data["response"]["error"] == {"code": "stage_lost", "message": "stage 1 went away"}
    assert data["sequence_number"] == len(raw) - 1


def test_client_gone_mid_stream_cancels_the_request(server, engine):
    engine.delay_s = 0.05
    body = {"model": "smol", "input": "Say hello.", "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=20) as resp:
        assert next(resp.iter_lines()) == "event: response.created"
    assert engine.wait_cancelled(10) and engine.cancelled


# ---------------------------------------------------------------- the real SmolLM2 pipeline

@pytest.fixture(scope="module")
def served(shared_pipelines):
    return shared_pipelines(2).url


@pytest.fixture(scope="module")
def real(served):
    with openai.OpenAI(base_url=served + "/v1", api_key="x", max_retries=0, timeout=300) as session:
        yield session


def test_real_greedy_answers_equal_chat_completions(real):
    turns = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Apple."},
             {"role": "user", "content": "Name a color."}]
    resp = create(real, model="m", max_output_tokens=24, temperature=0, instructions="Answer in one word.",
                  input=turns)
    chat = real.chat.completions.create(model="m", max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": "Answer in one word."}, *turns])
    assert resp.output_text == chat.choices[0].message.content and resp.output_text
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                   chat.usage.completion_tokens)
    assert {"stop": "completed", "length": "incomplete"}[chat.choices[0].finish_reason] == resp.status
    with real.responses.stream(model="m", max_output_tokens=24, temperature=0, instructions="Answer in one word.",
                               input=turns) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert text == resp.output_text


def test_real_structured_output(real):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    resp = create(real, model="m", max_output_tokens=60, temperature=0, input="Invent a person.",
                  text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(resp.output_text), schema)
    chat = real.chat.completions.create(model="m", max_tokens=60, temperature=0, messages=[
        {"role": "user", "content": "Invent a person."}], response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    assert resp.output_text == chat.choices[0].message.content and resp.status == "completed"


def test_real_function_call_round_trip(real):
    """tool_choice required forces the call (constrained decoding); its output goes back as a
    function_call_output item, once as items and once through previous_response_id; the final
    greedy answer equals chat completions' for the same history."""
    ask = "What is the weather in Paris?"
    first = create(real, model="m", max_output_tokens=100, temperature=0, input=ask, tools=[WEATHER],
                   tool_choice="required")
    assert [item.type for item in first.output] == ["function_call"]
    call = first.output[0]
    jsonschema.validate(json.loads(call.arguments), PARAMETERS)
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    final = create(real, model="m", max_output_tokens=30, temperature=0, tools=[WEATHER], tool_choice="none",
                   input=[{"role": "user", "content": ask}, call.model_dump(exclude_none=True), answer])
    chained = create(real, model="m", max_output_tokens=30, temperature=0, tools=[WEATHER], tool_choice="none",
                     previous_response_id=first.id, input=[answer])
    chat = real.chat.completions.create(model="m", max_tokens=30, temperature=0, tools=[CHAT_WEATHER],
                                        tool_choice="none", messages=[
        {"role": "user", "content": ask}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}])
    assert final.output_text == chained.output_text == chat.choices[0].message.content
    assert final.usage.output_tokens == chat.usage.completion_tokens


def test_real_agents_sdk_run_with_a_forced_function_tool(served):
    """The OpenAI Agents SDK's Runner, its model the Responses API of this server: the forced
    tool is called with schema-valid arguments, and the run finishes."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    async def run() -> object:
        client = openai.AsyncOpenAI(base_url=served + "/v1", api_key="x", max_retries=0, timeout=300)
        model = OpenAIResponsesModel(model="m", openai_client=client)
        agent = Agent(name="weather", instructions="You answer questions about the weather.", model=model,
                      tools=[get_weather], model_settings=ModelSettings(tool_choice="required", temperature=0,
                                                                        max_tokens=60))
        try:
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert len(calls) >= 1 and all(isinstance(city, str) and city for city in calls)
    assert isinstance(result.final_output, str)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"

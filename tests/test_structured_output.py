"""Structured output and tools with the official `openai` client against a real 2-stage
SmolLM2 pipeline with speculation on: response_format json_object / json_schema, the grammar
extension, tools (required, named, auto, a full round trip), streamed and not. Output always
parses and validates; speculation changes nothing."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest


pytestmark = pytest.mark.slow

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "geo": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90},
                                                 "lon": {"type": "integer", "minimum": -180, "maximum": 180}},
                "required": ["lat", "lon"], "additionalProperties": False}},
        "required": ["city", "geo"], "additionalProperties": False},
    "enum_array": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"}}, "required": ["colors", "ok"], "additionalProperties": False},
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                   "required": ["timezone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(shared_pipelines):
    shared = shared_pipelines(2)
    assert shared.topology.driver.speculative.enabled
    return shared.engine, shared.url


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="x", max_retries=0, timeout=300)


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(rf"^{name}{{?{re.escape(labels)}}}? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def chat(client, messages, stream=False, **kwargs):
    """(content, tool_calls as dicts, finish_reason) of a chat completion, streamed or not."""
    kwargs.setdefault("max_tokens", 120)
    if not stream:
        choice = client.chat.completions.create(model="m", messages=messages, **kwargs).choices[0]
        calls = [c.model_dump() for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(model="m", messages=messages, stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            assert call.index == len(calls) and call.id and call.function.name   # whole calls, in order
            calls.append({"id": call.id, "type": call.type,
                          "function": {"name": call.function.name, "arguments": call.function.arguments}})
        finish = chunk.choices[0].finish_reason or finish
    return content or None, calls, finish


def seeds(stream: bool, n: int = 3) -> range:
    """The seeds a test samples: n plain; one streamed. A streamed answer is the plain one sent in
    deltas (same seed, same tokens): its test proves the deltas assemble into a valid answer, which
    one sample shows; the constraint's validity over several samples is the plain test's (the 2
    streamed samples more were ~11 s of the suite's real-model decoding)."""
    return range(1 if stream else n)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_json_object_always_parses(client, stream):
    # JSON mode bounds no string or number: at temperature 1 this 135M model can write one
    # string until max_tokens (then the answer is cut, finish_reason "length", as anywhere).
    for seed in seeds(stream):
        ask = 'Reply with a JSON object like {"name": "Tom", "age": 3} for a cat.'
        content, _, finish = chat(client, [{"role": "user", "content": ask}], stream,
                                  response_format={"type": "json_object"}, temperature=1.0, seed=seed,
                                  max_tokens=300)
        assert finish == "stop", content
        assert isinstance(json.loads(content), dict)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_output_validates(client, name, stream):
    schema = SCHEMAS[name]
    for seed in seeds(stream):
        content, _, finish = chat(client, [{"role": "user", "content": f"Give me a {name} as JSON."}], stream,
                                  response_format=json_format(schema), temperature=1.0, seed=seed)
        assert finish == "stop", content
        jsonschema.validate(json.loads(content), schema)


def test_completions_json_schema_and_grammar(client):
    schema = SCHEMAS["person"]
    out = client.completions.create(model="m", prompt="A person as JSON:", max_tokens=80, temperature=1.0, seed=5,
                                    extra_body={"response_format": json_format(schema)})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].text), schema)
    for seed in range(3):
        out = client.completions.create(model="m", prompt="Is water wet? Answer:", max_tokens=10, temperature=1.0,
                                        seed=seed, extra_body={"grammar": 'root ::= ("yes" | "no") "."'})
        assert out.choices[0].text in ("yes.", "no.") and out.choices[0].finish_reason == "stop"
    lark = {"type": "lark", "value": 'start: /[0-9]{3}/'}
    out = client.completions.create(model="m", prompt="Three digits:", max_tokens=10, temperature=1.0, seed=1,
                                    extra_body={"grammar": lark})
    assert re.fullmatch(r"[0-9]{3}", out.choices[0].text)


def test_speculation_changes_nothing_under_a_constraint(client, served):
    """Drafts are checked against the mask like any token: with and without speculation the
    same seed gives the same JSON, and windows were verified."""
    url = served[1]
    schema = SCHEMAS["enum_array"]
    text = '{"colors": ["red", "green", "blue"], "ok": true}'
    messages = [{"role": "user", "content": f"Repeat exactly: {text} {text} {text}"}]
    before = metric(url, "skippy_spec_windows_total")
    masks_before = metric(url, "skippy_stage_constraint_masks_total", 'stage="s1"')
    outs = {}
    for speculative in (True, False):
        for seed in (0, 1):
            outs[speculative, seed] = chat(client, messages, response_format=json_format(schema), temperature=1.0,
                                           seed=seed, extra_body={"speculative": speculative})[0]
        outs[speculative, "greedy"] = chat(client, messages, response_format=json_format(schema), temperature=0,
                                           extra_body={"speculative": speculative})[0]
    for key, content in outs.items():
        jsonschema.validate(json.loads(content), schema)
        assert content == outs[(not key[0], key[1])], key
    assert metric(url, "skippy_spec_windows_total") > before, "no verify window ran under the constraint"
    assert metric(url, "skippy_stage_constraint_masks_total", 'stage="s1"') > masks_before
    assert metric(url, "skippy_stage_constraint_mask_seconds_total", 'stage="s1"') > 0


def test_bad_schema_and_bad_combinations_are_400(client):
    bad = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["a"]}
    cases = [
        ({"response_format": json_format({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})},
         "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": json_format(bad)}, "response_format"),
        ({"extra_body": {"grammar": "root ::= undefined"}}, "grammar"),
        ({"response_format": {"type": "json_object"}, "tools": [WEATHER]}, "response_format"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="m", messages=ASK, max_tokens=5, **kwargs)
        assert err.value.body["param"] == param, (kwargs, err.value.body)
        assert err.value.body["message"].startswith(param)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="m", prompt="x", max_tokens=5, extra_body={"tools": [WEATHER]})
    assert err.value.body["param"] == "tools"


def check_call(call: dict, tools: list[dict]) -> dict:
    spec = next(t["function"] for t in tools if t["function"]["name"] == call["function"]["name"])
    assert call["type"] == "function" and call["id"].startswith("call_")
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, spec["parameters"])
    return arguments


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_tool_choice_required_and_named_give_valid_calls(client, stream):
    tools = [WEATHER, TIME]
    for seed in seeds(stream, 2):
        content, calls, finish = chat(client, ASK, stream, tools=tools, tool_choice="required", temperature=1.0,
                                      seed=seed)
        assert finish == "tool_calls" and len(calls) == 1 and content is None, (content, calls)
        check_call(calls[0], tools)
    named = {"type": "function", "function": {"name": "get_time"}}
    content, calls, finish = chat(client, ASK, stream, tools=tools, tool_choice=named, temperature=1.0, seed=3)
    assert finish == "tool_calls" and [c["function"]["name"] for c in calls] == ["get_time"]
    check_call(calls[0], tools)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_tool_choice_auto_and_none(client, stream):
    content, calls, finish = chat(client, ASK, stream, tools=[WEATHER], temperature=0, max_tokens=60)
    assert finish in ("stop", "length", "tool_calls")
    assert calls or content
    for call in calls:
        check_call(call, [WEATHER])
    content, calls, finish = chat(client, ASK, stream, tools=[WEATHER], tool_choice="none", temperature=0,
                                  max_tokens=20)
    assert not calls and content and finish in ("stop", "length")


def test_tool_round_trip(client):
    """A call, the tool's result as a `tool` message, then the final answer."""
    tools = [WEATHER]
    first = client.chat.completions.create(model="m", messages=ASK, tools=tools, max_tokens=100, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    check_call(call.model_dump(), tools)
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    final = client.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=40, temperature=0)
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="m", messages=messages, tools=tools, tool_choice="none", max_tokens=40, temperature=0, stream=True)
        if c.choices)
    assert streamed


CITY = {"type": "function", "function": {
    "name": "make_city", "description": "Record a city.",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                                                    "population": {"type": "integer"}},
                   "required": ["name", "country", "population"]}}}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_forced_call_without_additional_properties_invents_no_keys(client, stream):
    """The schema leaves additionalProperties unsaid: the object is closed (as llama.cpp does),
    so the call has exactly the schema's keys and ends well inside max_tokens."""
    named = {"type": "function", "function": {"name": "make_city"}}
    for seed in seeds(stream):
        content, calls, finish = chat(client, [{"role": "user", "content": "Record the city of Paris."}], stream,
                                      tools=[CITY], tool_choice=named, temperature=1.0, seed=seed, max_tokens=200)
        assert finish == "tool_calls" and len(calls) == 1, (content, calls, finish)
        assert set(check_call(calls[0], [CITY])) == {"name", "country", "population"}

"""Model-native tool-call formats (skippy_zmq.text.tools: hermes, llama3_json, mistral, generic),
chosen from llama.cpp's real chat templates; reasoning splitting; objects closed in constraints."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest

from skippy_zmq.text.constrain import ConstraintSpec, Matcher, close_objects, tokenizer_info
from skippy_zmq.text import tools
from skippy_zmq.text.reasoning import ReasoningSplitter, prompt_opens_thinking, template_thinks


def split_reasoning(text: str, inside: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output: the splitter pushed once and flushed."""
    splitter = ReasoningSplitter(inside)
    reasoning, content = splitter.push(text)
    more_reasoning, more_content = splitter.flush()
    return (reasoning + more_reasoning) or None, content + more_content
from skippy_zmq.text.tools.mistral import mistral_call_id

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
AUTO = tools.validate_tools([WEATHER, TIME])
SINGLE = tools.validate_tools([WEATHER, TIME], "auto", False)
REQUIRED = tools.validate_tools([WEATHER, TIME], "required")
NAMED = tools.validate_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})

EXPECTED_FORMATS = {
    "Qwen-Qwen2.5-7B-Instruct.jinja": "hermes",
    "Qwen-Qwen3-0.6B.jinja": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct.jinja": "llama3_json",
    "meta-llama-Llama-3.2-3B-Instruct.jinja": "llama3_json",
    "meta-llama-Llama-3.3-70B-Instruct.jinja": "llama3_json",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": "mistral",
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": "mistral_args",
    "unsloth-mistral-Devstral-Small-2507.jinja": "mistral_args",
    "Qwen3-Coder.jinja": "generic",                   # <tool_call><function=...> XML: not read
    "meetkai-functionary-medium-v3.1.jinja": "generic",
    "google-gemma-2-2b-it.jinja": "generic",          # no tools in the template
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "generic",
}


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_formats_chosen_from_real_templates(llama_cpp_models):
    chosen = {name: tools.choose_format((llama_cpp_models / "templates" / name).read_text()).name
              for name in EXPECTED_FORMATS}
    assert chosen == EXPECTED_FORMATS
    assert tools.choose_format("").name == "generic" and tools.choose_format(None) is tools.GENERIC
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        tools.format_named("xml")


# ---------------------------------------------------------------- parsing, per format

PARSE_CASES = [   # (format, text, toolset, content, calls)
    (tools.HERMES, 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', AUTO,
     "Sure.", [("get_weather", {"city": "Oslo"})]),
    (tools.LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Oslo"}}', AUTO,
     None, [("get_weather", {"city": "Oslo"})]),
    (tools.LLAMA3_JSON, '  <|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", '
     '"parameters": {"city": "Rome"}}', AUTO, None, [("get_time", {}), ("get_weather", {"city": "Rome"})]),
    (tools.LLAMA3_JSON, '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}}',
     SINGLE, None, [("get_time", {})]),
    (tools.LLAMA3_JSON, 'Let me see. <|python_tag|>{"name": "get_time", "arguments": {}}', AUTO,
     "Let me see.", [("get_time", {})]),
    (tools.LLAMA3_JSON, '{"answer": 42}', AUTO, '{"answer": 42}', []),                      # JSON, not a call
    (tools.LLAMA3_JSON, '{"name": "rm_rf", "parameters": {}}', AUTO, '{"name": "rm_rf", "parameters": {}}', []),
    (tools.LLAMA3_JSON, 'The capital is Paris.', AUTO, "The capital is Paris.", []),
    (tools.MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "abcdefghi"}]', AUTO,
     None, [("get_weather", {"city": "Oslo"})]),
    (tools.MISTRAL, 'Checking. [TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "get_weather", '
     '"arguments": {"city": "Lima"}}]', AUTO, "Checking.", [("get_time", {}), ("get_weather", {"city": "Lima"})]),
    (tools.MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}',
     AUTO, None, [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (tools.MISTRAL_ARGS, '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', AUTO,
     None, [("get_weather", {"city": "Oslo"})]),
    (tools.MISTRAL_ARGS, '[TOOL_CALLS]get_weather[ARGS]{"city": ', AUTO, '[TOOL_CALLS]get_weather[ARGS]{"city": ', []),
    (tools.MISTRAL, "No tools needed.", AUTO, "No tools needed.", []),
]


@pytest.mark.parametrize("fmt, text, toolset, content, calls", PARSE_CASES)
def test_parse_native_calls(fmt, text, toolset, content, calls):
    got_content, got_calls = fmt.parse(text, toolset, ids())
    assert (got_content, _calls(got_calls)) == (content, calls)


def _split(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 10)))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("fmt, text, toolset, content, calls", PARSE_CASES)
def test_stream_reassembles_to_parse(fmt, text, toolset, content, calls):
    rng = random.Random(7)
    for _ in range(40):
        stream = fmt.stream(toolset, ids())
        deltas = [d for piece in _split(text, rng) for d in stream.push(piece)] + stream.flush()
        assert "".join(d.get("content", "") for d in deltas) == (content or "")
        streamed = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed] == calls
        assert [c["index"] for c in streamed] == list(range(len(calls)))
        assert all(d.get("content", "x") for d in deltas)   # no empty content deltas


def test_tail_stream_sends_text_before_the_marker_at_once():
    stream = tools.MISTRAL.stream(AUTO, ids())
    assert stream.push("Checking the weather") == [{"content": "Checking the weather"}]
    assert stream.push(" now. [TOOL") == [{"content": " now."}]            # "[TOOL" may open the marker
    assert stream.push('_CALLS][{"name": "get_time", "arguments": {}}]') == []
    assert stream.flush() == [{"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                                               "function": {"name": "get_time", "arguments": "{}"}}]}]
    llama = tools.LLAMA3_JSON.stream(AUTO, ids())
    assert llama.push("  ") == [] and llama.push('{"name": "get_time", ') == []
    assert llama.push('"parameters": {}}') == [] and llama.flush()[0]["tool_calls"][0]["function"]["name"] == "get_time"


def test_mistral_ids_are_nine_alphanumerics():
    made = tools.MISTRAL.new_id()
    assert len(made) == 9 and made.isalnum()
    assert mistral_call_id("abcDEF123") == "abcDEF123"
    mapped = mistral_call_id("call_0123456789abcdef01234567")
    assert len(mapped) == 9 and mapped.isalnum() and mapped == mistral_call_id("call_0123456789abcdef01234567")
    messages = tools.normalise_messages([
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "9:00"}])
    rendered, listed = tools.MISTRAL.template_inputs(messages, AUTO)
    assert rendered[1]["tool_calls"][0]["id"] == rendered[2]["tool_call_id"] == mistral_call_id("call_1")
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {}
    assert [t["function"]["name"] for t in listed] == ["get_weather", "get_time"]


# ---------------------------------------------------------------- constraints, per format

def test_constrained_prefixes_and_constraints():
    assert [f.constrained_prefix(NAMED) for f in tools.FORMATS] == [
        "[TOOL_CALLS]get_weather[ARGS]", "[TOOL_CALLS]", "", "<tool_call>\n", "<tool_call>\n"]
    assert all(f.constrained_prefix(AUTO) == "" and f.constraint(AUTO) is None for f in tools.FORMATS)
    llama = tools.LLAMA3_JSON.constraint(NAMED)
    assert llama.kind == "json_schema" and llama.schema["required"] == ["name", "parameters"]
    nemo = tools.MISTRAL.constraint(REQUIRED)
    assert nemo.schema["type"] == "array" and nemo.schema["maxItems"] == 1
    assert [o["properties"]["name"] for o in nemo.schema["items"]["anyOf"]] == [
        {"const": "get_weather"}, {"const": "get_time"}]
    assert tools.MISTRAL_ARGS.constraint(NAMED) == ConstraintSpec("json_schema", WEATHER["function"]["parameters"])
    grammar = tools.MISTRAL_ARGS.constraint(REQUIRED)
    assert grammar.kind == "grammar" and grammar.syntax == "lark"
    assert grammar.grammar.startswith('start: "get_weather[ARGS]" %json {')
    assert '| "get_time[ARGS]" %json' in grammar.grammar


@pytest.fixture(scope="module")
def info(model_dir):
    return tokenizer_info(model_dir)


def _walk(matcher, tokenizer, text):
    for token in tokenizer.encode(text, add_bos=False):
        matcher.advance(token)


@pytest.mark.parametrize("fmt", [tools.MISTRAL_ARGS, tools.MISTRAL, tools.LLAMA3_JSON, tools.GENERIC])
def test_forced_calls_compile_and_accept_their_format(info, fmt):
    written = {"mistral_args": 'get_time[ARGS]{}', "mistral": '[{"name": "get_time", "arguments": {}}]',
               "llama3_json": '{"name": "get_time", "parameters": {}}',
               "generic": '{"name": "get_time", "arguments": {}}'}[fmt.name]
    matcher = Matcher(fmt.constraint(REQUIRED), info)
    _walk(matcher, info.tokenizer, written)
    assert matcher.allows(info.eos_ids[0])
    content, calls = fmt.parse(fmt.constrained_prefix(REQUIRED) + written, REQUIRED, ids())
    assert content is None and _calls(calls) == [("get_time", {})]


# ---------------------------------------------------------------- closed objects

CITY = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                                         "population": {"type": "integer"}},
        "required": ["name", "country", "population"]}


def test_close_objects_rewrites_only_what_is_unsaid():
    closed = close_objects({"type": "object", "properties": {"city": CITY, "tags": {"type": "array", "items": CITY},
                                                             "any": {"type": "object"}},
                            "$defs": {"c": CITY}, "anyOf": [CITY]})
    assert closed["additionalProperties"] is False
    for sub in (closed["properties"]["city"], closed["properties"]["tags"]["items"], closed["$defs"]["c"],
                closed["anyOf"][0]):
        assert sub["additionalProperties"] is False
    assert closed["properties"]["any"] == {"type": "object"}   # no properties: any object
    assert close_objects({**CITY, "additionalProperties": True})["additionalProperties"] is True
    assert close_objects({**CITY, "additionalProperties": {"type": "integer"}})["additionalProperties"] == {
        "type": "integer"}
    parts = close_objects({"allOf": [CITY, {"properties": {"x": {"type": "integer"}}}]})["allOf"]
    assert all("additionalProperties" not in part for part in parts)   # closing a part would refuse the other's keys
    assert "additionalProperties" not in CITY                           # the caller's schema is not changed


def _comma_allowed(info, schema) -> bool:
    matcher = Matcher(ConstraintSpec("json_schema", schema), info)
    _walk(matcher, info.tokenizer, '{"name": "Paris", "country": "France", "population": 2100000')
    comma = info.tokenizer.encode(",", add_bos=False)
    assert len(comma) == 1
    brace = info.tokenizer.encode("}", add_bos=False)[0]
    assert matcher.allows(brace)
    return matcher.allows(comma[0])


def test_forced_city_call_cannot_invent_keys(info):
    """All three keys written: a closed object allows only `}` next, never `,` (another key);
    with additionalProperties: true the comma stays allowed."""
    assert not _comma_allowed(info, CITY)
    assert _comma_allowed(info, {**CITY, "additionalProperties": True})
    city_tool = {"type": "function", "function": {"name": "make_city", "parameters": CITY}}
    forced = tools.validate_tools([city_tool], {"type": "function", "function": {"name": "make_city"}})
    matcher = Matcher(tools.GENERIC.constraint(forced), info)
    _walk(matcher, info.tokenizer, '{"name": "make_city", "arguments": {"name": "Paris", "country": "France", '
                                   '"population": 2100000')
    mask = matcher.mask()
    assert not mask[info.tokenizer.encode(",", add_bos=False)[0]] and mask[info.tokenizer.encode("}", add_bos=False)[0]]
    allowed = [info.tokenizer.decode([int(t)]) for t in np.flatnonzero(mask)]
    assert not [t for t in allowed if "," in t or '"' in t]   # more digits, whitespace, "}": never another key


# ---------------------------------------------------------------- reasoning

REASONING_TEXTS = [   # (text, prompt opened <think>, reasoning, content)
    ("<think>\nLet me think.\n</think>\n\nHello!", False, "\nLet me think.\n", "Hello!"),
    ("  <think>a</think>b", False, "a", "b"),
    ("Hello!", False, None, "Hello!"),
    ("<thinking> is a word", False, None, "<thinking> is a word"),
    ("Plan: go.</think>\n\nAnswer", True, "Plan: go.", "Answer"),
    ("still thinking...", True, "still thinking...", ""),
    ("<think>unfinished", False, "unfinished", ""),
    ("<", False, None, "<"),
    ("", False, None, ""),
]


@pytest.mark.parametrize("text, inside, reasoning, content", REASONING_TEXTS)
def test_reasoning_split_and_stream_agree(text, inside, reasoning, content):
    assert split_reasoning(text, inside) == (reasoning, content)
    rng = random.Random(5)
    for _ in range(30):
        splitter = ReasoningSplitter(inside)
        parts = [splitter.push(piece) for piece in _split(text, rng)] + [splitter.flush()]
        assert ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts)) == (reasoning, content)


def test_thinking_templates(llama_cpp_models):
    templates = llama_cpp_models / "templates"
    assert template_thinks((templates / "Qwen-Qwen3-0.6B.jinja").read_text())
    assert template_thinks((templates / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text())
    assert not template_thinks((templates / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text())
    assert prompt_opens_thinking("<｜Assistant｜><think>\n") and not prompt_opens_thinking("<think>\n\n</think>\n\n")

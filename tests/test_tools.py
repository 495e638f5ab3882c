"""skippy_zmq.text.tools: tools / tool_choice validation, rendering, parsing, streaming, constraint schema."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from skippy_zmq.text.tools import NO_PARAMETERS, ToolCall, ToolCallStream, ToolError, ToolSet, constrained_prefix, finish_reason, messages_for_template, native_template_inputs, normalise_messages, parse_tool_calls, render_tool_prompt, template_supports_tools, tool_call_schema, validate_tools
from skippy_zmq.text.tokenizer import TextTokenizer, word_level_tokenizer

try:
    import jsonschema
except ImportError:   # not in the venv today: the schema-validation asserts are skipped
    jsonschema = None

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"
# models/smollm2-135m-instruct/tokenizer_meta.json's chat_template (checked below when the model is there).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools' }}{%- for tool in tools %}{{- tool | tojson }}"
    "{%- endfor %}{%- endif %}{%- for message in messages %}{{ message.content }}{%- endfor %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}   # no description, no parameters
TOOLS = [WEATHER, TIME]
WEATHER_SET = validate_tools(TOOLS)


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter):024x}"


# ---------------------------------------------------------------- validate_tools

@pytest.mark.parametrize("tools, choice, message", [
    ({"type": "function"}, None, "tools: must be a list of tools, got {'type': 'function'}"),
    ([WEATHER, "x"], None, "tools[1]: must be an object, got 'x'"),
    ([{"type": "retrieval", "function": {"name": "a"}}], None, "tools[0].type: must be \"function\", got 'retrieval'"),
    ([{"type": "function"}], None, "tools[0].function: must be an object, got None"),
    ([{"type": "function", "function": {"name": "get weather"}}], None,
     "tools[0].function.name: must match ^[a-zA-Z0-9_-]{1,64}$, got 'get weather'"),
    ([{"type": "function", "function": {"name": "a" * 65}}], None,
     "tools[0].function.name: must match ^[a-zA-Z0-9_-]{1,64}$, got '" + "a" * 56 + "..."),
    ([{"type": "function", "function": {"name": "a", "description": 3}}], None,
     "tools[0].function.description: must be a string, got 3"),
    ([WEATHER, {"type": "function", "function": {"name": "b", "parameters": "{}"}}], None,
     "tools[1].function.parameters: must be an object, got '{}'"),
    ([{"type": "function", "function": {"name": "b", "parameters": {"type": "array"}}}], None,
     "tools[0].function.parameters.type: must be \"object\" (function arguments are an object), got 'array'"),
    ([{"type": "function", "function": {"name": "b", "strict": "yes"}}], None,
     "tools[0].function.strict: must be a boolean, got 'yes'"),
    ([WEATHER, TIME, WEATHER], None, "tools[2].function.name: 'get_weather' is already the name of tools[0]"),
    (TOOLS, "any", "tool_choice: must be \"auto\", \"none\", \"required\" or a named function, got 'any'"),
    (TOOLS, 3, "tool_choice: must be \"auto\", \"none\", \"required\" or a named function, got 3"),
    (None, "required", "tool_choice: \"required\" needs at least one tool in tools"),
    (TOOLS, {"type": "tool", "function": {"name": "get_time"}}, "tool_choice.type: must be \"function\", got 'tool'"),
    (TOOLS, {"type": "function"}, "tool_choice.function: must be an object with a name, got None"),
    (TOOLS, {"type": "function", "function": {"name": 1}}, "tool_choice.function.name: must be a string, got 1"),
    (TOOLS, {"type": "function", "function": {"name": "get_date"}},
     "tool_choice.function.name: 'get_date' is not one of the tools (get_weather, get_time)"),
    ([], {"type": "function", "function": {"name": "get_date"}},
     "tool_choice.function.name: 'get_date' is not one of the tools (no tools given)"),
])
def test_validate_tools_errors_name_the_path(tools, choice, message):
    with pytest.raises(ToolError) as caught:
        validate_tools(tools, choice)
    assert str(caught.value) == message
    assert isinstance(caught.value, ValueError)
    assert caught.value.param == message.split(":")[0].split(".")[0].split("[")[0]


def test_parallel_tool_calls_must_be_boolean():
    with pytest.raises(ToolError, match=r"^parallel_tool_calls: must be a boolean, got 'no'$"):
        validate_tools(TOOLS, None, "no")


def test_validate_tools_modes_and_defaults():
    assert WEATHER_SET.mode == "auto" and WEATHER_SET.names == ("get_weather", "get_time")
    assert WEATHER_SET.active and not WEATHER_SET.constrained and WEATHER_SET.parallel
    assert WEATHER_SET.functions[0].parameters == WEATHER["function"]["parameters"]
    assert WEATHER_SET.functions[1].arguments_schema == NO_PARAMETERS
    for tools, choice in ((None, None), ([], None), (None, "none"), (None, "auto"), ([], "auto")):
        toolset = validate_tools(tools, choice)
        assert toolset == ToolSet() and not toolset.active and toolset.mode == "none"
    none = validate_tools(TOOLS, "none")
    assert none.mode == "none" and not none.active and none.allowed == ()
    required = validate_tools(TOOLS, "required", False)
    assert required.mode == "required" and required.constrained and not required.parallel
    named = validate_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert (named.mode, named.name, [f.name for f in named.allowed]) == ("function", "get_time", ["get_time"])


@pytest.mark.skipif(jsonschema is None, reason="jsonschema is not installed")
def test_invalid_parameters_schema_is_refused_with_a_path():
    parameters = {"type": "object", "properties": {"a": {"type": 5}}}
    bad = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    path = r"^tools\[0\]\.function\.parameters\.properties\.a\.type: not a valid JSON schema"
    with pytest.raises(ToolError, match=path):
        validate_tools([bad])


# ---------------------------------------------------------------- normalise_messages

CALL_ID = "call_0123456789abcdef01234567"
CONVERSATION = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris"}, {"type": "text", "text": "and the time?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": CALL_ID, "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": '{"temp": 21, "sky": "clear"}'},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "14:05"}]},
    {"role": "assistant", "content": "21 °C and clear; it is 14:05."},
    {"role": "user", "content": "And in Oslo?"},
]


def test_normalise_messages_accepts_tool_traffic():
    assert normalise_messages(CONVERSATION) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris\nand the time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": CALL_ID, "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": CALL_ID, "name": "get_weather", "content": '{"temp": 21, "sky": "clear"}'},
        {"role": "tool", "tool_call_id": "call_2", "name": "get_time", "content": "14:05"},
        {"role": "assistant", "content": "21 °C and clear; it is 14:05."},
        {"role": "user", "content": "And in Oslo?"},
    ]


def test_normalise_messages_plain_messages_keep_their_shape():
    plain = [{"role": "system", "content": "s", "name": "x"}, {"role": "user", "content": "u"},
             {"role": "assistant", "content": "a", "tool_calls": []}]
    assert normalise_messages(plain) == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                                         {"role": "assistant", "content": "a"}]
    # absent content and object arguments are tolerated and re-encoded
    out = normalise_messages([{"role": "user", "content": "u"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "function": {"name": "f", "arguments": {"x": [1, 2]}}}]}])
    assert out[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": [1, 2]}'}}]}


def _with(index, message):
    messages = [dict(m) for m in CONVERSATION]
    messages[index] = message
    return messages


ASSISTANT_CALL = CONVERSATION[2]


@pytest.mark.parametrize("messages, message", [
    ([], "messages: must be a non-empty list"),
    ({"role": "user"}, "messages: must be a non-empty list"),
    (["hi"], "messages[0]: must be an object, got 'hi'"),
    ([{"role": "function", "content": "x"}],
     "messages[0].role: must be one of system, user, assistant, tool, got 'function'"),
    ([{"role": "user", "content": None}],
     "messages[0].content: must be a string or a list of {\"type\": \"text\", \"text\": ...} parts, got None"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None}],
     "messages[1].content: must be a string or a list of {\"type\": \"text\", \"text\": ...} parts, got None"),
    ([{"role": "user", "content": "q", "tool_calls": [{"id": "a"}]}],
     "messages[0].tool_calls: only assistant messages have tool_calls, not user"),
    (_with(2, {"role": "assistant", "content": None, "tool_calls": {"id": "a"}}),
     "messages[2].tool_calls: must be a list, got {'id': 'a'}"),
    (_with(2, {"role": "assistant", "tool_calls": ["x"]}), "messages[2].tool_calls[0]: must be an object, got 'x'"),
    (_with(2, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}),
     "messages[2].tool_calls[0].id: must be a non-empty string, got None"),
    (_with(2, {"role": "assistant", "tool_calls": [{"id": "a", "type": "code", "function": {}}]}),
     "messages[2].tool_calls[0].type: must be \"function\", got 'code'"),
    (_with(2, {"role": "assistant", "tool_calls": [{"id": "a", "type": "function"}]}),
     "messages[2].tool_calls[0].function: must be an object, got None"),
    (_with(2, {"role": "assistant", "tool_calls": [
        ASSISTANT_CALL["tool_calls"][0], {"id": "b", "function": {"arguments": "{}"}}]}),
     "messages[2].tool_calls[1].function.name: must be a non-empty string, got None"),
    (_with(2, {"role": "assistant", "tool_calls": [
        {"id": CALL_ID, "function": {"name": "get_weather", "arguments": '{"city": "Par'}}]}),
     "messages[2].tool_calls[0].function.arguments: must be a string holding a JSON object, got '{\"city\": \"Par'"),
    (_with(2, {"role": "assistant", "tool_calls": [
        {"id": CALL_ID, "function": {"name": "get_weather", "arguments": "[1]"}}]}),
     "messages[2].tool_calls[0].function.arguments: must be a string holding a JSON object, got '[1]'"),
    (_with(2, {"role": "assistant", "tool_calls": [ASSISTANT_CALL["tool_calls"][0]] * 2}),
     f"messages[2].tool_calls[1].id: {CALL_ID!r} is used twice"),
    (_with(3, {"role": "tool", "content": "21"}), "messages[3].tool_call_id: must be a non-empty string, got None"),
    (_with(3, {"role": "tool", "tool_call_id": "call_9", "content": "21"}),
     "messages[3].tool_call_id: 'call_9' is not one of the preceding assistant message's tool_calls "
     f"({CALL_ID}, call_2)"),
    (_with(3, {"role": "tool", "tool_call_id": CALL_ID, "content": None}),
     "messages[3].content: must be a string or a list of {\"type\": \"text\", \"text\": ...} parts, got None"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "c", "content": "r"}],
     "messages[1].role: \"tool\" messages must follow an assistant message with tool_calls"),
    (CONVERSATION + [{"role": "tool", "tool_call_id": CALL_ID, "content": "late"}],
     "messages[7].role: \"tool\" messages must follow an assistant message with tool_calls"),
])
def test_normalise_messages_errors_name_the_path(messages, message):
    with pytest.raises(ToolError) as caught:
        normalise_messages(messages)
    assert str(caught.value) == message
    assert caught.value.param == "messages"


# ---------------------------------------------------------------- rendering

WEATHER_LINE = (
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}, '
    '"unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"], "additionalProperties": false}}}'
)
TIME_LINE = '{"type": "function", "function": {"name": "get_time"}}'
PROMPT_TAIL = (
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
AUTO_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    f"<tools>\n{WEATHER_LINE}\n{TIME_LINE}\n</tools>\n\n{PROMPT_TAIL}"
)


def test_render_tool_prompt():
    assert render_tool_prompt(WEATHER_SET) == AUTO_PROMPT
    assert render_tool_prompt(validate_tools(TOOLS, "none")) == ""
    assert render_tool_prompt(validate_tools(None)) == ""
    named = validate_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert render_tool_prompt(named) == (
        '# Tools\n\nYou must call the function "get_time".\n\n'
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{TIME_LINE}\n</tools>\n\n{PROMPT_TAIL}"
    )
    assert render_tool_prompt(validate_tools(TOOLS, "required", False)).startswith(
        "# Tools\n\nYou must call one of these functions.\n\n")


EXPECTED_TEMPLATE_MESSAGES = [
    {"role": "system", "content": "Be brief.\n\n" + AUTO_PROMPT},
    {"role": "user", "content": "Weather in Paris\nand the time?"},
    {"role": "assistant", "content":
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'},
    {"role": "user", "content":
        '<tool_response>\n{"temp": 21, "sky": "clear"}\n</tool_response>\n<tool_response>\n14:05\n</tool_response>'},
    {"role": "assistant", "content": "21 °C and clear; it is 14:05."},
    {"role": "user", "content": "And in Oslo?"},
]


def test_messages_for_template_two_turn_conversation():
    assert messages_for_template(normalise_messages(CONVERSATION), WEATHER_SET) == EXPECTED_TEMPLATE_MESSAGES


def test_messages_for_template_variants():
    normalised = normalise_messages(CONVERSATION[1:])
    # no system message: the tool prompt is a new one (default_system before it when given)
    assert messages_for_template(normalised, WEATHER_SET)[0] == {"role": "system", "content": AUTO_PROMPT}
    assert messages_for_template(normalised, WEATHER_SET, default_system="You are SmolLM.")[0] == {
        "role": "system", "content": "You are SmolLM.\n\n" + AUTO_PROMPT}
    # tool_choice none / no tools: history still rendered, no prompt
    no_prompt = messages_for_template(normalised, validate_tools(TOOLS, "none"))
    assert no_prompt == EXPECTED_TEMPLATE_MESSAGES[1:] == messages_for_template(normalised, None)
    # tool results as another role, and assistant text before its call
    msgs = normalise_messages([
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "9:00"},
    ])
    assert messages_for_template(msgs, None, tool_role="tool") == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content":
            'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'},
        {"role": "tool", "content": "<tool_response>\n9:00\n</tool_response>"},
    ]
    # plain chats without tools are untouched
    plain = normalise_messages([{"role": "user", "content": "Say hello."}])
    assert messages_for_template(plain, validate_tools(None)) == [{"role": "user", "content": "Say hello."}]


def test_smollm2_template_renders_the_generic_tool_conversation():
    tokenizer, meta = word_level_tokenizer(8)
    smol = TextTokenizer(tokenizer, {**meta, "bos_id": 1, "eos_id": 2, "chat_template": SMOLLM2_TEMPLATE})
    text = smol.apply_chat_template(messages_for_template(normalise_messages(CONVERSATION[1:4]), WEATHER_SET))
    assert text == (
        f"<|im_start|>system\n{AUTO_PROMPT}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris\nand the time?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"temp": 21, "sky": "clear"}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


def test_template_supports_tools():
    assert not template_supports_tools(SMOLLM2_TEMPLATE)
    assert not template_supports_tools("")
    assert template_supports_tools(QWEN_LIKE_TEMPLATE)
    assert not template_supports_tools("{{ 'no tools here' }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not template_supports_tools("{% set tools = [] %}{{ tools }}")   # assigned, not passed in
    assert template_supports_tools("{% if tools %}{{ tools")   # does not parse: word search
    if (MODEL_DIR / "tokenizer_meta.json").is_file():
        meta = json.loads((MODEL_DIR / "tokenizer_meta.json").read_text(encoding="utf-8"))
        assert meta["chat_template"] == SMOLLM2_TEMPLATE
        assert not template_supports_tools(meta["chat_template"])


def test_native_template_inputs():
    messages, tools = native_template_inputs(normalise_messages(CONVERSATION), WEATHER_SET)
    assert tools == TOOLS
    assert messages[2]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}
    assert messages[3] == {"role": "tool", "tool_call_id": CALL_ID, "name": "get_weather",
                           "content": '{"temp": 21, "sky": "clear"}'}
    assert native_template_inputs([], validate_tools(TOOLS, "none")) == ([], None)


# ---------------------------------------------------------------- parsing

def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_parse_one_call():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, WEATHER_SET, ids())
    assert content is None
    assert calls == [ToolCall("call_" + "0" * 24, "get_weather", '{"city": "Paris"}')]
    assert calls[0].to_openai() == {"id": "call_" + "0" * 24, "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_parse_two_calls_with_text_around():
    text = ('Checking both.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>\nOne moment.')
    content, calls = parse_tool_calls(text, WEATHER_SET)
    assert content == "Checking both.\nOne moment."
    assert _calls(calls) == [("get_weather", {"city": "Oslo", "unit": "c"}), ("get_time", {})]
    assert all(c.id.startswith("call_") and len(c.id) == 29 and int(c.id[5:], 16) >= 0 for c in calls)
    assert calls[0].id != calls[1].id
    assert calls[1].arguments == "{}"   # a string holding JSON is decoded, then re-serialised
    # parallel_tool_calls false: the first call only
    single = validate_tools(TOOLS, "auto", False)
    assert parse_tool_calls(text, single, ids()) == (
        "Checking both.\nOne moment.", [ToolCall("call_" + "0" * 24, "get_weather", '{"city": "Oslo", "unit": "c"}')])


def test_parse_leaves_bad_blocks_as_content():
    bad_json = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call> done'
    assert parse_tool_calls(bad_json, WEATHER_SET) == (bad_json, [])
    for inner in ('{"arguments": {}}', '{"name": "get_weather", "arguments": [1]}', '"get_weather"',
                  '{"name": "get_weather", "arguments": "not json"}', '{"name": "rm_rf", "arguments": {}}'):
        text = f"<tool_call>{inner}</tool_call>"
        assert parse_tool_calls(text, WEATHER_SET) == (text, [])
    # an unknown function is a call only without a toolset to check it against
    assert _calls(parse_tool_calls('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>')[1]) == [("rm_rf", {})]
    # a bad block next to a good one
    text = '<tool_call>{oops}</tool_call>\n<tool_call>{"name": "get_time", "parameters": {}}</tool_call>'
    content, calls = parse_tool_calls(text, WEATHER_SET)
    assert content == "<tool_call>{oops}</tool_call>" and _calls(calls) == [("get_time", {})]
    # unclosed at the end: a call if the JSON is whole, text if not
    assert _calls(parse_tool_calls('<tool_call>\n{"name": "get_time", "arguments": {}}\n', WEATHER_SET)[1]) == [
        ("get_time", {})]
    truncated = 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"ci'
    assert parse_tool_calls(truncated, WEATHER_SET) == (truncated, [])
    assert parse_tool_calls("", WEATHER_SET) == ("", [])
    assert parse_tool_calls("  plain answer \n", WEATHER_SET) == ("  plain answer \n", [])


def test_close_tag_inside_a_json_string_does_not_end_the_call():
    """Seen from SmolLM2 under a forced call: a string value holding "}}</tool_call>"."""
    forced = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "}}</tool_call> "\n}}'
    content, calls = parse_tool_calls(forced, validate_tools(TOOLS, "required"))
    assert content is None and _calls(calls) == [("get_weather", {"city": "}}</tool_call> "})]
    text = 'A <tool_call>{"name": "get_weather", "arguments": {"city": "</tool_call>"}}</tool_call> B'
    assert parse_tool_calls(text, WEATHER_SET)[0] == "A B"
    rng = random.Random(1)
    for source in (forced, text):
        for _ in range(50):
            _, content, calls, _ = _run_stream(_split(source, rng), validate_tools(TOOLS, "required"))
            assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "}}</tool_call> "}] \
                if source is forced else [{"city": "</tool_call>"}]


def test_parse_bare_json_only_when_constrained():
    bare = '{"name": "get_time", "arguments": {}}'
    assert parse_tool_calls(bare, WEATHER_SET) == (bare, [])
    required = validate_tools(TOOLS, "required")
    assert _calls(parse_tool_calls(f"  {bare}\n", required)[1]) == [("get_time", {})]
    both = f'[{bare}, {{"name": "get_weather", "arguments": {{"city": "Rome"}}}}]'
    assert _calls(parse_tool_calls(both, required)[1]) == [("get_time", {}), ("get_weather", {"city": "Rome"})]
    named = validate_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert parse_tool_calls(bare, named) == (bare, [])   # not the named function


def test_constrained_prefix_round_trip():
    named = validate_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    prefix = constrained_prefix(named)
    assert prefix == "<tool_call>\n" and constrained_prefix(WEATHER_SET) == ""
    generated = '{"name": "get_weather", "arguments": {"city": "Lima"}}'   # the grammar ends after the JSON
    content, calls = parse_tool_calls(prefix + generated, named)
    assert content is None and _calls(calls) == [("get_weather", {"city": "Lima"})]


def test_finish_reason():
    call = ToolCall("call_x", "get_time", "{}")
    assert finish_reason("stop", [call]) == "tool_calls"
    assert finish_reason("stop", 2) == "tool_calls"
    assert finish_reason("stop", []) == "stop"
    assert finish_reason("length", [call]) == "length"


# ---------------------------------------------------------------- streaming

STREAM_TEXTS = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    'Checking both.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
    '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nOne moment.',
    'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call> done <tool_',
    '  \n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>  \n  after  \n',
    "<tool<tool_call>x</tool_call> <tool_call>{\"name\": \"get_time\"}</tool_call>< tool_call>",
    'A <tool_call>{"name": "get_time", "arguments": {}}</tool_call> <tool_call>{"name": "get_time", '
    '"arguments": {}}</tool_call> B',
    'a "<tool_call>" in JSON: <tool_call>{"name": "get_weather", "arguments": {"city": "</tool_call>"}}</tool_call>',
    'unclosed <tool_call>{"name": "get_time", "arguments": {}}',
    '<tool_call>{"name": "get_time", "arguments": {}} trailing</tool_call> x <tool_call>{"name": "get_time"}',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "}}</tool_call> "\n}}',
    'truncated <tool_call>{"name": "get_time", "argu',
    "plain text, no calls \n\n",
    "   ",
    "",
    "日本語 <tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"東京\"}}</tool_call>",
]


def _split(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _run_stream(pieces, toolset):
    stream = ToolCallStream(toolset)
    deltas = [d for piece in pieces for d in stream.push(piece)] + stream.flush()
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    return deltas, content, calls, stream


@pytest.mark.parametrize("toolset", [WEATHER_SET, validate_tools(TOOLS, "auto", False), None,
                                     validate_tools(TOOLS, "required")], ids=["auto", "single", "no-toolset", "required"])
def test_stream_reassembles_to_parse_for_random_splits(toolset):
    rng = random.Random(16)
    for text in STREAM_TEXTS:
        want_content, want_calls = parse_tool_calls(text, toolset)
        for _ in range(60):
            pieces = _split(text, rng)
            deltas, content, calls, stream = _run_stream(pieces, toolset)
            assert content == (want_content or ""), (text, pieces)
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
                (c.name, c.arguments) for c in want_calls], (text, pieces)
            assert [c["index"] for c in calls] == list(range(len(calls)))
            assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
            assert [c.id for c in stream.calls] == [c["id"] for c in calls]
            assert all(set(d) in ({"content"}, {"tool_calls"}) for d in deltas)
            assert all(d["content"] for d in deltas if "content" in d)


def test_stream_holds_back_only_what_it_must():
    stream = ToolCallStream(WEATHER_SET, ids())
    assert stream.push("Hello") == [{"content": "Hello"}]
    assert stream.push(" wor") == [{"content": " wor"}]
    assert stream.push("ld. <tool") == [{"content": "ld."}]             # " <tool" might open a call
    assert stream.push('_call>{"name": "get_time",') == []              # inside a block
    assert stream.push(' "arguments": {}}</tool_call>\nDone') == [
        {"tool_calls": [{"index": 0, "id": "call_" + "0" * 24, "type": "function",
                         "function": {"name": "get_time", "arguments": "{}"}}]},
        {"content": "\nDone"},
    ]
    assert stream.push(" <b>") == [{"content": " <b>"}]                 # "<b" cannot start <tool_call>
    assert stream.push("  ") == []
    assert stream.flush() == [{"content": "  "}]
    assert stream.calls and stream.flush() == []
    with pytest.raises(RuntimeError):
        stream.push("x")


def test_stream_constrained_bare_json_and_prefix():
    required = validate_tools(TOOLS, "required")
    stream = ToolCallStream(required, ids())
    assert stream.push(' {"name": "get_time", ') == []
    assert stream.push('"arguments": {}}') == []
    assert stream.flush() == [{"tool_calls": [{"index": 0, "id": "call_" + "0" * 24, "type": "function",
                                               "function": {"name": "get_time", "arguments": "{}"}}]}]
    # the server feeds the constrained prefix first; the grammar ends after the JSON (no closing tag)
    stream = ToolCallStream(required, ids())
    assert stream.push(constrained_prefix(required)) == []
    assert stream.push('{"name": "get_weather", "arguments": {"city": "Lima"}}') == []
    assert stream.flush()[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Lima"}'}


# ---------------------------------------------------------------- constraint schema

def test_tool_call_schema_shapes():
    assert tool_call_schema(WEATHER_SET) is None
    assert tool_call_schema(validate_tools(TOOLS, "none")) is None
    named = validate_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert tool_call_schema(named) == {
        "type": "object",
        "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER["function"]["parameters"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    required = tool_call_schema(validate_tools(TOOLS, "required"))
    assert [o["properties"]["name"] for o in required["anyOf"]] == [{"const": "get_weather"}, {"const": "get_time"}]
    assert required["anyOf"][1]["properties"]["arguments"] == NO_PARAMETERS


PYDANTIC_STYLE = {   # what pydantic's model_json_schema() gives for a nested model
    "type": "function",
    "function": {"name": "book", "parameters": {
        "$defs": {"Guest": {"type": "object", "properties": {"name": {"type": "string"}},
                            "required": ["name"], "additionalProperties": False}},
        "type": "object",
        "properties": {"guests": {"type": "array", "items": {"$ref": "#/$defs/Guest"}, "minItems": 1},
                       "nights": {"type": "integer", "minimum": 1}},
        "required": ["guests", "nights"],
        "additionalProperties": False,
    }},
}
RECURSIVE = {
    "type": "function",
    "function": {"name": "tree", "parameters": {
        "type": "object",
        "properties": {"label": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["label"],
        "additionalProperties": False,
    }},
}


def test_tool_call_schema_moves_local_refs():
    schema = tool_call_schema(validate_tools([PYDANTIC_STYLE, RECURSIVE, WEATHER], "required"))
    assert set(schema["$defs"]) == {"book__Guest", "tree__root"}
    book_args = schema["anyOf"][0]["properties"]["arguments"]
    assert book_args["properties"]["guests"]["items"] == {"$ref": "#/$defs/book__Guest"} and "$defs" not in book_args
    assert schema["anyOf"][1]["properties"]["arguments"] == {"$ref": "#/$defs/tree__root"}
    assert schema["$defs"]["tree__root"]["properties"]["children"]["items"] == {"$ref": "#/$defs/tree__root"}
    assert PYDANTIC_STYLE["function"]["parameters"]["properties"]["guests"]["items"] == {"$ref": "#/$defs/Guest"}


@pytest.mark.skipif(jsonschema is None, reason="jsonschema is not installed")
def test_tool_call_schema_validates_good_calls_and_rejects_bad():
    toolset = validate_tools([PYDANTIC_STYLE, RECURSIVE, WEATHER, TIME], "required")
    validator = jsonschema.Draft202012Validator(tool_call_schema(toolset))
    validator.check_schema(validator.schema)
    good = [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "f"}},
        {"name": "get_time", "arguments": {}},
        {"name": "book", "arguments": {"guests": [{"name": "Ada"}], "nights": 2}},
        {"name": "tree", "arguments": {"label": "a", "children": [{"label": "b", "children": [{"label": "c"}]}]}},
    ]
    bad = [
        {"name": "get_weather", "arguments": {}},                              # city required
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "k"}},   # not in the enum
        {"name": "get_weather", "arguments": {"city": 3}},
        {"name": "get_weather", "arguments": {"city": "Paris", "extra": 1}},
        {"name": "get_time", "arguments": {"x": 1}},                           # no parameters
        {"name": "get_date", "arguments": {}},                                 # unknown function
        {"name": "get_time"},                                                  # arguments missing
        {"name": "get_time", "arguments": {}, "id": "x"},
        {"name": "book", "arguments": {"guests": [], "nights": 2}},
        {"name": "book", "arguments": {"guests": [{"nom": "Ada"}], "nights": 2}},
        {"name": "tree", "arguments": {"label": "a", "children": [{"children": []}]}},
        [{"name": "get_time", "arguments": {}}],
    ]
    for call in good:
        assert validator.is_valid(call), call
    for call in bad:
        assert not validator.is_valid(call), call
    named = jsonschema.Draft202012Validator(
        tool_call_schema(validate_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}})))
    assert named.is_valid(good[0]) and not named.is_valid(good[2])
    # what the parser returns from a constrained output validates too
    _, calls = parse_tool_calls('<tool_call>\n{"name": "book", "arguments": {"guests": [{"name": "Bo"}], "nights": 1}}',
                                toolset)
    assert validator.is_valid({"name": calls[0].name, "arguments": json.loads(calls[0].arguments)})


def test_stream_deltas_accumulate_in_the_openai_client():
    streaming = pytest.importorskip("openai.lib.streaming.chat")
    from openai.types.chat import ChatCompletionChunk

    def chunk(delta, finish=None):
        return ChatCompletionChunk.model_validate({
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    text = STREAM_TEXTS[1]
    stream, state = ToolCallStream(WEATHER_SET), streaming.ChatCompletionStreamState()
    state.handle_chunk(chunk({"role": "assistant", "content": ""}))
    for piece in _split(text, random.Random(3)):
        for delta in stream.push(piece):
            state.handle_chunk(chunk(delta))
    for delta in stream.flush():
        state.handle_chunk(chunk(delta))
    state.handle_chunk(chunk({}, finish_reason("stop", stream.calls)))
    choice = state.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking both.\nOne moment."
    assert [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        (c.id, c.name, c.arguments) for c in stream.calls]
    assert _calls(stream.calls) == [("get_weather", {"city": "Oslo", "unit": "c"}), ("get_time", {})]

"""Native tool calls and reasoning through the HTTP server: SmolLM2's tokenizer (with Mistral's
and Llama's call markers added as special tokens) under llama.cpp's real chat templates, a
scripted engine writing each model's own call text, the official openai client reading
message.tool_calls, reasoning_content and the SSE deltas."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import httpx
import openai
import pytest
from fake_engine import FakeEngine
from tokenizers import AddedToken, Tokenizer

from skippy_zmq.api.server import create_app, start_in_thread
from skippy_zmq.text.tokenizer import TextTokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"
MARKERS = ["[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0123456789abcdef01234567", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny."},
    {"role": "user", "content": "And in Oslo?"},
]


@pytest.fixture(scope="module")
def base() -> TextTokenizer:
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        pytest.skip(f"no tokenizer at {TOKENIZER_DIR}")
    loaded = TextTokenizer.load(TOKENIZER_DIR)
    tokenizer = Tokenizer.from_str(loaded.tokenizer.to_str())
    tokenizer.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    return TextTokenizer(tokenizer, loaded.meta)


@pytest.fixture(scope="module")
def templates(llama_cpp_models) -> Path:
    return llama_cpp_models / "templates"


@contextlib.contextmanager
def serving(base: TextTokenizer, template: str, reply: str):
    """An app whose model has `template` and always writes `reply` (then EOS)."""
    tok = TextTokenizer(base.tokenizer, {**base.meta, "chat_template": template})
    engine = FakeEngine([*tok.encode(reply, add_bos=False), tok.eos_ids[0]], tok.eos_ids, max_context=2048)
    handle = start_in_thread(create_app(engine, tok, model_name="m"))
    try:
        with openai.OpenAI(base_url=f"{handle.url}/v1", api_key="x", max_retries=0, timeout=20) as client:
            yield client, engine, tok
    finally:
        handle.stop()


def both(client, **kwargs):
    """(non-streamed message, streamed (content, reasoning, calls, finish)) of one request."""
    kwargs.setdefault("model", "m")
    message = client.chat.completions.create(**kwargs).choices[0]
    content = reasoning = ""
    calls, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        calls += [(c.function.name, json.loads(c.function.arguments)) for c in delta.tool_calls or []]
        finish = chunk.choices[0].finish_reason or finish
    return message, (content or None, reasoning or None, calls, finish)


NATIVE = [   # (template, what the model writes, what the prompt shows of the tools, of the history)
    ("Qwen-Qwen2.5-7B-Instruct.jinja",
     'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     '<tools>\n{"type": "function", "function": {"name": "get_weather"',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja",
     'Checking. <|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
     'Given the following functions, please respond with a JSON for a function call',
     '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja",
     'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
     '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather"',
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "'),
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja",
     'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}',
     '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather"',
     '[TOOL_CALLS]get_weather[CALL_ID]'),
]


@pytest.mark.parametrize("name, reply, tools_shown, history_shown", NATIVE, ids=[n[0].split(".jinja")[0] for n in NATIVE])
def test_native_calls_in_responses_and_deltas(base, templates, name, reply, tools_shown, history_shown):
    with serving(base, (templates / name).read_text(), reply) as (client, engine, tok):
        message, streamed = both(client, messages=HISTORY, tools=[WEATHER], max_tokens=200)
        prompt = tok.decode(list(engine.requests[-1].prompt_ids))
        assert tools_shown in prompt and history_shown in prompt
        assert "# Tools" not in prompt or "Qwen" in name   # the generic prompt is not used
        assert message.finish_reason == "tool_calls" and message.message.content == "Checking."
        [call] = message.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
        assert streamed == ("Checking.", None, [("get_weather", {"city": "Oslo"})], "tool_calls")
        if "Mistral" in name:
            assert len(call.id) == 9 and call.id.isalnum()


FORCED = [   # (template, what the model writes after the prefix, the prefix)
    ("Qwen-Qwen2.5-7B-Instruct.jinja", '{"name": "get_weather", "arguments": {"city": "Oslo"}}', "<tool_call>\n"),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
     "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
     "[/INST][TOOL_CALLS]"),
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja", '{"city": "Oslo"}', "[/INST][TOOL_CALLS]get_weather[ARGS]"),
]


@pytest.mark.parametrize("name, reply, prefix", FORCED, ids=[n[0].split(".jinja")[0] for n in FORCED])
def test_forced_native_call_is_constrained_to_the_format(base, templates, name, reply, prefix):
    with serving(base, (templates / name).read_text(), reply) as (client, engine, tok):
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            message, streamed = both(client, messages=ASK, tools=[WEATHER], tool_choice=choice, max_tokens=200)
            request = engine.requests[-1]
            assert tok.decode(list(request.prompt_ids)).endswith(prefix)
            assert request.constraint["kind"] == "json_schema"
            assert message.finish_reason == "tool_calls" and message.message.content is None
            assert [(c.function.name, json.loads(c.function.arguments)) for c in message.message.tool_calls] == [
                ("get_weather", {"city": "Oslo"})]
            assert streamed == (None, None, [("get_weather", {"city": "Oslo"})], "tool_calls")


@pytest.mark.parametrize("name", ["microsoft-Phi-3.5-mini-instruct.jinja", "google-gemma-2-2b-it.jinja"])
def test_templates_without_tools_keep_the_generic_prompt(base, templates, name):
    """Gemma's template refuses a system role: the tool prompt goes at the top of the user turn."""
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    with serving(base, (templates / name).read_text(), reply) as (client, engine, tok):
        message, streamed = both(client, messages=ASK, tools=[WEATHER], max_tokens=200)
        prompt = tok.decode(list(engine.requests[-1].prompt_ids))
        assert "# Tools" in prompt and prompt.index("# Tools") < prompt.index("Weather in Paris?")
        assert message.message.tool_calls[0].function.name == "get_weather"
        assert streamed[2] == [("get_weather", {"city": "Oslo"})]


def test_qwen3_reasoning_content_apart(base, templates):
    template = (templates / "Qwen-Qwen3-0.6B.jinja").read_text()
    with serving(base, template, "<think>\nThe user greets me.\n</think>\n\nHello!") as (client, engine, tok):
        message, streamed = both(client, messages=[{"role": "user", "content": "Hi"}], max_tokens=200)
        assert message.message.content == "Hello!"
        assert message.message.model_extra["reasoning_content"] == "\nThe user greets me.\n"
        assert streamed == ("Hello!", "\nThe user greets me.\n", [], "stop")
        # chat_template_kwargs reach the template; reasoning_format "none" leaves the text alone
        out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                         "reasoning_format": "none"})
        assert tok.decode(list(engine.requests[-1].prompt_ids)).endswith("<think>\n\n</think>\n\n")
        assert out.choices[0].message.content == "<think>\nThe user greets me.\n</think>\n\nHello!"


def test_reasoning_then_a_call(base, templates):
    template = (templates / "Qwen-Qwen3-0.6B.jinja").read_text()
    reply = ('<think>I need the weather.</think>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    with serving(base, template, reply) as (client, _, _):   # the history's null content renders as ""
        message, streamed = both(client, messages=HISTORY, tools=[WEATHER], max_tokens=200)
        assert message.message.content is None and message.finish_reason == "tool_calls"
        assert message.message.model_extra["reasoning_content"] == "I need the weather."
        assert streamed == (None, "I need the weather.", [("get_weather", {"city": "Oslo"})], "tool_calls")


def test_prompt_that_opens_thinking(base, templates):
    template = (templates / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    with serving(base, template, "Two plus two is four.</think>\n\n4") as (client, engine, tok):
        message, streamed = both(client, messages=[{"role": "user", "content": "2+2?"}], max_tokens=200,
                                 extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert tok.decode(list(engine.requests[-1].prompt_ids)).endswith("<think>\n")
        assert (message.message.content, message.message.model_extra["reasoning_content"]) == (
            "4", "Two plus two is four.")
        assert streamed == ("4", "Two plus two is four.", [], "stop")


@pytest.mark.parametrize("extra, message", [
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs must be an object, got ['enable_thinking']"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools: set by the server, not by the request"),
    ({"reasoning_format": "verbose"}, "reasoning_format must be one of auto, deepseek, none, got 'verbose'"),
])
def test_bad_template_kwargs_are_400(base, templates, extra, message):
    with serving(base, (templates / "Qwen-Qwen3-0.6B.jinja").read_text(), "Hi") as (client, _, _):
        url = str(client.base_url).rstrip("/") + "/chat/completions"
        response = httpx.post(url, json={"model": "m", "messages": ASK, **extra}, timeout=10)
        assert response.status_code == 400
        assert response.json()["error"]["message"] == message
        assert response.json()["error"]["param"] == next(iter(extra))


def test_format_comes_from_the_tool_use_template(base, templates):
    qwen = (templates / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    plain = (templates / "microsoft-Phi-3.5-mini-instruct.jinja").read_text()
    engine = FakeEngine([1], [2])
    named = TextTokenizer(base.tokenizer, {**base.meta, "chat_template": plain, "chat_templates": {"tool_use": qwen}})
    assert create_app(engine, named).state.ctx.tool_format.name == "hermes"
    only_plain = TextTokenizer(base.tokenizer, {**base.meta, "chat_template": plain})
    assert create_app(engine, only_plain).state.ctx.tool_format.name == "generic"
    qwen3 = (templates / "Qwen-Qwen3-0.6B.jinja").read_text()
    thinking = TextTokenizer(base.tokenizer, {**base.meta, "chat_template": qwen3})
    assert create_app(engine, thinking).state.ctx.thinks and not create_app(engine, named).state.ctx.thinks

"""A real vocabulary end to end: a random model of Qwen2.5-0.5B's shape (2 layers) with the real
Qwen2 vocabulary from llama.cpp's test vectors and Qwen2.5-Instruct's chat template, served by 2 real
stages over HTTP to the official client.

What it shows: the template is applied (prompt token counts equal the tokenizer's), streamed text
equals non-streamed text equals the decode of the returned tokens' bytes, an end-of-turn id stops
the answer, and a forced tool call comes back parsed from the model's own `<tool_call>` format.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from procs import serving, write_topology
from skippy_zmq.devtools.random_model import RandomSpec, write_random_model
from skippy_zmq.text.tokenizer import META_FILE, TextTokenizer

pytestmark = pytest.mark.slow

ASK = [{"role": "system", "content": "Réponds en une phrase."},
       {"role": "user", "content": "Wie ist das Wetter in Zürich? 天气怎么样？"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Zürich", "Paris"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}


@pytest.fixture(scope="module")
def served(llama_cpp_models: Path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("realvocab")
    model = tmp / "model"
    write_random_model(RandomSpec("qwen2.5-0.5b", seed=0, weights="q4", layers=2,
                                  vocab=str(llama_cpp_models / "ggml-vocab-qwen2.gguf")), model)
    # The Qwen2 vocabulary file carries Qwen2's template; Qwen2.5-Instruct's (the same vocabulary)
    # renders tools, as a user would set it for a Qwen2.5 model.
    meta = json.loads((model / META_FILE).read_text(encoding="utf-8"))
    meta["chat_template"] = (llama_cpp_models / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text("utf-8")
    meta["chat_templates"] = {}
    (model / META_FILE).write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")
    path = write_topology(tmp, model, 2, weights="q4", kv_lanes=2, driver__max_sessions=2)
    with serving(path, tmp / "run") as served:
        yield openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0), served.tokenizer


def test_template_applied_and_stream_equals_text_equals_decode(served) -> None:
    client, tok = served
    assert isinstance(tok, TextTokenizer) and tok.meta["pre"] == "qwen2"
    prompt_ids = tok.encode_chat(ASK)
    assert tok.decode(prompt_ids).startswith("<|im_start|>system\nRéponds")
    full = client.chat.completions.create(model="m", messages=ASK, max_tokens=24, temperature=0,
                                          logprobs=True, extra_body={"ignore_eos": True})
    assert full.usage.prompt_tokens == len(prompt_ids)
    text = full.choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="m", messages=ASK, max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True})
        if c.choices]
    assert "".join(pieces) == text
    got = b"".join(bytes(t.bytes) for t in full.choices[0].logprobs.content)
    assert got.decode("utf-8", errors="replace") == text and len(full.choices[0].logprobs.content) == 24


def test_end_of_turn_id_stops(served) -> None:
    client, tok = served
    im_end = tok.tokenizer.token_to_id("<|im_end|>")
    assert im_end in tok.eos_ids
    bias = {str(im_end): 100}
    full = client.chat.completions.create(model="m", messages=ASK, max_tokens=16, temperature=0, logit_bias=bias)
    assert full.choices[0].finish_reason == "stop" and full.choices[0].message.content == ""
    assert full.usage.completion_tokens == 1


def test_forced_native_tool_call_is_parsed(served) -> None:
    client, _ = served
    for stream in (False, True):
        kwargs = dict(model="m", messages=ASK, tools=[WEATHER], max_tokens=60, temperature=0,
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
        if not stream:
            call = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
            name, arguments = call.function.name, call.function.arguments
        else:
            deltas = [d for c in client.chat.completions.create(stream=True, **kwargs) if c.choices
                      for d in (c.choices[0].delta.tool_calls or ())]
            name = "".join(d.function.name or "" for d in deltas if d.function)
            arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
        args = json.loads(arguments)
        assert name == "get_weather" and args["city"] in ("Zürich", "Paris"), (name, arguments)
        assert args["unit"] in ("celsius", "fahrenheit") and set(args) == {"city", "unit"}

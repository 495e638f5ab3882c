"""Render llama.cpp's real chat templates with transformers, as fixtures our renderer must equal.

    .venv/bin/python scripts/make_template_fixtures.py [MODELS_DIR]

MODELS_DIR defaults to llama.cpp's models/ folder (fetched from the llama-cpp-python sdist by
skippy_zmq.files.fetch): its `templates/*.jinja`, and the templates inside its `ggml-vocab-*.gguf`
(fixtures named gguf.<vocab>.<name>.json, with the file and field they came from). Each template is rendered for every case in
tests/fixtures/chat_templates/cases.json (written here too) the way
`PreTrainedTokenizerBase.apply_chat_template(tokenize=False)` does it: messages normalised by
`_normalize_chat_messages`, then `render_jinja_template` with the tokenizer's special tokens
(here bos_token/eos_token, plausible per family) as template kwargs. `strftime_now` is pinned
to FIXED_NOW by patching the module's `datetime`. Output: one JSON per template,
tests/fixtures/chat_templates/<template>.json, with the template's sha256 (so a changed sdist
is noticed), the special tokens, and per case the text or the error transformers raised.
The templates themselves are not committed.
"""

from __future__ import annotations

import hashlib
import json
import sys
from datetime import datetime
from pathlib import Path

import transformers
from transformers.utils import chat_template_utils as ctu

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "chat_templates"
FIXED_NOW = datetime(2025, 7, 26, 13, 5, 9)

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
ASK = {"role": "user", "content": "What is 2+2?"}
ANSWER = {"role": "assistant", "content": "2+2 is 4."}
ASK_WEATHER = {"role": "user", "content": "What's the weather in Paris?"}
# Mistral's templates want 9-character alphanumeric call ids.
CALL = {"id": "call00001", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}
CALL_JSON_ARGS = {**CALL, "function": {**CALL["function"], "arguments": '{"city": "Paris", "unit": "celsius"}'}}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call00001", "name": "get_weather",
               "content": '{"temperature": 21, "condition": "sunny"}'}


def _calls(call: dict, content: str | None = None) -> list[dict]:
    # content None: OpenAI's `null` beside tool_calls, which transformers drops from the message.
    return [SYSTEM, ASK_WEATHER, {"role": "assistant", "content": content, "tool_calls": [call]}, TOOL_RESULT]


# name -> inputs; `when` (not passed on): the template text must contain it for the case to apply.
CASES: dict[str, dict] = {
    "user": {"messages": [ASK]},
    "system_user": {"messages": [SYSTEM, ASK]},
    "system_user_closed": {"messages": [SYSTEM, ASK, ANSWER], "add_generation_prompt": False},
    "turns": {"messages": [SYSTEM, ASK, ANSWER, {"role": "user", "content": "And 3+3?"}]},
    "turns_no_system": {"messages": [ASK, ANSWER, {"role": "user", "content": "And 3+3?"}]},
    "unicode": {"messages": [{"role": "system", "content": "Réponds en français. 你好！"},
                             {"role": "user", "content": "Grüße, 世界 👋"}]},
    "tools": {"messages": [SYSTEM, ASK_WEATHER], "tools": [WEATHER_TOOL]},
    "tools_no_system": {"messages": [ASK_WEATHER], "tools": [WEATHER_TOOL]},
    "tool_calls": {"messages": _calls(CALL), "tools": [WEATHER_TOOL]},
    "tool_calls_json_args": {"messages": _calls(CALL_JSON_ARGS), "tools": [WEATHER_TOOL]},
    "tool_calls_empty_content": {"messages": _calls(CALL, ""), "tools": [WEATHER_TOOL]},
    "reasoning_history": {"messages": [ASK, {**ANSWER, "reasoning_content": "Two plus two: 4."},
                                       {"role": "user", "content": "And 3+3?"}]},
    "thinking_on": {"messages": [ASK], "kwargs": {"enable_thinking": True}, "when": "enable_thinking"},
    "thinking_off": {"messages": [ASK], "kwargs": {"enable_thinking": False}, "when": "enable_thinking"},
    "documents": {"messages": [ASK], "when": "documents",
                  "documents": [{"title": "Arithmetic", "text": "2+2 equals 4."}]},
}

# (file-name fragment, bos_token, eos_token); first match wins, the last is everyone else's.
SPECIALS = [
    ("Hermes-2-Pro", "<|begin_of_text|>", "<|im_end|>"),
    ("Llama-3", "<|begin_of_text|>", "<|eot_id|>"),
    ("functionary", "<|begin_of_text|>", "<|eot_id|>"), ("Distill-Llama", "<|begin_of_text|>", "<|eot_id|>"),
    ("Qwen", "", "<|im_end|>"), ("QwQ", "", "<|im_end|>"), ("SmolLM3", "", "<|im_end|>"),
    ("deepseek", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    ("gemma", "<bos>", "<eos>"), ("Phi-3", "<s>", "<|endoftext|>"),
    ("gpt-oss", "<|startoftext|>", "<|return|>"), ("granite", "", "<|end_of_text|>"),
    ("command-r", "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"), ("Cohere", "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    ("", "<s>", "</s>"),
]


class _FixedDatetime(datetime):
    @classmethod
    def now(cls, tz=None):  # noqa: ANN001, ANN206 - datetime's own signature
        return FIXED_NOW


def specials_for(name: str) -> tuple[str, str]:
    return next((bos, eos) for frag, bos, eos in SPECIALS if frag.lower() in name.lower())


def cases_for(text: str) -> dict[str, dict]:
    """The cases that apply to a template, without their `when`."""
    return {name: {k: v for k, v in case.items() if k != "when"}
            for name, case in CASES.items() if case.get("when", "") in text}


def render_like_transformers(text: str, case: dict, bos: str, eos: str) -> dict:
    messages = ctu._normalize_chat_messages(case["messages"])
    try:
        rendered, _ = ctu.render_jinja_template(
            conversations=[messages], tools=case.get("tools"), documents=case.get("documents"),
            chat_template=text, add_generation_prompt=case.get("add_generation_prompt", True),
            bos_token=bos, eos_token=eos, **case.get("kwargs", {}))
    except Exception as err:  # what transformers raised is part of the record
        return {"error": type(err).__name__, "message": str(err)}
    return {"text": rendered[0]}


def gguf_sources(models_dir: Path) -> list[tuple[str, str, str, str]]:
    """(fixture stem, file name, GGUF field, text) of every template inside the vocab GGUFs
    (command-r carries `tool_use` and `rag` beside its default)."""
    import gguf

    out = []
    for path in sorted(models_dir.glob("ggml-vocab-*.gguf")):
        for key, field in gguf.GGUFReader(str(path)).fields.items():
            if key == "tokenizer.chat_template" or key.startswith("tokenizer.chat_template."):
                suffix = key.removeprefix("tokenizer.chat_template").lstrip(".") or "default"
                out.append((f"{path.stem}.{suffix}", path.name, key, field.contents()))
    return out


def fixture_for(name: str, text: str, **source: str) -> dict:
    bos, eos = specials_for(name)
    return {"template": name, **source, "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "transformers": transformers.__version__, "now": FIXED_NOW.isoformat(),
            "bos_token": bos, "eos_token": eos,
            "renders": {name: render_like_transformers(text, case, bos, eos)
                        for name, case in cases_for(text).items()}}


def write_fixture(stem: str, fixture: dict) -> int:
    out = FIXTURES / f"{stem}.json"
    out.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    return sum("error" in r for r in fixture["renders"].values())


def main(models_dir: Path) -> None:
    ctu.datetime = _FixedDatetime  # strftime_now reads the module's datetime when called
    FIXTURES.mkdir(parents=True, exist_ok=True)
    (FIXTURES / "cases.json").write_text(json.dumps(CASES, ensure_ascii=False, indent=1) + "\n",
                                         encoding="utf-8")
    paths = sorted((models_dir / "templates").glob("*.jinja"))
    if not paths:
        raise SystemExit(f"{models_dir}/templates: no *.jinja templates")
    errors = sum(write_fixture(p.stem, fixture_for(p.name, p.read_text(encoding="utf-8"))) for p in paths)
    embedded = gguf_sources(models_dir)
    errors += sum(write_fixture(f"gguf.{stem}", fixture_for(stem, text, gguf=file, gguf_field=key))
                  for stem, file, key, text in embedded)
    print(f"{len(paths)} templates + {len(embedded)} inside vocab GGUFs, {errors} cases where "
          f"transformers raises, written to {FIXTURES}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        from skippy_zmq.devtools.llama_cpp_models import fetch_llama_cpp_models
        main(fetch_llama_cpp_models())

"""What a tool-call format is: how tools reach the prompt, how calls are read back, and what a
required / named tool_choice constrains the output to.

One format per file (generic, hermes, llama3_json, mistral); skippy_zmq.text.tools.formats
chooses one from the chat template. A format is stateless; per-output state lives in the
stream it makes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from skippy_zmq.text.constrain import ConstraintSpec
from skippy_zmq.text.tools.calls import ToolCall, new_call_id
from skippy_zmq.text.tools.validation import ToolSet, arguments_object

NewId = Callable[[], str]


class CallStream(Protocol):
    """Streamed text in, OpenAI delta objects ({"content"} or {"tool_calls"}) out."""

    calls: list[ToolCall]

    def push(self, text: str) -> list[dict[str, Any]]: ...

    def flush(self) -> list[dict[str, Any]]: ...


class ToolFormat:
    """The interface every format implements (the defaults are the native, HF-convention ones)."""

    name = "base"
    native = True            # tools and tool traffic go through the model's own template
    keeps_special = False    # the call markers are special tokens: decode the output with them

    @staticmethod
    def detect(template: str) -> bool:
        """Whether a chat template (its text) writes calls in this format."""
        raise NotImplementedError

    def template_inputs(self, messages: Iterable[Mapping[str, Any]], toolset: ToolSet | None
                        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools) to render the template with."""
        return native_template_inputs(messages, toolset)

    def constrained_prefix(self, toolset: ToolSet) -> str:
        """Text the prompt ends with (and the output starts with) when the call is constrained."""
        raise NotImplementedError

    def constraint(self, toolset: ToolSet) -> ConstraintSpec | None:
        """What the output after constrained_prefix must match (None unless required / named)."""
        raise NotImplementedError

    def parse(self, text: str, toolset: ToolSet | None = None, new_id: NewId | None = None
              ) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output: content None when there are calls and no text."""
        raise NotImplementedError

    def stream(self, toolset: ToolSet | None = None, new_id: NewId | None = None) -> CallStream:
        """A stream whose deltas reassemble to parse() of the whole text."""
        raise NotImplementedError

    def new_id(self) -> str:
        return new_call_id()


def template_supports_tools(template_text: str) -> bool:
    """Whether a Jinja chat template renders a `tools` variable itself (Qwen2.5, Llama 3.1, Hermes...).

    Reads the template's free variables; falls back to a word search if the
    template does not parse.
    """
    if not template_text:
        return False
    from jinja2 import Environment, TemplateSyntaxError, meta

    try:
        env = Environment(extensions=["jinja2.ext.loopcontrols"])
        return "tools" in meta.find_undeclared_variables(env.parse(template_text))
    except TemplateSyntaxError:
        return re.search(r"\btools\b", template_text) is not None


def native_template_inputs(
    messages: Iterable[Mapping[str, Any]], toolset: ToolSet | None,
    call_id: Callable[[str], str] = str,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for a template that renders tools itself (HF convention).

    Call arguments become objects (HF templates write them with `| tojson`;
    vLLM does the same conversion) and a calling message's null content ""
    (Qwen3's template tests `'</think>' in content`; llama.cpp passes "" too);
    `call_id` maps the ids of calls and of tool results (Mistral's templates
    want 9 characters); tools are the
    allowed tools in OpenAI's shape, or None when no tools are active.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["content"] = message.get("content") or ""
            message["tool_calls"] = [
                {**c, "id": call_id(c["id"]),
                 "function": {"name": c["function"]["name"],
                              "arguments": arguments_object(c["function"]["arguments"], "arguments")}}
                for c in message["tool_calls"]
            ]
        if message.get("role") == "tool":
            message["tool_call_id"] = call_id(message["tool_call_id"])
        out.append(message)
    tools = [spec.to_openai() for spec in toolset.allowed] if toolset is not None and toolset.active else None
    return out, tools

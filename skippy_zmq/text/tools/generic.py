"""The generic tool format, for templates that do not render tools themselves (SmolLM2).

The tools go into the system message as a prompt in Qwen2.5's wording
(`render_tool_prompt`), past calls and tool results become plain messages
(`messages_for_template`), and the model is asked for Hermes-style
`<tool_call>` blocks, parsed by skippy_zmq.text.tools.tagged.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from skippy_zmq.text.constrain import ConstraintSpec
from skippy_zmq.text.tools.base import NewId, ToolFormat
from skippy_zmq.text.tools.calls import ToolCall
from skippy_zmq.text.tools.schema import tool_call_schema
from skippy_zmq.text.tools.tagged import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCallStream, parse_tool_calls
from skippy_zmq.text.tools.validation import ToolSet, dump

TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"


def render_tool_prompt(toolset: ToolSet) -> str:
    """The tool section of the system prompt ("" when no tools are active).

    Qwen2.5's wording: the functions as JSON lines in <tools></tools>, then
    how to answer with a call. Only the functions the choice allows are listed.
    """
    allowed = toolset.allowed if toolset.active else ()
    if not allowed:
        return ""
    listed = "\n".join(dump(spec.to_openai()) for spec in allowed)
    if toolset.mode == "function":
        rule = f'You must call the function "{toolset.name}".'
    elif toolset.mode == "required":
        rule = "You must call one of these functions." if not toolset.parallel else \
            "You must call one or more of these functions."
    else:
        rule = "You may call one of these functions to assist with the user query." if not toolset.parallel else \
            "You may call one or more functions to assist with the user query."
    return (
        f"# Tools\n\n{rule}\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
        f"For each function call, return a json object with function name and arguments within "
        f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} XML tags:\n"
        f'{TOOL_CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{TOOL_CALL_CLOSE}'
    )


def format_tool_call(name: str, arguments: Mapping[str, Any] | str) -> str:
    """One call as the model is told to write it: <tool_call>\\n{json}\\n</tool_call>."""
    if isinstance(arguments, str):
        arguments = json.loads(arguments) if arguments.strip() else {}
    return f"{TOOL_CALL_OPEN}\n{dump({'name': name, 'arguments': arguments})}\n{TOOL_CALL_CLOSE}"


def messages_for_template(
    messages: Iterable[Mapping[str, Any]],
    toolset: ToolSet | None = None,
    tool_role: str = "user",
    default_system: str | None = None,
) -> list[dict[str, str]]:
    """Normalised messages (tool traffic included) as plain {"role", "content"} messages.

    * an assistant message with tool_calls -> assistant content: its text (if
      any), then each call as a <tool_call> block, joined by newlines;
    * a run of consecutive tool messages -> ONE `tool_role` message (default
      "user", as Qwen2.5's template does: it keeps user/assistant alternation
      for templates that enforce it) holding each result in a
      <tool_response>\\n...\\n</tool_response> block, joined by newlines;
    * with active tools, the tool prompt goes at the end of the first system
      message (after a blank line), or becomes a new first system message
      (`default_system`, if given, before it). The template's own default
      system prompt (SmolLM2's "You are a helpful AI assistant named SmolLM")
      is then not rendered, as with any client-given system message.

    Plain messages and no active tools: the messages unchanged.
    """
    out: list[dict[str, str]] = []
    previous_tool = False
    for message in messages:
        role, content = message["role"], message.get("content")
        if role == "tool":
            block = f"{TOOL_RESPONSE_OPEN}\n{content}\n{TOOL_RESPONSE_CLOSE}"
            if previous_tool:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": tool_role, "content": block})
            previous_tool = True
            continue
        previous_tool = False
        if role == "assistant" and message.get("tool_calls"):
            parts = [content] if content else []
            parts += [format_tool_call(c["function"]["name"], c["function"]["arguments"])
                      for c in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(parts)})
            continue
        out.append({"role": role, "content": content if content is not None else ""})
    prompt = render_tool_prompt(toolset) if toolset is not None else ""
    if prompt:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": f"{default_system}\n\n{prompt}" if default_system else prompt})
    return out


class GenericFormat(ToolFormat):
    """Our own tool prompt in the system message, Hermes-style calls back; for any template."""

    name = "generic"
    native = False

    @staticmethod
    def detect(template: str) -> bool:
        return True   # the fallback: chosen last

    def template_inputs(self, messages: Iterable[Mapping[str, Any]], toolset: ToolSet | None
                        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        return messages_for_template(messages, toolset), None

    def constrained_prefix(self, toolset: ToolSet) -> str:
        return f"{TOOL_CALL_OPEN}\n" if toolset.constrained else ""

    def constraint(self, toolset: ToolSet) -> ConstraintSpec | None:
        schema = tool_call_schema(toolset)
        return None if schema is None else ConstraintSpec("json_schema", schema)

    def parse(self, text: str, toolset: ToolSet | None = None, new_id: NewId | None = None
              ) -> tuple[str | None, list[ToolCall]]:
        return parse_tool_calls(text, toolset, new_id or self.new_id)

    def stream(self, toolset: ToolSet | None = None, new_id: NewId | None = None) -> ToolCallStream:
        return ToolCallStream(toolset, new_id or self.new_id)


GENERIC = GenericFormat()

"""OpenAI tools: validation, the tool-call formats models speak, parsing and streaming of calls,
and the constraint a required / named tool_choice puts on the output.

Pure functions, no I/O; the server wires them in:

* validation: `validate_tools` -> `ToolSet`, `normalise_messages` (tool traffic in messages);
* formats (one file each, chosen from the chat template by `choose_format`, the generic one
  last): `hermes` (`<tool_call>` JSON, Qwen2.5 / Qwen3 / Hermes), `llama3_json` (Llama 3.1+
  JSON calls, `<|python_tag|>`), `mistral` (`[TOOL_CALLS]`, both spellings) and `generic`
  (our prompt in the system message for templates without tools, e.g. SmolLM2). A format
  renders the tools (`template_inputs`), parses a finished output (`parse`), streams one
  (`stream`) and says what a forced call is constrained to (`constrained_prefix`, `constraint`);
* the generic pieces keep their names: `render_tool_prompt`, `messages_for_template`,
  `parse_tool_calls`, `ToolCallStream`, `tool_call_schema`, `constrained_prefix`.
"""

from skippy_zmq.text.tools.base import CallStream, ToolFormat, native_template_inputs, template_supports_tools
from skippy_zmq.text.tools.calls import ToolCall, finish_reason, new_call_id
from skippy_zmq.text.tools.formats import FORMATS, NATIVE_FORMATS, choose_format, format_named
from skippy_zmq.text.tools.generic import GENERIC, TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN, format_tool_call, messages_for_template, render_tool_prompt
from skippy_zmq.text.tools.hermes import HERMES
from skippy_zmq.text.tools.llama3_json import LLAMA3_JSON
from skippy_zmq.text.tools.mistral import MISTRAL, MISTRAL_ARGS
from skippy_zmq.text.tools.schema import tool_call_schema
from skippy_zmq.text.tools.tagged import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCallStream, parse_tool_calls
from skippy_zmq.text.tools.validation import NO_PARAMETERS, NO_TOOLS, FunctionSpec, ToolError, ToolSet, normalise_messages, validate_tools


def constrained_prefix(toolset: ToolSet) -> str:
    """The generic format's constrained prefix (`<tool_call>\\n` for required / named)."""
    return GENERIC.constrained_prefix(toolset)


__all__ = [
    "CallStream", "FORMATS", "FunctionSpec", "GENERIC", "HERMES", "LLAMA3_JSON", "MISTRAL", "MISTRAL_ARGS",
    "NATIVE_FORMATS", "NO_PARAMETERS", "NO_TOOLS", "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "TOOL_RESPONSE_CLOSE",
    "TOOL_RESPONSE_OPEN", "ToolCall", "ToolCallStream", "ToolError", "ToolFormat", "ToolSet", "choose_format",
    "constrained_prefix", "finish_reason", "format_named", "format_tool_call", "messages_for_template",
    "native_template_inputs", "new_call_id", "normalise_messages", "parse_tool_calls", "render_tool_prompt",
    "template_supports_tools", "tool_call_schema", "validate_tools",
]

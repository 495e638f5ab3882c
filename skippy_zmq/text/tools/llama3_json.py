"""Llama 3.1 / 3.2 / 3.3 native calls: the template lists the tools ("Respond in the format
{"name": function name, "parameters": dictionary of argument name and its value}") and the
model answers with that JSON as its whole message, optionally after `<|python_tag|>`; several
calls are separated by `;` (vLLM's `llama3_json` parser)."""

from __future__ import annotations

from skippy_zmq.text.constrain import ConstraintSpec
from skippy_zmq.text.tools.base import NewId, ToolFormat
from skippy_zmq.text.tools.calls import ToolCall, call_from_json
from skippy_zmq.text.tools.schema import tool_call_schema
from skippy_zmq.text.tools.tail import TailCallStream, json_values, keep_allowed, split_tail, tail_content
from skippy_zmq.text.tools.validation import ToolSet

PYTHON_TAG = "<|python_tag|>"
_MARKERS = (PYTHON_TAG,)


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    keeps_special = True   # <|python_tag|> is a special token

    @staticmethod
    def detect(template: str) -> bool:
        return "<|start_header_id|>" in template and "<function=" not in template and (   # functionary: XML
            PYTHON_TAG in template or '"parameters": dictionary of argument name' in template)

    def constrained_prefix(self, toolset: ToolSet) -> str:
        return ""   # the message itself is the call

    def constraint(self, toolset: ToolSet) -> ConstraintSpec | None:
        schema = tool_call_schema(toolset, arguments_key="parameters")
        return None if schema is None else ConstraintSpec("json_schema", schema)

    def parse(self, text: str, toolset: ToolSet | None = None, new_id: NewId | None = None
              ) -> tuple[str | None, list[ToolCall]]:
        new_id = new_id or self.new_id
        start = split_tail(text, _MARKERS, leading_json=True)
        if start < 0:
            return text, []
        body = text[start:]
        body = body[len(PYTHON_TAG):] if body.startswith(PYTHON_TAG) else body
        values = json_values(body, separators=";")
        calls = keep_allowed([call_from_json(v, toolset, new_id) for v in values or ()], toolset)
        if calls is None:
            return text, []
        return tail_content(text, start), calls

    def stream(self, toolset: ToolSet | None = None, new_id: NewId | None = None) -> TailCallStream:
        return TailCallStream(lambda text: self.parse(text, toolset, new_id), _MARKERS, leading_json=True)


LLAMA3_JSON = Llama3JsonFormat()

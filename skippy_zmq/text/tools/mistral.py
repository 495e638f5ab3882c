"""Mistral native calls, after the `[TOOL_CALLS]` control token (vLLM's `mistral` parser):

* Mistral 7B v0.3 / Nemo: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
* Mistral Small 3.2, Devstral, Ministral 3 (templates with `[ARGS]`):
  `[TOOL_CALLS]name[ARGS]{...}`, once per call (history may hold `name[CALL_ID]id[ARGS]{...}`).

Both spellings are read whichever template chose the format. Mistral's templates refuse call
ids that are not 9 alphanumeric characters, so ids are made that way and others are mapped.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from collections.abc import Iterable, Mapping
from typing import Any

from skippy_zmq.text.constrain import ConstraintSpec, lark_json
from skippy_zmq.text.tools.base import NewId, ToolFormat, native_template_inputs
from skippy_zmq.text.tools.calls import ToolCall, call_from_json
from skippy_zmq.text.tools.schema import arguments_for, tool_call_schema
from skippy_zmq.text.tools.tail import TailCallStream, json_values, keep_allowed, split_tail, tail_content
from skippy_zmq.text.tools.validation import ToolSet

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_MARKERS = (TOOL_CALLS,)
_ID = re.compile(r"[A-Za-z0-9]{9}")
_ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_call_id(call_id: str) -> str:
    """A call id as Mistral's templates accept it: itself if 9 alphanumerics, else 9 hex digits
    of its hash (the same id always maps the same way, so a call and its result still match)."""
    return call_id if _ID.fullmatch(call_id) else hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _named_calls(body: str, toolset: ToolSet | None, new_id: NewId) -> list[ToolCall | None]:
    """`name[ARGS]{...}` segments separated by [TOOL_CALLS] (an optional [CALL_ID]id before [ARGS])."""
    calls: list[ToolCall | None] = []
    for segment in body.split(TOOL_CALLS):
        name, args, arguments = segment.partition(ARGS)
        name = name.partition(CALL_ID)[0].strip()
        values = json_values(arguments) if args else None
        if values is None or len(values) != 1:
            return [None]
        calls.append(call_from_json({"name": name, "arguments": values[0]}, toolset, new_id))
    return calls


class MistralFormat(ToolFormat):
    name = "mistral"
    keeps_special = True   # [TOOL_CALLS] and [ARGS] are control tokens

    @staticmethod
    def detect(template: str) -> bool:
        return TOOL_CALLS in template and ARGS not in template

    def template_inputs(self, messages: Iterable[Mapping[str, Any]], toolset: ToolSet | None
                        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        return native_template_inputs(messages, toolset, call_id=mistral_call_id)

    def new_id(self) -> str:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))

    def constrained_prefix(self, toolset: ToolSet) -> str:
        return TOOL_CALLS if toolset.constrained else ""

    def constraint(self, toolset: ToolSet) -> ConstraintSpec | None:
        """A JSON list holding the one call."""
        schema = tool_call_schema(toolset)
        if schema is None:
            return None
        defs = schema.pop("$defs", None)
        listed: dict[str, Any] = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
        return ConstraintSpec("json_schema", {**listed, "$defs": defs} if defs else listed)

    def parse(self, text: str, toolset: ToolSet | None = None, new_id: NewId | None = None
              ) -> tuple[str | None, list[ToolCall]]:
        new_id = new_id or self.new_id
        start = split_tail(text, _MARKERS, leading_json=False)
        if start < 0:
            return text, []
        body = text[start + len(TOOL_CALLS):]
        if body.lstrip().startswith(("[", "{")):
            values = json_values(body)
            items = values[0] if values and len(values) == 1 and isinstance(values[0], list) else values
            found = [call_from_json(item, toolset, new_id) for item in items or ()]
        else:
            found = _named_calls(body, toolset, new_id)
        calls = keep_allowed(found, toolset)
        if calls is None:
            return text, []
        return tail_content(text, start), calls

    def stream(self, toolset: ToolSet | None = None, new_id: NewId | None = None) -> TailCallStream:
        return TailCallStream(lambda text: self.parse(text, toolset, new_id), _MARKERS, leading_json=False)


class MistralArgsFormat(MistralFormat):
    """The `[TOOL_CALLS]name[ARGS]{...}` spelling (templates that write [ARGS])."""

    name = "mistral_args"

    @staticmethod
    def detect(template: str) -> bool:
        return TOOL_CALLS in template and ARGS in template

    def constrained_prefix(self, toolset: ToolSet) -> str:
        if not toolset.constrained:
            return ""
        allowed = toolset.allowed
        return TOOL_CALLS + (allowed[0].name + ARGS if len(allowed) == 1 else "")

    def constraint(self, toolset: ToolSet) -> ConstraintSpec | None:
        """The one function's arguments (its name is in the prefix), or for several a grammar:
        one of `name[ARGS]{arguments}`."""
        if not toolset.constrained:
            return None
        allowed = toolset.allowed
        if len(allowed) == 1:
            defs: dict[str, Any] = {}
            schema = arguments_for(allowed[0], defs)
            return ConstraintSpec("json_schema", {**schema, "$defs": defs} if defs else schema)
        options = []
        for spec in allowed:
            defs = {}
            schema = arguments_for(spec, defs)
            schema = {**schema, "$defs": defs} if defs else schema
            options.append(f"{json.dumps(spec.name + ARGS)} {lark_json(schema)}")
        return ConstraintSpec("grammar", grammar="start: " + " | ".join(options), syntax="lark")


MISTRAL = MistralFormat()
MISTRAL_ARGS = MistralArgsFormat()

"""Which tool-call format a chat template speaks, tried in order, the generic one last (as
llama.cpp's common/chat.cpp and vLLM's tool parsers tell formats apart by template markers).

A template that does not render `tools` gets the generic format whatever it contains; one that
renders tools in a format we do not read gets it too (our prompt, the template's tools unused).
"""

from __future__ import annotations

from skippy_zmq.text.tools.base import ToolFormat, template_supports_tools
from skippy_zmq.text.tools.generic import GENERIC
from skippy_zmq.text.tools.hermes import HERMES
from skippy_zmq.text.tools.llama3_json import LLAMA3_JSON
from skippy_zmq.text.tools.mistral import MISTRAL, MISTRAL_ARGS

NATIVE_FORMATS: tuple[ToolFormat, ...] = (MISTRAL_ARGS, MISTRAL, LLAMA3_JSON, HERMES)
FORMATS: tuple[ToolFormat, ...] = (*NATIVE_FORMATS, GENERIC)


def choose_format(template: str | None) -> ToolFormat:
    """The format of the model whose (tool-use) chat template is `template`."""
    if not template or not template_supports_tools(template):
        return GENERIC
    return next((f for f in NATIVE_FORMATS if f.detect(template)), GENERIC)


def format_named(name: str) -> ToolFormat:
    found = next((f for f in FORMATS if f.name == name), None)
    if found is None:
        raise ValueError(f"unknown tool-call format {name!r}; known: {', '.join(f.name for f in FORMATS)}")
    return found

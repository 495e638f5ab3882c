"""Hermes / Qwen2.5 / Qwen3 native calls: the template lists the tools itself and the model
answers `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (vLLM's `hermes`
parser). Same calls as the generic format; only the rendering differs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from skippy_zmq.text.tools.base import native_template_inputs
from skippy_zmq.text.tools.generic import GenericFormat
from skippy_zmq.text.tools.validation import ToolSet

# Templates that also write <tool_call> but put XML inside it (Qwen3-Coder's <function=...>,
# GLM's <arg_key>, MiniMax's <invoke>): not JSON calls, so not this format.
_OTHER_BODIES = ("<function=", "<arg_key>", "<invoke name=", "<|tool_call>call:")


class HermesFormat(GenericFormat):
    name = "hermes"
    native = True

    @staticmethod
    def detect(template: str) -> bool:
        return "<tool_call>" in template and not any(marker in template for marker in _OTHER_BODIES)

    def template_inputs(self, messages: Iterable[Mapping[str, Any]], toolset: ToolSet | None
                        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        return native_template_inputs(messages, toolset)


HERMES = HermesFormat()

"""One chat choice's generated text as OpenAI deltas: `reasoning_content`, `content` and
`tool_calls`, split by the model's reasoning tags and its tool-call format.

The streamed and the whole response are built by the same object (`ChatOutput.push` /
`flush`, then `message` over every delta for a non-streamed answer), so they always agree.

Where it sits: token ids -> text (tokenizer.stream_decoder) -> stop strings (stop_strings.py),
both in api/server.py's TextStream, which every API shape shares; then, for chat answers, this
object: reasoning (reasoning.py) -> tool calls (tools/). Every stage holds back what might grow
into its marker (holdback.py). They are not one list of `push(text) -> text` stages because
they do not all map text to text: the stop stage also ends the request (and the logprobs of a
chunk are those of the tokens its text came from), reasoning splits text in two, and tool calls
turn it into call objects.
"""

from __future__ import annotations

from typing import Any

from skippy_zmq.text import tools
from skippy_zmq.text.reasoning import ReasoningSplitter


class ChatOutput:
    """Text in, delta objects out: {"reasoning_content"}, {"content"} or {"tool_calls"}."""

    def __init__(self, tool_format: tools.ToolFormat, toolset: tools.ToolSet, prefix: str = "",
                 reasoning: bool = False, thinking_open: bool = False) -> None:
        """`prefix`: the text the prompt ended with that belongs to the output (a forced call's
        opening); `reasoning`: split <think> blocks out; `thinking_open`: the prompt opened one."""
        self._reasoning = ReasoningSplitter(thinking_open) if reasoning and not prefix else None
        self._calls = tool_format.stream(toolset) if toolset.active else None
        if self._calls is not None and prefix:
            held = self._calls.push(prefix)   # the opening tag: held, never sent
            assert not held, held

    @property
    def call_count(self) -> int:
        return len(self._calls.calls) if self._calls is not None else 0

    def push(self, text: str) -> list[dict[str, Any]]:
        if self._reasoning is None:
            return self._content(text)
        reasoning, content = self._reasoning.push(text)
        return self._thought(reasoning) + self._content(content)

    def flush(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._reasoning is not None:
            reasoning, content = self._reasoning.flush()
            out = self._thought(reasoning) + self._content(content)
        if self._calls is not None:
            out += self._calls.flush()
        return out

    @staticmethod
    def _thought(text: str) -> list[dict[str, Any]]:
        return [{"reasoning_content": text}] if text else []

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        return self._calls.push(text) if self._calls is not None else [{"content": text}]


def message_fields(deltas: list[dict[str, Any]]) -> tuple[str | None, str | None, list[dict[str, Any]]]:
    """(content, reasoning_content, tool_calls) of a whole answer from its deltas: content None
    when the answer is only calls, reasoning None when there was none."""
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls = [{k: v for k, v in c.items() if k != "index"} for d in deltas for c in d.get("tool_calls", ())]
    return (content or None) if calls else content, reasoning or None, calls

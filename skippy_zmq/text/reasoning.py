"""Reasoning text apart from the answer: `<think>…</think>` (Qwen3, QwQ, DeepSeek-R1 and the
templates that follow them), returned as `reasoning_content` beside `content`, as llama-server
(reasoning_format "deepseek") and vLLM's reasoning parsers do.

A template that writes `</think>` makes the model a thinking one. The output is reasoning from
a leading `<think>` (or from its first token, when the generation prompt itself ends with
`<think>`, as DeepSeek-R1's does) up to `</think>`; the whitespace after `</think>` is dropped;
an output that ends still thinking is all reasoning. `ReasoningSplitter` does this as the text
streams; a whole output is the same splitter pushed once and flushed, so the two always agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from skippy_zmq.text.holdback import held_back

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
REASONING_FORMATS = ("auto", "deepseek", "none")   # request's reasoning_format ("none": leave it in content)


def template_thinks(template: str | None) -> bool:
    """Whether a chat template belongs to a model that writes <think>…</think>."""
    return bool(template) and THINK_CLOSE in template


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside a <think> block (the output starts as reasoning)."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


@dataclass
class ReasoningSplitter:
    """Text in, (reasoning, content) pieces out; tags and partial tags are held back."""

    inside: bool = False      # the prompt opened <think>
    _buffer: str = ""
    _started: bool = False    # past the point where a leading <think> could open
    _after_close: bool = False   # strip the whitespace that follows </think>

    def push(self, text: str) -> tuple[str, str]:
        self._buffer += text
        return self._drain(final=False)

    def flush(self) -> tuple[str, str]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        while True:
            if not self._started and not self.inside:
                stripped = self._buffer.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._buffer, self.inside, self._started = stripped[len(THINK_OPEN):], True, True
                    continue
                if not final and THINK_OPEN.startswith(stripped):
                    return reasoning, content   # may still become <think>
                self._started = True
            self._started = True
            if self.inside:
                end = self._buffer.find(THINK_CLOSE)
                if end < 0:
                    keep = 0 if final else held_back(self._buffer, (THINK_CLOSE,))
                    reasoning += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return reasoning, content
                reasoning += self._buffer[:end]
                self._buffer, self.inside, self._after_close = self._buffer[end + len(THINK_CLOSE):], False, True
                continue
            if self._after_close:
                self._buffer = self._buffer.lstrip()
                if not self._buffer and not final:
                    return reasoning, content
                self._after_close = False
            content += self._buffer
            self._buffer = ""
            return reasoning, content

"""Chat templates: the Jinja environment transformers renders them with, and the model's templates.

A model may carry several named templates (`default`, `tool_use`, ...): GGUF keeps
`tokenizer.chat_template` and `tokenizer.chat_template.<name>`; an HF directory
keeps them in `tokenizer_config.json`, `chat_template.jinja` or `chat_template.json`.
They travel in tokenizer_meta.json as `chat_template` (the default) and
`chat_templates` (name -> text).
"""

from __future__ import annotations

import json
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def chat_environment() -> ImmutableSandboxedEnvironment:
    # Same settings as transformers' chat-template renderer, so templates
    # written for HF render identically (whitespace included).
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent
    )
    return env


class ChatTemplate:
    """One compiled template and how it is rendered."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._compiled = chat_environment().from_string(text)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               bos_token: str = "", eos_token: str = "", tools: list[dict[str, Any]] | None = None,
               documents: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """What transformers' apply_chat_template(tokenize=False) returns for the same inputs;
        `kwargs` are the request's chat_template_kwargs (e.g. enable_thinking)."""
        return self._compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=bos_token, eos_token=eos_token, tools=tools, documents=documents, **kwargs)

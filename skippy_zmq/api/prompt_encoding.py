"""A request's prompt as token ids: the model's chat template over the messages (system-role
polyfill included), or the completions prompt as text or ids; a text that surely cannot fit the
context is refused before the tokenizer spends seconds on it."""

from __future__ import annotations

from typing import Any

from jinja2.exceptions import TemplateError

from skippy_zmq.api.openai_schema import ParsedRequest, RequestError
from skippy_zmq.text.template_budget import RenderBudgetError
from skippy_zmq.text.tokenizer import TextTokenizer


def _system_in_first_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """A leading system message folded into the user message after it (None: no such pair)."""
    if len(messages) < 2 or [m.get("role") for m in messages[:2]] != ["system", "user"]:
        return None
    system, user = messages[0].get("content"), messages[1].get("content")
    if not isinstance(system, str) or not isinstance(user, str):
        return None
    return [{**messages[1], "content": f"{system}\n\n{user}" if system else user}, *messages[2:]]


def _render_chat(tokenizer: TextTokenizer, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
    """The rendered conversation. A template that refuses a system role (Gemma: "System role not
    supported") gets the system text at the top of the first user message, as llama.cpp's
    template polyfills do; any other failure, or a second one, is the request's error."""
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except RenderBudgetError as err:   # the conversation made the template work too long or build too much
        raise RequestError(f"messages: rendering the chat template went over its budget: {err}", "messages") from None
    except (TemplateError, ValueError, TypeError) as err:  # e.g. raise_exception() on role order
        folded = _system_in_first_user(messages) if "system" in str(err).lower() else None
        if folded is not None:
            try:
                return tokenizer.apply_chat_template(folded, **kwargs)
            except (TemplateError, ValueError, TypeError):
                pass
        raise RequestError(f"messages: the chat template failed: {err}", "messages") from None


def _check_text_fits(tokenizer: TextTokenizer, parsed: ParsedRequest, text: str, max_context: int | None) -> None:
    """A text with surely more tokens than the context holds is refused before it is tokenised
    (4 MB of text: seconds of tokenizer CPU for a request bound to fail)."""
    most = tokenizer.max_token_chars
    if max_context is None or most is None or len(text) <= max_context * most:
        return
    param = parsed.format.prompt_param
    raise RequestError(f"{param}: the prompt has at least {len(text) // most} tokens but this model's maximum "
                       f"context length is {max_context} tokens", param, code="context_length_exceeded")


def encode_prompt(tokenizer: TextTokenizer, parsed: ParsedRequest,
                  prompt: str | tuple[int, ...] | None = None, max_context: int | None = None) -> list[int]:
    """The prompt's token ids: the chat template over the messages, or `prompt` (default: the
    request's first) as text or ids; with `max_context`, a text that cannot fit is refused first."""
    prompt = parsed.prompt if prompt is None else prompt
    if parsed.messages:
        # The tool format renders tools and tool traffic: through the model's own template
        # (native formats), or as plain messages with our tool prompt (generic); a constrained
        # call's opening ends the prompt.
        messages, tool_list = parsed.tool_format.template_inputs(parsed.messages, parsed.toolset)
        kwargs = {**parsed.template_kwargs, **({"tools": tool_list} if tool_list is not None else {})}
        text = _render_chat(tokenizer, messages, kwargs) + parsed.output_prefix
        _check_text_fits(tokenizer, parsed, text, max_context)
        # encode_chat's tokenisation (the template writes any BOS itself)
        return tokenizer.encode(text, add_bos=False)
    if isinstance(prompt, str):
        _check_text_fits(tokenizer, parsed, prompt, max_context)
        try:
            return tokenizer.encode(prompt)
        except (TypeError, ValueError) as err:   # e.g. a lone surrogate the tokenizer cannot take
            raise RequestError(f"prompt cannot be tokenized: {err}", "prompt") from None
    return list(prompt or ())

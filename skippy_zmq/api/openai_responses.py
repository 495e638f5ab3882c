"""OpenAI wire format, the answer side: response objects (chat and completions), logprobs,
usage, and stop strings found in streamed text. openai_schema re-exports these names."""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Any

from skippy_zmq.text.tokenizer import TextTokenizer


# ---------------------------------------------------------------- responses

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True)
class ResponseFormat:
    """How one endpoint shapes its objects; CHAT and COMPLETION below."""

    endpoint: str
    prompt_param: str
    id_prefix: str
    object: str
    chunk_object: str
    chat: bool

    def envelope(self, response_id: str, created: int, model: str, choices: list, chunk: bool) -> dict[str, Any]:
        return {
            "id": response_id,
            "object": self.chunk_object if chunk else self.object,
            "created": created,
            "model": model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def choice(self, text: str | None, finish_reason: str | None,
               tool_calls: list[dict[str, Any]] | None = None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """The single choice of a non-streamed response (chat: with `tool_calls` when it made calls)."""
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = tool_calls
            body: dict[str, Any] = {"message": message}
        else:
            body = {"text": text}
        return {"index": 0, **body, "logprobs": logprobs, "finish_reason": finish_reason}

    def delta_choice(self, delta: dict[str, Any], finish_reason: str | None = None,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """A streamed chat choice carrying a ToolCallStream delta ({"content"} or {"tool_calls"})."""
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk_choice(self, text: str, finish_reason: str | None = None, opening: bool = False,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        delta: dict[str, str] = {"role": "assistant", "content": text} if opening else {}
        if text and not opening:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def logprobs(self, tokenizer: TextTokenizer, entries: list[TokenLogprob],
                 offsets: TextOffsets | None = None) -> dict[str, Any]:
        """A choice's `logprobs` for these tokens: chat's {"content": [...]}, completions'
        {tokens, token_logprobs, top_logprobs, text_offset}; `offsets` carries a stream's text
        offsets from one chunk to the next (None: the tokens start the text)."""
        if self.chat:
            return {"content": [_chat_logprob(tokenizer, e) for e in entries], "refusal": None}
        offsets = offsets or TextOffsets()
        texts, starts = [], []
        for e in entries:
            text, raw = _token_piece(tokenizer, e.token_id)
            texts.append(text)
            starts.append(offsets.push(bytes(raw)))
        tops: list[dict[str, float] | None] = []
        for entry in entries:   # the N most likely, and the chosen token (so up to N + 1, as OpenAI)
            if entry.logprob is None:   # echo: nothing predicts the prompt's first token
                tops.append(None)
                continue
            top = {_token_piece(tokenizer, tid)[0]: lp for tid, lp in entry.top}
            top.setdefault(_token_piece(tokenizer, entry.token_id)[0], entry.logprob)
            tops.append(top)
        return {"tokens": texts, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
                "text_offset": starts}


class TextOffsets:
    """Completions' text_offset: where each token starts in the text, in characters (a token that
    starts inside a character split across tokens counts from the characters complete before it)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def push(self, raw: bytes) -> int:
        """The offset of a token with these bytes; then move past it."""
        start = self.chars
        self.chars += len(self._decoder.decode(raw))
        return start


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob and its most likely alternatives [(id, logprob), ...]."""

    token_id: int
    logprob: float | None   # None: not known (the first prompt token, under echo)
    top: tuple[tuple[int, float], ...] = ()


def _token_piece(tokenizer: TextTokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token's text (decoded alone; U+FFFD where it holds part of a character) and its bytes."""
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def _chat_logprob(tokenizer: TextTokenizer, entry: TokenLogprob) -> dict[str, Any]:
    text, raw = _token_piece(tokenizer, entry.token_id)
    top = []
    for token_id, logprob in entry.top:
        alt_text, alt_raw = _token_piece(tokenizer, token_id)
        top.append({"token": alt_text, "logprob": logprob, "bytes": alt_raw})
    return {"token": text, "logprob": entry.logprob, "bytes": raw, "top_logprobs": top}


CHAT = ResponseFormat(
    "/v1/chat/completions", "messages", "chatcmpl", "chat.completion", "chat.completion.chunk", chat=True
)
COMPLETION = ResponseFormat(
    "/v1/completions", "prompt", "cmpl", "text_completion", "text_completion", chat=False
)

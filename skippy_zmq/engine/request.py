"""The contract between the HTTP layer and whatever produces tokens.

The HTTP server (driver/server.py) speaks OpenAI; an Engine turns token ids
into token ids. The pipeline scheduler is one Engine; tests use small fakes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol

from skippy_zmq.sampling import SamplingParams


class EngineError(Exception):
    """A request failed inside the engine. `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 500, code: str = "engine_error", retry_after: float | None = None):
        super().__init__(message)
        self.message, self.status, self.code, self.retry_after = message, status, code, retry_after


@dataclass(frozen=True)
class GenRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    max_tokens: int = 16
    ignore_eos: bool = False
    cache_key: str | None = None       # prompt_cache_key: prefix-cache namespace
    timeout_s: float | None = None     # deadline for the whole request
    speculative: bool | None = None    # False: never draft for this request (None: the driver's setting)
    n: int = 1                         # choices: one prefill, then n sessions fork its KV (TokenEvent.choice)
    # Structured output: a constrain.ConstraintSpec.to_dict() the final stage enforces (None: free text).
    # A constrained request always ends at EOS, ignore_eos or not: once the constraint is complete EOS
    # is the only token it allows.
    constraint: dict | None = field(default=None, hash=False, compare=False)
    # Logprobs: None = off; N = the chosen token's logprob plus the N most likely alternatives (0..20),
    # computed on the final stage (TokenEvent.logprob / top_logprobs).
    logprobs: int | None = None
    # echo: the prompt tokens' logprobs with N alternatives (None: off). Bypasses the prefix cache:
    # a restored prefix has no logits.
    prompt_logprobs: int | None = None
    # An embedding: "mean" or "last". The whole prompt is prefilled, the final stage pools its
    # final-norm hidden states and one TokenEvent (finish_reason "stop", `embedding` set) ends it.
    pooling: str | None = None


@dataclass
class TokenEvent:
    """One generated token, or the end of the stream (finish_reason set), or an error."""

    token_id: int | None = None
    finish_reason: str | None = None   # "stop" (EOS) | "length" | "cancelled"
    cached_tokens: int = 0             # prompt tokens served from the prefix cache (first event)
    stats: dict = field(default_factory=dict)
    choice: int = 0                    # which of the request's n choices (each ends with its own finish_reason)
    # With GenRequest.logprobs set: log p(token) and the top alternatives [(id, logprob), ...],
    # highest first, under the final logits after penalties, logit_bias and any constraint mask
    # and before temperature / top-k / top-p / min-p.
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    # First event, with GenRequest.prompt_logprobs set: one (logprob, [(id, logprob), ...]) per prompt
    # token, None for the first (nothing predicts it) and for any the stages did not report.
    prompt_logprobs: list | None = None
    # GenRequest.pooling: the pooled vector (float32 numpy [D], not normalised), on the one event.
    embedding: Any = None


class ChoiceControl:
    """n > 1: lets whoever reads one choice end it early (a stop string matched) while the other
    choices go on; the engine binds `cancel` when the request is submitted (cancels asked for
    before that are applied then)."""

    def __init__(self) -> None:
        self._cancel: Callable[[int], None] | None = None
        self._pending: list[int] = []

    def bind(self, cancel: Callable[[int], None]) -> None:
        self._cancel = cancel
        for choice in self._pending:
            cancel(choice)
        self._pending = []

    def cancel(self, choice: int) -> None:
        if self._cancel is None:
            self._pending.append(choice)
        else:
            self._cancel(choice)


class Engine(Protocol):
    model_name: str
    max_context: int

    def is_ready(self) -> bool: ...

    def generate(self, request: GenRequest, control: ChoiceControl | None = None) -> AsyncIterator[TokenEvent]:
        """Yields TokenEvents; the last one has finish_reason. Raises EngineError on failure.

        Closing the iterator early (client went away) must cancel the request
        and free its session everywhere. `control.cancel(c)` ends choice c alone.
        """
        ...

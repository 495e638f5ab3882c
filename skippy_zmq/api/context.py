"""What every route handler shares: the app's ServerContext (engine, tokenizer, metrics, caps, the
off-loop worker) and the OpenAI-shaped error responses the handlers and the app's exception
handlers answer with."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse
from loguru import logger

from skippy_zmq.api.limits import RequestLimits
from skippy_zmq.api.offloop import OffLoop
from skippy_zmq.api.openai_schema import ParsedRequest, RequestError, error_body
from skippy_zmq.api.request_prep import PrepContext
from skippy_zmq.engine.metrics import ServerMetrics, error_kind
from skippy_zmq.engine.request import Engine, EngineError
from skippy_zmq.text import tools
from skippy_zmq.text.chat_output import ChatOutput
from skippy_zmq.text.tokenizer import TextTokenizer


@dataclass
class ServerContext:
    """Everything a handler needs; one per app, kept on app.state.ctx."""

    engine: Engine
    tokenizer: TextTokenizer
    model_name: str
    metrics: ServerMetrics
    api_key: str | None
    max_body_bytes: int
    created: int = field(default_factory=lambda: int(time.time()))
    tool_format: tools.ToolFormat = tools.GENERIC   # how the model writes tool calls (from its template)
    thinks: bool = False                            # the template writes <think>…</think>
    limits: RequestLimits = field(default_factory=RequestLimits)   # caps on what one request may ask
    work: OffLoop = field(default_factory=OffLoop)  # request parsing, rendering and assembly, off the loop
    _constraint_info: Any = None
    _constraint_lock: threading.Lock = field(default_factory=threading.Lock)

    def constraint_info(self) -> Any:
        """The grammar engine's view of the tokenizer (constrain.TokenizerInfo), built on first use,
        to check constraints before they reach the final stage (which builds its own)."""
        with self._constraint_lock:
            if self._constraint_info is None:
                from skippy_zmq.text.constrain import ConstraintError, TokenizerInfo

                try:
                    self._constraint_info = TokenizerInfo(self.tokenizer)
                except ConstraintError as err:
                    raise RequestError(f"response_format: structured output is not available: {err}",
                                       "response_format") from None
            return self._constraint_info

    def build_constraints_behind(self) -> threading.Thread:
        """Build constraint_info in a thread now, while the stages start: the grammar engine's
        tokenizer build holds the GIL throughout (1.4 s for Qwen2's 151k-token vocabulary,
        measured), which on a first constrained request stalled the pipeline loop's thread as
        long. A tokenizer it refuses is left for a request to meet and report."""
        def build() -> None:
            started = time.perf_counter()
            try:
                self.constraint_info()
            except RequestError as err:
                logger.debug("constraints not prepared: {}", err.message)
                return
            logger.debug("constraints prepared in {:.2f} s", time.perf_counter() - started)

        thread = threading.Thread(target=build, name="constraints", daemon=True)
        thread.start()
        return thread

    def prep_context(self) -> PrepContext:
        return PrepContext(self.tokenizer, self.tool_format, self.thinks, self.limits, self.constraint_info,
                           self.engine.max_context)

    def require_ready(self) -> None:
        """A 503 (raised) while the model is still loading: checked once a request has parsed."""
        if not self.engine.is_ready():
            raise EngineError("the model is still loading", 503, "not_ready")

    def chat_output(self, parsed: ParsedRequest, thinking_open: bool) -> ChatOutput:
        """How a chat answer's text becomes reasoning, content and tool calls; `thinking_open`:
        the prompt ends inside <think> (the output starts as reasoning)."""
        return ChatOutput(parsed.tool_format, parsed.toolset, parsed.output_prefix,
                          reasoning=self.thinks and parsed.reasoning_format != "none", thinking_open=thinking_open)


def keeps_special(parsed: ParsedRequest) -> bool:
    """Special tokens stay in the text: the request's tools are on and its format's markers are special."""
    return parsed.toolset.active and parsed.tool_format.keeps_special


# ---------------------------------------------------------------- errors

def engine_status(err: EngineError) -> int:
    """The HTTP status an engine error answers with (a code outside 4xx/5xx is a 500)."""
    return err.status if 400 <= err.status <= 599 else 500


def retry_headers(err: EngineError) -> dict[str, str] | None:
    """Retry-After (whole seconds, at least 1) when the engine says when to retry."""
    return {"Retry-After": str(max(1, math.ceil(err.retry_after)))} if err.retry_after is not None else None


def error_response(ctx: ServerContext, status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    ctx.metrics.count_error(error_kind(status))
    return JSONResponse(error_body(message, status, param, code), status_code=status, headers=headers)


def engine_error_response(ctx: ServerContext, err: EngineError) -> JSONResponse:
    status = engine_status(err)
    logger.warning("engine error {} ({}): {}", status, err.code, err.message)
    return error_response(ctx, status, err.message, code=err.code, headers=retry_headers(err))

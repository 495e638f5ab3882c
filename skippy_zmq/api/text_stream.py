"""One choice's engine events as text: ChoiceFanOut splits an n-choice request's events by choice,
TextStream turns one choice's events into text deltas (incremental detokenisation, stop strings
across token boundaries, per-token metrics and logprobs).

Closing the engine's iterator is how a request is cancelled (stop string hit, client gone), so
every path that stops reading closes it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from loguru import logger

from skippy_zmq.api.context import ServerContext
from skippy_zmq.api.openai_responses import TokenLogprob
from skippy_zmq.text.stop_strings import StopMatcher
from skippy_zmq.engine.request import ChoiceControl, EngineError, GenRequest, TokenEvent


class ChoiceFanOut:
    """One engine request with n choices, split into one event iterator per choice.

    A single task reads the engine's iterator and routes each event by `TokenEvent.choice`; an
    error goes to every choice. `aclose` closes the engine's iterator, which cancels whatever has
    not finished.
    """

    def __init__(self, events: AsyncIterator[TokenEvent], n: int, control: ChoiceControl | None = None) -> None:
        self._events, self._queues = events, [asyncio.Queue() for _ in range(n)]
        self._task: asyncio.Task | None = None
        self._control = control   # a choice closed before its finish (a stop string) is cancelled alone

    async def _pump(self) -> None:
        try:
            async for event in self._events:
                self._queues[event.choice].put_nowait(event)
        except Exception as err:   # EngineError, or anything: every choice hears of it
            for queue in self._queues:
                queue.put_nowait(err)

    async def choice(self, index: int) -> AsyncIterator[TokenEvent]:
        if self._task is None:
            self._task = asyncio.ensure_future(self._pump())
        ended = False
        try:
            while True:
                item = await self._queues[index].get()
                ended = isinstance(item, Exception) or item.finish_reason is not None
                if isinstance(item, Exception):
                    raise item
                yield item
                if ended:
                    return
        finally:
            if not ended and self._control is not None:
                self._control.cancel(index)   # this choice's job ends now, freeing its lane

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._events.aclose()


class TextStream:
    """One choice's engine events turned into text deltas, stop strings applied."""

    def __init__(self, ctx: ServerContext, request: GenRequest, stops: tuple[str, ...], arrival: float,
                 discard: bool = False, events: AsyncIterator[TokenEvent] | None = None,
                 keep_special: bool = False) -> None:
        """`keep_special`: special tokens stay in the text (a tool format's markers), all but the
        end-of-generation token that ends the request."""
        self.ctx, self.request = ctx, request
        self._keep_special = keep_special
        self._discard = discard   # echo with max_tokens 0: the token generated is dropped
        self.completion_tokens = self.cached_tokens = 0
        self.finish_reason: str | None = None
        self._events = events if events is not None else ctx.engine.generate(request)
        self._decoder = ctx.tokenizer.stream_decoder(skip_special=not keep_special)
        self._stops = StopMatcher(stops)
        self._first: TokenEvent | None = None
        self._last_time = arrival  # the first token's gap is the time to first token
        self._logprobs: list[TokenLogprob] = []   # tokens consumed since take_logprobs (request.logprobs set)

    async def start(self) -> None:
        """Wait for the first event, so engine errors still get a proper HTTP status."""
        try:
            self._first = await anext(self._events)
        except StopAsyncIteration:
            raise EngineError("engine ended the request without a finish reason", 500) from None
        self.cached_tokens = self._first.cached_tokens
        self.ctx.metrics.observe_prompt(len(self.request.prompt_ids), self.cached_tokens)

    async def deltas(self) -> AsyncIterator[str]:
        event = self._first
        while event is not None:
            text = self._consume(event)
            if text:
                yield text
            if self.finish_reason is not None:
                break
            event = await anext(self._events, None)
        if self.finish_reason is None:
            raise EngineError("engine ended the request without a finish reason", 500)
        await self.close()
        logger.info("finished ({}): {} prompt tokens ({} cached), {} generated", self.finish_reason,
                    len(self.request.prompt_ids), self.cached_tokens, self.completion_tokens)

    async def collect(self) -> str:
        return "".join([text async for text in self.deltas()])

    async def close(self) -> None:
        """Close the engine iterator; if it had not finished, that cancels the request."""
        await self._events.aclose()

    def prompt_logprobs(self) -> list[TokenLogprob]:
        """echo: the prompt tokens with their logprobs (None for the first, which nothing predicts)."""
        scored = (self._first.prompt_logprobs if self._first is not None else None) or []
        out = []
        for i, token_id in enumerate(self.request.prompt_ids):
            entry = scored[i] if i < len(scored) else None
            out.append(TokenLogprob(token_id, None) if entry is None else
                       TokenLogprob(token_id, entry[0], tuple(entry[1])))
        return out

    def take_logprobs(self) -> list[TokenLogprob]:
        """The logprobs of the tokens consumed since the last call: after a delta, those of the
        tokens that made it (and of tokens held back before it, whose text it carries)."""
        taken, self._logprobs = self._logprobs, []
        return taken

    def _consume(self, event: TokenEvent) -> str:
        if self._discard:
            if event.finish_reason is not None:
                self.finish_reason = "length"
            return ""
        text = ""
        if event.finish_reason is not None:
            self.ctx.metrics.observe_speculation(event.stats.get("speculative"))
        if event.token_id is not None:
            now = time.perf_counter()
            self.ctx.metrics.observe_token(now - self._last_time, first=self.completion_tokens == 0)
            self._last_time = now
            self.completion_tokens += 1
            # The EOS that ends the request (finish "stop" from the engine) is not part of the text.
            if event.logprob is not None and self.request.logprobs is not None and event.finish_reason != "stop":
                self._logprobs.append(TokenLogprob(event.token_id, event.logprob, tuple(event.top_logprobs or ())))
            eos = self.ctx.tokenizer.eos_ids
            ending = self._keep_special and event.finish_reason == "stop" and event.token_id in eos
            text, hit = self._stops.push("" if ending else self._decoder.push(event.token_id))
            if hit:
                self.finish_reason = "stop"
                return text
        if event.finish_reason is not None:
            tail, hit = self._stops.push(self._decoder.flush())
            text += tail if hit else tail + self._stops.flush()
            self.finish_reason = "stop" if hit else event.finish_reason
        return text


"""A scripted Engine for HTTP-layer tests: no model, no sockets, full control.

It "generates" a fixed token script (or echoes the prompt), honours
max_tokens, EOS and ignore_eos like a real engine, records every request and
every cancellation, and can be told to fail or to be slow.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence

import numpy as np

from skippy_zmq.engine.request import EngineError, GenRequest, TokenEvent


class FakeEngine:
    """Implements the Engine protocol. Mutate the public knobs between requests."""

    def __init__(self, script: Sequence[int] | None, eos_ids: Sequence[int], *,
                 model_name: str = "fake-model", max_context: int = 512) -> None:
        self.script = None if script is None else list(script)  # None: echo the prompt
        self.eos_ids = frozenset(eos_ids)
        self.model_name, self.max_context = model_name, max_context
        self.reset()

    def reset(self) -> None:
        self.ready = True
        self.cached_tokens = 0
        self.delay_s = 0.0                        # sleep before each token
        self.fail: EngineError | None = None       # raised before the first token
        self.fail_after: int | None = None         # raise `fail_mid` after this many tokens
        self.fail_mid: EngineError = EngineError("stage 1 went away", 503, "stage_lost")
        self.requests: list[GenRequest] = []
        self.cancelled: list[str] = []
        self.choices_cancelled: list[int] = []
        self.finished: list[str] = []
        self._cancel_seen = threading.Event()

    def is_ready(self) -> bool:
        return self.ready

    def wait_cancelled(self, timeout_s: float) -> bool:
        """Block the calling (test) thread until some request was cancelled, at most timeout_s."""
        return self._cancel_seen.wait(timeout_s)

    async def generate(self, request: GenRequest, control=None) -> AsyncIterator[TokenEvent]:
        self.requests.append(request)
        if control is not None:   # choices ended early by their reader (n > 1)
            control.bind(self.choices_cancelled.append)
        if self.fail is not None:
            raise self.fail
        if request.pooling is not None:   # an embedding: a made-up vector (the prompt ids, repeated to 8 values)
            self.finished.append(request.request_id)
            yield TokenEvent(finish_reason="stop", embedding=np.resize(np.asarray(request.prompt_ids, np.float32), 8))
            return
        script = self.script if self.script is not None else list(request.prompt_ids)
        done = False
        try:
            # n choices: choice c's tokens are the script shifted by c, choices interleaved token by token
            for index, choice in ((i, c) for i in range(request.max_tokens) for c in range(request.n)):
                if self.fail_after is not None and index == self.fail_after:
                    done = True
                    raise self.fail_mid
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                token = script[(index + choice) % len(script)]
                finish = self._finish(token, index, request)
                done = finish is not None and choice == request.n - 1
                event = TokenEvent(token, finish, cached_tokens=self.cached_tokens if index == 0 else 0,
                                   choice=choice)
                if request.logprobs is not None:   # made-up values: the chosen token first, then ids 10, 11, ...
                    event.logprob = -0.25 - index / 64
                    alternatives = [(10 + k, event.logprob - 1.0 - k) for k in range(request.logprobs)]
                    event.top_logprobs = [(token, event.logprob), *alternatives][:request.logprobs]
                if request.prompt_logprobs is not None and index == 0:   # echo: made up, as above
                    event.prompt_logprobs = [None] + [(-1.0 - i / 64, [(t, -1.0 - i / 64)][:request.prompt_logprobs])
                                                      for i, t in enumerate(request.prompt_ids[1:])]
                yield event
                if finish is not None and request.n == 1:
                    break
        finally:
            # Closed (GeneratorExit) or cancelled (CancelledError) before the end.
            (self.finished if done else self.cancelled).append(request.request_id)
            if not done:
                self._cancel_seen.set()

    def _finish(self, token: int, index: int, request: GenRequest) -> str | None:
        if token in self.eos_ids and not request.ignore_eos:
            return "stop"
        return "length" if index + 1 >= request.max_tokens else None

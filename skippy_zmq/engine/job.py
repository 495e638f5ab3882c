"""One request's (or one choice's) state in the scheduler: a status and two counts.

As in vLLM v1, what a job sends next follows from how many tokens are known
(the prompt plus every token generated) against how many of them the stages
have been sent (`computed`): while `computed < prefill_target` it sends prefill
chunks; once they are all out it sends decode rows (one token, or a verify
window of the current token plus drafts) at `next_pos`. The status says whether
anything of its own is in flight (a decode row, a restore try) or what it
waits for (lanes, a fork of choice 0's prompt KV).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from skippy_zmq.engine.request import GenRequest
from skippy_zmq.kv.prefix_store import DEFAULT_NAMESPACE
from skippy_zmq.engine.speculative import Drafter

Sink = Callable[[object], None]   # receives TokenEvent or EngineError; must be thread-safe


class JobStatus(Enum):
    QUEUED = "queued"              # waiting for lanes
    FORK_WAIT = "fork_wait"        # n > 1: a choice waiting for choice 0's prompt KV to be forked to it
    READY = "ready"                # admitted, nothing of its own in flight: its counts say what to send
    RESTORING = "restoring"        # TRY_RESTORE_PREFILL in flight (the suffix is prefilled once it hit)
    RESTORING_FUSED = "fused"      # TRY_RESTORE_PREFILL_DECODE in flight; its token comes like a decode's
    DECODING = "decoding"          # a decode row (one token or a verify window) in flight
    DONE = "done"


IN_FLIGHT = (JobStatus.DECODING, JobStatus.RESTORING_FUSED)   # a row whose reply carries tokens


@dataclass
class WindowAhead:
    """A verify window sent while an earlier window of the same stream is still in flight."""
    request_id: int
    start: int          # position of row[0]
    row: list[int]      # the guessed bonus token of the window before, then drafts


@dataclass(eq=False)
class Job:
    req: GenRequest
    session_id: int
    sink: Sink
    eos: frozenset[int]
    deadline: float
    prompt: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    # Tokens whose KV is sent to the stages (prefill chunks, decode rows, a restore); vLLM's
    # num_computed_tokens. The next row starts here; everything before `prefill_target` is prefill.
    computed: int = 0
    status: JobStatus = JobStatus.QUEUED
    cancelled: bool = False         # asked to end; honoured once no row of it is in flight
    t_first: float = 0.0
    namespace: str = DEFAULT_NAMESPACE
    cached: int = 0                 # prompt tokens served from the prefix stores
    cache_status: str = "disabled"  # disabled | miss | hit
    fence_rid: int = 0              # replies to requests older than this predate a re-prefill: stale
    healed: set = field(default_factory=set)   # (stage id, incarnation) that already re-prefilled it
    spec: Drafter | None = None                # speculation on: drafts from prompt + output
    drafts: list[int] = field(default_factory=list)   # the drafts of the window in flight
    ahead: list[WindowAhead] = field(default_factory=list)  # later windows in flight behind it, oldest first
    prompt_entries: dict[int, list] = field(default_factory=dict)   # echo: prompt position -> logprob entry
    choice: int = 0                 # n > 1: this job's choice index (its sampler's key)
    children: list[Job] = field(default_factory=list)   # n > 1, on choice 0: the other choices' jobs
    root: int | None = None         # n > 1, on a child: choice 0's session (the request's handle)

    @property
    def history(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def known(self) -> int:
        """Tokens known: the prompt and every token generated (vLLM's num_tokens)."""
        return len(self.prompt) + len(self.generated)

    @property
    def prefill_target(self) -> int:
        """Tokens to prefill before the next decode: all known but the last, which the decode carries
        (an embedding prefills every prompt token and decodes none)."""
        return len(self.prompt) if self.req.pooling is not None else self.known - 1

    @property
    def next_pos(self) -> int:
        """Position of the next decode row: the last known token's."""
        return self.prefill_target

    @property
    def next_token(self) -> int:
        return self.generated[-1] if self.generated else self.prompt[-1]

    @property
    def in_flight(self) -> bool:
        return self.status in IN_FLIGHT

    @property
    def done(self) -> bool:
        return self.status is JobStatus.DONE

    @property
    def wants_prefill(self) -> bool:
        """Its next row is a prefill chunk (and nothing of its own is in flight)."""
        return self.status is JobStatus.READY and self.computed < self.prefill_target

    @property
    def decodable(self) -> bool:
        """Its next row is a decode row: every token but the last is sent, nothing in flight."""
        return self.status is JobStatus.READY and self.computed >= self.prefill_target and self.req.pooling is None

    @property
    def kv_tokens(self) -> list[int]:
        """Tokens whose KV the stages hold: the prompt and all generated tokens but the last."""
        return self.history[:self.known - 1]

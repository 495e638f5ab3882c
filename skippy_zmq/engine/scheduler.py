"""Iteration-level scheduler: admission, prefill credit, decode micro-batches, speculation.

Pure state machine, no sockets: `submit`, `cancel`, `on_reply` and `tick`
change state; `tick` returns the messages to push to stage 0. The pipeline
engine (engine/pipeline.py) owns the sockets and calls these from one thread;
the in-process chain (engine/inproc.py) calls them the same way without any.

It is composed of small parts that share one `SchedulerState` (jobs, what is in
flight, the outbox): `RowPlanner` decides every row from each job's status and
counts (engine/row_planner.py), `ReplyHandler` takes the stages' replies
(engine/replies.py) and `SpeculationBook` drafts and judges verify windows
(engine/speculation_book.py).

Pipelined windows: while fewer streams run than there are stages, a stream
keeps up to `speculative.depth` windows in flight (default: one per stage), so
every stage works on it at once; the tokens accepted are the same for any depth.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections import deque

from loguru import logger

from skippy_zmq.engine.awaiting import Awaiting
from skippy_zmq.engine.job import IN_FLIGHT, Job, JobStatus, Sink
from skippy_zmq.kv.prefix_store import DEFAULT_NAMESPACE
from skippy_zmq.engine.prefix_index import PrefixIndex
from skippy_zmq.engine.replies import ReplyHandler
from skippy_zmq.engine.request import EngineError, GenRequest
from skippy_zmq.engine.row_planner import RowPlanner
from skippy_zmq.engine.scheduler_config import SchedulerConfig
from skippy_zmq.engine.scheduler_state import SchedulerState
from skippy_zmq.protocol.wire import Message

__all__ = ["Scheduler", "SchedulerConfig"]


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, eos_ids: frozenset[int], index: PrefixIndex | None = None):
        self.eos_ids = eos_ids
        self.state = SchedulerState(cfg, index)
        self.planner = RowPlanner(self.state)
        self.replies = ReplyHandler(self.state)
        self.paused_since: float | None = None           # a stage died; requests wait for its replacement
        self.pause_reason = ""

    # ------------------------------------------------------------ what others read

    @property
    def cfg(self) -> SchedulerConfig:
        return self.state.cfg

    @cfg.setter
    def cfg(self, cfg: SchedulerConfig) -> None:
        self.state.cfg = self.state.speculation.cfg = cfg

    @property
    def index(self) -> PrefixIndex | None:
        return self.state.index

    @property
    def running(self) -> dict[int, Job]:
        return self.state.running

    @property
    def queue(self) -> deque[Job]:
        return self.state.queue

    @property
    def awaiting(self) -> Awaiting:
        return self.state.awaiting

    @property
    def prefix_counts(self) -> dict[str, int]:
        return self.state.prefix_counts

    @property
    def heals(self) -> int:
        return self.replies.heals

    @property
    def spec_counts(self) -> dict[str, int]:
        return self.state.speculation.counts

    @property
    def spec_accepted_lengths(self) -> list[int]:
        """Accepted drafts per window since /metrics last drained it (it swaps in [])."""
        return self.state.speculation.accepted_lengths

    @spec_accepted_lengths.setter
    def spec_accepted_lengths(self, lengths: list[int]) -> None:
        self.state.speculation.accepted_lengths = lengths

    @property
    def load(self) -> dict[str, int]:
        return {"running": len(self.running), "queued": len(self.queue), "batches_in_flight": len(self.awaiting.rows)}

    # ------------------------------------------------------------ requests

    def submit(self, req: GenRequest, sink: Sink) -> int:
        self._check(req)
        timeout = req.timeout_s or self.cfg.request_timeout_s
        # ignore_eos does not apply to a constrained request: once its constraint is complete the
        # final stage allows nothing but EOS, so going on would only repeat EOS.
        eos = frozenset() if req.ignore_eos and req.constraint is None else self.eos_ids
        if req.sampling.seed is None and req.sampling.temperature > 0:
            # Draws are keyed by (seed, choice, position): a seed fixed here makes a resumed or
            # speculated request draw what it would have drawn without either.
            req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, seed=secrets.randbits(63)))
        st = self.state
        job = Job(req, st.next_id(), sink, eos, time.monotonic() + timeout, prompt=list(req.prompt_ids),
                  namespace=req.cache_key or DEFAULT_NAMESPACE)
        # Every choice reports the prompt's logprobs (echo); choice 0 alone prefills, so they share its entries.
        job.children = [Job(req, st.next_id(), sink, eos, job.deadline, prompt=list(req.prompt_ids),
                            namespace=job.namespace, choice=i, status=JobStatus.FORK_WAIT,
                            prompt_entries=job.prompt_entries, root=job.session_id) for i in range(1, req.n)]
        st.queue.append(job)
        return job.session_id

    def _check(self, req: GenRequest) -> None:
        if len(req.prompt_ids) + (req.pooling is None) > self.cfg.max_context:   # an embedding generates nothing
            raise EngineError(f"prompt of {len(req.prompt_ids)} tokens exceeds the context of "
                              f"{self.cfg.max_context} tokens", 400, "context_length_exceeded")
        if not 1 <= req.n <= self.cfg.max_sessions:
            raise EngineError(f"n={req.n}: a request takes 1 to {self.cfg.max_sessions} choices here "
                              f"(each holds a KV lane; driver.max_sessions is {self.cfg.max_sessions})", 400, "n")
        waiting = len(self.queue)
        if len(self.running) + waiting >= self.cfg.max_sessions and waiting >= self.cfg.max_queue:
            raise EngineError(f"server is at capacity ({len(self.running)} running, {len(self.queue)} queued)",
                              429, "overloaded", retry_after=1.0)

    def cancel(self, session_id: int, choice: int | None = None) -> None:
        """Cancel request `session_id` (its first choice's session), or only its choice `choice`
        (n > 1: one choice ended early, by a stop string): that choice's lane is freed at the next
        tick its row is not in flight, while the other choices go on."""
        jobs = [j for j in [*self.running.values(), *self.queue] if session_id in (j.session_id, j.root)]
        for one in jobs + [c for j in jobs for c in j.children]:   # (children not admitted yet included)
            if not one.done and (choice is None or one.choice == choice):
                one.cancelled = True

    def on_reply(self, stage_id: str, msg: Message) -> None:
        self.replies.on_reply(stage_id, msg, paused=self.paused_since is not None)

    def tick(self, now: float | None = None) -> list[Message]:
        now = time.monotonic() if now is None else now
        self._expire(now)   # deadlines and cancellations apply while paused too
        if self.paused_since is None:
            self.planner.plan(now)
        elif now - self.paused_since > self.cfg.resume_timeout_s:
            self.paused_since = None
            self.fail_all(EngineError(f"{self.pause_reason}; no replacement within "
                                      f"{self.cfg.resume_timeout_s:g} s", 503, "stage_dead"))
        out, self.state.outbox = self.state.outbox, []
        return out

    def _expire(self, now: float) -> None:
        for job in list(self.running.values()) + list(self.queue):
            if job.cancelled and not job.in_flight:
                self.state.fail(job, None)
            elif now > job.deadline:
                self.state.fail(job, EngineError(f"request exceeded its deadline of "
                                                 f"{job.req.timeout_s or self.cfg.request_timeout_s:g} s", 504,
                                                 "timeout"))
        for sid in self.awaiting.expire(now, self.cfg.reply_timeout_s):
            if sid in self.running:
                self.state.fail(self.running[sid], EngineError(
                    f"no reply from the pipeline within {self.cfg.reply_timeout_s:g} s", 504, "stage_timeout"))

    # ------------------------------------------------------------ failures and stage loss

    def fail_sessions(self, session_ids: set[int], error: EngineError) -> None:
        """End the jobs of these sessions (running or queued) with `error`; unknown ids are ignored."""
        for job in [*self.running.values(), *self.queue]:
            if job.session_id in session_ids:
                self.state.fail(job, error)

    def fail_all(self, error: EngineError) -> None:
        for job in list(self.running.values()) + list(self.queue):
            self.state.fail(job, error)
        self.awaiting.clear()

    def pause(self, reason: str) -> None:
        """A stage died: drop everything in flight; running requests wait for a replacement."""
        if self.paused_since is None:
            self.paused_since, self.pause_reason = time.monotonic(), reason
        self.awaiting.clear()
        for job in self.running.values():
            if job.status in (*IN_FLIGHT, JobStatus.RESTORING):
                job.status = JobStatus.READY
            job.drafts, job.ahead = [], []

    def resume(self) -> float:
        """Every stage is back: re-prefill each paused session from its token history. Returns pause length."""
        paused = time.monotonic() - (self.paused_since or time.monotonic())
        self.paused_since = None
        for job in self.running.values():
            self.state.replay(job)
        logger.info("resuming {} request(s) after {:.2f} s: re-prefilling from token history",
                    len(self.running), paused)
        return paused

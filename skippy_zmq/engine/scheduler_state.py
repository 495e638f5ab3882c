"""What the scheduler's parts share: its jobs, what is in flight, the outbox, and how a job ends.

The row planner (what to send) and the reply handler (what came back) both
read and change this; neither holds state of its own beyond counters.
"""

from __future__ import annotations

import itertools
from collections import deque

from loguru import logger

from skippy_zmq.engine import job_messages
from skippy_zmq.engine.awaiting import Awaiting
from skippy_zmq.engine.job import Job, JobStatus
from skippy_zmq.engine.prefix_index import PrefixIndex
from skippy_zmq.engine.request import EngineError
from skippy_zmq.engine.scheduler_config import SchedulerConfig
from skippy_zmq.engine.speculation_book import SpeculationBook
from skippy_zmq.protocol.wire import Message


class SchedulerState:
    def __init__(self, cfg: SchedulerConfig, index: PrefixIndex | None):
        self.cfg = cfg
        self.index = index if index is not None and index.enabled else None
        self.speculation = SpeculationBook(cfg)
        self.queue: deque[Job] = deque()
        self.running: dict[int, Job] = {}
        self.awaiting = Awaiting()
        self.outbox: list[Message] = []
        self.prefix_counts = {"disabled": 0, "miss": 0, "hit": 0}
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        """A fresh id: sessions and request ids share one counter, so ids also order events."""
        return next(self._ids)

    def send(self, msg: Message) -> None:
        self.outbox.append(msg)

    def configure(self, job: Job) -> None:
        self.send(job_messages.configure(job, self.next_id()))

    def count_prefix(self, job: Job, status: str) -> None:
        job.cache_status = status
        self.prefix_counts[status] += 1
        logger.info("prefix cache {} for session {} ({}): matched {} of {} prompt tokens", status,
                    job.session_id, job.req.request_id, job.cached, len(job.prompt))

    def replay(self, job: Job) -> None:
        """Forget what the stages hold for `job` and prefill it again from its token history."""
        job.fence_rid = self.next_id()
        job.status, job.drafts, job.ahead = JobStatus.READY, [], []   # from its own history: no fork
        job.computed, job.cached = 0, 0
        self.configure(job)

    def finish(self, job: Job, record: bool = False) -> None:
        """STOP the session everywhere; after a normal end, stages record prompt + answer."""
        job.status = JobStatus.DONE
        self.running.pop(job.session_id, None)
        if record:
            self.speculation.finished(job)
        extras = {}
        if record and self.index is not None:
            self.index.add(job.namespace, job.kv_tokens)
            extras = {"record": job.namespace}
        self.send(job_messages.stop(job, self.next_id(), extras))

    def fail(self, job: Job, error: EngineError | None) -> None:
        """End a job early; `error` goes to its consumer (None: nobody is listening)."""
        if job.done:
            return
        if error is not None:
            job.sink(error)
        for child in job.children:   # choices still waiting for choice 0's KV will never get it
            if child.status is JobStatus.FORK_WAIT:
                self.fail(child, None)
        if job in self.queue:
            self.queue.remove(job)
            job.status = JobStatus.DONE
            return
        self.finish(job)

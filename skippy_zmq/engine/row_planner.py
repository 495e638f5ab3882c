"""What the scheduler sends each tick, decided from every job's status and counts.

One pass per tick, in this order: decode rows of running streams, prefill chunks
within their credit, the first decode rows of prompts just fully sent, then
verify windows ahead where stages would idle. Admission comes first: a request
whose prompt the prefix stores hold is restored (TRY_RESTORE_PREFILL, or
TRY_RESTORE_PREFILL_DECODE when all but its last token are held), else prefilled.

Decode: every running session with its next input token known is "ready".
Ready sessions are grouped into DECODE messages of up to
ceil(running / n_stages) rows, with at most n_stages micro-batches in flight,
so every stage has work while the others compute. A DECODE of every running
stream asks the chain to run on: to decode up to `run_on` more steps from its
own samples (stage/run_on.py; a longer chain sends each step from its last
stage to its first), the request ids reserved.
"""

from __future__ import annotations

import math
import time

from skippy_zmq.engine import job_messages
from skippy_zmq.engine.awaiting import Sent
from skippy_zmq.engine.job import Job, JobStatus
from skippy_zmq.engine.scheduler_state import SchedulerState


class RowPlanner:
    def __init__(self, state: SchedulerState):
        self.state = state

    def plan(self, now: float) -> None:
        self.admit()
        self.send_decodes(now)      # running streams first ...
        self.send_prefill(now)      # ... then prefill within its credit ...
        self.send_decodes(now)      # ... then first decodes of prompts fully sent ...
        self.send_ahead(now)        # ... then windows ahead, where stages would idle

    # ------------------------------------------------------------ admission

    def admit(self) -> None:
        """A request's n choices are admitted together (each holds a lane); the queue stays in order."""
        st = self.state
        while st.queue and len(st.running) + 1 + len(st.queue[0].children) <= st.cfg.max_sessions:
            job = st.queue.popleft()
            if job.done:
                continue
            self._start(job)
            for child in job.children:
                self._start(child)
                # a 1-token prompt has no KV to share
                child.status = JobStatus.FORK_WAIT if job.prefill_target > 0 else JobStatus.READY
                st.configure(child)
            self._restore_or_prefill(job)

    def _start(self, job: Job) -> None:
        self.state.running[job.session_id] = job
        job.status = JobStatus.READY
        # An embedding prefills every prompt token and decodes none. n > 1: only choice 0 drafts (a
        # forked choice's sampled windows drifted from its plain decode in one measured case; until
        # that is found, the other choices decode plainly).
        allowed = job.req.pooling is None and job.req.speculative is not False and not job.choice
        self.state.speculation.start(job, allowed)

    def _restore_or_prefill(self, job: Job) -> None:
        # echo needs logits at every prompt position, which a restored prefix does not have; n > 1
        # forks choice 0's prefilled lane, so it prefills (the fork follows its last chunk)
        st = self.state
        restorable = (st.index is not None and job.req.prompt_logprobs is None and not job.children
                      and job.req.pooling is None)   # an embedding pools every token's hidden state
        matched = st.index.longest(job.namespace, job.prompt, len(job.prompt) - 1) if restorable else 0
        if not matched:
            st.configure(job)
            st.count_prefix(job, "miss" if st.index else "disabled")
        elif matched == len(job.prompt) - 1:
            self._try_fused(job, matched)
        else:
            st.configure(job)
            self._try_restore(job, matched)

    def _try_fused(self, job: Job, matched: int) -> None:
        """Restore prompt[:-1] and decode the last token in one pass."""
        rid = self.state.next_id()
        job.status, job.cached, job.computed = JobStatus.RESTORING_FUSED, matched, job.prefill_target
        self.state.awaiting.restores[rid] = Sent({job.session_id}, time.monotonic())
        self.state.awaiting.rows[rid] = Sent({job.session_id}, time.monotonic())   # its token comes like a decode's
        self.state.send(job_messages.fused_restore(job, rid))

    def _try_restore(self, job: Job, matched: int) -> None:
        """Restore prompt[:matched]; the suffix is prefilled once it hit."""
        rid = self.state.next_id()
        job.status, job.cached = JobStatus.RESTORING, matched
        self.state.awaiting.restores[rid] = Sent({job.session_id}, time.monotonic())
        self.state.send(job_messages.prefix_restore(job, rid, matched))

    # ------------------------------------------------------------ prefill

    def send_prefill(self, now: float) -> None:
        st = self.state
        for job in st.running.values():
            while job.wants_prefill and len(st.awaiting.prefills) < st.cfg.prefill_credit:
                start = job.computed
                end = min(start + st.cfg.prefill_chunk, job.prefill_target)
                rid = st.next_id()
                st.send(job_messages.prefill_chunk(job, rid, start, end, self._prefill_extras(job, end)))
                st.awaiting.prefills[rid] = now
                job.computed = end
                if end == job.prefill_target:
                    self._fork(job)

    def _prefill_extras(self, job: Job, end: int) -> dict:
        extras: dict = {}
        index = self.state.index
        if job.req.pooling is not None:   # an embedding: the final stage pools, the last chunk answers
            extras = {"pool": job.req.pooling, "pool_last": end == job.prefill_target}
        elif end == job.prefill_target and index is not None:   # the prompt is in: record it
            index.add(job.namespace, job.history[:end])
            extras = {"record": job.namespace}
        if job.req.prompt_logprobs is not None and not job.generated:   # echo: score the prompt
            extras["prompt_logprobs"] = job.req.prompt_logprobs
        return extras

    def _fork(self, job: Job) -> None:
        """n > 1: right behind choice 0's last prefill chunk (the chain keeps their order), every
        stage copies its prompt KV into the lanes of the choices still waiting for it."""
        waiting = [c for c in job.children if c.status is JobStatus.FORK_WAIT]
        if not waiting:
            return
        self.state.send(job_messages.fork(job, self.state.next_id(), waiting))
        for child in waiting:
            child.status, child.computed = JobStatus.READY, child.prefill_target

    # ------------------------------------------------------------ decode

    def send_decodes(self, now: float) -> None:
        st = self.state
        ready = [j for j in st.running.values() if j.decodable and not j.cancelled]
        if not ready:
            return
        decoding = sum(1 for j in st.running.values() if j.computed >= j.prefill_target)
        in_flight = st.cfg.micro_batches or st.cfg.n_stages
        rows = max(1, math.ceil(decoding / in_flight))
        while ready and st.awaiting.micro_batches() < in_flight:
            group, ready = ready[:rows], ready[rows:]
            rid = st.next_id()
            st.speculation.draft(group)
            for job in group:
                job.status = JobStatus.DECODING
            msg = job_messages.decode(rid, group, [[j.next_token] + j.drafts for j in group],
                                      [j.next_pos for j in group])
            steps = self._run_on(group)
            if steps:
                msg.extras.update(run_on=steps, until=sorted(group[0].eos))
                for _ in range(steps):
                    st.next_id()   # the ids of the steps the stage runs on
            st.awaiting.rows[rid] = Sent({j.session_id for j in group}, now, ahead=bool(steps), run_on=steps)
            st.send(msg)

    def _run_on(self, group: list[Job]) -> int:
        """Steps the chain may decode after this DECODE from its own samples (a 1-stage chain runs
        them itself, a longer one sends each from its last stage to its first): only for a
        group of every running job (a stream that joins then decodes beside it, and they merge
        once the run ends), plain rows (a drafting stream's run ends where its drafter proposes a
        window, engine/replies.py, and is at most as long as its plain steps since its last window,
        so a stream that drafts often wastes few steps), one EOS set; never past max_tokens or the
        context."""
        st = self.state
        if not st.cfg.run_on or len(group) != len(st.running):
            return 0
        if any(j.drafts or j.ahead or j.eos != group[0].eos for j in group):
            return 0
        return max(0, min([st.cfg.run_on] + [min(j.req.max_tokens - len(j.generated) - 1,
                                                 st.cfg.max_context - j.next_pos - 2,
                                                 j.spec.policy.plain_run if j.spec is not None else st.cfg.run_on)
                                             for j in group]))

    def send_ahead(self, now: float) -> None:
        """Pipelined windows: while fewer streams run than there are stages, each stream that is
        drafting sends windows ahead of the one in flight, up to `speculative.depth` in all."""
        st = self.state
        depth = st.cfg.speculative.depth or st.cfg.n_stages
        if depth <= 1 or len(st.running) >= st.cfg.n_stages:   # independent streams keep every stage busy
            return
        for job in list(st.running.values()):
            while 1 + len(job.ahead) < depth and st.speculation.may_send_ahead(job):
                window = st.speculation.draft_ahead(job)
                if window is None:
                    break
                window.request_id = st.next_id()
                job.ahead.append(window)
                st.awaiting.rows[window.request_id] = Sent({job.session_id}, now, ahead=True)
                st.send(job_messages.decode(window.request_id, [job], [window.row], [window.start]))

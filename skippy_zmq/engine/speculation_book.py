"""The scheduler's speculation: drafts for the rows it sends, windows sent ahead, the accept
step of every window that comes back, and the counts /metrics reads.

Each stream drafts from its prompt and output (`Drafter`); a finished stream's
tokens go to the shared index that other streams fall back on. A window sent
ahead is drafted as if the windows before it were fully accepted; when one of
them is not, the windows behind it are retired (their replies are ignored and
the next window overwrites what they wrote), so the tokens accepted are the
same for any depth.
"""

from __future__ import annotations

from skippy_zmq.config.model import widest_window
from skippy_zmq.engine.awaiting import Awaiting
from skippy_zmq.engine.job import Job, JobStatus, WindowAhead
from skippy_zmq.engine.scheduler_config import SchedulerConfig
from skippy_zmq.engine.long_match import make_drafter
from skippy_zmq.engine.speculative import SharedIndex, judge_window

_KEEP_LENGTHS = 100_000   # accepted lengths kept when nobody drains them (the oldest half goes)


class SpeculationBook:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg   # the scheduler's own (replaced with it)
        spec = cfg.speculative
        self.shared = SharedIndex(spec) if spec.enabled and spec.shared else None
        self.counts = {"windows": 0, "drafted": 0, "accepted": 0, "plain_steps": 0, "ahead_sent": 0,
                       "ahead_retired": 0}
        # Accepted drafts per window since /metrics last drained it (swapped for []); bounded when nobody does.
        self.accepted_lengths: list[int] = []

    def start(self, job: Job, allowed: bool) -> None:
        """Give an admitted job its drafter when speculation is on for it."""
        if self.cfg.speculative.enabled and allowed:
            job.spec = make_drafter(self.cfg.speculative, job.prompt, self.shared)

    def draft(self, group: list[Job]) -> None:
        """Give each job of one DECODE its drafts (job.drafts), within what the message can carry:
        a message of several rows pads them all to its longest window, held to batch_tokens."""
        buckets = self._buckets()
        widest = widest_window(len(group), buckets, self.cfg.batch_tokens)
        for job in group:
            job.drafts = []
            if job.spec is not None:
                room = min(job.req.max_tokens - len(job.generated), self.cfg.max_context - 1 - job.next_pos)
                job.drafts = job.spec.drafts(room, buckets, widest)

    def proposes(self, job: Job) -> bool:
        """Whether the job's drafter has a window for it now: a run on (stage/run_on.py) ends there."""
        if job.spec is None:
            return False
        room = min(job.req.max_tokens - len(job.generated), self.cfg.max_context - 1 - job.next_pos)
        buckets = self._buckets()
        return job.spec.proposes(room, buckets, widest_window(1, buckets, self.cfg.batch_tokens))

    def _buckets(self) -> tuple[int, ...]:
        return tuple(n for n in self.cfg.window_lens if n >= 1)

    @staticmethod
    def may_send_ahead(job: Job) -> bool:
        """A window in flight whose own drafts (or the last window ahead's) give a guess to build on;
        never for constrained requests (a guessed token could be one the constraint refuses)."""
        last_drafts = job.ahead[-1].row[1:] if job.ahead else job.drafts
        return (job.status is JobStatus.DECODING and not job.cancelled
                and job.spec is not None and job.spec.policy.k > 0
                and job.req.constraint is None and bool(last_drafts))

    def draft_ahead(self, job: Job) -> WindowAhead | None:
        """The next window ahead: as if every window in flight were fully accepted, the guess of the
        last one's bonus token, then drafts; None when there is no room or no proposal."""
        assert job.spec is not None
        assumed = job.drafts + [t for w in job.ahead for t in w.row]
        start = job.next_pos + 1 + len(assumed)
        produced = len(job.generated) + 1 + len(assumed)     # generated tokens once those are accepted
        room = min(job.req.max_tokens - produced, self.cfg.max_context - 1 - start)
        buckets = self._buckets()
        row = job.spec.ahead(room, buckets, widest_window(1, buckets, self.cfg.batch_tokens), assumed)
        if not row:
            return None
        self.counts["ahead_sent"] += 1
        return WindowAhead(0, start, row)

    def judge(self, job: Job, targets: list[int]) -> list[int]:
        """The tokens a verified row yields (the target's while they match the drafts, then its own
        next one); the job's policy is told first, so its final event includes this window."""
        drafts, job.drafts = job.drafts, []
        run, accepted = judge_window(None, drafts, targets) if job.spec is None else job.spec.judge(drafts, targets)
        if drafts:
            self.counts["windows"] += 1
            self.counts["drafted"] += len(drafts)
            self.counts["accepted"] += accepted
            self.accepted_lengths.append(accepted)
            if len(self.accepted_lengths) > _KEEP_LENGTHS:
                del self.accepted_lengths[:_KEEP_LENGTHS // 2]
        elif job.spec is not None:
            self.counts["plain_steps"] += 1
        return run

    def next_ahead(self, job: Job, awaiting: Awaiting) -> None:
        """After a window's reply: the next window sent ahead becomes the one in flight if it started
        where the accepted run ended, with the token accepted last; otherwise every window ahead is
        retired (its reply will be ignored; the next window overwrites what it wrote)."""
        if not job.ahead:
            return
        nxt = job.ahead[0]
        if not job.done and not job.cancelled and nxt.start == job.next_pos and nxt.row[0] == job.next_token:
            job.ahead.pop(0)
            job.drafts, job.status = nxt.row[1:], JobStatus.DECODING
            return
        for window in job.ahead:
            sent = awaiting.rows.get(window.request_id)
            if sent is not None:
                sent.sessions.discard(job.session_id)
        self.counts["ahead_retired"] += len(job.ahead)
        job.ahead = []

    def finished(self, job: Job) -> None:
        """A stream ended normally: other streams may draft from its tokens."""
        if self.shared is not None and job.generated:
            self.shared.add(job.history)

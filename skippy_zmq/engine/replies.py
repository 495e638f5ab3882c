"""What the scheduler does with each reply from the stages: tokens to accept, ACKs of prefill
chunks and restore tries, embeddings, errors (a stage that lost a session's KV is healed by a
re-prefill from the session's token history).

Speculation: the final stage returns the target's token at every position of a
verify window; only here is the longest matching prefix accepted, plus the
target's next token. The rejected tail needs no message: the session's next row
starts where the accepted run ended and every stage truncates to it.
"""

from __future__ import annotations

import time

import numpy as np
from loguru import logger

from skippy_zmq.engine.awaiting import Sent
from skippy_zmq.engine.job import Job, JobStatus
from skippy_zmq.engine.request import EngineError, TokenEvent
from skippy_zmq.engine.scheduler_state import SchedulerState
from skippy_zmq.protocol.wire import Kind, Message


def _entry(entry: list) -> tuple[float, list[tuple[int, float]]]:
    """A stage's [logprob, [[id, logprob], ...]] as (logprob, [(id, logprob), ...])."""
    return float(entry[0]), [(int(t), float(v)) for t, v in entry[1]]


class ReplyHandler:
    def __init__(self, state: SchedulerState):
        self.state = state
        self.heals = 0   # sessions re-prefilled after a stage reported kv_gap

    def on_reply(self, stage_id: str, msg: Message, paused: bool) -> None:
        if msg.kind == Kind.PREDICTED_TOKENS:
            self._on_tokens(msg)
        elif msg.kind == Kind.ACK:
            self.state.awaiting.prefills.pop(msg.request_id, None)
            self._on_prompt_logprobs(msg)
            if msg.request_id in self.state.awaiting.restores:
                self._on_restore_ack(msg)
        elif msg.kind == Kind.ERROR:
            self._on_error(stage_id, msg, paused)
        elif msg.kind == Kind.EMBEDDING:
            self._on_embedding(msg)

    def _on_embedding(self, msg: Message) -> None:
        """An embedding's last prefill chunk answered with its pooled vector: the request ends."""
        self.state.awaiting.prefills.pop(msg.request_id, None)
        job = self.state.running.get(msg.session_id)
        if job is None or job.done or job.req.pooling is None or msg.request_id < job.fence_rid:
            logger.warning("dropping an embedding for session {} (request {}): no such embedding in flight",
                           msg.session_id, msg.request_id)
            return
        vector = np.array(msg.activation[0], np.float32)
        job.sink(TokenEvent(finish_reason="stop", embedding=vector, stats={"trace": msg.extras.get("trace", []),
                                                                             "pooled": int(msg.tokens[0])}))
        self.state.finish(job)

    def _on_prompt_logprobs(self, msg: Message) -> None:
        """A prefill chunk's ACK with the prompt tokens' logprobs (echo): kept by position."""
        stats = msg.extras.get("stats")
        scored = stats.get("prompt_logprobs") if isinstance(stats, dict) else None
        job = self.state.running.get(msg.session_id)
        if not isinstance(scored, dict) or job is None or job.req.prompt_logprobs is None:
            return
        start, entries = scored.get("start"), scored.get("entries")
        if isinstance(start, int) and isinstance(entries, list):
            for j, entry in enumerate(entries):
                job.prompt_entries[start + j] = entry

    def _on_restore_ack(self, msg: Message) -> None:
        """A restore try ended: a hit (TRY_RESTORE_PREFILL) or a miss at some stage (either kind)."""
        st = self.state
        job = st.running.get(next(iter(st.awaiting.restores.pop(msg.request_id).sessions)))
        st.awaiting.rows.pop(msg.request_id, None)
        if job is None or job.done:
            return
        hit = msg.extras.get("stats", {}).get("restore", {}).get("status") == "hit"
        fused = job.status is JobStatus.RESTORING_FUSED
        job.status = JobStatus.READY
        if hit and not fused:
            job.computed = job.cached
        else:   # fall back to a full prefill; positions are absolute, partial restores are overwritten
            job.cached, job.computed = 0, 0
            if fused:
                st.configure(job)
        st.count_prefix(job, "hit" if job.cached else "miss")

    def _on_tokens(self, msg: Message) -> None:
        st = self.state
        if st.awaiting.restores.pop(msg.request_id, None) is not None:   # a fused restore hit everywhere
            job = st.running.get(int(msg.session_ids[0]))
            if job is not None and job.status in (JobStatus.RESTORING, JobStatus.RESTORING_FUSED):
                job.status = JobStatus.DECODING
                st.count_prefix(job, "hit")
        sent = st.awaiting.rows.get(msg.request_id)
        if sent is None:   # dropped by a pause, timed out, or a step run on after its run was cut: stale
            logger.info("dropping tokens of unknown or expired batch {}", msg.request_id)
            return
        going_on = self._going_on(msg, sent)
        trace = msg.extras.get("trace", [])
        offsets = np.concatenate([[0], np.cumsum(msg.row_lengths)]).tolist()
        tokens = msg.tokens.tolist()
        logprobs = msg.extras.get("logprobs")   # one entry per token (None for rows without), or absent
        if not isinstance(logprobs, list) or len(logprobs) != len(tokens):
            logprobs = None
        for i, sid in enumerate(msg.session_ids.tolist()):
            if sid not in sent.sessions:   # taken out of the message by a re-prefill: its token is stale
                continue
            sent.sessions.discard(sid)
            job = st.running.get(sid)
            if job is None or job.done:
                continue
            entries = logprobs[offsets[i]:offsets[i + 1]] if logprobs is not None else None
            self._on_row(job, tokens[offsets[i]:offsets[i + 1]], trace, entries)
        if not sent.sessions:
            del st.awaiting.rows[msg.request_id]
        if going_on:
            self._run_on(msg.request_id + 1, going_on, sent.run_on - 1)

    def _run_on(self, request_id: int, sessions: list[int], steps: int) -> None:
        """The stage decodes these sessions' next step itself (request `request_id`): they stay in
        flight, except a drafting one whose drafter now proposes a window: it goes READY and its
        window, sent at once, drops the stage's step (or overwrites it, if it already ran)."""
        st = self.state
        jobs = [st.running[sid] for sid in sessions if sid in st.running and not st.running[sid].done]
        going = [j for j in jobs if not st.speculation.proposes(j)]
        for job in going:
            job.status = JobStatus.DECODING
        if going:
            st.awaiting.rows[request_id] = Sent({j.session_id for j in going}, time.monotonic(), ahead=True,
                                                run_on=steps)

    @staticmethod
    def _going_on(msg: Message, sent: Sent) -> list[int]:
        """The rows the stage runs on from this reply's samples (stage/run_on.py): only within the
        steps asked for, as the next request id, and of rows this message still answers for."""
        said = msg.extras.get("run_on")
        if not sent.run_on or not isinstance(said, dict) or said.get("next") != msg.request_id + 1:
            return []
        sessions = said.get("sessions")
        return [s for s in sessions if s in sent.sessions] if isinstance(sessions, list) else []

    def _on_row(self, job: Job, targets: list[int], trace: list, entries: list | None) -> None:
        """One row's tokens: the target's token at every position of its window."""
        job.status = JobStatus.READY
        if len(targets) != len(job.drafts) + 1:
            logger.warning("session {}: {} target tokens for a window of {} drafts", job.session_id,
                           len(targets), len(job.drafts))
            self.state.fail(job, EngineError(f"the final stage answered a window of {len(job.drafts)} drafts "
                                             f"with {len(targets)} tokens", 500, "bad_reply"))
            return
        self._accept_window(job, targets, trace, entries)
        self.state.speculation.next_ahead(job, self.state.awaiting)

    def _accept_window(self, job: Job, targets: list[int], trace: list, entries: list | None = None) -> None:
        """Accept the target's tokens while they match the drafts, then the target's next token.

        Greedy, this is exactly plain decoding; sampled, each position was drawn with the
        request's own keyed sampler (sample-and-match), so the output distribution is the
        target's. Tokens go out one at a time, so EOS or max_tokens inside a window stops there.
        `entries` (the final stage's logprobs, one per target) go with the accepted tokens only:
        an accepted position saw exactly the context plain decoding gives it.
        """
        for j, tok in enumerate(self.state.speculation.judge(job, targets)):
            self._accept_token(job, tok, trace, entries[j] if entries is not None else None)
            if job.done:
                break

    def _accept_token(self, job: Job, tok: int, trace: list, entry: list | None = None) -> None:
        job.generated.append(tok)
        if job.spec is not None:
            job.spec.accepted((tok,))
        first = len(job.generated) == 1
        if first:
            job.t_first = time.monotonic()
        job.computed = job.next_pos   # the decode just wrote the KV of every position before next_pos
        reason = None
        if tok in job.eos:
            reason = "stop"
        elif len(job.generated) >= job.req.max_tokens or job.next_pos + 1 >= self.state.cfg.max_context:
            reason = "length"
        job.sink(self._token_event(job, tok, reason, trace, entry))
        if reason:
            self.state.finish(job, record=True)

    @staticmethod
    def _token_event(job: Job, tok: int, reason: str | None, trace: list, entry: list | None) -> TokenEvent:
        first = len(job.generated) == 1
        stats = {"trace": trace, "first": first}
        if first:
            stats["prefix"] = {"status": job.cache_status, "matched": job.cached,
                               "suffix": len(job.prompt) - job.cached}
        if reason and job.spec is not None:
            stats["speculative"] = job.spec.stats()
        event = TokenEvent(token_id=tok, finish_reason=reason, cached_tokens=job.cached if first else 0,
                           stats=stats, choice=job.choice)
        if entry is not None and job.req.logprobs is not None:   # [logprob, [[id, logprob], ...]]
            event.logprob, event.top_logprobs = _entry(entry)
        if first and job.req.prompt_logprobs is not None:
            got = job.prompt_entries
            event.prompt_logprobs = [None] + [_entry(got[p]) if p in got else None for p in range(1, len(job.prompt))]
        return event

    def _on_error(self, stage_id: str, msg: Message, paused: bool) -> None:
        reason = msg.extras.get("error", "unknown error")
        code = msg.extras.get("code", "stage_error")
        self.state.awaiting.drop_session(msg.request_id, msg.session_id)
        job = self.state.running.get(msg.session_id)
        if job is None:
            logger.warning("error from {} for unknown session {}: {}", stage_id, msg.session_id, reason)
            return
        if paused or msg.request_id < job.fence_rid:
            # Paused: every session is re-prefilled on resume anyway. Older than the fence: the
            # error is about work the re-prefill already replaced.
            logger.info("ignoring a stale error from {} for session {} ({}): {}", stage_id, job.session_id,
                        code, reason)
            return
        if code == "kv_gap" and self._heal(job, stage_id, msg.extras.get("incarnation")):
            return
        status = 503 if code == "lanes_busy" else 500
        self.state.fail(job, EngineError(reason, status, code))

    def _heal(self, job: Job, stage_id: str, incarnation: object) -> bool:
        """A stage lacks KV this session should have: re-prefill it from its token history.

        Once per session per stage incarnation; a second gap there is a real failure.
        """
        key = (stage_id, incarnation)
        if key in job.healed:
            return False
        job.healed.add(key)
        self.heals += 1
        logger.warning("stage {} lost KV of session {} ({}): re-prefilling {} tokens from its history", stage_id,
                       job.session_id, job.req.request_id, job.next_pos)
        self.state.awaiting.forget_session(job.session_id)
        self.state.replay(job)
        return True

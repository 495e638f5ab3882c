"""Iteration-level scheduler: admission, prefill credit, decode micro-batches.

Pure state machine, no sockets: `submit`, `cancel`, `on_reply` and `tick`
change state; `tick` returns the messages to push to stage 0. The pipeline
engine (driver/pipeline.py) owns the sockets and calls these from one thread.

Decode: every running session with its next input token known is "ready".
Ready sessions are grouped into DECODE messages of up to
ceil(running / n_stages) rows, with at most n_stages micro-batches in flight,
so every stage has work while the others compute.

Speculation: a ready session may carry a verify window instead of one token,
its current token plus drafts from its own prompt and output (or recent
outputs of other requests), as one row of a DECODE at its absolute position.
The final stage returns the target's token at every position of the row; only
here is the longest matching prefix accepted, plus the target's next token.
The rejected tail needs no message: the session's next row starts where the
accepted run ended and every stage truncates to it.

Pipelined windows: while fewer streams run than there are stages, a stream
keeps up to `speculative.depth` windows in flight (default: one per stage), so
every stage works on it at once. A window sent ahead is drafted as if the ones
before it were fully accepted: its first token is the guess of the previous
window's bonus token. When a window comes back not fully accepted (or with
another bonus token), the windows behind it are retired: their replies are
ignored, and the session's next window starts at the accepted position,
overwriting what they wrote, as a rejected tail is overwritten. The tokens
accepted are the same for any depth.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from loguru import logger

from skippy_zmq.config.model import BATCH_TOKENS, widest_window
from skippy_zmq.engine.request import EngineError, GenRequest, TokenEvent
from skippy_zmq.engine.prefix_index import PrefixIndex
from skippy_zmq.engine.speculative import DraftPolicy, NgramProposer, SharedIndex, judge_window, propose_draft
from skippy_zmq.config.speculative import SpeculativeConfig
from skippy_zmq.protocol.wire import Kind, Message

DEFAULT_NAMESPACE = "default"


def _entry(entry: list) -> tuple[float, list[tuple[int, float]]]:
    """A stage's [logprob, [[id, logprob], ...]] as (logprob, [(id, logprob), ...])."""
    return float(entry[0]), [(int(t), float(v)) for t, v in entry[1]]
Sink = Callable[[object], None]   # receives TokenEvent or EngineError; must be thread-safe


@dataclass(frozen=True)
class SchedulerConfig:
    n_stages: int
    micro_batches: int = 0           # decode micro-batches in flight; 0 = n_stages
    max_sessions: int = 8
    max_queue: int = 64
    prefill_chunk: int = 256
    prefill_credit: int = 2          # prefill chunks in flight at once
    max_context: int = 2048
    reply_timeout_s: float = 30.0
    request_timeout_s: float = 120.0
    resume_timeout_s: float = 60.0   # how long paused requests wait for a replacement stage
    speculative: SpeculativeConfig = SpeculativeConfig()
    window_lens: tuple[int, ...] = (1, 2, 4, 8, 16)   # the stages' row buckets (config.Buckets.window_lens)
    batch_tokens: int = BATCH_TOKENS  # a DECODE with several rows pads them all to its longest window: cap rows x window


@dataclass(eq=False)
class Job:
    req: GenRequest
    session_id: int
    sink: Sink
    eos: frozenset[int]
    deadline: float
    prompt: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    prefill_sent: int = 0           # prompt[:-1] tokens sent as PREFILL
    next_token: int = -1
    next_pos: int = 0
    in_flight: bool = False
    cancelled: bool = False
    done: bool = False
    t_submit: float = field(default_factory=time.monotonic)
    t_first: float = 0.0
    namespace: str = DEFAULT_NAMESPACE
    restoring: str | None = None    # "fused" | "prefix" while a restore try is in flight
    cached: int = 0                 # prompt tokens served from the prefix stores
    cache_status: str = "disabled"  # disabled | miss | hit
    fence_rid: int = 0              # replies to requests older than this predate a re-prefill: stale
    healed: set = field(default_factory=set)   # (stage id, incarnation) that already re-prefilled it
    proposer: NgramProposer | None = None      # speculation on: drafts from prompt + output
    policy: DraftPolicy | None = None
    drafts: list[int] = field(default_factory=list)   # the drafts of the window in flight
    ahead: list[Ahead] = field(default_factory=list)  # later windows in flight behind it, oldest first
    prompt_entries: dict[int, list] = field(default_factory=dict)   # echo: prompt position -> logprob entry
    choice: int = 0                 # n > 1: this job's choice index (its sampler's key)
    children: list = field(default_factory=list)   # n > 1, on choice 0: the other choices' jobs
    waiting_fork: bool = False      # a child whose prompt KV is not forked from choice 0 yet
    root: int | None = None         # n > 1, on a child: choice 0's session (the request's handle)

    @property
    def history(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def prefill_total(self) -> int:
        """Tokens to prefill before the next decode: everything but the token about to be decoded."""
        return self.next_pos

    @property
    def decodable(self) -> bool:
        return self.prefill_sent >= self.prefill_total and not self.in_flight and not self.done \
            and not self.restoring and not self.waiting_fork and self.req.pooling is None

    @property
    def kv_tokens(self) -> list[int]:
        """Tokens whose KV the stages hold: the prompt and all generated tokens but the last."""
        return (self.prompt + self.generated)[:len(self.prompt) + len(self.generated) - 1]


@dataclass
class Ahead:
    """A verify window sent while an earlier window of the same stream is still in flight."""
    bid: int
    start: int          # position of row[0]
    row: list[int]      # the guessed bonus token of the window before, then drafts


@dataclass
class Batch:
    sessions: set[int]
    sent_at: float
    ahead: bool = False   # windows sent ahead do not count against micro_batches


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, eos_ids: frozenset[int], index: PrefixIndex | None = None):
        self.cfg, self.eos_ids = cfg, eos_ids
        self.index = index if index is not None and index.enabled else None
        self.restores: dict[int, Batch] = {}             # request id of a restore try -> its session
        self.prefix_counts = {"disabled": 0, "miss": 0, "hit": 0}
        self.heals = 0                                   # sessions re-prefilled after a stage reported kv_gap
        self.paused_since: float | None = None           # a stage died; requests wait for its replacement
        self.pause_reason = ""
        self.queue: deque[Job] = deque()
        self.running: dict[int, Job] = {}
        self.batches: dict[int, Batch] = {}
        self.prefill_in_flight: dict[int, float] = {}   # request id of chunk -> sent time
        self.outbox: list[Message] = []
        self._ids = itertools.count(1)
        spec = cfg.speculative
        self.shared = SharedIndex(spec) if spec.enabled and spec.shared else None
        self.spec_counts = {"windows": 0, "drafted": 0, "accepted": 0, "plain_steps": 0, "ahead_sent": 0,
                            "ahead_retired": 0}
        # Accepted drafts per window since /metrics last drained it (swapped for []); bounded when nobody does.
        self.spec_accepted_lengths: list[int] = []

    # ------------------------------------------------------------ requests

    def submit(self, req: GenRequest, sink: Sink) -> int:
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
        timeout = req.timeout_s or self.cfg.request_timeout_s
        # ignore_eos does not apply to a constrained request: once its constraint is complete the
        # final stage allows nothing but EOS, so going on would only repeat EOS.
        eos = frozenset() if req.ignore_eos and req.constraint is None else self.eos_ids
        if req.sampling.seed is None and req.sampling.temperature > 0:
            # Draws are keyed by (seed, choice, position): a seed fixed here makes a resumed or
            # speculated request draw what it would have drawn without either.
            req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, seed=secrets.randbits(63)))
        job = Job(req, next(self._ids), sink, eos, time.monotonic() + timeout, prompt=list(req.prompt_ids),
                  namespace=req.cache_key or DEFAULT_NAMESPACE)
        # Every choice reports the prompt's logprobs (echo); choice 0 alone prefills, so they share its entries.
        job.children = [Job(req, next(self._ids), sink, eos, job.deadline, prompt=list(req.prompt_ids),
                            namespace=job.namespace, choice=i, waiting_fork=True,
                            prompt_entries=job.prompt_entries, root=job.session_id) for i in range(1, req.n)]
        self.queue.append(job)
        return job.session_id

    def cancel(self, session_id: int, choice: int | None = None) -> None:
        """Cancel request `session_id` (its first choice's session), or only its choice `choice`
        (n > 1: one choice ended early, by a stop string): that choice's lane is freed at the next
        tick its row is not in flight, while the other choices go on."""
        jobs = [j for j in [*self.running.values(), *self.queue] if session_id in (j.session_id, j.root)]
        for one in jobs + [c for j in jobs for c in j.children]:   # (children not admitted yet included)
            if not one.done and (choice is None or one.choice == choice):
                one.cancelled = True

    @property
    def load(self) -> dict[str, int]:
        return {"running": len(self.running), "queued": len(self.queue), "batches_in_flight": len(self.batches)}

    # ------------------------------------------------------------ replies

    def on_reply(self, stage_id: str, msg: Message) -> None:
        if msg.kind == Kind.PREDICTED_TOKENS:
            self._on_tokens(msg)
        elif msg.kind == Kind.ACK:
            self.prefill_in_flight.pop(msg.request_id, None)
            self._on_prompt_logprobs(msg)
            if msg.request_id in self.restores:
                self._on_restore_ack(msg)
        elif msg.kind == Kind.ERROR:
            self._on_error(stage_id, msg)
        elif msg.kind == Kind.EMBEDDING:
            self._on_embedding(msg)

    def _on_embedding(self, msg: Message) -> None:
        """An embedding's last prefill chunk answered with its pooled vector: the request ends."""
        self.prefill_in_flight.pop(msg.request_id, None)
        job = self.running.get(msg.session_id)
        if job is None or job.done or job.req.pooling is None or msg.request_id < job.fence_rid:
            logger.warning("dropping an embedding for session {} (request {}): no such embedding in flight",
                           msg.session_id, msg.request_id)
            return
        vector = np.array(msg.activation[0], np.float32)
        job.sink(TokenEvent(finish_reason="stop", embedding=vector, stats={"trace": msg.extras.get("trace", []),
                                                                             "pooled": int(msg.tokens[0])}))
        self._finish(job)

    def _on_prompt_logprobs(self, msg: Message) -> None:
        """A prefill chunk's ACK with the prompt tokens' logprobs (echo): kept by position."""
        stats = msg.extras.get("stats")
        scored = stats.get("prompt_logprobs") if isinstance(stats, dict) else None
        job = self.running.get(msg.session_id)
        if not isinstance(scored, dict) or job is None or job.req.prompt_logprobs is None:
            return
        start, entries = scored.get("start"), scored.get("entries")
        if isinstance(start, int) and isinstance(entries, list):
            for j, entry in enumerate(entries):
                job.prompt_entries[start + j] = entry

    def _on_restore_ack(self, msg: Message) -> None:
        """A restore try ended: a hit (TRY_RESTORE_PREFILL) or a miss at some stage (either kind)."""
        job = self.running.get(next(iter(self.restores.pop(msg.request_id).sessions)))
        self.batches.pop(msg.request_id, None)
        if job is None or job.done:
            return
        hit = msg.extras.get("stats", {}).get("restore", {}).get("status") == "hit"
        fused = job.restoring == "fused"
        job.restoring, job.in_flight = None, False
        if hit and not fused:
            job.prefill_sent = job.cached
        else:   # fall back to a full prefill; positions are absolute, partial restores are overwritten
            job.cached, job.prefill_sent = 0, 0
            if fused:
                self.outbox.append(self._configure(job))
        self._count_prefix(job, "hit" if job.cached else "miss")

    def _count_prefix(self, job: Job, status: str) -> None:
        job.cache_status = status
        self.prefix_counts[status] += 1
        logger.info("prefix cache {} for session {} ({}): matched {} of {} prompt tokens", status,
                    job.session_id, job.req.request_id, job.cached, len(job.prompt))

    def _on_tokens(self, msg: Message) -> None:
        if self.restores.pop(msg.request_id, None) is not None:   # a fused restore hit everywhere
            job = self.running.get(int(msg.session_ids[0]))
            if job is not None and job.restoring:
                job.restoring = None
                self._count_prefix(job, "hit")
        batch = self.batches.get(msg.request_id)
        if batch is None:   # a batch dropped by a pause (or timed out): its tokens are stale
            logger.warning("dropping tokens of unknown or expired batch {}", msg.request_id)
            return
        trace = msg.extras.get("trace", [])
        offsets = np.concatenate([[0], np.cumsum(msg.row_lengths)]).tolist()
        tokens = msg.tokens.tolist()
        logprobs = msg.extras.get("logprobs")   # one entry per token (None for rows without), or absent
        if not isinstance(logprobs, list) or len(logprobs) != len(tokens):
            logprobs = None
        for i, sid in enumerate(msg.session_ids.tolist()):
            if sid not in batch.sessions:   # taken out of the batch by a re-prefill: its token is stale
                continue
            batch.sessions.discard(sid)
            job = self.running.get(sid)
            if job is None or job.done:
                continue
            job.in_flight = False
            targets = tokens[offsets[i]:offsets[i + 1]]
            if len(targets) != len(job.drafts) + 1:
                logger.warning("session {}: {} target tokens for a window of {} drafts", sid, len(targets),
                               len(job.drafts))
                self._fail(job, EngineError(f"the final stage answered a window of {len(job.drafts)} drafts "
                                            f"with {len(targets)} tokens", 500, "bad_reply"))
                continue
            entries = logprobs[offsets[i]:offsets[i + 1]] if logprobs is not None else None
            self._accept_window(job, targets, trace, entries)
            self._next_ahead(job)
        if not batch.sessions:
            del self.batches[msg.request_id]

    def _accept_window(self, job: Job, targets: list[int], trace: list, entries: list | None = None) -> None:
        """Accept the target's tokens while they match the drafts, then the target's next token.

        Greedy, this is exactly plain decoding; sampled, each position was drawn with the
        request's own keyed sampler (sample-and-match), so the output distribution is the
        target's. Tokens go out one at a time, so EOS or max_tokens inside a window stops there.
        `entries` (the final stage's logprobs, one per target) go with the accepted tokens only:
        an accepted position saw exactly the context plain decoding gives it.
        """
        drafts, job.drafts = job.drafts, []
        # the policy is told first, so a request's final event includes the window it ends in
        run, accepted = judge_window(job.policy, drafts, targets)
        if drafts:
            self.spec_counts["windows"] += 1
            self.spec_counts["drafted"] += len(drafts)
            self.spec_counts["accepted"] += accepted
            self.spec_accepted_lengths.append(accepted)
            if len(self.spec_accepted_lengths) > 100_000:
                del self.spec_accepted_lengths[:50_000]
        elif job.policy is not None:
            self.spec_counts["plain_steps"] += 1
        for j, tok in enumerate(run):
            self._accept_token(job, tok, trace, entries[j] if entries is not None else None)
            if job.done:
                break

    def _next_ahead(self, job: Job) -> None:
        """After a window's reply: the next window sent ahead becomes the one in flight if it started
        where the accepted run ended, with the token accepted last; otherwise every window ahead is
        retired (its reply will be ignored; the next window overwrites what it wrote)."""
        if not job.ahead:
            return
        nxt = job.ahead[0]
        if not job.done and not job.cancelled and nxt.start == job.next_pos and nxt.row[0] == job.next_token:
            job.ahead.pop(0)
            job.drafts, job.in_flight = nxt.row[1:], True
            return
        for window in job.ahead:
            batch = self.batches.get(window.bid)
            if batch is not None:
                batch.sessions.discard(job.session_id)
        self.spec_counts["ahead_retired"] += len(job.ahead)
        job.ahead = []

    def _accept_token(self, job: Job, tok: int, trace: list, entry: list | None = None) -> None:
        job.generated.append(tok)
        if job.proposer is not None:
            job.proposer.extend((tok,))
        first = len(job.generated) == 1
        if first:
            job.t_first = time.monotonic()
        job.next_token, job.next_pos = tok, job.next_pos + 1
        job.prefill_sent = job.next_pos   # the decode just wrote the KV of every position before next_pos
        reason = None
        if tok in job.eos:
            reason = "stop"
        elif len(job.generated) >= job.req.max_tokens or job.next_pos + 1 >= self.cfg.max_context:
            reason = "length"
        stats = {"trace": trace, "first": first}
        if first:
            stats["prefix"] = {"status": job.cache_status, "matched": job.cached,
                               "suffix": len(job.prompt) - job.cached}
        if reason and job.policy is not None:
            p = job.policy
            stats["speculative"] = {"windows": p.windows, "drafted": p.drafted, "accepted": p.accepted}
        event = TokenEvent(token_id=tok, finish_reason=reason, cached_tokens=job.cached if first else 0,
                           stats=stats, choice=job.choice)
        if entry is not None and job.req.logprobs is not None:   # [logprob, [[id, logprob], ...]]
            event.logprob, event.top_logprobs = _entry(entry)
        if first and job.req.prompt_logprobs is not None:
            got = job.prompt_entries
            event.prompt_logprobs = [None] + [_entry(got[p]) if p in got else None for p in range(1, len(job.prompt))]
        job.sink(event)
        if reason:
            self._finish(job, record=True)

    def _on_error(self, stage_id: str, msg: Message) -> None:
        reason = msg.extras.get("error", "unknown error")
        code = msg.extras.get("code", "stage_error")
        batch = self.batches.get(msg.request_id)
        if batch is not None:
            batch.sessions.discard(msg.session_id)
            if not batch.sessions:
                del self.batches[msg.request_id]
        self.prefill_in_flight.pop(msg.request_id, None)
        self.restores.pop(msg.request_id, None)
        job = self.running.get(msg.session_id)
        if job is None:
            logger.warning("error from {} for unknown session {}: {}", stage_id, msg.session_id, reason)
            return
        if self.paused_since is not None or msg.request_id < job.fence_rid:
            # Paused: every session is re-prefilled on resume anyway. Older than the fence: the
            # error is about work the re-prefill already replaced.
            logger.info("ignoring a stale error from {} for session {} ({}): {}", stage_id, job.session_id,
                        code, reason)
            return
        if code == "kv_gap" and self._heal(job, stage_id, msg.extras.get("incarnation")):
            return
        status = 503 if code == "lanes_busy" else 500
        self._fail(job, EngineError(reason, status, code))

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
        for pending in (self.batches, self.restores):
            for bid, batch in list(pending.items()):
                batch.sessions.discard(job.session_id)
                if not batch.sessions:
                    del pending[bid]
        self._replay(job)
        return True

    def _replay(self, job: Job) -> None:
        """Forget what the stages hold for `job` and prefill it again from its token history."""
        job.fence_rid = next(self._ids)
        job.in_flight, job.restoring, job.drafts, job.ahead = False, None, [], []
        job.waiting_fork = False   # a re-prefill from its own history needs no fork
        job.prefill_sent, job.cached = 0, 0
        self.outbox.append(self._configure(job))

    # ------------------------------------------------------------ lifecycle

    def _finish(self, job: Job, record: bool = False) -> None:
        """STOP the session everywhere; after a normal end, stages record prompt + answer."""
        job.done = True
        self.running.pop(job.session_id, None)
        if record and self.shared is not None and job.generated:
            self.shared.add(job.history)
        extras = {}
        if record and self.index is not None:
            self.index.add(job.namespace, job.kv_tokens)
            extras = {"record": job.namespace}
        self.outbox.append(Message(Kind.STOP, next(self._ids), job.session_id, extras=extras))

    def _fail(self, job: Job, error: EngineError | None) -> None:
        """End a job early; `error` goes to its consumer (None: nobody is listening)."""
        if job.done:
            return
        if error is not None:
            job.sink(error)
        for child in job.children:   # choices still waiting for choice 0's KV will never get it
            if child.waiting_fork:
                self._fail(child, None)
        if job in self.queue:
            self.queue.remove(job)
            job.done = True
            return
        self._finish(job)

    def fail_sessions(self, session_ids: set[int], error: EngineError) -> None:
        """End the jobs of these sessions (running or queued) with `error`; unknown ids are ignored."""
        for job in [*self.running.values(), *self.queue]:
            if job.session_id in session_ids:
                self._fail(job, error)

    def fail_all(self, error: EngineError) -> None:
        for job in list(self.running.values()) + list(self.queue):
            self._fail(job, error)
        self.batches.clear()
        self.restores.clear()
        self.prefill_in_flight.clear()

    def pause(self, reason: str) -> None:
        """A stage died: drop everything in flight; running requests wait for a replacement."""
        if self.paused_since is None:
            self.paused_since, self.pause_reason = time.monotonic(), reason
        self.batches.clear()
        self.restores.clear()
        self.prefill_in_flight.clear()
        for job in self.running.values():
            job.in_flight, job.restoring, job.drafts, job.ahead = False, None, [], []

    def resume(self) -> float:
        """Every stage is back: re-prefill each paused session from its token history. Returns pause length."""
        paused = time.monotonic() - (self.paused_since or time.monotonic())
        self.paused_since = None
        for job in self.running.values():
            self._replay(job)
        logger.info("resuming {} request(s) after {:.2f} s: re-prefilling from token history",
                    len(self.running), paused)
        return paused

    def tick(self, now: float | None = None) -> list[Message]:
        now = time.monotonic() if now is None else now
        if self.paused_since is not None:
            self._expire(now)   # deadlines and cancellations still apply while paused
            if now - self.paused_since > self.cfg.resume_timeout_s:
                self.paused_since = None
                self.fail_all(EngineError(f"{self.pause_reason}; no replacement within "
                                          f"{self.cfg.resume_timeout_s:g} s", 503, "stage_dead"))
            out, self.outbox = self.outbox, []
            return out
        self._expire(now)
        self._admit()
        self._send_decode_batches(now)      # running streams first ...
        self._send_prefill(now)             # ... then prefill within its credit ...
        self._send_decode_batches(now)      # ... then first decodes of prompts fully sent ...
        self._send_ahead(now)               # ... then windows ahead, where stages would idle
        out, self.outbox = self.outbox, []
        return out

    def _expire(self, now: float) -> None:
        for job in list(self.running.values()) + list(self.queue):
            if job.cancelled and not job.in_flight:
                self._fail(job, None)
            elif now > job.deadline:
                self._fail(job, EngineError(f"request exceeded its deadline of "
                                            f"{job.req.timeout_s or self.cfg.request_timeout_s:g} s", 504, "timeout"))
        for pending in (self.batches, self.restores):
            self._expire_pending(pending, now)
        for rid, sent in list(self.prefill_in_flight.items()):
            if now - sent > self.cfg.reply_timeout_s:
                del self.prefill_in_flight[rid]   # free the credit; the decode timeout catches the session

    def _expire_pending(self, pending: dict[int, Batch], now: float) -> None:
        stale = [bid for bid, b in pending.items() if now - b.sent_at > self.cfg.reply_timeout_s]
        for bid in stale:
            for sid in pending.pop(bid).sessions:
                if sid in self.running:
                    self._fail(self.running[sid], EngineError(
                        f"no reply from the pipeline within {self.cfg.reply_timeout_s:g} s", 504, "stage_timeout"))

    def _configure(self, job: Job) -> Message:
        """Sampling (and constraint, logprobs, choice) for the last stage; every stage takes a lane."""
        extras = {"sampling": job.req.sampling.to_dict()}
        if job.req.constraint is not None:
            extras["constraint"] = job.req.constraint
        if job.req.logprobs is not None:
            extras["logprobs"] = job.req.logprobs
        if job.choice:
            extras["choice"] = job.choice
        return Message(Kind.CONFIGURE_GENERATION, next(self._ids), job.session_id,
                       tokens=np.asarray(job.prompt, np.int32), extras=extras)

    def _start(self, job: Job) -> None:
        self.running[job.session_id] = job
        job.next_token, job.next_pos = job.prompt[-1], len(job.prompt) - 1
        if job.req.pooling is not None:   # an embedding prefills every prompt token and decodes none
            job.next_pos = len(job.prompt)
            return
        # n > 1: only choice 0 drafts (a forked choice's sampled windows drifted from its plain
        # decode in one measured case; until that is found, the other choices decode plainly)
        if self.cfg.speculative.enabled and job.req.speculative is not False and not job.choice:
            job.proposer = NgramProposer(self.cfg.speculative, job.prompt)
            job.policy = DraftPolicy(self.cfg.speculative)

    def _admit(self) -> None:
        # A request's n choices are admitted together (each holds a lane); the queue stays in order.
        while self.queue and len(self.running) + 1 + len(self.queue[0].children) <= self.cfg.max_sessions:
            job = self.queue.popleft()
            if job.done:
                continue
            self._start(job)
            for child in job.children:
                self._start(child)
                child.waiting_fork = job.prefill_total > 0   # a 1-token prompt has no KV to share
                self.outbox.append(self._configure(child))
            # echo needs logits at every prompt position, which a restored prefix does not have; n > 1
            # forks choice 0's prefilled lane, so it prefills (the fork follows its last chunk)
            restorable = (self.index is not None and job.req.prompt_logprobs is None and not job.children
                          and job.req.pooling is None)   # an embedding pools every token's hidden state
            matched = self.index.longest(job.namespace, job.prompt, len(job.prompt) - 1) if restorable else 0
            if not matched:
                self.outbox.append(self._configure(job))
                self._count_prefix(job, "miss" if self.index else "disabled")
            elif matched == len(job.prompt) - 1:
                self._try_fused(job, matched)
            else:
                self.outbox.append(self._configure(job))
                self._try_restore(job, matched)

    def _try_fused(self, job: Job, matched: int) -> None:
        """TRY_RESTORE_PREFILL_DECODE: restore prompt[:-1] and decode the last token in one pass."""
        rid = next(self._ids)
        job.restoring, job.in_flight, job.cached, job.prefill_sent = "fused", True, matched, job.prefill_total
        self.restores[rid] = Batch({job.session_id}, time.monotonic())
        self.batches[rid] = Batch({job.session_id}, time.monotonic())   # its token arrives like a decode's
        extras = {"namespace": job.namespace, "sampling": job.req.sampling.to_dict()}
        if job.req.constraint is not None:
            extras["constraint"] = job.req.constraint
        if job.req.logprobs is not None:
            extras["logprobs"] = job.req.logprobs
        self.outbox.append(Message(Kind.TRY_RESTORE_PREFILL_DECODE, rid, job.session_id,
                                   tokens=np.asarray(job.prompt, np.int32), extras=extras))

    def _try_restore(self, job: Job, matched: int) -> None:
        """TRY_RESTORE_PREFILL of prompt[:matched]; the suffix is prefilled once it hit."""
        rid = next(self._ids)
        job.restoring, job.cached = "prefix", matched
        self.restores[rid] = Batch({job.session_id}, time.monotonic())
        self.outbox.append(Message(Kind.TRY_RESTORE_PREFILL, rid, job.session_id,
                                   tokens=np.asarray(job.prompt[:matched], np.int32),
                                   extras={"namespace": job.namespace}))

    def _send_prefill(self, now: float) -> None:
        for job in self.running.values():
            while (job.prefill_sent < job.prefill_total and not job.restoring and not job.waiting_fork
                   and len(self.prefill_in_flight) < self.cfg.prefill_credit):
                start = job.prefill_sent
                end = min(start + self.cfg.prefill_chunk, job.prefill_total)
                rid = next(self._ids)
                extras = {}
                history = job.history
                if job.req.pooling is not None:   # an embedding: the final stage pools, the last chunk answers
                    extras = {"pool": job.req.pooling, "pool_last": end == job.prefill_total}
                elif end == job.prefill_total and self.index is not None:   # the prompt is in: record it
                    self.index.add(job.namespace, history[:end])
                    extras = {"record": job.namespace}
                if job.req.prompt_logprobs is not None and not job.generated:   # echo: score the prompt
                    extras["prompt_logprobs"] = job.req.prompt_logprobs
                self.outbox.append(Message(Kind.PREFILL, rid, job.session_id, position=start,
                                           tokens=np.asarray(history[start:end], np.int32), extras=extras))
                self.prefill_in_flight[rid] = now
                job.prefill_sent = end
                if end == job.prefill_total:
                    self._fork(job)

    def _fork(self, job: Job) -> None:
        """n > 1: right behind choice 0's last prefill chunk (the chain keeps their order), every
        stage copies its prompt KV into the lanes of the choices still waiting for it."""
        waiting = [c for c in job.children if c.waiting_fork and not c.done]
        if not waiting:
            return
        self.outbox.append(Message(Kind.FORK_SESSION, next(self._ids), job.session_id, position=job.prefill_total,
                                   sessions=np.array([job.session_id] + [c.session_id for c in waiting], np.uint64)))
        for child in waiting:
            child.waiting_fork, child.prefill_sent = False, child.prefill_total

    def _send_decode_batches(self, now: float) -> None:
        ready = [j for j in self.running.values() if j.decodable and not j.cancelled]
        if not ready:
            return
        decoding = sum(1 for j in self.running.values() if j.prefill_sent >= j.prefill_total)
        in_flight = self.cfg.micro_batches or self.cfg.n_stages
        rows = max(1, math.ceil(decoding / in_flight))
        while ready and sum(not b.ahead for b in self.batches.values()) < in_flight:
            group, ready = ready[:rows], ready[rows:]
            bid = next(self._ids)
            self._draft(group)
            tokens, positions, lengths = [], [], []
            for job in group:
                job.in_flight = True
                row = [job.next_token] + job.drafts
                tokens += row
                positions += range(job.next_pos, job.next_pos + len(row))
                lengths.append(len(row))
            self.batches[bid] = Batch({j.session_id for j in group}, now)
            extras = {"lengths": lengths} if any(n > 1 for n in lengths) else {}
            self.outbox.append(Message(
                Kind.DECODE, bid, group[0].session_id, position=group[0].next_pos,
                tokens=np.array(tokens, np.int32), positions=np.array(positions, np.int32),
                sessions=np.array([j.session_id for j in group], np.uint64), extras=extras))

    def _send_ahead(self, now: float) -> None:
        """Pipelined windows: while fewer streams run than there are stages, each stream that is
        drafting sends windows ahead of the one in flight, up to `speculative.depth` in all."""
        depth = self.cfg.speculative.depth or self.cfg.n_stages
        if depth <= 1:
            return
        if len(self.running) >= self.cfg.n_stages:   # independent streams already keep every stage busy
            return
        for job in list(self.running.values()):
            while 1 + len(job.ahead) < depth and self._may_send_ahead(job):
                window = self._draft_ahead(job)
                if window is None:
                    break
                bid = next(self._ids)
                window.bid = bid
                job.ahead.append(window)
                self.spec_counts["ahead_sent"] += 1
                self.batches[bid] = Batch({job.session_id}, now, ahead=True)
                n = len(window.row)
                self.outbox.append(Message(
                    Kind.DECODE, bid, job.session_id, position=window.start,
                    tokens=np.array(window.row, np.int32), positions=np.arange(window.start, window.start + n,
                                                                                dtype=np.int32),
                    sessions=np.array([job.session_id], np.uint64), extras={"lengths": [n]} if n > 1 else {}))

    @staticmethod
    def _may_send_ahead(job: Job) -> bool:
        """A window in flight whose own drafts (or the last window ahead's) give a guess to build on;
        never for constrained requests (a guessed token could be one the constraint refuses)."""
        last_drafts = job.ahead[-1].row[1:] if job.ahead else job.drafts
        return (job.in_flight and not job.restoring and not job.cancelled and not job.done
                and job.proposer is not None and job.policy is not None and job.policy.k > 0
                and job.req.constraint is None and bool(last_drafts))

    def _draft_ahead(self, job: Job) -> Ahead | None:
        """The next window ahead: as if every window in flight were fully accepted, the guess of the
        last one's bonus token, then drafts; None when there is no room or no proposal."""
        assumed = job.drafts + [t for w in job.ahead for t in w.row]
        start = job.next_pos + 1 + len(assumed)
        produced = len(job.generated) + 1 + len(assumed)     # generated tokens once those are accepted
        room = min(job.req.max_tokens - produced, self.cfg.max_context - 1 - start)
        want = min(job.policy.k, self.cfg.speculative.max_draft, room - 1)
        buckets = [n for n in self.cfg.window_lens if n >= 1]
        widest = widest_window(1, tuple(buckets), self.cfg.batch_tokens)
        fits = max([n for n in buckets if n <= min(want + 1, widest)] or [1])
        if fits <= 1:
            return None
        row = propose_draft(job.proposer, self.shared, fits, assumed)
        return Ahead(0, start, row) if len(row) >= 2 else None

    def _draft(self, group: list[Job]) -> None:
        """Give each job in a DECODE its drafts (job.drafts), within what the batch can carry.

        Rows pad to a window bucket, so a window drafts up to a bucket minus one (1, 3, 7, 15) and
        a batch of several rows is held to `batch_tokens` padded tokens. Drafts never run past
        max_tokens or the context, so no draft position is wasted on a token that cannot be kept.
        """
        buckets = [n for n in self.cfg.window_lens if n >= 1]
        widest = widest_window(len(group), tuple(buckets), self.cfg.batch_tokens)
        for job in group:
            job.drafts = []
            if job.proposer is None or job.policy is None or job.policy.k <= 0:
                continue
            room = min(job.req.max_tokens - len(job.generated), self.cfg.max_context - 1 - job.next_pos)
            want = min(job.policy.k, self.cfg.speculative.max_draft, room - 1)
            fits = max([n for n in buckets if n <= min(want + 1, widest)] or [1])
            if fits <= 1:
                continue
            job.drafts = propose_draft(job.proposer, self.shared, fits - 1)
            if not job.drafts:
                job.policy.no_draft_proposal()

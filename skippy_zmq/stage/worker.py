"""StageWorker: messages in, messages out. No sockets here.

`handle(message) -> list[Outbound]`; each Outbound goes down the chain ("next"),
straight back to the driver ("driver") or, run on (stage/run_on.py), as the chain's next step:
to itself on a stage that is the whole chain ("own", `handle_own`), from the last stage to the
first on a longer one ("ring"). Every stage forwards the token ids with its activations so any
stage can key its prefix store.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable

import numpy as np
from loguru import logger

from skippy_zmq.protocol.fencing import UNSTAMPED, BadView, Fence
from skippy_zmq.kv.prefix_store import PrefixStore
from skippy_zmq.model.compile_behind import LOOP_COMPILES
from skippy_zmq.model.runner import SliceRunner
from skippy_zmq.ops.placement import rss_bytes
from skippy_zmq.sampling import Sampler, SamplingParams, check_top_logprobs
from skippy_zmq.stage.pooling import pool_chunk, pool_request
from skippy_zmq.stage.recorder import Recorder
from skippy_zmq.stage.restore import RestoreRoutes
from skippy_zmq.stage.rows import (RowsToRun, Ran, RuntimeLock, Scored, logprob_entry, narrow, parse_rows,
                                   prompt_logprobs, top_of_prompt)
from skippy_zmq.stage.sessions import LanesBusy, SessionTable
from skippy_zmq.stage.run_on import RunOn
from skippy_zmq.stage.types import DRIVER, NEXT, OWN, RING, Outbound, StageFault, StageInfo  # noqa: F401 (re-exported)
from skippy_zmq.protocol.wire import Kind, Message

class StageWorker:
    def __init__(self, info: StageInfo, runner: SliceRunner, sessions: SessionTable,
                 store: PrefixStore | None = None):
        self.info, self.runner, self.sessions = info, runner, sessions
        self.store = Recorder(store, info.stage_id) if store is not None else None
        self.lock = RuntimeLock()
        self.fence = Fence(info.stage_id, info.incarnation)
        self.run_on = RunOn(info.first, info.last, info.ring)   # steps the chain runs from its own samples
        self.meanwhile: Callable[[], Any] | None = None   # handle_own's: runs while its step computes
        self.deferred: list[Callable[[], Any]] = []   # run by the loop after the replies are sent
        self.handlers: dict[Kind, Callable[[Message], list[Outbound]]] = {
            Kind.PREFILL: self.on_prefill,
            Kind.DECODE: self.on_decode,
            Kind.CONFIGURE_GENERATION: self.on_configure,
            Kind.STOP: self.on_stop,
            Kind.TRIM_SESSION: self.on_trim,
            Kind.FORK_SESSION: self.on_fork,
        }
        restore = RestoreRoutes(self)
        self.handlers[Kind.TRY_RESTORE_PREFILL] = restore.on_try_restore_prefill
        self.handlers[Kind.TRY_RESTORE_PREFILL_DECODE] = restore.on_try_restore_prefill_decode
        self.counters: dict[str, int] = {"messages": 0, "errors": 0, "tokens": 0, "bytes_forwarded": 0,
                                         "forwarded": 0, "encode_send_us": 0, "run_on_dropped": 0}
        self.memory: dict[str, int] = {}   # weight / KV / predicted bytes and budget (stage/factory.py)
        self.warm_later: list[Callable[[], Any]] = []   # compiles the loop runs while idle, after READY
        self.kernels: dict[str, str] = runner.kernels()   # the native CPU kernels its steps use, for /metrics
        # Final stage: the model directory (tokenizer.json) and logits width the constraint engine
        # reads, set by stage/factory.py; its TokenizerInfo is built on the first constrained request.
        self.tokenizer_source: tuple[Any, int | None] | None = None
        self._constraint_info: Any = None

    def handle(self, msg: Message) -> list[Outbound]:
        try:
            return self._dispatch(msg)
        finally:
            self.note_sessions()

    def note_sessions(self) -> None:
        """Tell the runner whether a request holds a lane here: its compile_behind waits while one does."""
        if len(self.sessions):
            if self.runner.quiet.is_set():
                self.runner.quiet.clear()
                self.runner.pause_behind()   # its child stops now, not at the compile thread's tick
        else:
            self.runner.quiet.set()

    def handle_own(self, msg: Message, meanwhile: Callable[[], Any] | None = None) -> list[Outbound]:
        """A step run on (run_on.py): its own (OWN) or, on a ring's first stage, the last stage's
        (fenced as upstream work is), for its rows still pending; `meanwhile` runs while it computes."""
        step = self.run_on.admit(msg, lambda sid: self.sessions.get(sid) is not None)
        self.counters["run_on_dropped"] += step is None
        self.meanwhile = meanwhile
        try:
            dropped = [] if step is None else self._fenced(step)
            return dropped if dropped is not None else self._guarded(step, self.on_decode)
        finally:
            self.meanwhile = None
            self.note_sessions()

    def _dispatch(self, msg: Message) -> list[Outbound]:
        self.counters["messages"] += 1
        dropped = self._fenced(msg)
        if dropped is not None:
            return dropped
        self.run_on.forget(msg)
        return self._guarded(msg, self.handlers.get(msg.kind))

    def _fenced(self, msg: Message) -> list[Outbound] | None:
        """None when the fence lets `msg` through; else its answer (a bad_view error, or nothing)."""
        try:
            stale = self.fence.check(msg)
        except BadView as exc:
            return [self.error(msg.request_id, msg.session_id, str(exc), "bad_view")]
        if not stale:
            return None
        # meant for a dead predecessor or an older chain view: acting on it would corrupt KV
        # (an unstamped one, with security on, was not sent by the driver: say it louder)
        log = logger.warning if stale.startswith(UNSTAMPED) else logger.info
        log("stage {} dropped {} request {} session {}: {}", self.info.stage_id, msg.kind.name,
            msg.request_id, msg.session_id, stale)
        return []

    def _guarded(self, msg: Message, handler: Callable[[Message], list[Outbound]] | None) -> list[Outbound]:
        try:
            if handler is None:
                raise StageFault(f"stage {self.info.stage_id} does not accept {msg.kind.name} messages",
                                 "unsupported_kind")
            return handler(msg)
        except StageFault as fault:
            return [self.error(msg.request_id, msg.session_id, fault.reason, fault.code)]
        except Exception as exc:   # a peer must never be able to kill the stage: answer and carry on
            logger.exception("stage {} failed on {} (request {})", self.info.stage_id, msg.kind.name, msg.request_id)
            return [self.error(msg.request_id, msg.session_id, f"internal error: {exc}", "internal_error")]

    def error(self, request_id: int, session_id: int, reason: str, code: str) -> Outbound:
        self.counters["errors"] += 1
        logger.warning("stage {} request {} session {}: {} ({})", self.info.stage_id, request_id, session_id,
                       reason, code)
        reply = Message.error(request_id, session_id, f"stage {self.info.stage_id}: {reason}", code)
        reply.extras["incarnation"] = self.info.incarnation   # the driver heals a kv_gap once per incarnation
        return Outbound(DRIVER, reply)

    # ------------------------------------------------------------ helpers

    def _inputs(self, msg: Message, n: int) -> np.ndarray:
        """Token ids at the first stage, activations elsewhere (checked against n tokens)."""
        if self.info.first:
            return msg.tokens
        if msg.activation is None:
            raise StageFault("message carries no activations but this stage is not the first", "no_activation")
        if msg.activation.shape != (n, self.info.width):
            raise StageFault(f"activation shape {msg.activation.shape} does not match ({n}, {self.info.width})",
                             "bad_activation")
        return msg.activation

    def _acquire(self, session_id: int, request_id: int) -> Any:
        try:
            return self.sessions.acquire(session_id, request_id)
        except LanesBusy as exc:
            raise StageFault(str(exc), "lanes_busy") from exc

    def _align(self, session_id: int, request_id: int, position: int, n: int = 1) -> Any:
        """Acquire the session and make it end at `position` (auto-align: positions are absolute, so
        KV ahead of a row's start, such as a rejected draft's, is simply truncated).

        Everything is checked before a lane is taken, so a refused message holds none.
        """
        if position < 0 or position + n > self.runner.capacity:
            raise StageFault(f"positions [{position}, {position + n}) fall outside the KV capacity of "
                             f"{self.runner.capacity}", "bad_position")
        existing = self.sessions.get(session_id)
        length = existing.length if existing is not None else 0
        if length < position:
            raise StageFault(f"session {session_id} has KV up to position {length}, message starts at {position}",
                             "kv_gap")
        session = self._acquire(session_id, request_id)
        session.truncate(position)
        return session

    def _trace(self, msg: Message, compute_ms: float, rows: int, tokens: int) -> dict[str, Any]:
        trace = msg.extras.get("trace", [])
        trace = list(trace) if isinstance(trace, list) else []   # a peer's bad trace is dropped, not fatal
        # tokens: rows x positions run (a decode step: one each; cluster/drift.py compares only those)
        trace.append({"stage": self.info.stage_id, "compute_ms": round(compute_ms, 3), "rows": rows, "tokens": tokens,
                      **self.lock.times()})
        return {**msg.extras, "trace": trace}

    # ------------------------------------------------------------ handlers

    def constraint_info(self) -> Any:
        """The constraint engine's view of this model's tokenizer (built once, on first use)."""
        if self._constraint_info is None:
            if self.tokenizer_source is None:
                raise StageFault("this stage has no tokenizer to constrain output with", "bad_constraint")
            from skippy_zmq.text.constrain import tokenizer_info

            model_dir, vocab_size = self.tokenizer_source
            self._constraint_info = tokenizer_info(model_dir, vocab_size)
        return self._constraint_info

    def make_sampler(self, extras: dict[str, Any], prompt: list[int]) -> Sampler:
        """The final stage's sampler of a CONFIGURE_GENERATION (or fused restore): sampling params,
        choice index, `logprobs` (top alternatives to report with every token; absent or None: no
        logprobs) and, when `extras["constraint"]` holds a ConstraintSpec dict, its matcher."""
        try:
            params = SamplingParams.from_dict(extras.get("sampling", {}))
            choice = int(extras.get("choice", 0))
            logprobs = extras.get("logprobs")
            logprobs = None if logprobs is None else check_top_logprobs(logprobs)
        except (TypeError, ValueError) as exc:
            raise StageFault(f"bad sampling configuration: {exc}", "bad_sampling") from exc
        matcher = None
        if extras.get("constraint") is not None:
            from skippy_zmq.text.constrain import ConstraintError, ConstraintSpec, Matcher

            try:
                matcher = Matcher(ConstraintSpec.from_dict(extras["constraint"]), self.constraint_info())
            except ConstraintError as exc:
                raise StageFault(f"bad constraint: {exc}", "bad_constraint") from exc
        return Sampler(params, prompt, choice=choice, matcher=matcher, logprobs=logprobs)

    def on_configure(self, msg: Message) -> list[Outbound]:
        session = self._acquire(msg.session_id, msg.request_id)
        if self.info.last:
            session.set_sampler(self.make_sampler(msg.extras, msg.tokens.tolist()))
            return []
        return [Outbound(NEXT, msg)]

    def on_prefill(self, msg: Message) -> list[Outbound]:
        if msg.tokens.shape[0] == 0:
            raise StageFault("PREFILL carries no tokens", "empty")
        if len(msg.session_ids) != 1:   # wire validation refuses these too; an in-process peer gets this
            raise StageFault(f"PREFILL names {len(msg.session_ids)} sessions; a prefill carries one session's "
                             f"tokens", "bad_rows")
        return self.on_rows(msg, score=False)

    def on_decode(self, msg: Message) -> list[Outbound]:
        return self.on_rows(msg, score=True)

    def on_rows(self, msg: Message, score: bool) -> list[Outbound]:
        """The one path for rows of work: a prefill chunk (one row, no scores), batched decode (rows
        of one token) and verify windows (rows of k+1 tokens), all scored at every position.

        Each row is aligned to its start (truncating KV ahead of it), computed in one jitted call,
        and appended; the final stage samples every scored position with the row's own sampler
        and returns them to the driver, which alone decides what is accepted. A row refused in
        its session or failing in its sampling gets its own ERROR; the other rows go on.
        """
        batch = self._check_rows(msg, score)
        placed, refused = self._place(batch)
        if placed is None:
            return refused
        ran = self._run(placed)
        scored = self._score(placed, ran) if self.info.last else None
        return refused + self._reply(placed, ran, scored)

    def _check_rows(self, msg: Message, score: bool) -> RowsToRun:
        """Step 1: the rows and their inputs checked against the message and this stage's buckets;
        nothing is taken yet, so a refused message holds no lane."""
        rows = parse_rows(msg)
        if len(rows) > self.runner.buckets.decode_rows[-1]:
            raise StageFault(f"{len(rows)} rows exceed this stage's largest batch of "
                             f"{self.runner.buckets.decode_rows[-1]}", "too_many_rows")
        longest = max(row.length for row in rows)
        if score and longest > self.runner.buckets.window_lens[-1]:
            raise StageFault(f"a row of {longest} tokens exceeds this stage's largest window of "
                             f"{self.runner.buckets.window_lens[-1]}", "too_many_tokens")
        x = self._inputs(msg, int(msg.tokens.shape[0]))
        # echo: a prefill that asks for "prompt_logprobs" (N) is scored at the final stage too
        prompt_top = top_of_prompt(msg) if self.info.last and not score else None
        pool = pool_request(msg.extras) if self.info.last and not score else None   # an embedding's prompt
        return RowsToRun(msg, x, rows, score, prompt_top, pool=pool)

    def _place(self, batch: RowsToRun) -> tuple[RowsToRun | None, list[Outbound]]:
        """Step 2: every row aligned in its session's lane; a row refused there (kv_gap,
        lanes_busy, ...) answers its own ERROR and the batch goes on without it (None: no row left)."""
        keep, lanes, refused = [], [], []
        for row in batch.rows:
            try:
                lanes.append(self._align(row.session_id, batch.msg.request_id, row.start, row.length).lane)
                keep.append(row)
            except StageFault as fault:
                refused.append(self.error(batch.msg.request_id, row.session_id, fault.reason, fault.code))
        if not keep:
            return None, refused
        return replace(narrow(batch, keep), lanes=np.asarray(lanes, np.int32)), refused

    def _run(self, batch: RowsToRun) -> Ran:
        """Step 3: the slice over every placed row in one jitted call, then the rows' tokens
        appended to their sessions."""
        starts = np.array([row.start for row in batch.rows])
        lengths = np.array([row.length for row in batch.rows])
        last = self.info.last
        output = "logits" if last and (batch.score or batch.prompt_top is not None) else ("none" if last else "hidden")
        output = "normed" if batch.pool is not None else output
        t0 = time.perf_counter()
        if batch.score:
            result = self.lock.run(lambda: self.runner.step(batch.lanes, batch.x, starts, lengths, output,
                                                            self.meanwhile))
        else:   # a prefill: one row of any length, chunked by the runner
            result = self.lock.run(lambda: self.runner.prefill(int(batch.lanes[0]), batch.x, int(starts[0]),
                                                               output=output))
        compute_ms = 1000 * (time.perf_counter() - t0)
        self._append(batch)
        return Ran(result, self._trace(batch.msg, compute_ms, len(batch.rows), int(lengths.sum())))

    def _append(self, batch: RowsToRun) -> None:
        """The rows' token ids into their sessions (a recording prefill records after the reply)."""
        token_ids = batch.msg.tokens.tolist()
        for row in batch.rows:
            self.sessions.get(row.session_id).append(token_ids[row.offset:row.offset + row.length])
        self.counters["tokens"] += sum(row.length for row in batch.rows)
        if not batch.score and "record" in batch.msg.extras:
            self.record_later(self.sessions.get(batch.rows[0].session_id), str(batch.msg.extras["record"]))

    def _score(self, batch: RowsToRun, ran: Ran) -> Scored:
        """Step 4 (final stage): a prefill's prompt logprobs, or every row's positions sampled with
        the row's own sampler; whatever fails in one row (sampler, constraint, logprobs) ends that
        row's request alone."""
        if not batch.score:
            row = batch.rows[0]
            if batch.pool is not None:
                session = self.sessions.get(row.session_id)
                return Scored(pooled=pool_chunk(session, batch.pool[0], ran.result, row.start))
            if batch.prompt_top is None:
                return Scored()
            return Scored(prompt_logprobs=prompt_logprobs(self.sessions.get(row.session_id), ran.result,
                                                          row.start, batch.prompt_top))
        t0 = time.perf_counter()
        scored, token_ids = Scored(), batch.msg.tokens.tolist()
        for row in batch.rows:
            try:
                row_tokens, entries = self._sample_row(row.session_id, ran.result[row.offset:row.offset + row.length],
                                                       row.start, token_ids[row.offset:row.offset + row.length])
            except StageFault as fault:
                scored.errors.append(self.error(batch.msg.request_id, row.session_id, fault.reason, fault.code))
                continue
            except Exception as exc:
                scored.errors.append(self._row_failure(batch.msg.request_id, row.session_id, exc))
                continue
            scored.answered.append(row)
            scored.tokens.extend(row_tokens)
            scored.logprobs.extend(entries)
        scored.sample_ms = round(1000 * (time.perf_counter() - t0), 3)
        return scored

    def _reply(self, batch: RowsToRun, ran: Ran, scored: Scored | None) -> list[Outbound]:
        """Step 5: the activations down the chain, or the final stage's answer to the driver: a
        prefill's ACK, or the ERRORs of rows whose sampling failed and one PREDICTED_TOKENS of the rest."""
        msg = batch.msg
        if scored is None:
            return [Outbound(NEXT, replace(msg, activation=ran.result, extras=ran.extras))]
        trace = ran.extras["trace"]
        if batch.pool is not None and batch.pool[1]:   # an embedding's last chunk: its vector
            return [Outbound(DRIVER, Message.embedding(msg.request_id, msg.session_id, scored.pooled.vector(),
                                                       scored.pooled.count, {"trace": trace}))]
        if not batch.score:
            stats = {"prefilled": self.sessions.get(batch.rows[0].session_id).length, "trace": trace}
            if scored.prompt_logprobs is not None:
                stats["prompt_logprobs"] = scored.prompt_logprobs
            return [Outbound(DRIVER, Message.ack(msg.request_id, msg.session_id, stats))]
        trace[-1]["sample_ms"] = scored.sample_ms
        if not scored.answered:
            return scored.errors
        sessions = [row.session_id for row in scored.answered]
        reply, own = self.run_on.follow(msg, sessions, scored.tokens, [row.start for row in scored.answered])
        reply["trace"] = trace
        if any(entry is not None for entry in scored.logprobs):   # aligned with the tokens; None for rows without
            reply["logprobs"] = scored.logprobs
        return scored.errors + [Outbound(DRIVER, Message.predicted_tokens(
            msg.request_id, sessions, scored.tokens, reply, lengths=[row.length for row in scored.answered]))] + \
            ([Outbound(OWN if self.info.first else RING, own)] if own is not None else [])

    def _sampler(self, session_id: int) -> Sampler:
        """The row's sampler; a session never configured is refused, never sampled greedily."""
        session = self.sessions.get(session_id)
        if session.sampler is None:
            raise StageFault(f"session {session_id} has no sampler: no CONFIGURE_GENERATION reached this "
                             f"final stage before its rows", "not_configured")
        return session.sampler

    def _sample_row(self, session_id: int, logits: np.ndarray, start: int,
                    tokens: list[int]) -> tuple[list[int], list[Any]]:
        """One row's sampled tokens and logprob entries (None each without logprobs)."""
        sampler = self._sampler(session_id)
        if sampler.logprobs is None:
            return sampler.sample_window(logits, start, tokens), [None] * len(tokens)
        row_tokens, entries = sampler.sample_window_logprobs(logits, start, tokens)
        return row_tokens, [logprob_entry(entry) for entry in entries]

    def _row_failure(self, request_id: int, session_id: int, exc: Exception) -> Outbound:
        """The error reply of one row whose sampling raised: the constraint engine (a limit, a dead
        end) or anything else; the other rows of its message are unaffected."""
        from skippy_zmq.text.constrain import ConstraintError

        if isinstance(exc, ConstraintError):
            return self.error(request_id, session_id, f"constrained decoding failed: {exc}", "constraint_error")
        logger.opt(exception=exc).error("stage {} failed sampling session {} (request {})", self.info.stage_id,
                                        session_id, request_id)
        return self.error(request_id, session_id, f"internal error sampling this row: {exc}", "internal_error")

    def on_stop(self, msg: Message) -> list[Outbound]:
        for sid in msg.session_ids.tolist():
            session = self.sessions.get(sid)
            if session is not None and "record" in msg.extras:
                self.record(session, str(msg.extras["record"]))
            self.sessions.release(sid)
        return [] if self.info.last else [Outbound(NEXT, msg)]

    def on_fork(self, msg: Message) -> list[Outbound]:
        """n > 1 choices: each session in `sessions` gets a copy of session_id's KV (and token ids)
        at positions [0, position), so the prompt is prefilled once. A child that cannot get a
        lane answers its own ERROR; the others still fork."""
        parent = self.sessions.get(msg.session_id)
        length = int(msg.position)
        if parent is None or parent.length < length or length < 0:
            held = parent.length if parent is not None else 0
            raise StageFault(f"session {msg.session_id} has KV up to position {held}, a fork needs {length}",
                             "kv_gap")
        out: list[Outbound] = []
        tokens = parent.tokens[:length]
        for sid in msg.session_ids.tolist():
            if sid == msg.session_id:
                continue
            try:
                child = self._acquire(sid, msg.request_id)
            except StageFault as fault:
                out.append(self.error(msg.request_id, sid, fault.reason, fault.code))
                continue
            self.lock.run(lambda: self.runner.copy_lane(parent.lane, child.lane, length))
            child.reset(list(tokens))
        return out if self.info.last else out + [Outbound(NEXT, msg)]

    def on_trim(self, msg: Message) -> list[Outbound]:
        session = self.sessions.get(msg.session_id)
        if session is not None:
            session.truncate(msg.position)
        return [] if self.info.last else [Outbound(NEXT, msg)]

    def run_deferred(self) -> None:
        """Work that must not delay a reply (prefix recording); the loop calls this after sending."""
        work, self.deferred = self.deferred, []
        for fn in work:
            fn()

    def record_later(self, session: Any, namespace: str) -> None:
        """Record the session's KV once the replies of this message are sent."""
        self.deferred.append(lambda: self.record(session, namespace))

    def record(self, session: Any, namespace: str) -> None:
        """Copy the session's KV into the prefix store; only the device-side copy is on this thread."""
        if self.store is None or session.length < self.store.config.min_tokens:
            return
        length = session.length
        kv = self.lock.run(lambda: self.runner.read_kv_device(session.lane, length))
        self.store.submit(namespace, session.tokens[:length], kv, length)

    # ------------------------------------------------------------ what restore uses (restore.RestoreHost)

    def lookup_prefix(self, namespace: str, prefix: np.ndarray) -> Any:
        """The prefix store's entry for the longest stored prefix of `prefix`, or None (no store,
        or one that only records)."""
        if self.store is None or self.store.config.mode != "lookup-record":
            return None
        return self.store.lookup(namespace, prefix)

    def restore_session(self, session_id: int, request_id: int, entry: Any, prefix: np.ndarray) -> Any:
        """The session, acquired, holding the entry's KV at positions [0, entry.length) and its token ids."""
        session = self._acquire(session_id, request_id)
        self.lock.run(lambda: self.runner.write_kv(session.lane, entry.k, entry.v))
        session.reset([int(t) for t in prefix[:entry.length]])
        return session

    def restore_telemetry(self) -> dict[str, Any]:
        """Lock wait and hold of the last runtime use, and the prefix store's evictions so far."""
        return {**self.lock.times(), "evictions": self.store.stats()["evictions"] if self.store else 0}

    def status(self) -> dict[str, Any]:
        out = {"lanes_in_use": len(self.sessions), "lanes": self.sessions.lanes, **self.counters,
               "fenced": self.fence.dropped, "unstamped": self.fence.unstamped, **self.memory,
               "rss_bytes": rss_bytes(),
               "warmups_pending": len(self.warm_later), "compiling": self.runner.compiling,   # compile_behind's thread
               "cold_steps": self.runner.stats.cold_steps, "behind_waits": self.runner.stats.behind_waits,
               "behind_child": self.runner.stats.behind_child, "loop_compiles": LOOP_COMPILES.count,
               **{f"kernel_{k}": v for k, v in self.kernels.items()}}
        if getattr(self.runner, "moe_layers", 0):   # a mixture-of-experts slice: its routing counts
            out.update(moe_layer_passes=self.runner.stats.moe_layer_passes,
                       moe_experts_routed=self.runner.stats.moe_experts_routed)
        if self.store is not None:
            out.update({f"cache_{k}": v for k, v in self.store.stats().items()})
        if self.info.last:   # constrained decoding: time spent computing token masks, and how many
            seconds, count = self._constraint_info.mask_stats.snapshot() if self._constraint_info else (0.0, 0)
            out.update(constraint_mask_seconds=round(seconds, 6), constraint_masks=count)
        return out

"""PipelineEngine: the Engine that drives stage processes over ZeroMQ.

One thread owns the driver's sockets (PUSH to stage 0, ROUTER for replies)
and the Scheduler. Other threads talk to it through a command queue and a
wake-up pipe that sits in the same poller as the sockets, so the loop blocks
only when idle and never sleeps for synchronisation.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator

import zmq
from loguru import logger

from skippy_zmq.protocol import transport, wire
from skippy_zmq.engine.request import ChoiceControl, EngineError, GenRequest, TokenEvent
from skippy_zmq.engine.prefix_index import PrefixIndex
from skippy_zmq.engine.scheduler import Scheduler, SchedulerConfig
from skippy_zmq.protocol.fencing import ChainView
from skippy_zmq.protocol.security import security_for
from skippy_zmq.config.topology import Topology

REPLY_EXTRAS_BYTES = 4 * 1024 * 1024   # a reply's JSON extras (logprobs of every token of a batch)


@dataclass
class StageState:
    stage_id: str
    ready: bool = False
    incarnation: int = 0
    last_seen: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    route: bytes = b""   # the routing identity of its main DEALER (from its READY): driver heartbeats go there


class PipelineEngine:
    def __init__(self, topology: Topology, eos_ids: list[int], model_name: str = ""):
        self.topology = topology
        self.model_name = model_name or topology.model_path.name
        d = topology.driver
        self.max_context = d.max_context
        self.scheduler = Scheduler(SchedulerConfig(
            n_stages=len(topology.stages), micro_batches=d.micro_batches, max_sessions=d.max_sessions, max_queue=d.max_queue,
            prefill_chunk=d.prefill_chunk, max_context=d.max_context, reply_timeout_s=d.reply_timeout_s, run_on=d.run_on,
            request_timeout_s=d.request_timeout_s, resume_timeout_s=d.resume_timeout_s,
            speculative=d.speculative), frozenset(eos_ids),
            PrefixIndex([s.cache for s in topology.stages]))
        self.stages = {s.id: StageState(s.id) for s in topology.stages}
        self.security = security_for(topology, "driver")
        # Replies carry logprobs in their JSON extras (up to ~600 bytes per token with 20 alternatives).
        self.limits = wire.WireLimits(max_message_bytes=topology.wire.max_message_bytes,
                                      max_extras_bytes=REPLY_EXTRAS_BYTES)
        self.commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._ready = threading.Event()
        self.incarnation = int.from_bytes(os.urandom(4), "little")
        self.view = ChainView(self.incarnation, 0, {})   # stamped on every request (skippy_zmq/protocol/fencing.py)
        self.faults: list[dict[str, float]] = []   # time to detect / resume, per stage failure
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_reply_hooks: list[Callable[[str, wire.Message], None]] = []
        self.internal_errors = 0   # driver bugs the loop survived (logged with their traceback)
        self.wire_rejected = 0     # replies dropped: sent under another party's key, or naming another stage
        self.on_rejected_hooks: list[Callable[[str, str], None]] = []   # (claimed stage, why), per drop
        # A re-cut (engine/recut.py): admission waits (requests queue) until every new stage is READY;
        # `missing` is the 503 every request gets while no split of the workers left holds the model.
        self.recutting = False
        self.missing: str | None = None
        self.socks: transport.DriverSockets | None = None
        # the loop's own time (every pass, outside its poll): the driver's software per token, which
        # ops/speed.py's time model charges (`bench cluster` reads it; seconds, passes)
        self.loop_busy_s, self.loop_passes = 0.0, 0
        # What the scheduler hands a request's sink on this thread waits here until the pass has sent
        # the work it made (_step): delivering a token wakes the HTTP thread, whose detokenize and SSE
        # write then held the GIL while the next DECODE waited to leave (every token paid for both).
        self._outbox: list[tuple[Callable[[object], None], object]] = []

    # ------------------------------------------------------------ lifecycle

    def start(self) -> "PipelineEngine":
        self._thread = threading.Thread(target=self._run, name="pipeline", daemon=True)
        self._thread.start()
        return self

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    def is_ready(self) -> bool:
        return self._ready.is_set()

    def close(self) -> None:
        self._stop.set()
        self._wake()
        if self._thread:
            self._thread.join(timeout=5)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def call(self, fn: Callable[[], None]) -> None:
        """Run fn on the pipeline thread."""
        self.commands.put(fn)
        self._wake()

    # ------------------------------------------------------------ engine API

    def submit(self, req: GenRequest, sink: Callable[[object], None]) -> Callable[[], None]:
        """Queue a request; returns a cancel function. Raises EngineError when it cannot be taken."""
        if self.missing is not None:
            raise EngineError(self.missing, 503, "layers_missing")
        if not self.is_ready() and not self.recutting:
            raise EngineError(self.not_ready_reason(), 503, "not_ready")
        result: queue.Queue = queue.Queue(maxsize=1)

        def do_submit() -> None:
            try:
                result.put(self.scheduler.submit(req, self._after_sends(sink)))
            except EngineError as exc:
                result.put(exc)
            except Exception as exc:   # logged by _run_commands; the caller gets an answer now, not in 10 s
                result.put(EngineError(f"the driver could not take the request: {exc!r}", 500, "driver_error"))
                raise
        self.call(do_submit)
        try:
            outcome = result.get(timeout=10)
        except queue.Empty:
            raise EngineError("the pipeline thread did not answer", 503, "not_ready") from None
        if isinstance(outcome, EngineError):
            raise outcome
        return lambda choice=None: self.call(lambda: self.scheduler.cancel(outcome, choice))

    async def generate(self, req: GenRequest, control: ChoiceControl | None = None) -> AsyncIterator[TokenEvent]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        submitted = asyncio.ensure_future(asyncio.to_thread(
            self.submit, req, lambda item: loop.call_soon_threadsafe(events.put_nowait, item)))
        finished, ended = False, set()   # choices finished, or cancelled by their reader
        try:
            # Shielded: a client that leaves during admission still gets its request cancelled below.
            cancel = await asyncio.shield(submitted)
            if control is not None:
                control.bind(lambda choice: self._cancel_choice(cancel, choice, ended, events))
            while True:
                item = await events.get()
                if isinstance(item, EngineError):
                    finished = True
                    raise item
                if item is not None and item.finish_reason is not None:
                    ended.add(item.choice)
                finished = len(ended) >= req.n
                if item is not None:
                    yield item
                if finished:
                    return
        finally:
            if not finished:
                if submitted.done() and not submitted.cancelled() and submitted.exception() is None:
                    submitted.result()()
                elif not submitted.done():
                    submitted.add_done_callback(lambda f: f.exception() is None and f.result()())

    @staticmethod
    def _cancel_choice(cancel: Callable[..., None], choice: int, ended: set, events: asyncio.Queue) -> None:
        """One choice ended early (its reader saw a stop string): cancel its job, count it ended."""
        ended.add(choice)
        cancel(choice)
        events.put_nowait(None)   # wake the reader: this may have been the last open choice

    def generate_blocking(self, req: GenRequest) -> Iterator[TokenEvent]:
        events: queue.Queue = queue.Queue()
        cancel = self.submit(req, events.put)
        finished, open_choices = False, req.n
        try:
            while not finished:
                item = events.get()
                if isinstance(item, EngineError):
                    finished = True
                    raise item
                open_choices -= item.finish_reason is not None
                finished = open_choices == 0
                yield item
        finally:
            if not finished:
                cancel()

    def not_ready_reason(self) -> str:
        missing = [s.stage_id for s in self.stages.values() if not s.ready]
        return f"pipeline not ready: waiting for stage(s) {', '.join(missing)}" if missing else "pipeline not ready"

    # ------------------------------------------------------------ the loop

    def _run(self) -> None:
        d = self.topology.driver
        ctx = transport.context_for(self.security)
        try:
            socks = transport.open_driver_sockets(ctx, self.topology.first.connect, d.return_endpoint,
                                                  hwm=self.topology.wire.hwm,
                                                  max_message_bytes=self.topology.wire.max_message_bytes,
                                                  security=self.security, first_stage_id=self.topology.first.id)
        except Exception:   # said here, or the engine would only ever look "not ready"
            logger.exception("the driver could not open its sockets")
            raise
        self.socks = socks
        poller = zmq.Poller()
        poller.register(socks.router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while not self._stop.is_set():
                if time.monotonic() >= next_beat:
                    self._beat(socks.router)
                    next_beat = time.monotonic() + d.heartbeat_s
                try:
                    self._step(socks, poller)
                except Exception:   # a bug must not stop the loop: heartbeats and every later request need it
                    logger.exception("the driver's pipeline loop failed; failing {} running request(s)",
                                     len(self.scheduler.running) + len(self.scheduler.queue))
                    self.internal_errors += 1
                    self.scheduler.fail_all(EngineError("the driver's pipeline loop failed (see its log)", 500,
                                                        "driver_error"))
                    self._deliver()
                    time.sleep(0.05)   # a failure that repeats every pass must not spin
        finally:
            # whatever was accepted ends now, or its reader waits for tokens no loop will send
            self._run_commands()
            self.scheduler.fail_all(EngineError("the engine was closed", 503, "engine_closed"))
            self._deliver()
            socks.close()
            if ctx is not transport.context():
                ctx.term()

    def _step(self, socks: transport.DriverSockets, poller: zmq.Poller) -> None:
        """One pass: wait for replies or a wake-up, handle them and queued commands, send what is due."""
        busy = bool(self.scheduler.running or self.scheduler.queue)
        events = dict(poller.poll(50 if busy else 200))
        # Every reply that arrived before this moment is read below (the router was polled empty, or is
        # drained now): silence is judged up to here, not up to the liveness check, so a pass the driver
        # itself spent stalled (a command, another thread holding the GIL) is not counted as the stages'.
        heard_until = time.monotonic()
        t0 = time.perf_counter()
        if self._wake_r in events:
            self._drain_wake()
        if socks.router in events:
            self._drain_replies(socks.router)
        try:
            self._run_commands()
            self._check_liveness(heard_until)
            for msg in self.scheduler.tick():
                transport.send_message(socks.push, self.view.stamp(msg))
        finally:
            self._deliver()   # the next step is on its way: now the tokens may go out to their readers
        self.loop_busy_s += time.perf_counter() - t0
        self.loop_passes += 1

    def _after_sends(self, sink: Callable[[object], None]) -> Callable[[object], None]:
        """`sink` as the scheduler calls it: on this engine's thread an event is held in the outbox
        until the pass has sent what it made (`_deliver`); from any other thread it goes at once."""
        def deliver(item: object) -> None:
            if threading.current_thread() is self._thread:
                self._outbox.append((sink, item))
            else:
                sink(item)
        return deliver

    def _deliver(self) -> None:
        """Hand the pass's events to their sinks, in the order the scheduler made them."""
        outbox, self._outbox = self._outbox, []
        for sink, item in outbox:
            try:
                sink(item)
            except Exception:   # a reader's sink that fails concerns its own request only
                logger.exception("a request's event sink failed")
                self.internal_errors += 1

    def _beat(self, router: zmq.Socket) -> None:
        """Driver -> stage heartbeats, so a stage notices a dead driver and frees its lanes."""
        beat = wire.Message.heartbeat("driver", self.incarnation, {"state": "serving"})
        for state in self.stages.values():
            if state.ready:
                try:
                    transport.send_routed(router, state.route or state.stage_id.encode(), beat, flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass   # unroutable right now (peer gone); liveness is judged elsewhere

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _run_commands(self) -> None:
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:   # a failed submit or cancel concerns its own request only
                logger.exception("a driver command failed")
                self.internal_errors += 1

    def _drain_replies(self, router: zmq.Socket) -> None:
        for _ in range(10_000):
            try:
                identity, frames = transport.recv_routed(router, zmq.NOBLOCK)
            except zmq.Again:
                return
            stage_id = transport.stage_of(identity)
            if self.security is not None and transport.peer_name(frames) != stage_id:
                self._reject(stage_id, f"sent under the key of {transport.peer_name(frames)!r}")
                continue
            try:
                msg = wire.decode(frames, self.limits)
            except wire.WireError as exc:
                logger.warning("driver rejected a reply from {}: {} ({})", stage_id, exc.reason, exc.code)
                continue
            if msg.kind in (wire.Kind.READY, wire.Kind.HEARTBEAT) and msg.extras.get("stage_id", stage_id) != stage_id:
                self._reject(stage_id, f"a {msg.kind.name} naming stage {str(msg.extras['stage_id'])[:64]!r}")
                continue
            try:
                self._on_reply(stage_id, msg, identity)
            except Exception:   # one reply the driver mishandles ends its own request, not the loop
                logger.exception("the driver failed on a {} reply from {} (request {}, session {})", msg.kind.name,
                                 stage_id, msg.request_id, msg.session_id)
                self.internal_errors += 1
                self.scheduler.fail_sessions({msg.session_id, *msg.session_ids.tolist()},
                                             EngineError(f"the driver failed on a {msg.kind.name} reply from "
                                                         f"{stage_id} (see its log)", 500, "driver_error"))

    def _reject(self, claimed: str, why: str) -> None:
        """A message that claims to come from stage `claimed` but does not: drop, count, log (the
        first ones at WARNING: only a holder of one of the topology's keys gets this far)."""
        self.wire_rejected += 1
        log = logger.warning if self.wire_rejected <= 20 or self.wire_rejected.bit_count() == 1 else logger.debug
        log("driver dropped a message claiming to be from stage {!r}: {} ({} dropped so far)", claimed[:64], why,
            self.wire_rejected)
        for hook in self.on_rejected_hooks:
            hook(claimed, why)

    def _on_reply(self, stage_id: str, msg: wire.Message, identity: bytes = b"") -> None:
        state = self.stages.get(stage_id)
        if state is None:
            logger.warning("reply from unknown stage {!r} ignored", stage_id[:64])
            return
        state.last_seen = time.monotonic()
        if msg.kind == wire.Kind.READY and identity:
            state.route = identity   # READY leaves on the stage's main DEALER, the one that hears heartbeats
        if msg.kind in (wire.Kind.READY, wire.Kind.HEARTBEAT):
            self._on_presence(state, msg)
        else:
            self.scheduler.on_reply(stage_id, msg)
        for hook in self.on_reply_hooks:
            hook(stage_id, msg)

    def _on_presence(self, state: StageState, msg: wire.Message) -> None:
        incarnation = int(msg.extras.get("incarnation", 0))
        info = msg.extras.get("info", {})
        if msg.kind == wire.Kind.READY and state.ready and incarnation != state.incarnation:
            # A replacement announced itself before its predecessor was judged dead: that one is gone.
            self._mark_down(state, f"stage {state.stage_id} was replaced (incarnation {incarnation:08x})", 0.0)
        if msg.kind == wire.Kind.READY or (not state.ready and info.get("state") == "serving"
                                           and incarnation == state.incarnation):
            if not state.ready:
                restarted = state.incarnation not in (0, incarnation)
                logger.info("stage {} is ready (incarnation {:08x}{})", state.stage_id, incarnation,
                            ", a replacement" if restarted else "")
            state.ready, state.incarnation = True, incarnation
            self.view = self.view.with_stage(state.stage_id, incarnation)
        if info.get("state") == "stopping" and state.ready and incarnation == state.incarnation:
            self._mark_down(state, f"stage {state.stage_id} is shutting down", 0.0)
        if incarnation == state.incarnation:
            state.info = info
        self._update_ready()

    def _update_ready(self) -> None:
        if all(s.ready for s in self.stages.values()):
            if not self._ready.is_set():
                logger.info("all {} stages ready", len(self.stages))
            self._ready.set()
            self.recutting = False
            if self.scheduler.paused_since is not None:
                paused = self.scheduler.resume()
                if self.faults:
                    self.faults[-1]["resume_s"] = round(paused, 3)
        else:
            self._ready.clear()

    def _mark_down(self, state: StageState, reason: str, silent_s: float) -> None:
        """A stage is gone: pause running requests until a replacement says READY (or resume_timeout)."""
        state.ready = False
        logger.error("{}; pausing {} request(s) for up to {:g} s while it is replaced", reason,
                     len(self.scheduler.running), self.topology.driver.resume_timeout_s)
        self.faults.append({"stage": state.stage_id, "detect_s": round(silent_s, 3)})
        self.scheduler.pause(reason)

    def _check_liveness(self, heard_until: float) -> None:
        """Mark down each ready stage silent for over dead_after_s as of `heard_until` (the moment up to
        which every arrived message has been read)."""
        dead_after = self.topology.driver.dead_after_s
        for state in self.stages.values():
            if state.ready and heard_until - state.last_seen > dead_after:
                self._mark_down(state, f"stage {state.stage_id} is unreachable (no heartbeat for {dead_after:g} s)",
                                heard_until - state.last_seen)
        self._update_ready()

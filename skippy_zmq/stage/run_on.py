"""Run-on: the chain decodes its next step from its own sample, so a single stream's token no
longer waits for a round through the driver. A stage that is the whole chain (first and last) runs
that step itself; on a longer chain the last stage sends it straight to the first stage's PULL (the
ring: `Topology.ring`), which takes it only from the last stage's key and only for the sessions and
request id it expects.

The driver asks for it per DECODE (extras "run_on": k more steps at most, "until": the token ids
that end a row, its EOS set) and reserves the request ids r+1 .. r+k for the steps that follow.
After sampling step r, every row whose token is not in "until" goes on as step r+1 (its token at
the next position); the reply says which rows did ("run_on": {"next": r+1, "sessions": [...]})
so the driver keeps them in flight. Each step's tokens go to the driver as a plain step's would:
the driver still accepts, stops and streams every token, and draws are keyed by position, so
the tokens are those of driver-sent steps.

A step run on is only ever a guess of what the driver would send next: any message from
upstream that names a session (a STOP after a stop string, a cancel, a re-prefill, a new DECODE)
drops that session's pending step, and a step whose session is gone runs nothing. On a ring the
first stage keeps that book: a DECODE from the driver that asks to run on makes it expect request
r+1 for each of its sessions, and each step it admits, the next one; a step the driver has moved
past meanwhile (on the wire, or queued behind the driver's STOP) finds nothing pending and runs
nothing. A step that had already passed the first stage before that STOP reaches every later stage
before it too (the chain is one FIFO), and its reply is one the driver no longer waits for. A row the
driver has finished meanwhile only computed KV past its end, which the next row's start truncates.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import numpy as np

from skippy_zmq.config.topology import MAX_RUN_ON
from skippy_zmq.protocol.wire import Kind, Message


RING_KEY = "ring"   # extras of a step the last stage sent round to the first (how it is told apart without CURVE)


def _steps(msg: Message) -> int:
    """The steps a DECODE asks the chain to run on after it (0: none, or not a valid ask)."""
    steps = msg.extras.get("run_on")
    ok = msg.kind is Kind.DECODE and isinstance(steps, int) and not isinstance(steps, bool)
    return steps if ok and 0 < steps <= MAX_RUN_ON else 0


class RunOn:
    def __init__(self, first: bool, last: bool, ring: bool = False):
        self.first = first
        self.makes = last and (first or ring)     # samples, and makes each next step
        self.takes = first and (last or ring)     # runs each next step (its own, or the ring's)
        self.pending: dict[int, int] = {}        # session -> request id of its step run on next

    def forget(self, msg: Message) -> None:
        """An upstream message about these sessions: the driver has moved on, so must they. On a
        ring's first stage, a DECODE that asks to run on makes it expect the next step of each."""
        if self.pending:
            for sid in msg.session_ids.tolist():
                self.pending.pop(sid, None)
        if self.takes and not self.makes and _steps(msg):
            self._expect(msg.session_ids.tolist(), msg.request_id + 1)

    def _expect(self, sessions: list[int], request_id: int) -> None:
        for sid in sessions:
            self.pending[sid] = request_id

    def admit(self, msg: Message, held: Callable[[int], bool]) -> Message | None:
        """A step run on, narrowed to the rows still pending under its request id whose session is
        still `held` (a lane freed meanwhile, say by a lost driver, runs nothing); None if none is."""
        if not self.takes or msg.kind is not Kind.DECODE:
            return None
        ids = msg.session_ids.tolist()
        mine = {sid for sid in ids if self.pending.get(sid) == msg.request_id}
        for sid in mine:
            del self.pending[sid]
        keep = [i for i, sid in enumerate(ids) if sid in mine and held(sid)]
        if not keep:
            return None
        if not self.makes and _steps(msg):   # a ring: the step after this one comes round too
            self._expect([ids[i] for i in keep], msg.request_id + 1)
        if len(keep) == msg.session_ids.shape[0]:
            return msg
        sessions = msg.session_ids[keep]
        return replace(msg, session_id=int(sessions[0]), sessions=sessions, tokens=msg.tokens[keep],
                       positions=msg.positions[keep], position=int(msg.positions[keep[0]]))

    def follow(self, msg: Message, sessions: list[int], tokens: list[int],
               starts: list[int]) -> tuple[dict[str, Any], Message | None]:
        """After a DECODE's rows were sampled (one token each): the reply's "run_on" extra and the
        step to run next (None: no row goes on, or the message did not ask)."""
        steps = _steps(msg)
        if not self.makes or not steps or len(tokens) != len(sessions):
            return {}, None
        until = msg.extras.get("until", [])
        stop = set(until) if isinstance(until, list) else set()
        rows = [i for i, tok in enumerate(tokens) if tok not in stop]
        if not rows:
            return {}, None
        rid = msg.request_id + 1
        ids = [sessions[i] for i in rows]
        if self.first:
            self._expect(ids, rid)
        extras = {k: v for k, v in msg.extras.items() if k not in ("trace", "run_on", "lengths", RING_KEY)}
        if steps > 1:
            extras["run_on"] = steps - 1
        if not self.first:
            extras[RING_KEY] = True
        nxt = Message(Kind.DECODE, rid, ids[0], position=starts[rows[0]] + 1,
                      tokens=np.array([tokens[i] for i in rows], np.int32),
                      positions=np.array([starts[i] + 1 for i in rows], np.int32),
                      sessions=np.array(ids, np.uint64), extras=extras)
        return {"run_on": {"next": rid, "sessions": ids}}, nxt

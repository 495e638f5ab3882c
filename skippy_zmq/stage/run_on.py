"""Run-on: a stage that is the whole chain (first and last) decodes its next step from its own
sample, so a single stream's token no longer waits for a round through the driver.

The driver asks for it per DECODE (extras "run_on": k more steps at most, "until": the token ids
that end a row, its EOS set) and reserves the request ids r+1 .. r+k for the steps that follow.
After sampling step r, every row whose token is not in "until" goes on as step r+1 (its token at
the next position); the reply says which rows did ("run_on": {"next": r+1, "sessions": [...]})
so the driver keeps them in flight. Each step's tokens go to the driver as a plain step's would:
the driver still accepts, stops and streams every token, and draws are keyed by position, so
the tokens are those of driver-sent steps.

A step run on is only ever a guess of what the driver would send next: any message from
upstream that names a session (a STOP after a stop string, a cancel, a re-prefill, a new DECODE)
drops that session's pending step, and a step whose session is gone runs nothing. A row the
driver has finished meanwhile only computed KV past its end, which the next row's start truncates.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import numpy as np

from skippy_zmq.config.topology import MAX_RUN_ON
from skippy_zmq.protocol.wire import Kind, Message


class RunOn:
    def __init__(self, whole_chain: bool):
        self.whole_chain = whole_chain           # first and last: the only stage that may run on
        self.pending: dict[int, int] = {}        # session -> request id of its step run on next

    def forget(self, msg: Message) -> None:
        """An upstream message about these sessions: the driver has moved on, so must they."""
        if self.pending:
            for sid in msg.session_ids.tolist():
                self.pending.pop(sid, None)

    def admit(self, msg: Message, held: Callable[[int], bool]) -> Message | None:
        """A step run on, narrowed to the rows still pending under its request id whose session is
        still `held` (a lane freed meanwhile, say by a lost driver, runs nothing); None if none is."""
        ids = msg.session_ids.tolist()
        mine = {sid for sid in ids if self.pending.get(sid) == msg.request_id}
        for sid in mine:
            del self.pending[sid]
        keep = [i for i, sid in enumerate(ids) if sid in mine and held(sid)]
        if not keep:
            return None
        if len(keep) == msg.session_ids.shape[0]:
            return msg
        sessions = msg.session_ids[keep]
        return replace(msg, session_id=int(sessions[0]), sessions=sessions, tokens=msg.tokens[keep],
                       positions=msg.positions[keep], position=int(msg.positions[keep[0]]))

    def follow(self, msg: Message, sessions: list[int], tokens: list[int],
               starts: list[int]) -> tuple[dict[str, Any], Message | None]:
        """After a DECODE's rows were sampled (one token each): the reply's "run_on" extra and the
        step to run next (None: no row goes on, or the message did not ask)."""
        steps = msg.extras.get("run_on")
        if not self.whole_chain or msg.kind is not Kind.DECODE or not isinstance(steps, int) \
                or not 0 < steps <= MAX_RUN_ON or len(tokens) != len(sessions):
            return {}, None
        until = msg.extras.get("until", [])
        stop = set(until) if isinstance(until, list) else set()
        rows = [i for i, tok in enumerate(tokens) if tok not in stop]
        if not rows:
            return {}, None
        rid = msg.request_id + 1
        ids = [sessions[i] for i in rows]
        for sid in ids:
            self.pending[sid] = rid
        extras = {k: v for k, v in msg.extras.items() if k not in ("trace", "run_on", "lengths")}
        if steps > 1:
            extras["run_on"] = steps - 1
        nxt = Message(Kind.DECODE, rid, ids[0], position=starts[rows[0]] + 1,
                      tokens=np.array([tokens[i] for i in rows], np.int32),
                      positions=np.array([starts[i] + 1 for i in rows], np.int32),
                      sessions=np.array(ids, np.uint64), extras=extras)
        return {"run_on": {"next": rid, "sessions": ids}}, nxt

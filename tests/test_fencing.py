"""Incarnation fencing and kv_gap self-healing, in process on the tiny model.

A stage "dies" by being swapped for a fresh worker (new incarnation, no KV);
messages that were in flight to the dead one are then delivered to the
replacement, as ZeroMQ does when the endpoint is bound again.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TINY, random_ids
from pipeline_helpers import make_chain, make_scheduler, make_worker
from skippy_zmq.engine.request import EngineError, GenRequest, TokenEvent
from skippy_zmq.protocol.fencing import VIEW_KEY, ChainView, Fence
from skippy_zmq.engine.inproc import InprocChain
from skippy_zmq.protocol.wire import Kind, Message

CUTS = [1, 3]
BOUNDS = [0, *CUTS, TINY.n_layers]
PROMPT = tuple(random_ids(30, TINY.vocab_size, seed=5).tolist())


def view_of(chain: InprocChain) -> ChainView:
    view = ChainView(driver=7, epoch=0, stages={})
    for w in chain.workers:
        view = view.with_stage(w.info.stage_id, w.info.incarnation)
    return view


class Harness:
    """The driver loop in miniature: stamp, send, route replies."""

    def __init__(self, tree, **sched_kw):
        self.chain = make_chain(TINY, tree, CUTS)
        self.sched = make_scheduler(len(self.chain.workers), **sched_kw)
        self.view = view_of(self.chain)
        self.events: list = []
        self.sched.submit(GenRequest("r", PROMPT, max_tokens=24, ignore_eos=True), self.events.append)

    def deliver(self, messages: list[Message]) -> None:
        for msg in messages:
            for stage_id, reply in self.chain.send(msg):
                self.sched.on_reply(stage_id, reply)

    def step(self) -> list[Message]:
        out = [self.view.stamp(m) for m in self.sched.tick()]
        self.deliver(out)
        return out

    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if isinstance(e, TokenEvent)]

    def finished(self) -> bool:
        return bool(self.events) and (isinstance(self.events[-1], EngineError) or self.events[-1].finish_reason)

    def run_until(self, n_tokens: int) -> None:
        for _ in range(10_000):
            if self.finished() or len(self.tokens()) >= n_tokens:
                return
            self.step()
        raise RuntimeError("no progress")

    def replace(self, index: int):
        a, b = BOUNDS[index], BOUNDS[index + 1]
        fresh = make_worker(TINY, self.tree, a, b, stage_id=f"s{index}")
        self.chain.workers[index] = fresh
        return fresh


@pytest.fixture()
def harness(tiny_tree):
    def make(**kw):
        h = Harness(tiny_tree, **kw)
        h.tree = tiny_tree
        return h
    return make


@pytest.fixture(scope="module")
def clean(tiny_tree):
    h = Harness(tiny_tree)
    h.tree = tiny_tree
    h.run_until(10_000)
    assert len(h.tokens()) == 24
    return h.tokens()


# ---------------------------------------------------------------- the fence itself


def stamped(driver=1, epoch=0, **stages) -> Message:
    return ChainView(driver, epoch, stages).stamp(Message(Kind.STOP, 1, 1))


def test_fence_drops_requests_for_another_incarnation():
    fence = Fence("s1", incarnation=0xAB)
    assert fence.check(Message(Kind.STOP, 1, 1)) is None                 # unstamped: tools and tests
    assert fence.check(stamped(s0=5, s1=0xAB)) is None
    assert fence.check(stamped(s0=5)) is None                            # a view that does not name this stage
    reason = fence.check(stamped(s0=5, s1=0xAC))
    assert reason == "sent for incarnation 000000ac of s1, this is 000000ab" and fence.dropped == 1


def test_with_security_on_a_request_must_carry_a_stamp_naming_this_stage():
    fence = Fence("s1", incarnation=0xAB, required=True)
    assert fence.check(Message(Kind.STOP, 1, 1)) == ("unstamped request: carries no chain view stamp (required "
                                                    "when the wire is authenticated)")
    assert fence.check(stamped(s0=5)).startswith("unstamped request: its chain view stamp does not name s1")
    assert fence.check(stamped(s0=5, s1=0xAB)) is None
    assert (fence.unstamped, fence.dropped) == (2, 2)


def test_stage_drops_unstamped_work_silently_when_security_is_on(tiny_tree):
    worker = make_worker(TINY, tiny_tree, 0, 1, stage_id="s0")
    worker.fence.required = True   # what the stage loop sets when its links are CURVE
    bias = {"sampling": {"logit_bias": {"7": 100.0}}}
    assert worker.handle(Message(Kind.CONFIGURE_GENERATION, 4, 4, tokens=np.array([5], np.int32), extras=bias)) == []
    assert worker.handle(Message(Kind.PREFILL, 4, 4, tokens=np.array([5, 6], np.int32), extras={"record": "x"})) == []
    status = worker.status()
    assert (status["unstamped"], status["fenced"], status["errors"], status["lanes_in_use"]) == (2, 2, 0, 0)
    assert [o.to for o in worker.handle(stamped(s0=worker.info.incarnation))] == ["next"]   # the driver's work


def test_fence_drops_an_older_view_after_a_newer_one_per_driver():
    fence = Fence("s2", incarnation=3)
    assert fence.check(stamped(epoch=4, s2=3)) is None
    assert fence.check(stamped(epoch=3, s2=3)) == "chain view epoch 3 is older than epoch 4 already served"
    assert fence.check(stamped(driver=2, epoch=0, s2=3)) is None          # a new driver starts its own epochs
    assert fence.check(stamped(epoch=4, s2=3)) is None


def test_view_epoch_grows_only_when_an_incarnation_changes():
    view = ChainView(1, 0, {}).with_stage("s0", 10).with_stage("s1", 20)
    assert view.epoch == 2 and view.with_stage("s1", 20) is view
    assert view.with_stage("s1", 21).epoch == 3
    msg = view.stamp(Message(Kind.DECODE, 9, 9, extras={"trace": []}))
    assert msg.extras == {"trace": [], VIEW_KEY: {"driver": 1, "epoch": 2, "stages": {"s0": 10, "s1": 20}}}


def test_stage_answers_a_malformed_view_with_an_error_and_keeps_serving(tiny_tree):
    worker = make_worker(TINY, tiny_tree, 0, 1, stage_id="s0")
    out = worker.handle(Message(Kind.STOP, 4, 4, extras={VIEW_KEY: {"driver": "x"}}))
    assert [o.message.extras["code"] for o in out] == ["bad_view"]
    assert "malformed chain view stamp" in out[0].message.extras["error"]
    assert [o.to for o in worker.handle(stamped(s0=worker.info.incarnation))] == ["next"]   # still serving
    assert worker.status()["fenced"] == 0


# ---------------------------------------------------------------- replacement with the fence


@pytest.mark.parametrize("victim", [0, 1, 2], ids=["first", "middle", "last"])
def test_messages_in_flight_to_a_dead_stage_never_reach_its_replacement(harness, clean, victim):
    h = harness()
    h.run_until(6)
    in_flight = [h.view.stamp(m) for m in h.sched.tick()]       # sent, but the stage died before taking them
    assert any(m.kind == Kind.DECODE for m in in_flight)
    h.sched.pause("stage died")
    fresh = h.replace(victim)
    h.deliver(in_flight)                                         # ZeroMQ hands them to the replacement
    assert fresh.fence.dropped == len(in_flight) and len(fresh.sessions) == 0
    h.view = h.view.with_stage(fresh.info.stage_id, fresh.info.incarnation)
    h.sched.resume()
    h.run_until(10_000)
    assert h.tokens() == clean and h.sched.heals == 0


def test_without_the_fence_the_replacement_would_report_a_kv_gap(harness):
    h = harness()
    h.run_until(6)
    in_flight = list(h.sched.tick())                             # unstamped: the fence cannot tell
    fresh = h.replace(2)
    replies = h.chain.send(next(m for m in in_flight if m.kind == Kind.DECODE))
    assert [(sid, r.extras["code"]) for sid, r in replies] == [("s2", "kv_gap")]
    assert replies[0][1].extras["incarnation"] == fresh.info.incarnation


# ---------------------------------------------------------------- self-healing, the second line


@pytest.mark.parametrize("victim", [0, 2], ids=["first", "last"])
def test_a_kv_gap_re_prefills_the_session_instead_of_failing_it(harness, clean, victim):
    h = harness()
    h.run_until(8)
    h.chain.workers[victim].sessions.release_all()               # the stage lost the session's KV
    h.run_until(10_000)
    assert h.tokens() == clean and h.sched.heals == 1


def test_a_second_gap_at_the_same_incarnation_fails_the_request(harness):
    h = harness()
    h.run_until(8)
    h.chain.workers[1].sessions.release_all()
    h.run_until(12)
    assert h.sched.heals == 1 and not h.finished()
    h.chain.workers[1].sessions.release_all()
    h.run_until(10_000)
    assert isinstance(h.events[-1], EngineError) and h.events[-1].code == "kv_gap"

"""StageWorker without sockets: routing, alignment, lanes and error replies."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TINY, random_ids
from pipeline_helpers import make_chain, make_scheduler, make_worker
from skippy_zmq.protocol import wire
from skippy_zmq.engine.request import EngineError, GenRequest
from skippy_zmq.engine.inproc import run_requests, tokens_of
from skippy_zmq.sampling import SamplingParams
from skippy_zmq.stage.worker import DRIVER, NEXT
from skippy_zmq.protocol.wire import Kind, Message


def prefill(sid: int, ids: np.ndarray, pos: int = 0, rid: int = 1) -> Message:
    return Message(Kind.PREFILL, rid, sid, position=pos, tokens=np.asarray(ids, np.int32))


def decode(sids: list[int], toks: list[int], poss: list[int], rid: int = 2) -> Message:
    return Message(Kind.DECODE, rid, sids[0], position=poss[0], tokens=np.asarray(toks, np.int32),
                   positions=np.asarray(poss, np.int32), sessions=np.asarray(sids, np.uint64))


@pytest.fixture()
def first(tiny_tree):
    return make_worker(TINY, tiny_tree, 0, 2, lanes=2)


def test_first_stage_forwards_activations_with_tokens(first):
    ids = random_ids(10, TINY.vocab_size)
    [out] = first.handle(prefill(7, ids))
    assert out.to == NEXT and out.message.kind == Kind.PREFILL
    assert out.message.activation.shape == (10, TINY.d_model)
    np.testing.assert_array_equal(out.message.tokens, ids)
    assert out.message.extras["trace"][0]["stage"] == "s0"
    assert first.sessions.get(7).length == 10


def test_last_stage_acks_prefill_and_returns_tokens_directly(tiny_tree):
    chain = make_chain(TINY, tiny_tree, [2])
    ids = random_ids(10, TINY.vocab_size)
    assert chain.send(Message(Kind.CONFIGURE_GENERATION, 1, 1, tokens=ids.astype(np.int32))) == []
    [(stage, ack)] = chain.send(prefill(1, ids[:-1]))
    assert stage == "s1" and ack.kind == Kind.ACK and ack.extras["stats"]["prefilled"] == 9
    [(stage, reply)] = chain.send(decode([1], [int(ids[-1])], [9]))
    assert stage == "s1" and reply.kind == Kind.PREDICTED_TOKENS
    assert reply.session_ids.tolist() == [1] and reply.tokens.shape == (1,)
    assert [t["stage"] for t in reply.extras["trace"]] == ["s0", "s1"]


def test_lanes_busy_is_an_error_reply(first):
    first.handle(prefill(1, [5, 6]))
    first.handle(prefill(2, [5, 6]))
    [out] = first.handle(prefill(3, [5, 6]))
    assert out.to == DRIVER and out.message.kind == Kind.ERROR
    assert out.message.extras["code"] == "lanes_busy"
    assert "all 2 KV lanes are busy" in out.message.extras["error"]


def test_stop_frees_the_lane(first):
    first.handle(prefill(1, [5, 6]))
    first.handle(prefill(2, [5, 6]))
    first.handle(Message(Kind.STOP, 9, 1))
    [out] = first.handle(prefill(3, [5, 6]))
    assert out.to == NEXT


def test_a_held_lane_keeps_the_runner_from_compiling_behind(first):
    """While a request holds a lane the runner is not quiet: its compile_behind waits (runner.quiet)."""
    paused = []
    first.runner.pause_behind = lambda: paused.append(len(first.sessions))   # its child stopped at once
    assert first.runner.quiet.is_set()
    first.handle(prefill(1, [5, 6]))
    first.handle(prefill(2, [5, 6]))
    assert not first.runner.quiet.is_set() and paused == [1]   # on the change to busy only
    first.handle(Message(Kind.STOP, 9, 1))
    first.handle(Message(Kind.STOP, 9, 2))
    assert first.runner.quiet.is_set()


def test_idle_warmups_wait_while_a_request_holds_a_lane(first):
    """The loop's idle warm-ups (compiles of seconds) never run between a request's steps."""
    from skippy_zmq.stage.loop import idle_warmup

    done: list[int] = []
    first.warm_later = [lambda: done.append(1)]
    first.handle(prefill(1, [5, 6]))
    assert idle_warmup(first) is False and len(first.warm_later) == 1 and done == []
    first.handle(Message(Kind.STOP, 9, 1))
    assert idle_warmup(first) is True and first.warm_later == [] and done == [1]
    assert idle_warmup(first) is False


def test_status_counts_the_steps_that_compiled_on_the_spot(first):
    """Nothing warmed this runner: its first prefill compiles (a cold step), a second of that shape
    does not; heartbeats carry the count to /metrics (skippy_stage_cold_steps)."""
    from skippy_zmq.engine.pipeline_metrics import STAGE_COUNTERS

    assert first.status()["cold_steps"] == 0
    first.handle(prefill(1, [5, 6]))
    first.handle(prefill(2, [7, 8]))
    assert first.status()["cold_steps"] == 1 and first.status()["behind_waits"] == 0
    assert first.status()["behind_child"] == 0     # nothing compiled behind: no child process ran
    assert {"cold_steps", "behind_waits", "behind_child"} <= set(STAGE_COUNTERS)


def test_auto_align_trims_kv_that_is_ahead_and_gaps_are_refused(first):
    first.handle(prefill(1, random_ids(20, TINY.vocab_size)))
    [out] = first.handle(prefill(1, [4, 5, 6], pos=10))        # rewrite from 10: trims 20 -> 10 first
    assert out.to == NEXT and first.sessions.get(1).length == 13
    [err] = first.handle(prefill(1, [4], pos=30))
    assert err.message.extras["code"] == "kv_gap" and "KV up to position 13" in err.message.extras["error"]


def test_decode_rows_with_one_bad_row_still_serve_the_rest(first):
    first.handle(prefill(1, [5, 6, 7]))
    outs = first.handle(decode([1, 2], [8, 9], [3, 5]))        # session 2 is new: position 5 is a gap
    errors = [o for o in outs if o.to == DRIVER]
    forwarded = [o for o in outs if o.to == NEXT]
    assert len(errors) == 1 and errors[0].message.session_id == 2
    assert forwarded[0].message.session_ids.tolist() == [1]
    assert forwarded[0].message.activation.shape == (1, TINY.d_model)


def test_middle_stage_without_activation_and_unknown_kind(tiny_tree):
    middle = make_worker(TINY, tiny_tree, 1, 3)
    [out] = middle.handle(prefill(1, [5, 6]))
    assert out.message.extras["code"] == "no_activation"
    [out] = middle.handle(Message(Kind.HEARTBEAT))
    assert out.message.extras["code"] == "unsupported_kind"


def test_scheduler_over_inproc_chain_matches_single_stage(tiny_tree):
    prompts = [random_ids(n, TINY.vocab_size, seed=n).tolist() for n in (5, 30, 70, 12, 41)]

    def run(cuts, **kw):
        reqs = [GenRequest(f"r{i}", tuple(p), max_tokens=12, ignore_eos=True) for i, p in enumerate(prompts)]
        events = run_requests(make_scheduler(len(cuts) + 1, **kw), make_chain(TINY, tiny_tree, cuts), reqs)
        return {rid: tokens_of(ev) for rid, ev in events.items()}

    one = run([], max_sessions=1)
    assert all(len(t) == 12 for t in one.values())
    assert run([2]) == one
    assert run([1, 3]) == one


def test_scheduler_sampling_with_seed_is_reproducible(tiny_tree):
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=42)
    req = GenRequest("a", tuple(random_ids(9, TINY.vocab_size).tolist()), params, max_tokens=10, ignore_eos=True)
    got = [tokens_of(run_requests(make_scheduler(2), make_chain(TINY, tiny_tree, [2]), [req])["a"]) for _ in range(2)]
    assert got[0] == got[1] and len(got[0]) == 10


def test_scheduler_rejects_overfull_queue_and_long_prompts():
    sched = make_scheduler(2, max_queue=1, max_sessions=1)
    sched.submit(GenRequest("a", (1, 2, 3)), lambda e: None)
    sched.tick()                                                  # a runs
    sched.submit(GenRequest("a2", (1, 2, 3)), lambda e: None)     # a2 waits
    with pytest.raises(EngineError) as exc:
        sched.submit(GenRequest("b", (1, 2, 3)), lambda e: None)
    assert exc.value.status == 429 and exc.value.retry_after
    with pytest.raises(EngineError) as exc:
        make_scheduler(2).submit(GenRequest("c", tuple(range(300))), lambda e: None)
    assert exc.value.status == 400 and "exceeds the context of 256" in exc.value.message


def test_scheduler_times_out_a_silent_pipeline():
    sched = make_scheduler(2, reply_timeout_s=1.0)
    got = []
    sched.submit(GenRequest("a", (1, 2, 3), max_tokens=4), got.append)
    sent = sched.tick(now=100.0)
    assert [m.kind for m in sent] == [Kind.CONFIGURE_GENERATION, Kind.PREFILL, Kind.DECODE]
    out = sched.tick(now=102.0)   # nobody answered
    assert isinstance(got[-1], EngineError) and got[-1].status == 504
    assert [m.kind for m in out] == [Kind.STOP]


def test_each_prompt_is_prefilled_once_and_each_token_decoded_once(tiny_tree):
    sched, chain = make_scheduler(2), make_chain(TINY, tiny_tree, [2])
    sent = []
    send = chain.send

    def counting_send(message):
        sent.append(message.kind)
        return send(message)

    chain.send = counting_send
    prompt = random_ids(150, TINY.vocab_size, seed=9).tolist()     # 149 prefill tokens: 3 chunks of <= 64
    events = run_requests(sched, chain, [GenRequest("a", tuple(prompt), max_tokens=10, ignore_eos=True)])
    assert len(tokens_of(events["a"])) == 10
    assert sent.count(Kind.PREFILL) == 3
    assert sent.count(Kind.DECODE) == 10
    assert sent.count(Kind.CONFIGURE_GENERATION) == 1 and sent.count(Kind.STOP) == 1

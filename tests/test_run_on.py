"""Run-on: the chain decodes its next steps from its own samples (stage/run_on.py), so a stream's
token does not wait for a driver round: a 1-stage chain runs them itself, a longer one sends each
from its last stage to its first (the ring). The tokens, logprobs and finish reasons are those of
driver-sent steps; the driver still accepts and stops every token; no stage computes a step the
driver would not have sent; anything the driver says about a session ends its run."""

from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import TINY, random_ids
from pipeline_helpers import make_chain, make_scheduler, make_worker
from skippy_zmq.config.speculative import SpeculativeConfig
from skippy_zmq.config.topology_yaml import parse_topology
from skippy_zmq.engine.inproc import run_requests, tokens_of
from skippy_zmq.engine.job import JobStatus
from skippy_zmq.engine.request import GenRequest, TokenEvent
from skippy_zmq.protocol.wire import Kind, Message
from skippy_zmq.sampling import SamplingParams
from skippy_zmq.stage.worker import DRIVER, OWN


def run(tree, reqs, run_on, eos=frozenset({2}), cuts=(), ring=False, **kw):
    """Every request's events, the DECODE messages the driver sent, and the tokens the stages ran."""
    chain = make_chain(TINY, tree, list(cuts), ring=ring)
    sent, send = [], chain.send
    chain.send = lambda m: (sent.append(m), send(m))[1]
    events = run_requests(make_scheduler(len(cuts) + 1, eos, run_on=run_on, **kw), chain, reqs)
    decodes = [m for m in sent if m.kind == Kind.DECODE]
    return events, decodes, [w.counters["tokens"] for w in chain.workers]


def summary(events):
    return {rid: [(e.token_id, e.finish_reason, e.logprob, e.top_logprobs) if isinstance(e, TokenEvent) else repr(e)
                  for e in ev] for rid, ev in events.items()}


def test_one_stream_runs_on_in_steps_of_the_budget_and_gives_the_same_tokens(tiny_tree):
    req = GenRequest("a", tuple(random_ids(9, TINY.vocab_size, seed=3).tolist()), max_tokens=20, ignore_eos=True,
                     logprobs=2)
    plain, plain_decodes, plain_ran = run(tiny_tree, [req], run_on=0)
    ran_on, decodes, ran = run(tiny_tree, [req], run_on=8)
    assert len(tokens_of(plain["a"])) == 20 and summary(ran_on) == summary(plain)
    assert len(plain_decodes) == 20
    # 1 + 8 tokens, 1 + 8, then 1 + 1: never a step past max_tokens
    assert [m.extras.get("run_on") for m in decodes] == [8, 8, 1]
    assert ran == plain_ran   # the stage computed exactly the steps the driver would have sent


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=7),
                                    SamplingParams(temperature=1.0, repetition_penalty=1.3, seed=11)])
def test_streams_of_any_length_and_sampling_match_the_driver_round_each_step(tiny_tree, params):
    prompts = [random_ids(n, TINY.vocab_size, seed=n).tolist() for n in (5, 30, 70, 12)]
    reqs = [GenRequest(f"r{i}", tuple(p), params, max_tokens=m, ignore_eos=True)
            for i, (p, m) in enumerate(zip(prompts, (1, 2, 13, 30)))]
    plain, _, plain_ran = run(tiny_tree, reqs, run_on=0)
    ran_on, decodes, ran = run(tiny_tree, reqs, run_on=8)
    assert summary(ran_on) == summary(plain) and ran == plain_ran
    assert [len(tokens_of(plain[r.request_id])) for r in reqs] == [1, 2, 13, 30]
    assert any(len(m.session_ids) > 1 and m.extras.get("run_on") for m in decodes)   # several rows run on together


def test_eos_ends_the_run_at_the_stage(tiny_tree):
    req = GenRequest("a", tuple(random_ids(11, TINY.vocab_size, seed=5).tolist()), max_tokens=30, ignore_eos=True)
    free = tokens_of(run(tiny_tree, [req], run_on=0)[0]["a"])
    eos = frozenset({free[4]})   # the fifth token ends it: inside the first run of 8
    stop = GenRequest("a", req.prompt_ids, max_tokens=30)
    plain, _, plain_ran = run(tiny_tree, [stop], run_on=0, eos=eos)
    ran_on, decodes, ran = run(tiny_tree, [stop], run_on=8, eos=eos)
    assert summary(ran_on) == summary(plain) and plain["a"][-1].finish_reason == "stop"
    assert tokens_of(ran_on["a"])[-1] in eos and len(tokens_of(ran_on["a"])) <= 5
    assert ran == plain_ran and len(decodes) == 1 and decodes[0].extras["until"] == sorted(eos)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_drafting_stream_runs_on_as_long_as_it_went_without_drafts(tiny_tree, method):
    looped = (random_ids(6, TINY.vocab_size, seed=3).tolist() * 4)[:21]
    reqs = [GenRequest("a", tuple(looped), max_tokens=60, ignore_eos=True),
            GenRequest("b", tuple(random_ids(9, TINY.vocab_size, seed=9).tolist()), max_tokens=60, ignore_eos=True)]
    spec = SpeculativeConfig(method=method, max_draft=8, min_match=1, shared=False)
    plain = run(tiny_tree, reqs, run_on=0)[0]
    for one in (reqs[:1], reqs[1:], reqs):
        events, decodes, _ = run(tiny_tree, one, run_on=8, speculative=spec)
        assert {r: tokens_of(e) for r, e in events.items()} == {r.request_id: tokens_of(plain[r.request_id]) for r in one}
        assert not any("run_on" in m.extras and "lengths" in m.extras for m in decodes)   # never a window run on
        if one == reqs[1:]:   # a plain step, then a run as long as the plain steps so far (1), then windows
            assert [m.extras.get("run_on") for m in decodes[:2]] == [None, 1] and "lengths" in decodes[2].extras


@pytest.mark.parametrize("cuts", [(2,), (1, 3)])
def test_a_ring_runs_on_over_two_and_three_stages(tiny_tree, cuts):
    req = GenRequest("a", tuple(random_ids(9, TINY.vocab_size, seed=3).tolist()), max_tokens=20, ignore_eos=True,
                     logprobs=2)
    plain, plain_decodes, plain_ran = run(tiny_tree, [req], run_on=0, cuts=cuts)
    ran_on, decodes, ran = run(tiny_tree, [req], run_on=8, cuts=cuts, ring=True)
    assert len(plain_decodes) == 20 and summary(ran_on) == summary(plain)
    assert [m.extras.get("run_on") for m in decodes] == [8, 8, 1]
    assert ran == plain_ran   # every stage computed exactly the steps the driver would have sent


def test_a_ring_matches_the_driver_round_while_streams_join_and_end(tiny_tree):
    """Four streams on two stages: two micro-batches (no run) until one stream is left, which runs on."""
    prompts = [random_ids(n, TINY.vocab_size, seed=n).tolist() for n in (5, 30, 70, 12)]
    reqs = [GenRequest(f"r{i}", tuple(p), SamplingParams(temperature=0.8, top_p=0.9, seed=7), max_tokens=m,
                       ignore_eos=True) for i, (p, m) in enumerate(zip(prompts, (1, 2, 13, 30)))]
    plain, _, plain_ran = run(tiny_tree, reqs, run_on=0, cuts=(2,))
    ran_on, decodes, ran = run(tiny_tree, reqs, run_on=8, cuts=(2,), ring=True)
    assert summary(ran_on) == summary(plain) and ran == plain_ran
    assert any(m.extras.get("run_on") for m in decodes) and len(decodes) < sum(r.max_tokens for r in reqs) - 8


def test_a_chain_without_the_ring_runs_no_step_on(tiny_tree):
    """The driver asks, but a last stage that is not on a ring (run_on 0 in its topology, or an
    older stage) makes no step: the reply says nothing runs on, and the driver sends every step."""
    req = GenRequest("a", tuple(random_ids(9, TINY.vocab_size, seed=3).tolist()), max_tokens=6, ignore_eos=True)
    plain = run(tiny_tree, [req], run_on=0, cuts=(2,))[0]
    ran_on, decodes, _ = run(tiny_tree, [req], run_on=8, cuts=(2,))
    assert summary(ran_on) == summary(plain) and len(decodes) == 6 and decodes[0].extras["run_on"] == 5


def whole(tree):
    return make_worker(TINY, tree, 0, TINY.n_layers, lanes=2)


def configure_and_prefill(worker, sid, ids):
    worker.handle(Message(Kind.CONFIGURE_GENERATION, 1, sid, tokens=np.asarray(ids, np.int32)))
    worker.handle(Message(Kind.PREFILL, 2, sid, position=0, tokens=np.asarray(ids[:-1], np.int32)))


def decode(sid, tok, pos, rid, **extras):
    return Message(Kind.DECODE, rid, sid, position=pos, tokens=np.asarray([tok], np.int32),
                   positions=np.asarray([pos], np.int32), sessions=np.asarray([sid], np.uint64), extras=extras)


def test_the_stage_runs_its_own_sample_at_the_next_position_and_says_so(tiny_tree):
    worker, ids = whole(tiny_tree), random_ids(8, TINY.vocab_size, seed=1).tolist()
    configure_and_prefill(worker, 5, ids)
    reply, own = worker.handle(decode(5, ids[-1], 7, rid=10, run_on=2, until=[]))
    assert (reply.to, own.to) == (DRIVER, OWN)
    tok = int(reply.message.tokens[0])
    assert reply.message.extras["run_on"] == {"next": 11, "sessions": [5]}
    step = own.message
    assert (step.kind, step.request_id, step.tokens.tolist(), step.positions.tolist()) == (Kind.DECODE, 11, [tok], [8])
    assert step.extras["run_on"] == 1 and "trace" not in step.extras
    reply2, own2 = worker.handle_own(step)
    assert reply2.message.request_id == 11 and own2.message.request_id == 12 and "run_on" not in own2.message.extras
    (last,) = worker.handle_own(own2.message)   # the last step asked for: no further one
    assert last.to == DRIVER and "run_on" not in last.message.extras
    assert worker.sessions.get(5).length == 10


@pytest.mark.parametrize("said", ["stop", "decode", "configure"])
def test_anything_the_driver_says_about_a_session_drops_its_pending_step(tiny_tree, said):
    worker, ids = whole(tiny_tree), random_ids(8, TINY.vocab_size, seed=2).tolist()
    configure_and_prefill(worker, 5, ids)
    configure_and_prefill(worker, 6, ids)
    both = Message(Kind.DECODE, 10, 5, position=7, tokens=np.asarray([ids[-1]] * 2, np.int32),
                   positions=np.asarray([7, 7], np.int32), sessions=np.asarray([5, 6], np.uint64),
                   extras={"run_on": 4, "until": []})
    _reply, own = worker.handle(both)
    assert own.message.session_ids.tolist() == [5, 6]
    if said == "stop":
        worker.handle(Message(Kind.STOP, 20, 5))
    elif said == "decode":
        worker.handle(decode(5, ids[-1], 7, rid=20))
    else:
        worker.handle(Message(Kind.CONFIGURE_GENERATION, 20, 5, tokens=np.asarray(ids, np.int32)))
    reply, nxt = worker.handle_own(own.message)
    assert reply.message.session_ids.tolist() == [6] and nxt.message.session_ids.tolist() == [6]
    worker.handle(Message(Kind.STOP, 21, 6))
    assert worker.handle_own(nxt.message) == []   # no row left: nothing runs, nothing answers


@pytest.mark.parametrize("ring", [False, True])
def test_a_longer_chain_runs_on_only_on_a_ring(tiny_tree, ring):
    chain = make_chain(TINY, tiny_tree, [2], ring=ring)
    ids = random_ids(8, TINY.vocab_size, seed=2).tolist()
    chain.send(Message(Kind.CONFIGURE_GENERATION, 1, 5, tokens=np.asarray(ids, np.int32)))
    chain.send(Message(Kind.PREFILL, 2, 5, position=0, tokens=np.asarray(ids[:-1], np.int32)))
    replies = chain.send(decode(5, ids[-1], 7, rid=10, run_on=4, until=[]))
    assert all(m.kind is Kind.PREDICTED_TOKENS and stage == "s1" for stage, m in replies)
    if not ring:
        assert len(replies) == 1 and "run_on" not in replies[0][1].extras
        return
    # the last stage sent each step round to the first: 4 more steps, each announced but the last
    assert [m.request_id for _, m in replies] == [10, 11, 12, 13, 14]
    assert [m.extras.get("run_on") for _, m in replies] == [{"next": r, "sessions": [5]} for r in (11, 12, 13, 14)] + [None]
    assert [w.sessions.get(5).length for w in chain.workers] == [12, 12]


def ring_first(tiny_tree):
    """A ring's first stage (layers 0-2 of 4) with session 5 prefilled, and a step as its last stage sends it."""
    worker, ids = make_worker(TINY, tiny_tree, 0, 2, lanes=2, ring=True), random_ids(8, TINY.vocab_size, seed=6).tolist()
    configure_and_prefill(worker, 5, ids)
    return worker, ids


def test_a_rings_first_stage_runs_only_the_steps_it_expects(tiny_tree):
    worker, ids = ring_first(tiny_tree)

    def step(rid, steps=1, kind=Kind.DECODE, sid=5, pos=None):
        m = decode(sid, 9, 8 + rid - 11 if pos is None else pos, rid, run_on=steps, until=[], ring=True)
        return m if kind is Kind.DECODE else Message(kind, rid, sid, tokens=m.tokens, extras=m.extras)

    assert worker.handle_own(step(11)) == []   # nothing asked yet: a ring step runs nothing
    (fwd,) = worker.handle(decode(5, ids[-1], 7, rid=10, run_on=3, until=[]))   # the driver asks for 3 more
    assert fwd.to == "next" and fwd.message.extras["run_on"] == 3
    assert worker.handle_own(step(12)) == [] and worker.handle_own(step(11, kind=Kind.PREFILL)) == []
    assert worker.handle_own(step(11, sid=6)) == []   # a session it was not asked about
    (ran,) = worker.handle_own(step(11, steps=2))
    assert ran.to == "next" and ran.message.request_id == 11 and ran.message.positions.tolist() == [8]
    assert worker.handle_own(step(11, steps=2)) == []   # each step once
    worker.handle(Message(Kind.STOP, 20, 5, sessions=np.asarray([5], np.uint64)))   # the driver moved on
    assert worker.handle_own(step(12)) == [] and worker.counters["tokens"] == 7 + 1 + 1


def test_the_driver_keeps_in_flight_only_the_runs_it_asked_for():
    sched = make_scheduler(1, run_on=0)
    sched.submit(GenRequest("a", (1, 2, 3), max_tokens=8), lambda e: None)
    out = sched.tick(now=100.0)
    dec = [m for m in out if m.kind == Kind.DECODE][0]
    assert "run_on" not in dec.extras
    sid = int(dec.session_ids[0])
    forged = Message.predicted_tokens(dec.request_id, [sid], [7], {"run_on": {"next": dec.request_id + 1,
                                                                               "sessions": [sid]}})
    sched.on_reply("s0", forged)
    assert sched.running[sid].status is JobStatus.READY and dec.request_id + 1 not in sched.awaiting.rows
    again = [m for m in sched.tick(now=100.1) if m.kind == Kind.DECODE]
    assert again and again[0].tokens.tolist() == [7]


def test_the_driver_follows_a_run_it_asked_for_and_refuses_a_wrong_next_id():
    sched = make_scheduler(1, run_on=4)
    sched.submit(GenRequest("a", (1, 2, 3), max_tokens=8), lambda e: None)
    dec = [m for m in sched.tick(now=100.0) if m.kind == Kind.DECODE][0]
    sid, rid = int(dec.session_ids[0]), dec.request_id
    assert dec.extras["run_on"] == 4 and dec.extras["until"] == [2]
    sched.on_reply("s0", Message.predicted_tokens(rid, [sid], [7], {"run_on": {"next": rid + 1, "sessions": [sid]}}))
    assert sched.running[sid].status is JobStatus.DECODING and sched.awaiting.rows[rid + 1].run_on == 3
    assert not [m for m in sched.tick(now=100.1) if m.kind == Kind.DECODE]   # the stage decodes it
    sched.on_reply("s0", Message.predicted_tokens(rid + 1, [sid], [8], {"run_on": {"next": rid + 5, "sessions": [sid]}}))
    assert sched.running[sid].status is JobStatus.READY and sched.running[sid].generated == [7, 8]
    assert [m.tokens.tolist() for m in sched.tick(now=100.2) if m.kind == Kind.DECODE] == [[8]]


def test_run_on_is_a_driver_setting_with_bounds(tmp_path):
    base = {"model": "m", "n_layers": 4, "stages": [{"id": "s0", "layers": [0, 4], "listen": "tcp://127.0.0.1:5601"}]}
    assert parse_topology(base).driver.run_on == 8
    assert parse_topology({**base, "driver": {"run_on": 0}}).driver.run_on == 0
    with pytest.raises(Exception, match="run_on.*at most 64"):
        parse_topology({**base, "driver": {"run_on": 65}})


def test_a_last_stage_without_a_connection_to_the_first_asks_the_driver_for_each_step():
    """StageLoop.ring_first over a real PUSH (immediate): with no first stage to take it, the step
    is dropped and the reply no longer says it runs on (the driver sends the next step); once the
    first stage is there, the step goes first and the reply says so."""
    from types import SimpleNamespace

    import zmq

    from procs import free_endpoint
    from skippy_zmq.protocol import transport
    from skippy_zmq.stage.loop import StageLoop
    from skippy_zmq.stage.types import RING, Outbound

    endpoint, ctx = free_endpoint(), transport.context()
    ring = transport.make_socket(ctx, zmq.PUSH, endpoint, bind=False, immediate=True)
    loop = SimpleNamespace(sockets=SimpleNamespace(ring=ring), ring_down=False, stage=SimpleNamespace(id="s1"))

    def outs():
        reply = Message.predicted_tokens(10, [5], [7], {"run_on": {"next": 11, "sessions": [5]}})
        return reply, [Outbound(DRIVER, reply), Outbound(RING, decode(5, 7, 8, 11, run_on=1, ring=True))]

    pull = None
    try:
        reply, out = outs()
        assert [o.to for o in StageLoop.ring_first(loop, out)] == [DRIVER]
        assert "run_on" not in reply.extras and loop.ring_down
        pull = transport.make_socket(ctx, zmq.PULL, endpoint, bind=True)
        assert ring.poll(5000, zmq.POLLOUT)
        reply, out = outs()
        assert [o.to for o in StageLoop.ring_first(loop, out)] == [RING, DRIVER]
        assert reply.extras["run_on"]["next"] == 11 and not loop.ring_down
    finally:
        ring.close(linger=0)
        if pull is not None:
            pull.close(linger=0)


@pytest.mark.slow
@pytest.mark.parametrize("n_stages", [1, 2])
def test_a_real_pipeline_runs_on_and_stops_where_the_driver_says(small_model_dir, tmp_path, n_stages):
    """Real processes (CURVE): a 1-stage chain's and a 2-stage ring's tokens equal the in-process
    engine's, their replies say they ran on, a stop string mid-run ends the text there, and the
    lanes and KV it left serve the next request exactly (the STOP dropped the pending step)."""
    import httpx

    from conftest import lanes_in_use
    from procs import serving, write_topology
    from skippy_zmq.engine.generate import LocalEngine

    path = write_topology(tmp_path, small_model_dir, n_stages, name="runon", kv_lanes=2, driver__max_sessions=2)
    with serving(path, tmp_path / "run") as served:
        ran_on = []
        served.engine.on_reply_hooks.append(lambda _sid, msg: ran_on.append("run_on" in msg.extras))
        prompt = served.tokenizer.encode("Once upon a time there was")
        req = GenRequest("a", tuple(prompt), max_tokens=40, ignore_eos=True)
        tokens = [e.token_id for e in served.engine.generate_blocking(req) if e.token_id is not None]
        assert tokens == LocalEngine(small_model_dir, capacity=256).generate(prompt, SamplingParams(), 40, True).token_ids
        assert sum(ran_on) >= 4   # a run of 8 announced at least every ninth token

        body = {"model": "m", "prompt": "Once upon a time there was", "max_tokens": 40, "temperature": 0,
                "ignore_eos": True}
        full = httpx.post(served.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        at = next(k for k in range(12, len(full) - 3) if full.find(full[k:k + 3]) == k and full[k:k + 3].strip())
        cut = httpx.post(served.url + "/v1/completions", json={**body, "stop": [full[at:at + 3]]}, timeout=120).json()
        assert cut["choices"][0]["text"] == full[:at] and cut["choices"][0]["finish_reason"] == "stop"
        again = httpx.post(served.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        assert again == full
        deadline = time.monotonic() + 30
        while lanes_in_use(served.url) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert lanes_in_use(served.url) == {}


def test_a_run_is_cut_where_the_drafter_proposes_and_its_late_step_is_dropped():
    sched = make_scheduler(1, run_on=8, speculative=SpeculativeConfig(method="ngram", max_draft=8, min_match=1,
                                                                    shared=False))
    got = []
    sched.submit(GenRequest("a", (5, 6, 7, 8, 9), max_tokens=30, ignore_eos=True), got.append)
    first = [m for m in sched.tick(now=100.0) if m.kind == Kind.DECODE][0]
    assert "run_on" not in first.extras   # no plain step yet: no run
    sid = int(first.session_ids[0])
    sched.on_reply("s0", Message.predicted_tokens(first.request_id, [sid], [10]))
    second = [m for m in sched.tick(now=100.1) if m.kind == Kind.DECODE][0]
    rid = second.request_id
    assert second.extras["run_on"] == 1 and second.tokens.tolist() == [10]
    # the stage ran on, and its token 6 is one the prompt continues: the drafter proposes 7 8 9 10
    sched.on_reply("s0", Message.predicted_tokens(rid, [sid], [6], {"run_on": {"next": rid + 1, "sessions": [sid]}}))
    assert sched.running[sid].status is JobStatus.READY and rid + 1 not in sched.awaiting.rows
    window = [m for m in sched.tick(now=100.2) if m.kind == Kind.DECODE][0]
    assert window.tokens.tolist()[:4] == [6, 7, 8, 9] and window.positions.tolist()[0] == 6
    sched.on_reply("s0", Message.predicted_tokens(rid + 1, [sid], [99]))   # the step it ran before the window came
    assert sched.running[sid].generated == [10, 6] and sched.running[sid].status is JobStatus.DECODING


def test_a_step_for_a_lane_freed_meanwhile_runs_nothing(tiny_tree):
    """A lost driver frees every lane (StageLoop.check_driver): a step already made runs nothing
    and answers nothing (no kv_gap error to a driver that is gone)."""
    worker, ids = whole(tiny_tree), random_ids(8, TINY.vocab_size, seed=4).tolist()
    configure_and_prefill(worker, 5, ids)
    _reply, own = worker.handle(decode(5, ids[-1], 7, rid=10, run_on=3, until=[]))
    assert worker.sessions.release_all() == 1
    errors = worker.counters["errors"]
    assert worker.handle_own(own.message) == [] and worker.counters["errors"] == errors


def test_the_last_reply_is_sent_while_the_next_step_computes(tiny_tree):
    """handle_own(meanwhile=...): called once, after the step is dispatched and before its result is
    read (the loop sends the held reply of the step before); a step that runs nothing calls nothing."""
    worker, ids = whole(tiny_tree), random_ids(8, TINY.vocab_size, seed=6).tolist()
    configure_and_prefill(worker, 5, ids)
    _reply, own = worker.handle(decode(5, ids[-1], 7, rid=10, run_on=3, until=[]))
    calls = []
    reply, nxt = worker.handle_own(own.message, meanwhile=lambda: calls.append(worker.sessions.get(5).length))
    assert calls == [8] and reply.message.request_id == 11   # before the step's tokens were appended (9)
    worker.handle(Message(Kind.STOP, 20, 5))
    assert worker.handle_own(nxt.message, meanwhile=lambda: calls.append("ran")) == [] and calls == [8]
    assert worker.meanwhile is None

"""n > 1 choices: one prefill, then every stage forks the prompt's KV into the other choices' lanes
(FORK_SESSION); each choice samples with its own key (seed, choice, position)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import TINY, random_ids
from pipeline_helpers import make_chain, make_scheduler, make_worker
from skippy_zmq.engine.request import EngineError, GenRequest, TokenEvent
from skippy_zmq.config.speculative import SpeculativeConfig
from skippy_zmq.engine.inproc import run_requests
from skippy_zmq.engine.job import JobStatus
from skippy_zmq.sampling import SamplingParams
from skippy_zmq.protocol.wire import Kind, Message
from model_helpers import read_kv


def by_choice(events: list) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for e in events:
        if isinstance(e, TokenEvent) and e.token_id is not None:
            out.setdefault(e.choice, []).append(e.token_id)
    return out


def spy(chain) -> list:
    seen, send = [], chain.send

    def record(msg):
        seen.append(msg)
        return send(msg)
    chain.send = record
    return seen


@pytest.mark.parametrize("cuts", [[], [2], [1, 3]], ids=["1stage", "2stage", "3stage"])
def test_n_choices_prefill_once_and_sample_their_own_streams(tiny_tree, cuts):
    prompt = tuple(random_ids(40, TINY.vocab_size, seed=4).tolist())
    params = SamplingParams(temperature=1.0, seed=9)
    chain = make_chain(TINY, tiny_tree, cuts)
    sent = spy(chain)
    req = GenRequest("n", prompt, params, max_tokens=12, ignore_eos=True, n=3)
    events = run_requests(make_scheduler(len(cuts) + 1, max_sessions=4), chain, [req])["n"]
    got = by_choice(events)
    assert sorted(got) == [0, 1, 2] and all(len(t) == 12 for t in got.values())
    assert sum(1 for e in events if e.finish_reason) == 3
    prefilled = sum(len(m.tokens) for m in sent if m.kind == Kind.PREFILL)
    assert prefilled == len(prompt) - 1                       # the prompt went through once
    forks = [m for m in sent if m.kind == Kind.FORK_SESSION]
    assert len(forks) == 1 and forks[0].position == len(prompt) - 1 and len(forks[0].session_ids) == 3
    # Choice 0 is the request alone; choice i draws from key (seed, i, position): a fresh request
    # whose stages sample it as choice i would give the same tokens, and the choices differ.
    alone = by_choice(run_requests(make_scheduler(len(cuts) + 1), make_chain(TINY, tiny_tree, cuts),
                                   [dataclasses.replace(req, n=1)])["n"])
    assert alone[0] == got[0]
    assert len({tuple(t) for t in got.values()}) == 3
    for w in chain.workers:
        assert len(w.sessions) == 0                           # every choice STOPped its lane


def test_greedy_choices_are_identical_and_speculation_keeps_them(tiny_tree):
    prompt = tuple((random_ids(6, TINY.vocab_size, seed=3).tolist() * 4)[:21])
    spec = SpeculativeConfig(method="ngram", min_match=1, shared=False)
    req = GenRequest("g", prompt, max_tokens=20, ignore_eos=True, n=2)
    plain = by_choice(run_requests(make_scheduler(2), make_chain(TINY, tiny_tree, [2]), [req])["g"])
    fast = by_choice(run_requests(make_scheduler(2, speculative=spec), make_chain(TINY, tiny_tree, [2]), [req])["g"])
    assert plain[0] == plain[1] == fast[0] == fast[1]


def test_n_above_the_lanes_is_refused_and_n_waits_for_enough_free_lanes(tiny_tree):
    sched = make_scheduler(2, max_sessions=4)
    with pytest.raises(EngineError) as info:
        sched.submit(GenRequest("big", (1, 2, 3), n=5), lambda e: None)
    assert info.value.status == 400 and "1 to 4 choices" in info.value.message
    chain = make_chain(TINY, tiny_tree, [2])
    reqs = [GenRequest("a", (5, 6, 7, 8), max_tokens=6, ignore_eos=True, n=3),
            GenRequest("b", (9, 10, 11), max_tokens=6, ignore_eos=True, n=2)]
    events = run_requests(sched, chain, reqs)
    assert sorted(by_choice(events["a"])) == [0, 1, 2] and sorted(by_choice(events["b"])) == [0, 1]


def test_fork_copies_kv_and_refuses_a_gap(tiny_tree):
    worker = make_worker(TINY, tiny_tree, 0, TINY.n_layers)
    prompt = random_ids(20, TINY.vocab_size, seed=2)
    worker.handle(Message(Kind.PREFILL, 1, 1, position=0, tokens=prompt[:-1]))
    assert worker.handle(Message(Kind.FORK_SESSION, 2, 1, position=19, sessions=np.array([1, 2], np.uint64))) == []
    a, b = worker.sessions.get(1), worker.sessions.get(2)
    assert b.length == 19 and b.tokens == a.tokens
    ka, kb = read_kv(worker.runner, a.lane, 19), read_kv(worker.runner, b.lane, 19)
    np.testing.assert_array_equal(ka[0], kb[0])
    np.testing.assert_array_equal(ka[1], kb[1])
    [out] = worker.handle(Message(Kind.FORK_SESSION, 3, 1, position=25, sessions=np.array([1, 3], np.uint64)))
    assert out.message.extras["code"] == "kv_gap" and "a fork needs 25" in out.message.extras["error"]


def test_choices_waiting_for_a_fork_end_with_choice_0(tiny_tree):
    """Choice 0 fails before its prefill is in (here: cancelled while queued work is pending): the
    choices waiting for its KV are ended too and free their lanes, instead of waiting out the deadline."""
    sched = make_scheduler(2, max_sessions=4)
    chain = make_chain(TINY, tiny_tree, [2])
    events: list = []
    prompt = tuple(random_ids(200, TINY.vocab_size, seed=8).tolist())   # 4 prefill chunks: 2 go out at once
    sid = sched.submit(GenRequest("x", prompt, max_tokens=4, n=3, ignore_eos=True), events.append)
    for msg in sched.tick():   # admitted: choice 0's first prefill chunk is out, the fork is not
        for stage_id, reply in chain.send(msg):
            sched.on_reply(stage_id, reply)
    assert len(sched.running) == 3 and any(j.status is JobStatus.FORK_WAIT for j in sched.running.values())
    sched.fail_sessions({sid}, EngineError("stage went away", 503, "stage_lost"))
    assert sched.running == {}
    for msg in sched.tick():
        for stage_id, reply in chain.send(msg):
            sched.on_reply(stage_id, reply)
    assert all(len(w.sessions) == 0 for w in chain.workers)


def test_every_choice_carries_the_prompts_logprobs(tiny_tree):
    """echo + logprobs with n = 2: choice 0 alone prefills, yet every choice's first event has
    the prompt entries (not None past the first prompt token), the same values as choice 0's."""
    prompt = tuple(random_ids(30, TINY.vocab_size, seed=6).tolist())
    req = GenRequest("e", prompt, SamplingParams(temperature=1.0, seed=2), max_tokens=4, ignore_eos=True, n=2,
                     logprobs=1, prompt_logprobs=1)
    events = run_requests(make_scheduler(2), make_chain(TINY, tiny_tree, [2]), [req])["e"]
    firsts = {}
    for e in events:
        if isinstance(e, TokenEvent) and e.choice not in firsts:
            firsts[e.choice] = e.prompt_logprobs
    assert sorted(firsts) == [0, 1]
    for choice, scored in firsts.items():
        assert len(scored) == len(prompt) and scored[0] is None
        assert all(entry is not None for entry in scored[1:]), f"choice {choice} lacks prompt logprobs"
    assert firsts[1] == firsts[0]


def test_cancelling_one_choice_frees_its_lane_and_the_others_go_on(tiny_tree):
    """A choice ended early (its stop string, at the server) is cancelled alone: its lane is
    freed on every stage at the next tick, the other choice decodes to its max_tokens."""
    sched = make_scheduler(2, max_sessions=4)
    chain = make_chain(TINY, tiny_tree, [2])
    events: list = []
    prompt = tuple(random_ids(12, TINY.vocab_size, seed=9).tolist())
    sid = sched.submit(GenRequest("c", prompt, SamplingParams(temperature=1.0, seed=4), max_tokens=30,
                                  ignore_eos=True, n=2), events.append)

    def step():
        for msg in sched.tick():
            for stage_id, reply in chain.send(msg):
                sched.on_reply(stage_id, reply)
    for _ in range(200):   # until both choices have a token
        step()
        if set(by_choice(events)) == {0, 1}:
            break
    assert all(len(w.sessions) == 2 for w in chain.workers)
    sched.cancel(sid, choice=1)
    for _ in range(3):
        step()
    assert all(len(w.sessions) == 1 for w in chain.workers)   # choice 1's lane is free everywhere
    cut = len(by_choice(events)[1])
    for _ in range(500):
        if not sched.running:
            break
        step()
    step()
    got = by_choice(events)
    assert len(got[0]) == 30 and len(got[1]) == cut < 30
    assert [e.choice for e in events if isinstance(e, TokenEvent) and e.finish_reason] == [0]
    assert all(len(w.sessions) == 0 for w in chain.workers)


def test_a_stop_string_in_one_choice_cancels_that_choice_at_the_engine():
    """Over HTTP with the official client: n = 2, a stop string only choice 1's text has; choice 1
    ends with finish_reason "stop" and the engine is told to cancel choice 1 alone."""
    from fake_engine import FakeEngine

    from conftest import MODEL_DIR
    from skippy_zmq.api.server import create_app, start_in_thread
    from skippy_zmq.text.tokenizer import TextTokenizer

    if not (MODEL_DIR / "tokenizer.json").is_file():
        pytest.skip(f"no tokenizer at {MODEL_DIR}")
    import openai

    tok = TextTokenizer.load(MODEL_DIR)
    words = tok.encode(" alpha beta gamma delta epsilon zeta eta theta")
    engine = FakeEngine(words, tok.eos_ids, max_context=256)   # choice c: the script shifted by c
    handle = start_in_thread(create_app(engine, tok, model_name="fake"))
    try:
        client = openai.OpenAI(base_url=f"{handle.url}/v1", api_key="x", max_retries=0, timeout=30)
        n_tokens = len(words) + 1
        texts = [tok.decode((words * 2)[c:c + n_tokens]) for c in range(2)]
        stop = tok.decode(words[-1:] + words[:1])   # where the script wraps: choice 0 at its last token,
        # choice 1 one token earlier, so choice 1 ends before its engine stream does and is cancelled
        reply = client.completions.create(model="fake", prompt="x", n=2, max_tokens=n_tokens, stop=[stop])
        by_index = {c.index: c for c in reply.choices}
        assert by_index[1].finish_reason == "stop"
        assert by_index[1].text == texts[1][:texts[1].index(stop)]
        assert engine.choices_cancelled == [1]     # choice 0's stop came with its last event: nothing to cancel
    finally:
        handle.stop()

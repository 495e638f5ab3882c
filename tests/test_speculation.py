"""Speculative decoding: verify windows through the stage chain give exactly the tokens of plain decoding.

In-process chains of real StageWorkers (wire encode/decode between them) and the real Scheduler,
on the tiny random model: its greedy output falls into loops, so n-gram drafts are proposed and
mostly accepted, and every path (accept, early reject, bonus token, windows beside plain rows)
is exercised.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import TINY, random_ids
from pipeline_helpers import CACHE, make_chain, make_scheduler, make_worker
from skippy_zmq.engine.request import GenRequest
from skippy_zmq.engine.speculative import accepted_run
from skippy_zmq.config.speculative import SpeculativeConfig
from skippy_zmq.engine.inproc import run_requests, tokens_of
from skippy_zmq.sampling import Sampler, SamplingParams
from skippy_zmq.protocol.wire import Kind, Message
from model_helpers import random_params

SPEC = SpeculativeConfig(method="ngram", max_draft=8, min_match=1, shared=False)


def prompts() -> list[list[int]]:
    """Prompts with repeats (so the prompt itself is a draft source) and without."""
    looped = (random_ids(6, TINY.vocab_size, seed=3).tolist() * 4)[:21]
    return [looped, random_ids(30, TINY.vocab_size, seed=30).tolist(), random_ids(9, TINY.vocab_size, seed=9).tolist()]


def run(cuts: list[int], reqs: list[GenRequest], spec: SpeculativeConfig | None, **kw) -> dict[str, list]:
    sched = make_scheduler(len(cuts) + 1, speculative=spec or SpeculativeConfig(), **kw)
    events = run_requests(sched, make_chain(TINY, tiny_tree_of(), cuts), reqs)
    run.last = sched   # type: ignore[attr-defined]
    return events


_TREE: dict = {}


def tiny_tree_of() -> dict:
    if not _TREE:
        _TREE.update(random_params(TINY, seed=0))
    return _TREE


def requests(sampling: SamplingParams = SamplingParams(), max_tokens: int = 40) -> list[GenRequest]:
    return [GenRequest(f"r{i}", tuple(p), sampling, max_tokens=max_tokens, ignore_eos=True)
            for i, p in enumerate(prompts())]


def token_lists(events: dict[str, list]) -> dict[str, list[int]]:
    return {rid: tokens_of(ev) for rid, ev in events.items()}


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("cuts", [[], [2], [1, 3]], ids=["1stage", "2stage", "3stage"])
def test_greedy_tokens_are_identical_with_speculation_on_and_off(cuts, method):
    reqs = requests()
    off = token_lists(run(cuts, reqs, None))
    on_events = run(cuts, reqs, dataclasses.replace(SPEC, method=method))
    counts = run.last.spec_counts   # type: ignore[attr-defined]
    assert token_lists(on_events) == off
    assert all(len(t) == 40 for t in off.values())
    # The windows really ran, and most drafts of the looping output were accepted.
    assert counts["windows"] >= 10 and counts["accepted"] >= counts["drafted"] // 2
    final = on_events["r0"][-1]
    assert final.finish_reason == "length"
    spec = final.stats["speculative"]
    assert spec["windows"] > 0 and spec["accepted"] <= spec["drafted"]


def test_windows_ride_beside_plain_rows_in_one_decode():
    """Concurrent sessions, one of which opted out: rows of one token and windows share DECODEs."""
    reqs = requests()
    reqs[1] = dataclasses.replace(reqs[1], speculative=False)
    off = token_lists(run([2], reqs, None))
    sched = make_scheduler(2, speculative=SPEC)
    chain = make_chain(TINY, tiny_tree_of(), [2])
    mixed = []

    def spy(msg: Message) -> list:
        if msg.kind == Kind.DECODE and len(set(msg.row_lengths.tolist())) > 1:
            mixed.append(msg.row_lengths.tolist())
        return send(msg)
    send = chain.send
    chain.send = spy   # type: ignore[method-assign]
    assert token_lists(run_requests(sched, chain, reqs)) == off
    assert mixed, "no DECODE carried a window beside a plain row"
    assert sched.running == {}


def test_seeded_sampling_is_identical_with_speculation_on_and_off():
    params = SamplingParams(temperature=0.8, top_k=20, presence_penalty=0.3, repetition_penalty=1.1, seed=11)
    reqs = requests(params, max_tokens=30)
    off = token_lists(run([2], reqs, None))
    assert token_lists(run([2], reqs, SPEC)) == off
    assert token_lists(run([1, 3], reqs, SPEC)) == off
    other = [dataclasses.replace(r, sampling=dataclasses.replace(params, seed=12)) for r in reqs]
    assert token_lists(run([2], other, SPEC)) != off


def test_max_tokens_and_eos_inside_a_window_stop_there():
    reqs = requests(max_tokens=7)
    for events in run([2], reqs, SPEC).values():
        toks = tokens_of(events)
        assert len(toks) == 7 and events[-1].finish_reason == "length"
    # EOS: make the looping request's 5th plain token the EOS id; on and off stop at the same place.
    plain = token_lists(run([2], requests(), None))["r0"]
    eos = plain[12]
    reqs = [dataclasses.replace(r, ignore_eos=False) for r in requests()]
    sched_kw = dict(eos=frozenset({eos}))
    off = {rid: tokens_of(ev) for rid, ev in run_requests(make_scheduler(2, **sched_kw),
                                                          make_chain(TINY, tiny_tree_of(), [2]), reqs).items()}
    on = run_requests(make_scheduler(2, speculative=SPEC, **sched_kw), make_chain(TINY, tiny_tree_of(), [2]), reqs)
    assert token_lists(on) == off
    assert off["r0"][-1] == eos and len(off["r0"]) <= 13
    assert on["r0"][-1].finish_reason == "stop"


def test_speculation_after_a_fused_prefix_restore():
    """The second request restores prompt[:-1] and decodes in one pass (TRY_RESTORE_PREFILL_DECODE),
    then drafts: same tokens as recomputing without the cache or the drafts."""
    reqs = [requests()[0]]
    off = tokens_of(run([2], reqs, None)["r0"])
    sched = make_scheduler(2, cache=CACHE, speculative=SPEC)
    chain = make_chain(TINY, tiny_tree_of(), [2], cache=CACHE)
    first = tokens_of(run_requests(sched, chain, reqs)["r0"])
    again = run_requests(sched, chain, [dataclasses.replace(reqs[0], request_id="again")])["again"]
    assert first == off and tokens_of(again) == off
    assert again[0].cached_tokens == len(reqs[0].prompt_ids) - 1 and sched.prefix_counts["hit"] == 1


def test_resume_after_a_pause_inside_speculation_gives_the_same_tokens():
    """Stages lose every session mid-request (a replacement stage); the driver re-prefills from
    history and keeps drafting. Seeded sampling survives too: draws are keyed by position."""
    params = SamplingParams(temperature=0.7, seed=5)
    for sampling in (SamplingParams(), params):
        reqs = requests(sampling, max_tokens=30)
        want = token_lists(run([2], reqs, None))
        sched = make_scheduler(2, speculative=SPEC)
        chain = make_chain(TINY, tiny_tree_of(), [2])
        events: dict[str, list] = {r.request_id: [] for r in reqs}
        for r in reqs:
            sched.submit(r, events[r.request_id].append)
        steps, paused = 0, False
        while sched.running or sched.queue or steps == 0:
            steps += 1
            if not paused and sum(len(tokens_of(e)) for e in events.values()) >= 20:
                paused = True
                sched.pause("test: a stage was replaced")
                for w in chain.workers:
                    w.sessions.release_all()
                sched.resume()
            for msg in sched.tick():
                for stage_id, reply in chain.send(msg):
                    sched.on_reply(stage_id, reply)
            assert steps < 10_000
        assert paused and token_lists(events) == want


def test_a_window_row_verifies_every_position_and_a_rejected_tail_is_truncated():
    """Direct to one whole-model worker: a DECODE row of current + drafts gets the target's token at
    every position; the next row starts inside the window and the stage truncates to it."""
    worker = make_worker(TINY, tiny_tree_of(), 0, TINY.n_layers)
    prompt = random_ids(10, TINY.vocab_size, seed=1).tolist()
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5)
    worker.handle(Message(Kind.CONFIGURE_GENERATION, 1, 7, tokens=np.array(prompt, np.int32),
                          extras={"sampling": params.to_dict()}))
    worker.handle(Message(Kind.PREFILL, 2, 7, position=0, tokens=np.array(prompt[:-1], np.int32)))
    plain, token, pos = [], prompt[-1], len(prompt) - 1
    ref = make_worker(TINY, tiny_tree_of(), 0, TINY.n_layers)
    ref.handle(Message(Kind.CONFIGURE_GENERATION, 1, 7, tokens=np.array(prompt, np.int32),
                       extras={"sampling": params.to_dict()}))
    ref.handle(Message(Kind.PREFILL, 2, 7, position=0, tokens=np.array(prompt[:-1], np.int32)))
    for i in range(8):
        [out] = ref.handle(Message(Kind.DECODE, 3 + i, 7, position=pos, tokens=np.array([token], np.int32)))
        token, pos = int(out.message.tokens[0]), pos + 1
        plain.append(token)
    # A window whose first 3 drafts are right and the 4th wrong.
    drafts = plain[:3] + [(plain[3] + 1) % TINY.vocab_size, 5, 6]
    start = len(prompt) - 1
    row = [prompt[-1]] + drafts
    [out] = worker.handle(Message(Kind.DECODE, 20, 7, tokens=np.array(row, np.int32),
                                  positions=np.arange(start, start + len(row), dtype=np.int32),
                                  sessions=np.array([7], np.uint64), extras={"lengths": [len(row)]}))
    assert out.message.kind == Kind.PREDICTED_TOKENS and out.message.row_lengths.tolist() == [7]
    targets = out.message.tokens.tolist()
    run_, accepted = accepted_run(drafts, targets)
    assert accepted == 3 and run_ == plain[:4]
    session = worker.sessions.get(7)
    assert session.length == start + len(row)
    # Next row: the accepted run's last token at its position; the stage truncates the rejected tail.
    nxt = start + len(run_)
    [out] = worker.handle(Message(Kind.DECODE, 21, 7, position=nxt, tokens=np.array([run_[-1]], np.int32)))
    assert int(out.message.tokens[0]) == plain[4]
    assert session.length == nxt + 1 and session.tokens == prompt + plain[:4]
    assert session.sampler.length == nxt + 1


def test_window_rows_are_checked():
    worker = make_worker(TINY, tiny_tree_of(), 0, TINY.n_layers)
    base = dict(tokens=np.arange(3, 20, dtype=np.int32), sessions=np.array([1], np.uint64))
    [out] = worker.handle(Message(Kind.DECODE, 1, 1, positions=np.arange(17, dtype=np.int32),
                                  extras={"lengths": [17]}, **base))
    assert out.message.extras["code"] == "too_many_tokens" and "largest window of 16" in out.message.extras["error"]
    positions = np.array([0, 1, 3], np.int32)
    [out] = worker.handle(Message(Kind.DECODE, 2, 1, tokens=np.array([3, 4, 5], np.int32), positions=positions,
                                  sessions=np.array([1], np.uint64), extras={"lengths": [3]}))
    assert out.message.extras["code"] == "bad_rows" and "not consecutive" in out.message.extras["error"]
    assert worker.sessions.get(1) is None   # refused before a lane was taken


def test_accepted_run():
    assert accepted_run([5, 6, 7], [5, 6, 9, 1]) == ([5, 6, 9], 2)
    assert accepted_run([5, 6], [5, 6, 8]) == ([5, 6, 8], 2)
    assert accepted_run([], [4]) == ([4], 0)
    assert accepted_run([1], [2, 3]) == ([2], 0)
    with pytest.raises(ValueError, match="needs 3 target tokens"):
        accepted_run([1, 2], [1])


def test_sampler_window_equals_step_by_step_on_the_model():
    """The final stage's sample_window over a window whose drafts are the plain tokens reproduces them."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
    sampler = Sampler(params, [1, 2, 3])
    logits = np.random.default_rng(0).normal(size=(4, TINY.vocab_size)).astype(np.float32)
    steps = [sampler.choose(logits[0], 2)]
    for j in range(1, 4):
        sampler.put(2 + j, [steps[-1]])
        steps.append(sampler.choose(logits[j], 2 + j))
    again = Sampler(params, [1, 2, 3]).sample_window(logits, 2, [3] + steps[:3])
    assert again == steps


@pytest.fixture(scope="module")
def real_engine(model_dir):
    """One single-process engine of the real model for this module's tests (a load and its compiles
    each, when each made its own), running the checkpoint's own blocks as a user's stage does (f32
    layers took 2.7x the time a token)."""
    from skippy_zmq.engine.generate import LocalEngine

    return LocalEngine(model_dir, weights="auto")


@pytest.mark.slow
def test_local_engine_speculation_on_the_real_model(real_engine, monkeypatch):
    """`generate --speculative ngram|suffix` (single process): identical greedy tokens, windows
    reported. The short copy's drafts are mostly rejected (about 3 in 4), the last prompt's (bench
    spec's code rewrite: a long copy with changed lines) mostly accepted: both paths on real logits.
    Every window and plain step goes through judge_window (one accept step with the scheduler's), so
    the draft policy hears of plain steps. (Two parity chat prompts ran here too: their drafts are
    rejected as the copy's are, and each prompt is ~3 generations of 48 real-model tokens, 45 -> ~25 s
    of the suite; the accept step's check had its own 2 generations of 24 tokens, now it watches these.)"""
    from skippy_zmq.devtools.bench.spec_workloads import copy_messages
    from skippy_zmq.engine import speculative
    from skippy_zmq.engine.speculative import judge_window

    calls: list[int] = []

    def spy(policy, drafts, targets):
        calls.append(len(drafts))
        return judge_window(policy, drafts, targets)
    monkeypatch.setattr(speculative, "judge_window", spy)
    engine = real_engine
    copy = engine.tokenizer.encode_chat([{"role": "user", "content": (
        "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank.")}])
    code = engine.tokenizer.encode_chat([{"role": "user", "content": copy_messages()[2]}])
    rejected = 0
    for ids in (copy, code):
        off = engine.generate(ids, max_tokens=48, ignore_eos=True)
        for method in ("ngram", "suffix"):
            calls.clear()
            on = engine.generate(ids, max_tokens=48, ignore_eos=True, speculative=dataclasses.replace(SPEC, method=method))
            assert on.token_ids == off.token_ids and on.finish_reason == off.finish_reason, method
            rejected += on.speculative["drafted"] - on.speculative["accepted"]
            assert calls and any(calls), method   # windows with drafts went through the shared step
            assert sum(calls) >= on.speculative["drafted"] and len(calls) == on.speculative["windows"] + calls.count(0)
    assert rejected > 0   # rejected drafts changed no token either
    assert on.speculative["windows"] > 0
    spec = on.to_json()["speculative"]
    assert spec["accepted_per_step"] == round(spec["accepted"] / spec["windows"], 3) and spec["accepted_per_step"] > 0.5


def test_judge_window_tells_the_policy_of_plain_steps_so_a_stopped_session_probes_again():
    from skippy_zmq.engine.speculative import DraftPolicy, judge_window

    cfg = SpeculativeConfig(method="ngram", probe_every=4, min_acceptance=0.5)
    policy = DraftPolicy(cfg)
    while policy.k:   # every draft rejected: the session stops drafting
        k = policy.k
        assert judge_window(policy, [1] * k, [2] * (k + 1)) == ([2], 0)
    for _ in range(cfg.probe_every - 1):
        assert judge_window(policy, [], [7]) == ([7], 0) and policy.k == 0
    judge_window(policy, [], [7])
    assert policy.k >= 1                       # the probe_every-th plain step probes again


def _one_stream(spec: SpeculativeConfig | None, sampling: SamplingParams, cuts: list[int], prompt: list[int],
                max_tokens: int = 48) -> tuple[list[int], dict, int]:
    """One request alone through an in-process chain; (tokens, spec counts, the most DECODEs of that
    session one tick sent at once)."""
    sched = make_scheduler(len(cuts) + 1, speculative=spec or SpeculativeConfig())
    chain = make_chain(TINY, tiny_tree_of(), cuts)
    events: list = []
    sched.submit(GenRequest("one", tuple(prompt), sampling, max_tokens=max_tokens, ignore_eos=True), events.append)
    most = 0
    for _ in range(10_000):
        out = sched.tick()
        most = max(most, sum(m.kind == Kind.DECODE for m in out))
        for msg in out:
            for stage_id, reply in chain.send(msg):
                sched.on_reply(stage_id, reply)
        if not sched.running and events:
            break
    return tokens_of(events), dict(sched.spec_counts), most


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=7,
                                                                       repetition_penalty=1.1)],
                         ids=["greedy", "seeded"])
def test_pipelined_windows_give_the_tokens_of_plain_decoding(sampling):
    """One stream on 3 stages keeps up to 3 windows in flight (each drafted as if the ones before were
    accepted); windows behind a rejection are retired. Tokens equal plain decoding at every depth."""
    looped = (random_ids(5, TINY.vocab_size, seed=4).tolist() * 6)[:27]
    mixed = looped[:12] + random_ids(12, TINY.vocab_size, seed=8).tolist() + looped[:6]
    counts = {}
    for name, prompt in (("looped", looped), ("mixed", mixed)):
        plain, _, _ = _one_stream(None, sampling, [1, 3], prompt)
        one, counts1, most1 = _one_stream(dataclasses.replace(SPEC, depth=1), sampling, [1, 3], prompt)
        three, counts[name], most3 = _one_stream(SPEC, sampling, [1, 3], prompt)   # depth 0: one per stage
        assert one == plain and three == plain and len(plain) == 48
        assert counts1["ahead_sent"] == 0 and most1 == 1
        assert counts[name]["ahead_sent"] > 0 and most3 == 3
    assert counts["mixed"]["ahead_retired"] > 0              # behind a rejection: retired, tokens unchanged
    if sampling.temperature == 0:                            # greedy copies: most windows ahead were kept
        assert counts["looped"]["ahead_retired"] < counts["looped"]["ahead_sent"] / 2


def test_deeper_than_the_stages_and_never_ahead_in_a_busy_pipeline():
    """A depth beyond the stage count still gives plain tokens; while as many streams decode as there
    are stages nothing is sent ahead (every stage already has a stream)."""
    mixed = random_ids(6, TINY.vocab_size, seed=4).tolist() * 3 + random_ids(10, TINY.vocab_size, seed=5).tolist()
    plain, _, _ = _one_stream(None, SamplingParams(), [2], mixed)
    deep, counts, most = _one_stream(dataclasses.replace(SPEC, depth=4), SamplingParams(), [2], mixed)
    assert deep == plain and most >= 3 and counts["ahead_sent"] > 0
    sched = make_scheduler(2, speculative=SPEC)
    looped = random_ids(5, TINY.vocab_size, seed=4).tolist() * 5
    sched.submit(GenRequest("a", tuple(looped), SamplingParams(), max_tokens=16, ignore_eos=True), lambda e: None)
    sched.submit(GenRequest("b", tuple(looped[1:]), SamplingParams(), max_tokens=16, ignore_eos=True), lambda e: None)
    chain = make_chain(TINY, tiny_tree_of(), [2])
    both = False
    for _ in range(1000):   # until the first of the two ends (the other then pipelines alone)
        for msg in sched.tick():
            for stage_id, reply in chain.send(msg):
                sched.on_reply(stage_id, reply)
        both = both or len(sched.running) == 2
        if both and len(sched.running) < 2:
            break
    assert sched.spec_counts["windows"] > 0 and sched.spec_counts["ahead_sent"] == 0   # two streams, two stages


def test_a_proposal_can_assume_tokens_still_in_flight():
    from skippy_zmq.engine.speculative import NgramProposer, propose_draft

    p = NgramProposer(SPEC, [5, 6, 7, 8, 5, 6])
    assert p.propose(2) == [7, 8]
    assert p.propose(3, assumed=[7, 8]) == [5, 6, 7]       # as if 7, 8 were accepted
    assert propose_draft(p, None, 3, [7, 8]) == [5, 6, 7] and len(p) == 6   # nothing kept


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.7, seed=5)], ids=["greedy", "seeded"])
def test_a_resume_with_windows_ahead_in_flight_gives_the_same_tokens(sampling):
    """Stages lose every session while windows of one stream are in flight ahead of each other
    (messages sent, replies not yet read); the driver re-prefills from history and pipelines again."""
    looped = (random_ids(5, TINY.vocab_size, seed=4).tolist() * 6)[:27]
    want, _, _ = _one_stream(None, sampling, [1, 3], looped)
    sched = make_scheduler(3, speculative=SPEC)
    chain = make_chain(TINY, tiny_tree_of(), [1, 3])
    events: list = []
    sched.submit(GenRequest("one", tuple(looped), sampling, max_tokens=48, ignore_eos=True), events.append)
    paused = False
    for _ in range(10_000):
        out = sched.tick()
        if not paused and len(tokens_of(events)) >= 12 and sum(m.kind == Kind.DECODE for m in out) >= 2:
            paused = True            # these DECODEs never arrive: the stages were replaced
            sched.pause("test: every stage was replaced")
            for w in chain.workers:
                w.sessions.release_all()
            sched.resume()
            continue
        for msg in out:
            for stage_id, reply in chain.send(msg):
                sched.on_reply(stage_id, reply)
        if not sched.running and events:
            break
    assert paused and tokens_of(events) == want and sched.spec_counts["ahead_sent"] > 0

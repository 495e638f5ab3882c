"""Per-row isolation: whatever fails in one row of a DECODE (its sampler, constraint or logprobs)
ends that row's request alone, with its own ERROR in the same round trip; the other rows get
their tokens in that reply. A PREFILL naming two sessions and a final stage without
CONFIGURE are refused with a clear error, never served by guessing."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TINY, random_ids
from pipeline_helpers import make_chain, make_scheduler, make_worker
from skippy_zmq.protocol import wire
from skippy_zmq.engine.request import EngineError, GenRequest, TokenEvent
from skippy_zmq.engine.inproc import tokens_of
from skippy_zmq.sampling import SamplingParams
from skippy_zmq.stage.worker import DRIVER
from skippy_zmq.protocol.wire import Kind, Message

ROWS = 8
BAD_SEED = 666   # the request whose sampler fails


def configure(sid: int, prompt: list[int], seed: int = 0) -> Message:
    return Message(Kind.CONFIGURE_GENERATION, 1, sid, tokens=np.asarray(prompt, np.int32),
                   extras={"sampling": SamplingParams(seed=seed).to_dict()})


def prefill(sid: int, ids: list[int]) -> Message:
    return Message(Kind.PREFILL, 2, sid, tokens=np.asarray(ids, np.int32))


def decode(sids: list[int], toks: list[int], poss: list[int], rid: int = 3) -> Message:
    return Message(Kind.DECODE, rid, sids[0], position=poss[0], tokens=np.asarray(toks, np.int32),
                   positions=np.asarray(poss, np.int32), sessions=np.asarray(sids, np.uint64))


def failing_on(worker, seed: int, exc: Exception, after: int = 0):
    """Make the samplers of requests with `seed` raise `exc` when they sample, after `after`
    rows sampled well (a fault injected into one row)."""
    make = worker.make_sampler

    def make_sampler(extras, prompt):
        sampler = make(extras, prompt)
        if sampler.seed == seed:
            calls, window = [0], sampler.sample_window

            def boom(*args, **kw):
                calls[0] += 1
                if calls[0] > after:
                    raise exc
                return window(*args, **kw)
            sampler.sample_window = sampler.sample_window_logprobs = boom
        return sampler
    worker.make_sampler = make_sampler


def one_stage(tiny_tree):
    return make_worker(TINY, tiny_tree, 0, TINY.n_layers, lanes=ROWS)


def batch_of_eight(worker, bad: int | None):
    """8 sessions prefilled with their own prompts, then one DECODE of all 8 rows."""
    prompts = [random_ids(6 + i, TINY.vocab_size, seed=i).tolist() for i in range(ROWS)]
    for sid, prompt in enumerate(prompts, start=1):
        worker.handle(configure(sid, prompt, BAD_SEED if sid == bad else 0))
        worker.handle(prefill(sid, prompt[:-1]))
    sids = list(range(1, ROWS + 1))
    return worker.handle(decode(sids, [p[-1] for p in prompts], [len(p) - 1 for p in prompts]))


@pytest.mark.parametrize("exc", [RuntimeError("injected sampler failure"), ValueError("bad logits"),
                                 IndexError("logprobs index")], ids=["runtime", "value", "index"])
def test_one_failing_row_of_eight_ends_alone_and_the_other_seven_get_their_tokens(tiny_tree, exc):
    clean = batch_of_eight(one_stage(tiny_tree), bad=None)
    [reference] = [o.message for o in clean if o.message.kind == Kind.PREDICTED_TOKENS]
    want = dict(zip(reference.session_ids.tolist(), reference.tokens.tolist()))
    worker = one_stage(tiny_tree)
    failing_on(worker, BAD_SEED, exc)
    outs = batch_of_eight(worker, bad=5)
    assert all(o.to == DRIVER for o in outs)
    errors = [o.message for o in outs if o.message.kind == Kind.ERROR]
    [tokens] = [o.message for o in outs if o.message.kind == Kind.PREDICTED_TOKENS]   # one reply, this step
    assert [e.session_id for e in errors] == [5]
    assert errors[0].extras["code"] == "internal_error" and str(exc) in errors[0].extras["error"]
    got = dict(zip(tokens.session_ids.tolist(), tokens.tokens.tolist()))
    assert sorted(got) == [1, 2, 3, 4, 6, 7, 8]
    assert got == {sid: tok for sid, tok in want.items() if sid != 5}


def test_a_constraint_error_in_one_row_is_a_constraint_error_reply(tiny_tree):
    from skippy_zmq.text.constrain import ConstraintError

    worker = one_stage(tiny_tree)
    failing_on(worker, BAD_SEED, ConstraintError("the schema cannot continue", "response_format"))
    outs = batch_of_eight(worker, bad=2)
    [error] = [o.message for o in outs if o.message.kind == Kind.ERROR]
    assert error.session_id == 2 and error.extras["code"] == "constraint_error"
    [tokens] = [o.message for o in outs if o.message.kind == Kind.PREDICTED_TOKENS]
    assert len(tokens.session_ids) == ROWS - 1


def test_a_final_stage_without_configure_refuses_the_row_naming_its_session(tiny_tree):
    worker = one_stage(tiny_tree)
    prompt = random_ids(8, TINY.vocab_size).tolist()
    worker.handle(configure(1, prompt))
    worker.handle(prefill(1, prompt[:-1]))
    worker.handle(prefill(2, prompt[:-1]))   # session 2 never configured
    outs = worker.handle(decode([1, 2], [prompt[-1]] * 2, [7, 7]))
    [error] = [o.message for o in outs if o.message.kind == Kind.ERROR]
    assert error.session_id == 2 and error.extras["code"] == "not_configured"
    assert "session 2 has no sampler" in error.extras["error"]
    [tokens] = [o.message for o in outs if o.message.kind == Kind.PREDICTED_TOKENS]
    assert tokens.session_ids.tolist() == [1]


def test_a_prefill_naming_two_sessions_is_refused(tiny_tree):
    msg = Message(Kind.PREFILL, 4, 1, tokens=np.arange(6, dtype=np.int32), sessions=np.asarray([1, 2], np.uint64))
    with pytest.raises(wire.WireError, match="PREFILL names 2 sessions"):
        wire.decode(wire.encode(msg))
    worker = one_stage(tiny_tree)
    [out] = worker.handle(msg)
    assert out.message.extras["code"] == "bad_rows" and "PREFILL names 2 sessions" in out.message.extras["error"]
    assert len(worker.sessions) == 0   # nothing was written into any lane


@pytest.mark.parametrize("cuts", [[], [2]], ids=["1stage", "2stage"])
def test_scheduler_one_failing_request_of_eight_the_rest_unaffected_in_the_same_step(tiny_tree, cuts):
    """Through the scheduler: 8 requests decode together; the one whose row fails gets its
    EngineError in the round its row failed, the other 7 the tokens of a fault-free run, and no
    batch is left waiting for an answer after any round (none would wait out a reply timeout)."""
    prompts = [tuple(random_ids(12, TINY.vocab_size, seed=20 + i).tolist()) for i in range(ROWS)]

    def run(bad: int | None):
        chain = make_chain(TINY, tiny_tree, cuts, lanes=ROWS)
        if bad is not None:
            failing_on(chain.workers[-1], BAD_SEED, RuntimeError("injected"), after=2)
        sched = make_scheduler(len(cuts) + 1, max_sessions=ROWS, max_queue=ROWS, micro_batches=1)
        events = {}
        for i, prompt in enumerate(prompts):
            events[i] = []
            seed = BAD_SEED if i == bad else 0
            sched.submit(GenRequest(str(i), prompt, SamplingParams(seed=seed), max_tokens=6, ignore_eos=True),
                         events[i].append)
        rows_seen, failed_round = 0, None
        for round_ in range(1000):
            for msg in sched.tick():
                if msg.kind == Kind.DECODE and failed_round is None:
                    rows_seen = len(msg.session_ids)   # the rows of the latest DECODE before the failure
                for stage_id, reply in chain.send(msg):
                    sched.on_reply(stage_id, reply)
            assert not sched.awaiting.rows, f"round {round_}: a batch still waits for {list(sched.awaiting.rows)}"
            if bad is not None and failed_round is None and any(isinstance(e, EngineError) for e in events[bad]):
                failed_round = round_
            if not sched.running and not sched.queue:
                break
        return events, rows_seen, failed_round

    clean, _, _ = run(None)
    events, rows_seen, failed_round = run(3)
    assert rows_seen == ROWS                                       # the failure happened inside an 8-row DECODE
    assert failed_round is not None
    [error] = [e for e in events[3] if isinstance(e, EngineError)]
    assert error.code == "internal_error" and "injected" in str(error)
    for i in range(ROWS):
        if i != 3:
            assert tokens_of(events[i]) == tokens_of(clean[i]) and len(tokens_of(events[i])) == 6
            assert isinstance(events[i][-1], TokenEvent) and events[i][-1].finish_reason == "length"


@pytest.mark.slow
def test_real_stages_one_bad_row_of_eight_the_others_unaffected(small_model_dir, tmp_path):
    """2 real stage processes; 8 requests decode together, one with a logit_bias id past the
    vocabulary (the final stage's sampler raises on its row). That one ends with its own error
    (no 504, no timeout); the other 7 get exactly the tokens they get in a run without it."""
    import threading

    from procs import running_pipeline, write_topology

    path = write_topology(tmp_path, small_model_dir, 2)   # real processes, the small model's shapes
    prompts = [tuple(range(100 + 7 * i, 110 + 7 * i)) for i in range(ROWS)]

    def request(i: int, bad: bool) -> GenRequest:
        sampling = SamplingParams(logit_bias=((10 ** 7, 1.0),)) if bad else SamplingParams()
        return GenRequest(f"r{i}", prompts[i], sampling, max_tokens=8, ignore_eos=True)

    def run_all(engine, bad: int | None) -> dict[int, object]:
        out: dict[int, object] = {}

        def one(i: int) -> None:
            try:
                out[i] = [e.token_id for e in engine.generate_blocking(request(i, i == bad))
                          if e.token_id is not None]
            except EngineError as exc:
                out[i] = exc
        threads = [threading.Thread(target=one, args=(i,)) for i in range(ROWS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    with running_pipeline(path, tmp_path / "run") as (engine, _tok, _topo, _procs):
        clean = run_all(engine, None)
        got = run_all(engine, 4)
    error = got[4]
    assert isinstance(error, EngineError) and error.code == "internal_error" and error.status == 500
    assert "logit_bias token ids must be" in str(error)
    for i in range(ROWS):
        if i != 4:
            assert got[i] == clean[i] and len(got[i]) == 8
    print("7/7 other rows got their tokens; the bad row ended with its own error:", error.code)

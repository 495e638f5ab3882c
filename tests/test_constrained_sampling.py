"""Sampler + constraint matcher (skippy_zmq/sampling/ with skippy_zmq/text/constrain.py): the mask
follows the generated tokens as the penalty history does, through windows, rejected drafts,
truncation and puts; greedy and sampled outputs always parse."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from skippy_zmq.text.constrain import ConstraintSpec, Matcher, tokenizer_info
from skippy_zmq.sampling import Sampler, SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "n", "tags"], "additionalProperties": False}
PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def info(model_dir):
    return tokenizer_info(model_dir)


def sampler(info, params: SamplingParams = SamplingParams(), schema=SCHEMA) -> Sampler:
    return Sampler(params, PROMPT, matcher=Matcher(ConstraintSpec("json_schema", schema), info))


def reference_mask(info, generated: list[int], schema=SCHEMA) -> np.ndarray:
    m = Matcher(ConstraintSpec("json_schema", schema), info)
    for t in generated:
        m.advance(t)
    return m.mask()


def random_logits(rng, vocab: int) -> np.ndarray:
    return rng.standard_normal(vocab).astype(np.float32) * 3


def decode_loop(s: Sampler, info, rng, limit: int = 200) -> list[int]:
    """Plain step-by-step decoding as the stage does it: the token fed back is put, then scored."""
    out: list[int] = []
    position = len(PROMPT) - 1
    while len(out) < limit:
        token = s.choose(random_logits(rng, info.vocab_size), position)
        out.append(token)
        if token in info.eos_ids:
            break
        position += 1
        s.put(position, [token])
    return out


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=3),
                                    SamplingParams(temperature=1.0, top_p=0.9, seed=4, presence_penalty=0.5,
                                                   logit_bias={39428: -100})])
def test_decoding_with_a_matcher_gives_valid_json(info, params):
    for seed in range(5):
        rng = np.random.default_rng(seed)
        out = decode_loop(sampler(info, params), info, rng)
        assert out[-1] in info.eos_ids, "the constraint must end in EOS"
        value = json.loads(info.tokenizer.decode(out[:-1]))
        jsonschema.validate(value, SCHEMA)


def test_no_matcher_greedy_is_plain_argmax():
    rng = np.random.default_rng(0)
    s = Sampler(SamplingParams(), PROMPT)
    logits = random_logits(rng, 100)
    assert s.choose(logits, 4) == int(np.argmax(logits))
    assert s.constraint_mask(4) is None


def test_window_masks_equal_step_by_step_masks(info):
    """A verify window's positions are masked as if its drafts had been accepted one by one."""
    text = '{"name": "ab", "n": 7, "tags": ["a"]}'
    ids = info.tokenizer.encode(text)
    s = sampler(info)
    start = len(PROMPT) - 1
    window = [PROMPT[-1]] + ids[:6]            # current token + 6 grammatical drafts
    for j in range(len(window)):
        s.put(start + j, window[j:j + 1])
        mask = s.constraint_mask(start + j)
        np.testing.assert_array_equal(mask, reference_mask(info, ids[:j]))
    # sample_window over real logits: every output is allowed by its position's mask
    rng = np.random.default_rng(1)
    logits = np.stack([random_logits(rng, info.vocab_size) for _ in window])
    outs = s.sample_window(logits, start, window)
    for j, token in enumerate(outs):
        assert reference_mask(info, ids[:j])[token]


def test_a_disallowed_draft_stops_the_matcher_and_the_target_differs(info):
    ids = info.tokenizer.encode('{"name": "x"')
    bad = info.tokenizer.encode("}")[0]          # '}' is not allowed before "n" and "tags"
    assert not reference_mask(info, ids)[bad]
    s = sampler(info)
    start = len(PROMPT) - 1
    window = [PROMPT[-1]] + ids + [bad] + ids[:2]  # drafts: grammatical, then one refused, then more
    rng = np.random.default_rng(2)
    logits = np.stack([random_logits(rng, info.vocab_size) for _ in window])
    logits[len(ids), bad] = 1e4                 # the model "wants" the bad token there
    s.put(start, window)                        # as Session.append does before sampling
    outs = s.sample_window(logits, start, window)
    # the target at the position before the bad draft cannot be it: the driver rejects there
    assert outs[len(ids)] != bad
    assert reference_mask(info, ids)[outs[len(ids)]]
    assert s.refused_at == len(ids)
    for j in range(len(ids) + 1):
        assert reference_mask(info, ids[:j])[outs[j]]


def test_truncate_after_a_rejection_gives_the_same_masks(info):
    ids = info.tokenizer.encode('{"name": "xy", "n": 12, "tags": []}')
    bad = info.tokenizer.encode("]")[0]
    s = sampler(info)
    start = len(PROMPT) - 1
    rng = np.random.default_rng(3)
    window = [PROMPT[-1]] + ids[:5] + [bad, bad]
    s.put(start, window)
    s.sample_window(np.stack([random_logits(rng, info.vocab_size) for _ in window]), start, window)
    # the driver accepted 3 drafts; the next row starts after them with the target's token
    accepted = 3
    s.truncate(start + 1 + accepted)
    nxt = ids[accepted]
    second = [nxt] + ids[accepted + 1:accepted + 4]
    s.put(start + 1 + accepted, second)
    for j in range(len(second)):
        np.testing.assert_array_equal(s.constraint_mask(start + 1 + accepted + j),
                                      reference_mask(info, ids[:accepted + 1 + j]))
    # truncating back into the prompt resets to the start state
    s.truncate(len(PROMPT))
    np.testing.assert_array_equal(s.constraint_mask(len(PROMPT) - 1), reference_mask(info, []))


def test_complete_output_allows_only_eos(info):
    ids = info.tokenizer.encode('{"name": "", "n": 1, "tags": []}')
    s = sampler(info, SamplingParams(temperature=1.0, seed=1))
    s.put(len(PROMPT) - 1, [PROMPT[-1]] + ids)
    position = len(PROMPT) - 1 + len(ids)
    logits = np.zeros(info.vocab_size, np.float32)
    logits[info.eos_ids[0]] = -50.0
    for _ in range(5):
        assert s.choose(logits, position) in info.eos_ids
    mask = s.constraint_mask(position)
    assert set(np.flatnonzero(mask).tolist()) == set(info.eos_ids)


def test_padded_vocabulary_logits_past_the_tokenizer_are_masked(info):
    s = sampler(info)
    logits = np.zeros(info.vocab_size + 64, np.float32)
    logits[-1] = 1e4                            # a padding row the tokenizer has no token for
    token = s.choose(logits, len(PROMPT) - 1)
    assert token < info.vocab_size and reference_mask(info, [])[token]


def test_scheduler_sends_the_constraint_and_ends_constrained_requests_at_eos():
    """CONFIGURE_GENERATION and the fused restore carry the constraint; ignore_eos does not
    apply to a constrained request (its constraint allows nothing but EOS once complete)."""
    from pipeline_helpers import CACHE, make_scheduler

    from skippy_zmq.engine.request import GenRequest
    from skippy_zmq.protocol.wire import Kind

    spec = ConstraintSpec("json_object").to_dict()
    sched = make_scheduler(1, eos=frozenset({2}))
    sched.submit(GenRequest("a", (5, 6, 7), constraint=spec, ignore_eos=True), lambda e: None)
    sched.submit(GenRequest("b", (5, 6, 7), ignore_eos=True), lambda e: None)
    configures = [m for m in sched.tick() if m.kind == Kind.CONFIGURE_GENERATION]
    assert [m.extras.get("constraint") for m in configures] == [spec, None]
    jobs = sorted(sched.running.values(), key=lambda j: j.req.request_id)
    assert jobs[0].eos == frozenset({2}) and jobs[1].eos == frozenset()

    cached = make_scheduler(1, cache=CACHE)
    cached.index.add("default", [5, 6, 7, 8, 9, 10, 11, 12, 13])
    cached.submit(GenRequest("c", tuple(range(5, 15)), constraint=spec), lambda e: None)
    [fused] = [m for m in cached.tick() if m.kind == Kind.TRY_RESTORE_PREFILL_DECODE]
    assert fused.extras["constraint"] == spec


def test_rolling_back_tokens_after_eos_leaves_the_engine_alone(info):
    """EOS and the EOS-only tokens after it never reach the engine: rolling back only those
    (EOS stays, `_eos_at < target`) must not roll back the engine's last real token."""
    ids = info.tokenizer.encode('{"name": "", "n": 1, "tags": []}')
    eos = info.eos_ids[0]
    m = Matcher(ConstraintSpec("json_schema", SCHEMA), info)
    for t in ids:
        m.advance(t)
    before_eos = m.mask().copy()
    m.advance(eos)
    m.advance(eos)                 # EOS-only after EOS
    m.rollback(1)                  # the second EOS: nothing of the engine's goes
    assert m.length == len(ids) + 1 and set(np.flatnonzero(m.mask()).tolist()) == set(info.eos_ids)
    m.rollback(1)                  # the first EOS: back to the state the JSON ended in
    assert m.length == len(ids)
    np.testing.assert_array_equal(m.mask(), before_eos)
    np.testing.assert_array_equal(m.mask(), reference_mask(info, ids))


class DeadAfter:
    """A matcher wrapper whose engine 'cannot continue' (ConstraintError from _fill) once it has
    taken `token`: what a limit or a dead end looks like from the sampler."""

    def __init__(self, inner: Matcher, token: int) -> None:
        self.inner, self.token, self.taken = inner, token, []

    def _check(self) -> None:
        from skippy_zmq.text.constrain import ConstraintError

        if self.token in self.taken:
            raise ConstraintError("the schema cannot continue: injected", "response_format")

    def allows(self, token: int) -> bool:
        self._check()
        return self.inner.allows(token)

    def advance(self, token: int) -> None:
        self.inner.advance(token)
        self.taken.append(token)

    def rollback(self, n: int) -> None:
        self.inner.rollback(n)
        del self.taken[len(self.taken) - n:]

    def mask(self) -> np.ndarray:
        self._check()
        return self.inner.mask()


def test_a_draft_leading_to_a_dead_end_is_refused_not_fatal(info):
    ids = info.tokenizer.encode('{"name": "x"')
    dead = ids[2]                                # the engine dies after this draft
    s = Sampler(SamplingParams(), PROMPT, matcher=DeadAfter(Matcher(ConstraintSpec("json_schema", SCHEMA), info),
                                                             dead))
    start = len(PROMPT) - 1
    window = [PROMPT[-1]] + ids[:4]
    rng = np.random.default_rng(5)
    logits = np.stack([random_logits(rng, info.vocab_size) for _ in window])
    s.put(start, window)
    outs = s.sample_window(logits, start, window)   # no ConstraintError out of a draft
    assert len(outs) == len(window)
    assert s.refused_at == 3                     # stopped at the dead state draft ids[2] led to
    for j in range(3):                           # positions before it are masked as plain decoding masks them
        assert reference_mask(info, ids[:j])[outs[j]]
    # the same dead state reached by accepted tokens alone is the request's failure
    from skippy_zmq.text.constrain import ConstraintError

    s.truncate(start + 1)
    s.put(start + 1, ids[:3])
    with pytest.raises(ConstraintError, match="injected"):
        s.sample_window(logits[:1], start + 3, [ids[2]])

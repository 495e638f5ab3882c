"""Numeric tests for the host-side sampler (numpy only, fast)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from skippy_zmq.sampling import (
    Sampler,
    SamplingParams,
    TokenHistory,
    adjust_logits,
    candidate_probs,
    token_logprobs,
    uniform,
)

VOCAB = 1000


@pytest.fixture
def logits() -> np.ndarray:
    return np.random.default_rng(0).normal(0.0, 2.0, VOCAB).astype(np.float32)


def decode(sampler: Sampler, logits: np.ndarray) -> int:
    """One plain decode step as the final stage takes it: choose from the logits at the last held
    position, then put the chosen token at the next one (the input of the next step)."""
    token = sampler.choose(logits, sampler.length - 1)
    sampler.put(sampler.length, [token])
    return token


def draws(params: SamplingParams, logits: np.ndarray, n: int, prompt: tuple[int, ...] = ()) -> list[int]:
    sampler = Sampler(params, prompt)
    return [decode(sampler, logits) for _ in range(n)]


def test_greedy_is_argmax(logits: np.ndarray) -> None:
    params = SamplingParams()
    assert params.greedy
    assert draws(params, logits, 3) == [int(np.argmax(logits))] * 3
    tied = np.zeros(8, np.float32)
    tied[[3, 5]] = 1.0
    assert decode(Sampler(params), tied) == 3  # ties go to the lowest index


def test_greedy_flag_off_with_penalties() -> None:
    assert not SamplingParams(temperature=0.5).greedy
    assert not SamplingParams(repetition_penalty=1.2).greedy
    assert not SamplingParams(logit_bias=((1, 2.0),)).greedy


def test_seeded_sampling_reproducible_and_seed_sensitive(logits: np.ndarray) -> None:
    params = SamplingParams(temperature=1.0, seed=123)
    first = draws(params, logits, 50)
    assert first == draws(params, logits, 50)
    assert first != draws(SamplingParams(temperature=1.0, seed=124), logits, 50)
    assert len(set(first)) > 5  # really sampling, not stuck on argmax


def test_unseeded_samplers_differ(logits: np.ndarray) -> None:
    params = SamplingParams(temperature=2.0)
    assert draws(params, logits, 50) != draws(params, logits, 50)


def test_top_k_one_is_greedy(logits: np.ndarray) -> None:
    params = SamplingParams(temperature=1.5, top_k=1, seed=0)
    assert set(draws(params, logits, 30)) == {int(np.argmax(logits))}


def test_top_k_stays_inside_top_k(logits: np.ndarray) -> None:
    k = 10
    allowed = set(np.argsort(-logits)[:k].tolist())
    got = draws(SamplingParams(temperature=2.0, top_k=k, seed=1), logits, 500)
    assert set(got) <= allowed
    assert len(set(got)) > 3


def test_top_p_stays_inside_nucleus() -> None:
    # 6 tokens hold ~all the mass; cumulative 0.3, 0.5, 0.66: top_p=0.6 keeps 3.
    x = np.full(VOCAB, -30.0, np.float32)
    x[[7, 11, 13, 17, 19, 23]] = np.log([0.3, 0.16, 0.1, 0.1, 0.2, 0.14])
    ids, probs = candidate_probs(x, SamplingParams(temperature=1.0, top_p=0.6))
    assert sorted(ids.tolist()) == [7, 11, 19]
    np.testing.assert_allclose(probs[np.argsort(ids)], np.array([0.3, 0.16, 0.2]) / 0.66, rtol=1e-5)
    got = draws(SamplingParams(temperature=1.0, top_p=0.6, seed=2), x, 300)
    assert set(got) == {7, 11, 19}


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.0])  # probe hits at 512, 4096, full sort
def test_top_p_large_vocab_keeps_smallest_top_prefix(temperature: float) -> None:
    x = np.random.default_rng(5).normal(0.0, 3.0, 49152).astype(np.float32)
    top_p = 0.9
    ids, _ = candidate_probs(x, SamplingParams(temperature=temperature, top_p=top_p))
    p = np.exp((x.astype(np.float64) - x.max()) / temperature)
    p /= p.sum()
    kept = np.zeros(x.size, bool)
    kept[ids] = True
    assert p[kept].min() >= p[~kept].max()  # a prefix of the sorted distribution
    assert p[kept].sum() >= top_p - 1e-6  # reaches the mass
    assert p[kept].sum() - p[kept].min() < top_p + 1e-6  # and is the smallest such prefix


def test_draw_inverse_cdf_across_blocks() -> None:
    from skippy_zmq.sampling.transforms import _draw

    flat = np.ones(1000, np.float32)
    assert [_draw(flat, u) for u in (0.0, 0.2555, 0.2565, 0.5, 0.9999)] == [0, 255, 256, 500, 999]
    sparse = np.zeros(1000, np.float32)
    sparse[[3, 600]] = [1.0, 3.0]
    assert [_draw(sparse, u) for u in (0.0, 0.2499, 0.25, 0.999999)] == [3, 3, 600, 600]


def test_sample_frequencies_match_softmax() -> None:
    x = np.full(2000, -40.0, np.float32)
    hot = np.array([5, 300, 301, 1024, 1999])
    x[hot] = np.log([0.1, 0.2, 0.3, 0.15, 0.25])
    got = np.array(draws(SamplingParams(temperature=1.0, seed=9), x, 4000))
    freq = np.array([(got == t).mean() for t in hot])
    assert np.isin(got, hot).all()
    np.testing.assert_allclose(freq, [0.1, 0.2, 0.3, 0.15, 0.25], atol=0.03)


def test_min_p_filter() -> None:
    x = np.log(np.array([0.5, 0.3, 0.1, 0.06, 0.04], np.float32))
    ids, probs = candidate_probs(x, SamplingParams(temperature=1.0, min_p=0.15))
    # threshold 0.15 * 0.5 = 0.075: tokens 0, 1, 2 survive
    assert sorted(ids.tolist()) == [0, 1, 2]
    np.testing.assert_allclose(probs[np.argsort(ids)], np.array([0.5, 0.3, 0.1]) / 0.9, rtol=1e-5)


def test_combined_filters_and_temperature_scaling() -> None:
    x = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    ids, probs = candidate_probs(x, SamplingParams(temperature=0.5, top_k=3))
    expect = np.array([0.4, 0.3, 0.2]) ** 2
    np.testing.assert_allclose(probs[np.argsort(ids)], expect / expect.sum(), rtol=1e-5)


def test_low_temperature_concentrates(logits: np.ndarray) -> None:
    top = int(np.argmax(logits))
    cold = draws(SamplingParams(temperature=0.01, seed=3), logits, 200)
    hot = draws(SamplingParams(temperature=2.0, seed=3), logits, 200)
    assert cold.count(top) == 200
    assert hot.count(top) < 200


def test_logit_bias_forces_and_bans(logits: np.ndarray) -> None:
    low = int(np.argmin(logits))
    forced = draws(SamplingParams(temperature=1.0, logit_bias=((low, 100.0),), seed=4), logits, 50)
    assert set(forced) == {low}
    top = int(np.argmax(logits))
    banned = draws(SamplingParams(temperature=0.0, logit_bias=((top, -100.0),)), logits, 5)
    assert top not in banned
    assert SamplingParams(logit_bias=((1, 500.0),)).logit_bias == ((1, 100.0),)  # clipped


def test_logit_bias_vocab_checked_at_sample_time(logits: np.ndarray) -> None:
    sampler = Sampler(SamplingParams(temperature=1.0, logit_bias=((VOCAB, 1.0),)))
    with pytest.raises(ValueError, match=r"^logit_bias"):
        decode(sampler, logits)


def test_repetition_penalty_direction() -> None:
    x = np.array([2.0, -2.0, 1.0, -1.0], np.float32)
    out = adjust_logits(x, SamplingParams(repetition_penalty=2.0), TokenHistory(prompt_ids=[0, 1, 0]))
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0, -1.0])
    np.testing.assert_array_equal(x, [2.0, -2.0, 1.0, -1.0])  # input untouched


def test_presence_and_frequency_penalties() -> None:
    x = np.zeros(4, np.float32)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    history = TokenHistory(prompt_ids=[0, 1], generated=[2, 1, 2, 2])
    np.testing.assert_array_equal(np.sort(history.seen_ids), [0, 1, 2])
    out = adjust_logits(x, params, history)
    # token 0 is only in the prompt: OpenAI penalties ignore it
    np.testing.assert_allclose(out, [0.0, -0.75, -1.25, 0.0])


def test_sampler_applies_penalties_from_history() -> None:
    # Two equal-best tokens; repetition penalty on the prompt token flips greedy.
    x = np.array([3.0, 3.0, 0.0], np.float32)
    assert decode(Sampler(SamplingParams(repetition_penalty=1.5), prompt_ids=[0]), x) == 1
    sampler = Sampler(SamplingParams(frequency_penalty=1.0))
    assert [decode(sampler, x) for _ in range(4)] == [0, 1, 0, 1]
    assert sampler.generated == [0, 1, 0, 1]


def test_put_records_forced_tokens() -> None:
    sampler = Sampler(SamplingParams(presence_penalty=2.0))
    sampler.put(0, [0])                # a token chosen elsewhere, at the next position
    assert sampler.generated == [0] and sampler.length == 1
    assert decode(sampler, np.array([1.0, 0.0], np.float32)) == 1


def test_each_row_with_its_own_sampler() -> None:
    """Rows of a batch are chosen by their own samplers: a greedy row and a sampled top-k 1 row
    both give their row's argmax, and neither sampler's history sees the other's token."""
    x = np.array([[0.0, 5.0, 1.0], [9.0, 0.0, 1.0]], np.float32)
    samplers = [Sampler(SamplingParams()), Sampler(SamplingParams(temperature=0.5, top_k=1, seed=0))]
    assert [decode(s, row) for s, row in zip(samplers, x)] == [1, 0]
    assert [s.generated for s in samplers] == [[1], [0]]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": 3.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"seed": -3}, "seed"),
    ],
)
def test_validation_names_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name} "):
        SamplingParams(**kwargs)


def test_validate_against_vocab() -> None:
    params = SamplingParams(logit_bias=((10, 1.0),))
    params.validate(vocab_size=11)
    with pytest.raises(ValueError, match=r"^logit_bias.*< 10"):
        params.validate(vocab_size=10)


def test_dict_roundtrip_through_json() -> None:
    params = SamplingParams(
        temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
        presence_penalty=0.2, frequency_penalty=-0.3, logit_bias=((5, -100.0), (2, 3.5)), seed=7,
    )
    wire = json.loads(json.dumps(params.to_dict()))
    assert wire["logit_bias"] == {"2": 3.5, "5": -100.0}
    again = SamplingParams.from_dict(wire)
    assert again == params
    assert hash(again) == hash(params)


def test_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5, "top_k": 3})


# ------------------------------------------------ position-keyed randomness and history

SPEC_PARAMS = [
    SamplingParams(temperature=1.0, seed=11),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=12),
    SamplingParams(temperature=1.2, top_p=0.8, min_p=0.01, repetition_penalty=1.3,
                   presence_penalty=0.7, frequency_penalty=0.4, seed=13),
    SamplingParams(repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5),  # greedy + penalties
    SamplingParams(),  # plain greedy
]


def context_logits(history: list[int], vocab: int = 64) -> np.ndarray:
    """Logits that depend on the whole context (hash of the token prefix) but peak on few tokens."""
    rng = np.random.default_rng([len(history), *history[-4:], sum(history) % 9973])
    return rng.normal(0.0, 2.5, vocab).astype(np.float32)


def test_uniform_pure_keyed_and_in_range() -> None:
    assert uniform(5, 0, 17) == uniform(5, 0, 17)
    values = {uniform(5, 0, p) for p in range(100)}
    assert len(values) == 100 and all(0.0 <= u < 1.0 for u in values)
    assert uniform(5, 0, 17) != uniform(5, 1, 17) != uniform(6, 0, 17)
    assert uniform(5, 0, -1) != uniform(5, 0, 0)  # an empty history samples at position -1
    assert uniform(2**64 + 5, 0, 3) != uniform(5, 0, 3)  # seeds wider than 64 bits are folded, not cut


def _ks(values: np.ndarray) -> float:
    x = np.sort(values)
    n = x.size
    return float(max((np.arange(1, n + 1) / n - x).max(), (x - np.arange(n) / n).max()))


def test_uniform_is_uniform_over_positions() -> None:
    n = 20000
    for seed, choice in [(0, 0), (1, 0), (0, 1), (2**62 + 3, 7)]:
        u = np.array([uniform(seed, choice, p) for p in range(n)])
        assert _ks(u) < 3.0 / np.sqrt(n)  # KS 99.9% critical value is ~1.95/sqrt(n)
        assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.05  # neighbouring positions uncorrelated
        assert abs(u.mean() - 0.5) < 0.01
    a = np.array([uniform(0, 0, p) for p in range(2000)])
    b = np.array([uniform(1, 0, p) for p in range(2000)])
    c = np.array([uniform(0, 1, p) for p in range(2000)])
    assert (a != b).all() and (a != c).all()
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.1 and abs(np.corrcoef(a, c)[0, 1]) < 0.1
    across_seeds = np.array([uniform(s, 0, 0) for s in range(n)])  # same position, consecutive seeds
    assert _ks(across_seeds) < 3.0 / np.sqrt(n)


def test_same_position_same_token_regardless_of_draw_order(logits: np.ndarray) -> None:
    params = SamplingParams(temperature=2.0, seed=77)
    prompt = list(range(10))
    a = Sampler(params, prompt)
    forward = [a.choose(logits, p) for p in range(10)]
    b = Sampler(params, prompt)
    for _ in range(37):  # many unrelated draws first
        b.choose(logits, 3)
    backward = [b.choose(logits, p) for p in reversed(range(10))][::-1]
    assert forward == backward
    assert len(set(forward)) > 3
    other = Sampler(params, prompt, choice=1)
    assert other.seed == a.seed
    assert [other.choose(logits, p) for p in range(10)] != forward  # another choice, another stream
    assert a.length == 10  # choose never changes state


def test_seed_none_picks_one_seed_per_sampler() -> None:
    a, b = Sampler(SamplingParams(temperature=1.0)), Sampler(SamplingParams(temperature=1.0))
    assert a.seed != b.seed and 0 <= a.seed < 2**63
    assert Sampler(SamplingParams(seed=9)).seed == 9


def step_by_step(params: SamplingParams, prompt: list[int], steps: int) -> list[int]:
    sampler = Sampler(params, prompt)
    out: list[int] = []
    for _ in range(steps):
        out.append(decode(sampler, context_logits(prompt + out)))
    return out


@pytest.mark.parametrize("params", SPEC_PARAMS)
@pytest.mark.parametrize("k", [1, 3, 6])
def test_sample_window_with_matching_drafts_equals_step_by_step(params: SamplingParams, k: int) -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    steps = 20
    want = step_by_step(params, prompt, steps)
    assert len(set(want)) > 2
    sampler = Sampler(params, prompt)
    seq = prompt[:]  # inputs so far; the last one is the window's current token
    out: list[int] = []
    while len(out) < steps:
        start = len(seq) - 1
        drafts = want[len(out) : len(out) + k]
        window = [seq[-1], *drafts]
        logits = np.stack([context_logits(seq + drafts[:j]) for j in range(len(window))])
        got = sampler.sample_window(logits, start, window)
        assert sampler.length == max(len(prompt), start + len(window))
        # the driver accepts the matching prefix plus the target's next token
        m = 0
        while m < len(drafts) and drafts[m] == got[m]:
            m += 1
        accepted = got[: m + 1]
        out.extend(accepted)
        seq.extend(accepted)
    assert out[:steps] == want


@pytest.mark.parametrize("params", SPEC_PARAMS)
def test_rejected_windows_reproduce_step_by_step(params: SamplingParams) -> None:
    """Wrong drafts are rejected and re-sampled later; output equals plain decoding."""
    prompt = [7, 7, 2, 8]
    steps = 25
    want = step_by_step(params, prompt, steps)
    rng = np.random.default_rng(0)
    sampler = Sampler(params, prompt)
    seq, out = prompt[:], []
    while len(out) < steps:
        start = len(seq) - 1
        # half right, then garbage: a mix of accepted and rejected drafts
        good = want[len(out) : len(out) + int(rng.integers(0, 4))]
        drafts = good + rng.integers(0, 64, int(rng.integers(0, 4))).tolist()
        window = [seq[-1], *drafts]
        logits = np.stack([context_logits(seq + drafts[:j]) for j in range(len(window))])
        got = sampler.sample_window(logits, start, window)
        m = 0
        while m < len(drafts) and drafts[m] == got[m]:
            m += 1
        out.extend(got[: m + 1])
        seq.extend(got[: m + 1])
    assert out[:steps] == want
    # once the last accepted token is put, the history is a plain decode's, penalties included
    sampler.put(len(seq) - 1, [seq[-1]])
    plain = Sampler(params, prompt)
    plain.put(len(prompt), out)
    assert sampler.generated == plain.generated == out
    x = context_logits(seq)
    np.testing.assert_array_equal(adjust_logits(x, params, sampler.history), adjust_logits(x, params, plain.history))


def test_truncate_and_put_forget_rejected_tokens() -> None:
    params = SamplingParams(repetition_penalty=1.7, presence_penalty=0.6, frequency_penalty=0.3)
    x = np.random.default_rng(3).normal(0.0, 2.0, 32).astype(np.float32)
    prompt = [1, 2, 3, 2]
    clean = Sampler(params, prompt)
    clean.put(4, [5, 6, 5])
    dirty = Sampler(params, prompt)
    dirty.put(4, [5, 6, 5])
    # make the penalty arrays exist before the rejection so removal updates them in place
    adjust_logits(x, params, dirty.history)
    dirty.put(7, [9, 9, 2, 30, 6])  # a window whose drafts all get rejected
    adjust_logits(x, params, dirty.history)
    dirty.truncate(7)
    np.testing.assert_array_equal(adjust_logits(x, params, dirty.history), adjust_logits(x, params, clean.history))
    assert dirty.length == clean.length == 7
    # overwrite in place: put at 6 replaces the last 5
    dirty.put(6, [11])
    clean2 = Sampler(params, prompt)
    clean2.put(4, [5, 6, 11])
    np.testing.assert_array_equal(adjust_logits(x, params, dirty.history), adjust_logits(x, params, clean2.history))
    assert dirty.generated == [5, 6, 11]
    # truncating into the prompt never forgets the prompt
    dirty.truncate(2)
    assert dirty.length == 4 and dirty.generated == []
    np.testing.assert_array_equal(adjust_logits(x, params, dirty.history),
                                  adjust_logits(x, params, Sampler(params, prompt).history))
    assert sorted(dirty.history.seen_ids.tolist()) == [1, 2, 3]
    assert dirty.history.generated_ids.size == 0


def test_put_ignores_prompt_positions_and_rejects_gaps() -> None:
    sampler = Sampler(SamplingParams(presence_penalty=1.0), prompt_ids=[4, 5, 6])
    sampler.put(1, [99, 98, 7, 8])  # positions 1, 2 are the prompt's: ignored
    assert sampler.length == 5 and sampler.generated == [7, 8]
    with pytest.raises(ValueError, match="6.*5"):
        sampler.put(6, [1])
    with pytest.raises(ValueError, match="7.*5"):
        sampler.choose(np.zeros(10, np.float32), 7)
    sampler.put(5, [1])  # exactly at the end is fine
    assert sampler.length == 6


def test_choose_uses_history_through_its_position() -> None:
    # choose at an earlier position ignores tokens held after it (slow path)
    params = SamplingParams(presence_penalty=2.0)
    sampler = Sampler(params, prompt_ids=[2])
    sampler.put(1, [0, 1])
    x = np.array([1.0, 0.5, 0.0], np.float32)
    assert sampler.choose(x, 2) == 2  # 0 and 1 both penalised
    assert sampler.choose(x, 1) == 1  # only 0 held through position 1
    assert sampler.choose(x, 0) == 0  # prompt only
    assert sampler.length == 3


def test_sample_window_on_fresh_prompt_window_at_last_prompt_token(logits: np.ndarray) -> None:
    params = SamplingParams(temperature=1.0, seed=5, frequency_penalty=0.5)
    prompt = [1, 2, 3]
    first = decode(Sampler(params, prompt), logits)
    sampler = Sampler(params, prompt)
    got = sampler.sample_window(np.stack([logits, logits]), 2, [3, first])
    assert got[0] == first and sampler.length == 4
    with pytest.raises(ValueError):
        sampler.sample_window(np.stack([logits]), 2, [3, first])


def test_penalty_arrays_track_counts_through_many_edits() -> None:
    rng = np.random.default_rng(1)
    sampler = Sampler(SamplingParams(frequency_penalty=1.0), prompt_ids=rng.integers(0, 20, 30).tolist())
    history = sampler.history
    history.generated_ids  # build the arrays, then edit incrementally
    for _ in range(300):
        pos = int(rng.integers(len(history.prompt) - 2, sampler.length + 1))
        sampler.put(pos, rng.integers(0, 20, int(rng.integers(0, 5))).tolist())
        ref = TokenHistory(history.prompt, history.generated)
        got = dict(zip(history.generated_ids.tolist(), history.generated_counts.tolist()))
        want = dict(zip(ref.generated_ids.tolist(), ref.generated_counts.tolist()))
        assert got == want
        assert sorted(history.seen_ids.tolist()) == sorted(set(history.prompt + history.generated))


# ---------------------------------------------------------------- logprobs


def reference_logprobs(x: np.ndarray) -> np.ndarray:
    """Float64 log-softmax, written out independently of token_logprobs."""
    x = np.asarray(x, np.float64)
    finite = x[np.isfinite(x)]
    m = finite.max()
    return x - (m + np.log(np.sum(np.exp(finite - m))))


def test_token_logprobs_is_a_float64_log_softmax(logits: np.ndarray) -> None:
    ref = reference_logprobs(logits)
    order = sorted(range(VOCAB), key=lambda i: (-ref[i], i))
    for token in (int(np.argmax(logits)), 17, order[-1]):
        for top_n in (0, 1, 5, 20):
            lp, top = token_logprobs(logits, token, top_n)
            assert isinstance(lp, float) and lp == pytest.approx(ref[token], abs=1e-12)
            assert [i for i, _ in top] == order[:top_n]
            assert all(isinstance(v, float) and v == pytest.approx(ref[i], abs=1e-12) for i, v in top)
    assert np.exp([v for _, v in token_logprobs(logits, 0, VOCAB)[1]]).sum() == pytest.approx(1.0, abs=1e-9)
    # huge logits do not overflow; ties go to the lower id; masked ids never show up in the top list
    big = np.full(8, -np.inf, np.float32)
    big[[2, 5, 6]] = [1e4, 1e4, 1e4 - 1]
    lp, top = token_logprobs(big, 5, 5)
    assert [i for i, _ in top] == [2, 5, 6] and lp == pytest.approx(top[0][1])
    assert token_logprobs(big, 0, 0)[0] == -np.inf
    with pytest.raises(ValueError):
        token_logprobs(np.full(4, -np.inf), 0, 1)


def test_top_logprobs_range_is_checked() -> None:
    assert Sampler(SamplingParams(), logprobs=20).logprobs == 20
    for bad in (-1, 21, 2.0, True):
        with pytest.raises(ValueError, match="logprobs"):
            Sampler(SamplingParams(), logprobs=bad)


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.8, min_p=0.01, seed=11),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.7, frequency_penalty=0.4,
                   logit_bias={5: 3.0, 9: -100.0}),
    SamplingParams(temperature=1.2, repetition_penalty=1.1, frequency_penalty=0.5, logit_bias={3: 2.0}, seed=5),
])
def test_window_logprobs_equal_step_by_step(params: SamplingParams) -> None:
    """A verify window's tokens and logprobs are the plain decode's: values are the log-softmax of
    the logits after bias and penalties (history through each position), before temperature and
    the top-k / top-p / min-p filters."""
    rng = np.random.default_rng(1)
    prompt = (1, 2, 3, 4)
    rows = rng.normal(0.0, 3.0, (12, VOCAB)).astype(np.float32)
    step = Sampler(params, prompt, logprobs=5)
    tokens, entries = [], []
    for row in rows:
        position = step.length - 1
        token, entry = step.choose_logprobs(row, position, 5)
        assert token == step.choose(row, position)
        # the values are over the adjusted logits only: temperature and filters do not enter
        assert entry[0] == pytest.approx(reference_logprobs(adjust_logits(row, params, step.history))[token],
                                         abs=1e-9)
        step.put(step.length, [token])
        tokens.append(token)
        entries.append(entry)
    # the same in windows of 1..5 positions whose inputs are what step-by-step fed back
    window = Sampler(params, prompt, logprobs=5)
    inputs = [prompt[-1]] + tokens
    start, got_tokens, got_entries = len(prompt) - 1, [], []
    for size in (1, 3, 5, 2, 1):
        j = start - (len(prompt) - 1)
        out, lps = window.sample_window_logprobs(rows[j:j + size], start, inputs[j:j + size])
        assert out == window.sample_window(rows[j:j + size], start, inputs[j:j + size])
        got_tokens += out
        got_entries += lps
        start += size
    assert got_tokens == tokens
    assert got_entries == entries   # exactly: the same float64 arithmetic on the same logits
    # a rejected tail re-sampled: the window is put again from an earlier start
    out, lps = window.sample_window_logprobs(rows[3:6], len(prompt) - 1 + 3, inputs[3:6])
    assert out == tokens[3:6] and lps == entries[3:6]


def test_greedy_logprobs_are_over_raw_logits(logits: np.ndarray) -> None:
    s = Sampler(SamplingParams(), (1, 2), logprobs=3)
    token, (lp, top) = s.choose_logprobs(logits, 1, 3)
    assert token == int(np.argmax(logits)) == top[0][0] and lp == top[0][1]
    assert s.scored(logits, 1) is logits   # no copy when nothing adjusts the logits


def test_a_tiny_repetition_penalty_never_overflows_to_inf() -> None:
    """Found by the HTTP fuzzer: repetition_penalty 2.3e-178 divided a positive logit to +inf and
    sampling failed with 'no finite maximum' (a 500). The pushed logit is clipped to float32's max."""
    logits = np.array([1.0, 3.0, 2.0, -1.0], np.float32)
    for temperature in (0.0, 1.0):
        params = SamplingParams(repetition_penalty=2.300957280988195e-178, temperature=temperature, seed=1)
        adjusted = adjust_logits(logits, params, TokenHistory([0]))
        assert np.isfinite(adjusted).all() and adjusted[0] == np.finfo(np.float32).max and adjusted[3] == -1.0
        assert decode(Sampler(params, [0]), logits) == 0

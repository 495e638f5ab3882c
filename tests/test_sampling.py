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
    sample_rows,
)

VOCAB = 1000


@pytest.fixture
def logits() -> np.ndarray:
    return np.random.default_rng(0).normal(0.0, 2.0, VOCAB).astype(np.float32)


def draws(params: SamplingParams, logits: np.ndarray, n: int, prompt: tuple[int, ...] = ()) -> list[int]:
    sampler = Sampler(params, prompt)
    return [sampler.sample(logits) for _ in range(n)]


def test_greedy_is_argmax(logits: np.ndarray) -> None:
    params = SamplingParams()
    assert params.greedy
    assert draws(params, logits, 3) == [int(np.argmax(logits))] * 3
    tied = np.zeros(8, np.float32)
    tied[[3, 5]] = 1.0
    assert Sampler(params).sample(tied) == 3  # ties go to the lowest index


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
    from skippy_zmq.sampling import _draw

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
        sampler.sample(logits)


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
    assert Sampler(SamplingParams(repetition_penalty=1.5), prompt_ids=[0]).sample(x) == 1
    sampler = Sampler(SamplingParams(frequency_penalty=1.0))
    assert [sampler.sample(x) for _ in range(4)] == [0, 1, 0, 1]
    assert sampler.generated == [0, 1, 0, 1]


def test_accept_records_forced_tokens() -> None:
    sampler = Sampler(SamplingParams(presence_penalty=2.0))
    sampler.accept(0)
    assert sampler.generated == [0]
    assert sampler.sample(np.array([1.0, 0.0], np.float32)) == 1


def test_sample_rows() -> None:
    x = np.array([[0.0, 5.0, 1.0], [9.0, 0.0, 1.0]], np.float32)
    samplers = [Sampler(SamplingParams()), Sampler(SamplingParams(temperature=0.5, top_k=1, seed=0))]
    out = sample_rows(samplers, x)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, [1, 0])
    with pytest.raises(ValueError):
        sample_rows(samplers[:1], x)


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

"""Driver-side drafts: n-gram lookup (own tokens and the shared index), the window policy, the config."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from skippy_zmq.engine.speculative import DraftPolicy, NgramProposer, SharedIndex, propose_draft
from skippy_zmq.config.speculative import SpeculativeConfig, SpeculativeConfigError

CFG = SpeculativeConfig(method="ngram", max_draft=8)


def cfg(**kw) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict({"method": "ngram", **kw})


# ------------------------------------------------------------ brute-force references


def continuation(seq: list[int], start: int, k: int) -> list[int]:
    """seq[start:start+k], reading past the end from the drafts themselves."""
    out = []
    for j in range(k):
        i = start + j
        out.append(seq[i] if i < len(seq) else out[i - len(seq)])
    return out


def reference_propose(c: SpeculativeConfig, toks: list[int], k: int) -> list[int]:
    L = len(toks)
    for n in range(min(c.max_match, L - 1), c.min_match - 1, -1):
        for end in range(L - 1, n - 1, -1):   # latest earlier occurrence first
            if toks[end - n:end] == toks[L - n:]:
                return continuation(toks, end, k) if k > 0 else []
    return []


def reference_shared(c: SpeculativeConfig, seqs: list[list[int]], tail: list[int], k: int) -> list[int]:
    kept: list[list[int]] = []
    for seq in seqs:
        seq = seq[-c.shared_tokens:]
        if len(seq) > c.min_match:
            kept.append(seq)
        while sum(map(len, kept)) > c.shared_tokens:
            kept.pop(0)
    tail = tail[-c.max_match:]
    for n in range(min(c.max_match, len(tail)), c.min_match - 1, -1):
        for seq in reversed(kept):
            for end in range(len(seq) - 1, n - 1, -1):   # a match must have a token after it
                if seq[end - n:end] == tail[len(tail) - n:]:
                    return seq[end:end + k] if k > 0 else []
    return []


# ------------------------------------------------------------ NgramProposer


def test_copy_like_sequence_proposes_the_true_continuation():
    passage = [17, 4, 99, 23, 8, 61, 5, 42, 11, 30, 77]
    tokens = [1, 2, 3] + passage + [50, 51] + passage[:5]
    proposer = NgramProposer(CFG, tokens)
    assert proposer.propose(4) == passage[5:9]
    proposer.extend(passage[5:9])
    assert proposer.propose(2) == passage[9:11]


def test_no_match_is_empty():
    assert NgramProposer(CFG, [1, 2, 3, 4, 5, 6]).propose(4) == []
    assert NgramProposer(CFG).propose(4) == []
    assert NgramProposer(CFG, [7]).propose(4) == []
    assert NgramProposer(CFG, [1, 2, 1, 2]).propose(0) == []


def test_the_longest_match_wins_over_a_shorter_more_recent_one():
    tokens = [1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3]
    assert NgramProposer(CFG, tokens).propose(1) == [9]          # "1 2 3" -> 9, not "2 3" -> 7
    assert NgramProposer(cfg(max_match=2), tokens).propose(1) == [7]   # capped at 2: the later "2 3"


def test_the_most_recent_occurrence_of_equal_length_wins():
    assert NgramProposer(CFG, [4, 5, 1, 4, 5, 2, 4, 5]).propose(1) == [2]


def test_min_match_is_respected():
    tokens = [5, 1, 9, 1]
    assert NgramProposer(CFG, tokens).propose(4) == []            # only "1" repeats; min_match is 2
    assert NgramProposer(cfg(min_match=1), tokens).propose(4) == [9, 1, 9, 1]


def test_a_repeating_sequence_continues_its_period():
    a, b = 10, 20
    assert NgramProposer(CFG, [a, b, a, b, a, b]).propose(5) == [a, b, a, b, a]
    assert NgramProposer(cfg(min_match=1), [3, 3, 3]).propose(4) == [3, 3, 3, 3]


def test_token_ids_are_checked():
    with pytest.raises(ValueError, match="token ids must lie in 0.."):
        NgramProposer(CFG, [1, -1])


@pytest.mark.parametrize("seed", range(6))
def test_incremental_extend_matches_scratch_and_brute_force(seed):
    rng = random.Random(seed)
    c = cfg(min_match=rng.randint(1, 3), max_match=rng.randint(3, 6))
    tokens = [rng.randrange(3 + seed % 3) for _ in range(120)]
    grown = NgramProposer(c)
    i = 0
    while i < len(tokens):
        step = rng.randint(1, 5)
        grown.extend(tokens[i:i + step])
        i += step
        prefix = tokens[:min(i, len(tokens))]
        k = rng.randint(0, 9)
        expected = reference_propose(c, prefix, k)
        assert grown.propose(k) == expected == NgramProposer(c, prefix).propose(k), (prefix, k)
    assert grown.tokens == tuple(tokens)


def test_truncate_keeps_a_prefix_and_forgets_the_rest():
    rng = random.Random(7)
    tokens = [rng.randrange(3) for _ in range(60)]
    proposer = NgramProposer(CFG, tokens)
    proposer.truncate(33)
    proposer.extend([2, 1])
    expected = tokens[:33] + [2, 1]
    assert len(proposer) == 35 and proposer.tail() == expected[-CFG.max_match:]
    for k in (1, 4, 8):
        assert proposer.propose(k) == reference_propose(CFG, expected, k)


# ------------------------------------------------------------ SharedIndex


def test_shared_index_finds_another_requests_output():
    shared = SharedIndex(CFG)
    shared.add([1, 2, 3, 4, 5, 6, 7])
    shared.add([8, 2, 3, 9, 9])
    assert shared.propose([0, 0, 2, 3], 3) == [9, 9]           # the newer "2 3"; stops at its sequence end
    assert shared.propose([1, 2, 3], 3) == [4, 5, 6]           # the longer "1 2 3" wins
    assert shared.propose([6, 7], 3) == []                     # nothing followed it
    assert shared.propose([5, 5], 3) == []
    assert shared.propose([1, 2], 0) == []


def test_shared_index_forgets_the_oldest_beyond_its_bound():
    shared = SharedIndex(cfg(shared_tokens=10))
    shared.add([1, 2, 3, 4])
    shared.add([5, 6, 7, 8])
    assert shared.tokens == 8 and shared.propose([1, 2], 2) == [3, 4]
    shared.add([9, 10, 11, 12])                                # 12 > 10: the first sequence goes
    assert shared.tokens == 8
    assert shared.propose([1, 2], 2) == []
    assert shared.propose([5, 6], 2) == [7, 8]
    shared.add(list(range(100, 130)))                          # longer than the bound: its last 10 kept
    assert shared.tokens == 10
    assert shared.propose([120, 121], 3) == [122, 123, 124] and shared.propose([105, 106], 1) == []
    assert shared.propose([9, 10], 1) == []


@pytest.mark.parametrize("seed", range(4))
def test_shared_index_matches_brute_force_across_evictions(seed):
    rng = random.Random(100 + seed)
    c = cfg(shared_tokens=rng.randint(8, 40), min_match=rng.randint(1, 2), max_match=rng.randint(2, 5))
    shared, seqs = SharedIndex(c), []
    for _ in range(60):
        seq = [rng.randrange(4) for _ in range(rng.randint(1, 15))]
        shared.add(seq)
        seqs.append(seq)
        for _ in range(3):
            tail, k = [rng.randrange(4) for _ in range(rng.randint(1, 7))], rng.randint(1, 6)
            assert shared.propose(tail, k) == reference_shared(c, seqs, tail, k), (seqs, tail, k)
        assert shared.tokens <= c.shared_tokens


def test_propose_draft_falls_back_to_the_shared_index():
    shared = SharedIndex(CFG)
    shared.add([40, 41, 42, 43, 44])
    own = NgramProposer(CFG, [7, 8, 40, 41])
    assert propose_draft(own, shared, 2) == [42, 43]
    assert propose_draft(own, None, 2) == []
    own.extend([9, 40, 41])                                    # now its own tokens match: they win
    assert propose_draft(own, shared, 2) == [9, 40]


# ------------------------------------------------------------ DraftPolicy


def test_policy_grows_on_full_accepts_and_shrinks_on_rejects():
    policy = DraftPolicy(CFG)
    assert policy.k == 4
    policy.update(4, 4)
    assert policy.k == 8
    policy.update(8, 8)
    assert policy.k == 8
    policy.update(8, 2)
    assert policy.k == 4                                     # half the last window (more than 2 + 1)
    policy.update(4, 3)
    assert policy.k == 4                                     # the accepted run + 1
    policy.update(4, 0)
    assert policy.k == 2
    policy.update(2, 0)
    assert policy.k == 1
    assert (policy.windows, policy.drafted, policy.accepted) == (6, 30, 17)
    assert policy.acceptance == pytest.approx(17 / 30)


def test_policy_stops_after_eight_poor_windows_and_probes():
    c = cfg(probe_every=5)
    policy = DraftPolicy(c)
    for i in range(8):
        assert policy.k > 0 and not policy.stopped, i
        policy.update(policy.k, 0)
    assert policy.k == 0 and policy.stopped
    for _ in range(4):
        policy.on_plain_step()
    assert policy.k == 0
    policy.on_plain_step()
    assert policy.k == 2 and not policy.stopped                # the probe window
    policy.update(2, 0)                                        # a poor probe: stopped again, count restarts
    assert policy.k == 0 and policy.stopped
    for _ in range(5):
        policy.on_plain_step()
    assert policy.k == 2
    policy.update(2, 2)                                        # the text turned repetitive: drafting resumes
    assert policy.k == 4 and not policy.stopped and policy.ema == 1.0
    assert policy.windows == 10


def test_policy_keeps_drafting_while_acceptance_is_fair():
    policy = DraftPolicy(CFG)
    for _ in range(40):
        drafted = policy.k
        policy.update(drafted, drafted // 2)                   # 50% of each window
    assert policy.k > 0 and not policy.stopped and policy.ema >= 0.25


def test_policy_when_off_and_its_counters():
    assert DraftPolicy(SpeculativeConfig()).k == 0
    assert DraftPolicy(cfg(max_draft=1)).k == 1
    policy = DraftPolicy(CFG)
    policy.no_draft_proposal()
    assert policy.empty == 1 and policy.k == 4
    with pytest.raises(ValueError, match="got 3 of 2"):
        policy.update(2, 3)
    with pytest.raises(ValueError):
        policy.update(0, 0)


# ------------------------------------------------------------ config


def test_config_defaults_and_round_trip():
    default = SpeculativeConfig()
    assert not default.enabled and (default.max_draft, default.min_match, default.max_match) == (15, 2, 8)
    assert SpeculativeConfig.from_dict({}) == default
    c = cfg(max_draft=4, shared=False, min_acceptance=1)
    assert c.enabled and c.min_acceptance == 1.0 and isinstance(c.min_acceptance, float)
    assert SpeculativeConfig.from_dict(c.to_dict()) == c
    assert SpeculativeConfig.from_dict({"method": False}).method == "off"   # YAML's bare `off`
    hash(c)


@pytest.mark.parametrize("raw, text", [
    ({"max_drafts": 4}, "max_drafts: unknown key (allowed: depth, long_match, max_draft, max_match, method, min_acceptance,"),
    ({"method": "eagle"}, "method: expected one of off, ngram, suffix, got 'eagle'"),
    ({"method": True}, "method: expected one of off, ngram, suffix, got True"),
    ({"max_draft": "eight"}, "max_draft: expected an integer, got 'eight'"),
    ({"max_draft": True}, "max_draft: expected an integer, got True"),
    ({"max_draft": 33}, "max_draft: must be at most 32, got 33"),
    ({"max_draft": 0}, "max_draft: must be at least 1, got 0"),
    ({"min_draft": 16}, "min_draft: must be at most max_draft (15), got 16"),
    ({"min_match": 0}, "min_match: must be at least 1, got 0"),
    ({"min_match": 3, "max_match": 2}, "max_match: must be at least min_match (3), got 2"),
    ({"long_match": 0}, "long_match: must be at least 1, got 0"),
    ({"shared": "yes"}, "shared: expected true or false, got 'yes'"),
    ({"shared_tokens": 0}, "shared_tokens: must be at least 1, got 0"),
    ({"min_acceptance": 1.5}, "min_acceptance: must be between 0 and 1, got 1.5"),
    ({"min_acceptance": "high"}, "min_acceptance: expected a number, got 'high'"),
    ({"probe_every": 2.5}, "probe_every: expected an integer, got 2.5"),
    ({"depth": 17}, "depth: must be at most 16, got 17"),
    ({"depth": -1}, "depth: must be at least 0, got -1"),
    ([1, 2], "expected a mapping, got [1, 2]"),
])
def test_config_errors_name_the_key_and_value(raw, text):
    with pytest.raises(SpeculativeConfigError) as info:
        SpeculativeConfig.from_dict(raw)
    assert str(info.value).startswith(text), str(info.value)
    assert isinstance(info.value, ValueError)


def test_imports_neither_jax_nor_zmq():
    code = ("import sys, skippy_zmq.engine.speculative; "
            "assert not {'jax', 'zmq'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)

"""The `suffix` drafter (engine/long_match.py): a match followed for as long as it holds, windows
sized by its length; on token sequences of the real tokenizer (copies, repeated code blocks, a
change mid-copy, no match) and on brute-force references."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from skippy_zmq.config.speculative import SpeculativeConfig
from skippy_zmq.engine.long_match import MatchDrafter, MatchProposer, make_drafter, match_drafts
from skippy_zmq.engine.speculative import Drafter, NgramProposer

SUFFIX = SpeculativeConfig(method="suffix", shared=False)
NGRAM = SpeculativeConfig(method="ngram", shared=False)
BUCKETS, WIDEST = (1, 2, 4, 8, 16), 16
MODEL = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"

CODE = '''def summarize(orders):
    if not orders:
        return {"count": 0, "sum": 0.0, "largest": None}
    total = sum(order["total"] for order in orders)
    return {"count": len(orders), "sum": round(total, 2), "largest": orders[0]["id"]}'''
HINTED = CODE.replace("def summarize(orders):", "def summarize(orders: list[dict]) -> dict:")


@pytest.fixture(scope="module")
def encode():
    """Token ids of the real SmolLM2 tokenizer (the GGUF's vocabulary)."""
    if not (MODEL / "tokenizer.json").exists():
        pytest.skip("models/smollm2-135m-instruct is not there (make model)")
    from skippy_zmq.text.tokenizer import TextTokenizer

    tok = TextTokenizer.load(MODEL)
    return lambda text: list(tok.encode(text))


def measured(toks: list[int], src: int) -> int:
    """How many tokens before `src` agree with the last tokens of `toks` (brute force)."""
    n = 0
    while n < src and toks[src - n - 1] == toks[len(toks) - n - 1]:
        n += 1
    return n


def replay(drafter: Drafter, answer: list[int]) -> list[tuple[int, int]]:
    """Greedy decoding of `answer` as the target's output: (drafted, accepted) of every step."""
    drafter.accepted(answer[:1])
    pos, steps = 1, []
    while pos < len(answer):
        drafts = drafter.drafts(len(answer) - pos, BUCKETS, WIDEST)
        run, accepted = drafter.judge(drafts, answer[pos:pos + len(drafts) + 1])
        assert run == answer[pos:pos + len(run)]
        drafter.accepted(run)
        steps.append((len(drafts), accepted))
        pos += len(run)
    return steps


# ------------------------------------------------------------ sizes


def test_match_drafts_sizes_by_the_matchs_length():
    assert match_drafts(0, 15, 12, 15) == 0
    assert match_drafts(2, 15, 12, 15) == 3          # a short match is a guess: one token past it
    assert match_drafts(8, 7, 12, 15) == 7           # the policy's k bounds it
    assert match_drafts(12, 3, 12, 15) == 15         # a long match drafts the widest window at once
    assert match_drafts(300, 1, 12, 15) == 15


# ------------------------------------------------------------ the proposer on real tokens


def test_a_long_copy_is_followed_past_max_match(encode):
    prompt = encode("Repeat this code exactly.\n\n" + CODE + "\n\nHere it is:\n\n")
    body = encode(CODE)
    proposer = MatchProposer(SUFFIX, prompt)
    proposer.extend(body[:3])
    assert proposer.propose(10) == body[3:13]
    for i in range(3, 40):
        proposer.extend(body[i:i + 1])
        assert proposer.match_len >= i + 1 > SUFFIX.max_match or proposer.match_len >= i + 1
    assert proposer.propose(15) == body[40:55]


def test_a_change_mid_copy_drops_the_match_and_resumes_min_match_tokens_later(encode):
    prompt = encode("Add type hints.\n\n" + CODE + "\n\nAnswer:\n\n")
    source, answer = encode(CODE), encode(HINTED)
    changed = next(i for i, (a, b) in enumerate(zip(source, answer)) if a != b)   # ":" for "):"
    proposer = MatchProposer(SUFFIX, prompt)
    proposer.extend(answer[:changed])
    assert proposer.match_len >= changed and proposer.propose(1) == [source[changed]]
    proposer.extend(answer[changed:changed + 1])
    assert proposer.match_len < changed                   # the long match is gone
    if_ = answer.index(source[changed + 2], changed)      # " if": the first line of the body again
    proposer.extend(answer[changed + 1:if_ + 1])          # the hint, then "\n   ", " if"
    assert proposer.match_len == 2                        # resumed after min_match tokens, not 24
    assert proposer.propose(12) == answer[if_ + 1:if_ + 13]


def test_repeated_code_blocks_follow_the_longest_match_not_the_latest(encode):
    """Two functions share a line longer than max_match, then differ: copying the first, the n-gram
    drafter takes the shared line's latest occurrence (the second function's continuation), the
    tracked match keeps to the function being copied."""
    line = '    total = sum(order["total"] for order in orders if order["code"] == currency)\n'
    block_a = encode("def first(orders, currency):\n" + line + "    return total\n")
    block_b = encode("def other(orders, currency):\n" + line + "    print(total)\n")
    prompt = encode("Copy the first function.\n\n") + block_a + block_b + encode("\n\n")
    apart = [j for j, (a, b) in enumerate(zip(block_a, block_b)) if a != b]
    assert apart[0] < 4 and apart[1] - apart[0] > SUFFIX.max_match   # the names, then the shared line
    copied = block_a[:apart[1]]
    tracked = MatchProposer(SUFFIX, prompt)
    tracked.extend(copied)
    assert tracked.propose(3) == block_a[apart[1]:]                # " return total\n"
    assert NgramProposer(SUFFIX, prompt + copied).propose(3) == block_b[apart[1]:apart[1] + 3]   # " print(total"


def test_no_match_proposes_nothing(encode):
    proposer = MatchProposer(SUFFIX, encode("A short question about the weather"))
    proposer.extend(encode(" tomorrow in Paris?"))
    assert proposer.match_len == 0 and proposer.propose(8) == []


@pytest.mark.parametrize("seed", range(6))
def test_the_tracked_match_is_a_real_match_at_least_as_long_as_the_ngram_drafters(seed):
    """Random small-alphabet streams fed in random steps: the tracked match's length is what a
    brute-force comparison measures at its source, never shorter than the longest earlier
    occurrence of the last max_match tokens (the n-gram drafter's match), there is one exactly when
    the n-gram drafter has one, and a proposal reads the source's continuation (the drafts where it
    runs into the end)."""
    rng = random.Random(seed)
    tokens = [rng.randrange(3 + seed % 3) for _ in range(200)]
    grown, i = MatchProposer(SUFFIX), 0
    while i < len(tokens):
        step = rng.randint(1, 4)
        grown.extend(tokens[i:i + step])
        i += step
        seen = tokens[:i]
        length, src = grown.match_len, grown._src
        assert bool(length) == bool(NgramProposer(SUFFIX, seen).propose(1))
        if not length:
            continue
        longest = max(min(measured(seen, end), SUFFIX.max_match) for end in range(1, len(seen)))
        assert 0 < src < len(seen) and length == measured(seen, src) >= longest
        k = rng.randint(1, 9)
        expected: list[int] = []
        for j in range(k):
            expected.append(seen[src + j] if src + j < len(seen) else expected[src + j - len(seen)])
        assert grown.propose(k) == expected


def test_a_proposal_can_assume_tokens_in_flight(encode):
    prompt = encode("Copy:\n" + CODE + "\n\n")
    body = encode(CODE)
    proposer = MatchProposer(SUFFIX, prompt + body[:5])
    assert proposer.propose(6, assumed=body[5:9]) == body[9:15]
    assert proposer.propose(4) == body[5:9]                # the assumed tokens were not kept


def test_truncate_forgets_the_match():
    proposer = MatchProposer(SUFFIX, [1, 2, 3, 4, 5, 9, 1, 2, 3, 4])
    assert proposer.propose(1) == [5] and proposer.match_len == 4
    proposer.truncate(8)
    assert proposer.propose(2) == [3, 4] and proposer.match_len == 2 and len(proposer) == 8


# ------------------------------------------------------------ the drafter over whole answers


def wasted(steps: list[tuple[int, int]]) -> int:
    return sum(d - a for d, a in steps)


def test_a_long_copy_drafts_the_widest_windows_and_wastes_nothing(encode):
    prompt = encode("Repeat this code exactly.\n\n" + CODE + "\n\n")
    answer = encode("Here it is:\n\n" + CODE)
    steps = replay(MatchDrafter(SUFFIX, prompt), answer)
    assert [d for d, _ in steps].count(15) >= 3 and wasted(steps) == 0


def test_a_rejection_mid_copy_wastes_less_than_ngram_and_the_copy_resumes(encode):
    """The answer adds type hints to the copied def line: the first window after the def line's
    start is rejected; the n-gram drafter had drafted 7 tokens into it, the suffix drafter only one
    past its short match; the body after the changed line is then drafted in the widest windows."""
    prompt = encode("Add type hints.\n\n" + CODE + "\n\n")
    answer = encode(HINTED)
    new, old = replay(MatchDrafter(SUFFIX, prompt), answer), replay(Drafter(NGRAM, prompt), answer)
    assert len(new) == len(old) and 0 < wasted(new) < wasted(old)
    rejected = max(i for i, (d, a) in enumerate(new) if a < d)
    assert sum(a for _, a in new[rejected + 1:]) >= len(answer) // 2 and max(d for d, _ in new) == 15


def test_make_drafter_picks_by_method():
    assert type(make_drafter(SUFFIX, [1, 2])) is MatchDrafter
    assert type(make_drafter(NGRAM, [1, 2])) is Drafter

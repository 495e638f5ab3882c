"""held_back: the one hold-back rule every streaming text parser uses."""

import pytest

from skippy_zmq.text.holdback import held_back


@pytest.mark.parametrize("text, markers, expected", [
    ("hello <thi", ("</think>",), 0),          # "<thi" is not a prefix of "</think>"
    ("hello </thi", ("</think>",), 5),
    ("hello <", ("</think>",), 1),
    ("", ("</think>",), 0),
    ("abc", (), 0),
    ("x </think>", ("</think>",), 0),           # a whole marker is the caller's to find, not held
    ("say STO", ("STOP", "ST"), 3),             # the longest partial of any marker wins
    ("say ST", ("STOP", "ST"), 2),              # a whole short marker counts as a partial of a longer one
    ("say S", ("STOP", "ST"), 1),
    ("[TOOL_CALL", ("[TOOL_CALLS]", "<|python_tag|>"), 10),
    ("<|py", ("[TOOL_CALLS]", "<|python_tag|>"), 4),
])
def test_held_back_is_the_longest_suffix_that_is_a_proper_prefix_of_a_marker(text, markers, expected):
    assert held_back(text, markers) == expected


def test_held_back_matches_a_brute_force_definition():
    markers = ("<tool_call>", "</think>", "ab", "aab")
    for text in ["", "a", "aa", "xaab", "<tool_", "</th", "zz<", "ab<tool_call", "aa</think"]:
        want = max((size for size in range(1, len(text) + 1)
                    if any(len(m) > size and m.startswith(text[-size:]) for m in markers)), default=0)
        assert held_back(text, markers) == want, text

"""Hold-back for streamed text: how much of a text's end might still grow into a marker.

Every streaming parser here (stop strings, `<think>` tags, tool-call openers and tail markers)
emits text as it comes but must never emit the start of a marker whose end has not arrived
yet; it keeps back the text's longest suffix that is a proper prefix of one of its markers
and settles it with the next piece (or at the end, when nothing more can come).
"""

from __future__ import annotations

from collections.abc import Iterable


def held_back(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`.

    A whole marker at the end is not counted: callers look for whole markers first.
    """
    markers = tuple(markers)
    longest = max(map(len, markers), default=0)
    for size in range(min(longest - 1, len(text)), 0, -1):
        suffix = text[-size:]
        if any(len(marker) > size and marker.startswith(suffix) for marker in markers):
            return size
    return 0

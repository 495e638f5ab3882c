"""The keyed randomness of sampling: uniform(seed, choice, position), a counter-based splitmix64
hash, so the draw at a position never depends on what was drawn before it or in what order."""

from __future__ import annotations

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a bijective avalanche mix of a 64-bit int."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(seed: int, choice: int, position: int) -> float:
    """The uniform in [0, 1) that sampling uses at an absolute position.

    A pure, counter-based function of (seed, choice index, position): the
    draw at a position does not depend on how many draws came before or in
    what order positions were sampled, so speculative windows, re-sampled
    rejected tails and resumes all reproduce the plain decode. Each input is
    folded in through splitmix64's mixer (seeds wider than 64 bits in 64-bit
    chunks); the top 53 bits of the result become the float. About 1 us.
    """
    h = _mix64(_GOLDEN)
    seed = int(seed)
    while True:  # fold every 64-bit chunk of the seed (one chunk for seeds < 2**64)
        h = _mix64((h ^ (seed & _MASK64)) + _GOLDEN & _MASK64)
        seed >>= 64
        if seed <= 0:
            break
    h = _mix64((h ^ (int(choice) & _MASK64)) + _GOLDEN & _MASK64)
    h = _mix64((h ^ (int(position) & _MASK64)) + _GOLDEN & _MASK64)
    return (h >> 11) * (1.0 / (1 << 53))

"""Host-side token sampling: numpy only, one token per position per sequence.

Randomness is keyed by (seed, choice index, absolute position) through
uniform(), and the penalty history is addressed by position (truncate / put),
so a verify window sampled in one go, a rejected tail re-sampled later, and a
resumed session all give the tokens plain step-by-step decoding gives.

One owner per concern: `parameters` (SamplingParams, check_top_logprobs), `rng` (the keyed
uniform), `history` (TokenHistory), `transforms` (what is done to one position's logits:
penalties, masks, top-k / top-p / min-p, the draw, logprobs) and `sampler` (Sampler, a
sequence's state and the calls the final stage makes). The names callers import are here.
"""

from skippy_zmq.sampling.history import TokenHistory
from skippy_zmq.sampling.parameters import MAX_TOP_LOGPROBS, SamplingParams, check_top_logprobs
from skippy_zmq.sampling.rng import uniform
from skippy_zmq.sampling.sampler import Sampler
from skippy_zmq.sampling.transforms import (
    TokenLogprobs,
    adjust_logits,
    candidate_probs,
    mask_logits,
    token_logprobs,
)

__all__ = [
    "MAX_TOP_LOGPROBS", "Sampler", "SamplingParams", "TokenHistory", "TokenLogprobs", "adjust_logits",
    "candidate_probs", "check_top_logprobs", "mask_logits", "token_logprobs", "uniform",
]

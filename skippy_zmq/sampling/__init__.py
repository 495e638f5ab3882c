"""Host-side token sampling (numpy only); the names callers import live in the modules below."""

from skippy_zmq.sampling.sampler import (
    MAX_TOP_LOGPROBS,
    Sampler,
    SamplingParams,
    TokenHistory,
    TokenLogprobs,
    adjust_logits,
    candidate_probs,
    check_top_logprobs,
    mask_logits,
    sample_rows,
    token_logprobs,
    uniform,
)

__all__ = [
    "MAX_TOP_LOGPROBS", "Sampler", "SamplingParams", "TokenHistory", "TokenLogprobs", "adjust_logits",
    "candidate_probs", "check_top_logprobs", "mask_logits", "sample_rows", "token_logprobs", "uniform",
]

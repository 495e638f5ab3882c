"""What sampling does to one position's logits: logit bias and penalties (adjust_logits), the
constraint mask (mask_logits), temperature with top-k / top-p / min-p and the inverse-CDF draw
(candidate_probs, draw_candidate), and the logprobs reported with a token (token_logprobs).
All pure functions of their arguments (mask_logits works in place).

Order of operations (as in OpenAI / vLLM): logit bias -> repetition penalty
-> presence/frequency penalties -> greedy argmax or temperature -> top-k ->
top-p -> min-p -> draw. Work over the full vocabulary is kept to a couple of
vectorised passes; anything sorted is only the surviving candidates.
"""

from __future__ import annotations

import math

import numpy as np

from skippy_zmq.sampling.history import TokenHistory
from skippy_zmq.sampling.parameters import SamplingParams

# Top-p first looks for the nucleus among the best few hundred / few thousand
# tokens (argpartition, O(vocab)) and only falls back to sorting everything.
_NUCLEUS_PROBES = (512, 4096)
_DRAW_BLOCK = 256
_F32_MAX = np.float32(np.finfo(np.float32).max)


def adjust_logits(logits: np.ndarray, params: SamplingParams, history: TokenHistory | None = None) -> np.ndarray:
    """Return a float32 copy of logits with logit bias and penalties applied.

    Repetition penalty covers prompt + generated tokens (HF/llama.cpp);
    presence/frequency cover generated tokens only (OpenAI). Pure: the input
    is not modified.
    """
    out = np.array(logits, dtype=np.float32, copy=True)
    if params.logit_bias:
        bias_ids, bias_vals = zip(*params.logit_bias)
        out[list(bias_ids)] += np.asarray(bias_vals, dtype=np.float32)
    if history is None:
        return out
    if params.repetition_penalty != 1.0 and history.seen_ids.size:
        seen = history.seen_ids
        vals = out[seen]
        # Always push away from being chosen again, whatever the logit's sign. A penalty far below 1
        # would overflow a positive logit to +inf (no finite maximum to sample from): clip it to the
        # largest float32 instead, so such a token is simply the most likely.
        # In float64: the penalty itself may not fit a float32 (2.3e-178 would round to 0).
        vals, penalty = vals.astype(np.float64), float(params.repetition_penalty)
        with np.errstate(over="ignore"):
            pushed = np.where(vals > 0, vals / penalty, vals * penalty)
        out[seen] = np.clip(pushed, -_F32_MAX, _F32_MAX)
    if (params.presence_penalty or params.frequency_penalty) and history.generated_ids.size:
        counts = history.generated_counts
        out[history.generated_ids] -= params.presence_penalty + params.frequency_penalty * counts
    return out


def candidate_probs(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Token ids that survive top-k/top-p/min-p and their renormalised probabilities.

    Requires temperature > 0. Ids come back in no particular order.
    """
    ids, weights = _filtered_weights(logits, params)
    probs = weights / weights.sum(dtype=np.float64)
    return (np.arange(logits.shape[-1]) if ids is None else ids), probs


def draw_candidate(logits: np.ndarray, params: SamplingParams, u: float) -> int:
    """The token id the uniform u picks among the candidates top-k / top-p / min-p leave, with
    temperature (> 0) applied: the inverse-CDF draw over their weights."""
    ids, weights = _filtered_weights(logits, params)
    pick = _draw(weights, u)
    return pick if ids is None else int(ids[pick])


def _filtered_weights(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray | None, np.ndarray]:
    """Surviving ids (None: the whole vocab, in order) and unnormalised float32 weights."""
    n = logits.shape[-1]
    ids: np.ndarray | None = None
    cand = logits
    if 0 < params.top_k < n:
        ids = np.argpartition(logits, n - params.top_k)[n - params.top_k :]
        cand = logits[ids]
    top = float(cand.max())
    if not math.isfinite(top):
        raise ValueError(f"logits have no finite maximum (max={top})")
    if params.min_p > 0.0:
        # p_i >= min_p * p_max  <=>  x_i >= x_max + T*log(min_p). Renormalising
        # after top-p keeps p_i/p_max, so filtering before top-p gives the same
        # set and shrinks what top-p has to sort.
        keep = np.flatnonzero(cand >= top + params.temperature * math.log(params.min_p))
        ids = keep if ids is None else ids[keep]
        cand = cand[keep]
    # Shifting by the max keeps exp in range, so float32 is enough; one new array.
    weights = np.subtract(cand, top, dtype=np.float32)
    weights *= np.float32(1.0 / params.temperature)
    np.exp(weights, out=weights)
    if params.top_p < 1.0:
        ids, weights = _nucleus(ids, weights, params.top_p)
    return ids, weights


def _nucleus(ids: np.ndarray | None, weights: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Smallest highest-weight prefix whose share of the mass reaches top_p."""
    target = top_p * float(weights.sum(dtype=np.float64))
    pool = None
    for size in _NUCLEUS_PROBES:
        if weights.size <= size:
            break
        probe = np.argpartition(weights, weights.size - size)[-size:]
        if weights[probe].sum(dtype=np.float64) >= target:
            pool = probe  # the nucleus lies inside the probe; sort just that
            break
    if pool is None:
        pool = np.arange(weights.size)
    order = pool[np.argsort(-weights[pool])]
    cut = int(np.searchsorted(np.cumsum(weights[order], dtype=np.float64), target)) + 1
    kept = order[: min(cut, order.size)]
    return (kept if ids is None else ids[kept]), weights[kept]


def _draw(weights: np.ndarray, u: float) -> int:
    """Inverse-CDF pick of an index for a uniform u in [0, 1).

    One uniform per token (see uniform()) keeps seeded sampling reproducible. np.cumsum is
    sequential and slow over a full vocabulary, so find the block first.
    """
    offset, target = 0, u * float(weights.sum(dtype=np.float64))
    if weights.size > _DRAW_BLOCK:
        block_sums = np.add.reduceat(weights, np.arange(0, weights.size, _DRAW_BLOCK), dtype=np.float64)
        block_cdf = np.cumsum(block_sums)
        block = _search(block_cdf, block_sums, target)
        target -= block_cdf[block] - block_sums[block]
        offset = block * _DRAW_BLOCK
        weights = weights[offset : offset + _DRAW_BLOCK]
    return offset + _search(np.cumsum(weights, dtype=np.float64), weights, target)


def _search(cdf: np.ndarray, mass: np.ndarray, target: float) -> int:
    index = int(np.searchsorted(cdf, target, side="right"))
    # Rounding can put target past the end; fall back to the last index with mass.
    return index if index < cdf.size else int(np.flatnonzero(mass)[-1])


def mask_logits(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Set logits where `mask` is False to -inf, in place; logits past the mask's width (a padded
    vocabulary) too. `mask` broadcasts against `logits`; returns `logits`."""
    width = mask.shape[-1]
    if logits.shape[-1] < width:
        raise ValueError(f"logits width {logits.shape[-1]} < mask width {width}")
    if mask.ndim == 1 and np.count_nonzero(mask) * 16 < width:
        # Few allowed (JSON structure, enums): keep those, fill the rest; twice as fast.
        allowed = np.flatnonzero(mask)
        kept = logits[..., allowed]
        logits[...] = -np.inf
        logits[..., allowed] = kept
        return logits
    logits[..., width:] = -np.inf
    np.copyto(logits[..., :width], -np.inf, where=~mask)
    return logits


TokenLogprobs = tuple[float, list[tuple[int, float]]]   # (log p(token), [(id, log p), ...] highest first)


def token_logprobs(adjusted_logits: np.ndarray, token: int, top_n: int = 0) -> TokenLogprobs:
    """(log p(token), [(id, log p), ...] of the top_n most likely ids) under softmax(adjusted_logits).

    The log-softmax is taken in float64 over the whole vocabulary, of the logits as given (in
    serving: after logit bias, penalties and any constraint mask, before temperature and
    top-k / top-p / min-p). The top list is ordered by logprob, highest first (ties: lower id
    first) and leaves out ids whose logit is -inf (masked: they cannot be chosen), so it can be
    shorter than top_n. A -inf chosen token's logprob is -inf. Pure.
    """
    x = np.asarray(adjusted_logits, dtype=np.float64).reshape(-1)
    top = float(x.max())
    if not math.isfinite(top):
        raise ValueError(f"logits have no finite maximum (max={top})")
    shifted = x - top
    lse = math.log(float(np.exp(shifted).sum()))
    logprob = float(shifted[int(token)] - lse)
    n = min(int(top_n), x.size)
    if n <= 0:
        return logprob, []
    ids = np.argpartition(shifted, x.size - n)[x.size - n:] if n < x.size else np.arange(x.size)
    ids = ids[np.lexsort((ids, -shifted[ids]))]
    return logprob, [(int(i), float(shifted[i] - lse)) for i in ids if shifted[i] != -math.inf]

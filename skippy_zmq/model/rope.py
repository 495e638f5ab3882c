"""Rotary position embedding: each rope type is one small function giving the
inverse frequencies of a head, [head_dim / 2] float32, from a ModelConfig.

The angle of frequency i at position p is p * inv_freq[i] (HF rotate-half
layout, see llama.rope_tables). The types follow transformers'
`modeling_rope_utils` (`ROPE_INIT_FUNCTIONS`), computed in float32 as it does:

    default  theta ** (-2i / head_dim)
    linear   default / factor            (positions stretched by `factor`)
    llama3   Llama 3.1: wavelengths longer than original_max_pos / low_freq_factor
             are divided by `factor`, shorter than original_max_pos / high_freq_factor
             are kept, and the band between is interpolated smoothly
    longrope Phi-3/4: default divided by per-frequency factors (rope_freq_factors: the
             short ones; rope_long_freq_factors for positions >= rope_original_max_pos,
             see `long_inv_freq`), cos and sin times rope_attn_factor

Partial rotary (Phi-4-mini): only the first `rotary_dim` dims of a head rotate,
and the frequencies are those of a head of that width.

A GGUF file carries Llama 3 scaling not as parameters but as the tensor
`rope_freqs.weight`, one divisor per frequency (llama.cpp computes them at
conversion time). We keep those divisors verbatim in
`ModelConfig.rope_freq_factors` and divide whatever the rope type gives by
them, so a GGUF's scaling is applied exactly as llama.cpp applies it, with no
guess at the parameters it came from.

The functions run on the host at trace time (the config is static), so the
frequencies are constants of the jitted step.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from skippy_zmq.config.model import ModelConfig


def default_inv_freq(cfg: ModelConfig, theta: float | None = None) -> np.ndarray:
    dim = cfg.rope_dim
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    base = np.float32(cfg.rope_theta if theta is None else theta)
    return (np.float32(1.0) / base ** exponents).astype(np.float32)


def linear_inv_freq(cfg: ModelConfig) -> np.ndarray:
    return (default_inv_freq(cfg) / np.float32(cfg.rope_factor)).astype(np.float32)


def llama3_inv_freq(cfg: ModelConfig) -> np.ndarray:
    inv = default_inv_freq(cfg)
    factor, low, high = (np.float32(x) for x in (cfg.rope_factor, cfg.rope_low_freq_factor,
                                                 cfg.rope_high_freq_factor))
    old_len = np.float32(cfg.rope_original_max_pos)
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


ROPE_INV_FREQ: dict[str, Callable[[ModelConfig], np.ndarray]] = {
    "default": default_inv_freq,
    "linear": linear_inv_freq,
    "llama3": llama3_inv_freq,
    "longrope": default_inv_freq,     # its factors come as rope_freq_factors, divided in below
}


def inv_freq(cfg: ModelConfig) -> np.ndarray:
    """The inverse frequencies of cfg's rope type, divided by a GGUF's rope_freqs when it has them."""
    inv = ROPE_INV_FREQ[cfg.rope_type](cfg)
    if cfg.rope_freq_factors:
        inv = inv / np.asarray(cfg.rope_freq_factors, np.float32)
    return inv.astype(np.float32)



def long_inv_freq(cfg: ModelConfig) -> np.ndarray | None:
    """longrope's frequencies past the pretraining context (None when the config has no long factors).

    transformers switches its whole cache to these once a forward's sequence exceeds
    original_max_position_embeddings; we switch per token at that position (the same
    frequencies up to it, and beyond it each new token gets the long ones).
    """
    if not cfg.rope_long_freq_factors:
        return None
    return (default_inv_freq(cfg) / np.asarray(cfg.rope_long_freq_factors, np.float32)).astype(np.float32)


def local_inv_freq(cfg: ModelConfig) -> np.ndarray | None:
    """Gemma 3's windowed layers: default rope at rope_local_theta (None: they share the global rope)."""
    return default_inv_freq(cfg, cfg.rope_local_theta) if cfg.rope_local_theta else None

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

from skippy_zmq.config import ModelConfig


def default_inv_freq(cfg: ModelConfig) -> np.ndarray:
    exponents = np.arange(0, cfg.head_dim, 2, dtype=np.float32) / np.float32(cfg.head_dim)
    return (np.float32(1.0) / np.float32(cfg.rope_theta) ** exponents).astype(np.float32)


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
}


def inv_freq(cfg: ModelConfig) -> np.ndarray:
    """The inverse frequencies of cfg's rope type, divided by a GGUF's rope_freqs when it has them."""
    inv = ROPE_INV_FREQ[cfg.rope_type](cfg)
    if cfg.rope_freq_factors:
        inv = inv / np.asarray(cfg.rope_freq_factors, np.float32)
    return inv.astype(np.float32)


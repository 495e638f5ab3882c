"""Config reading for Gemma 3 (text) and Phi-3/4: HF config.json (transformers 4 or 5
layout) or GGUF metadata -> the ModelConfig fields these families switch on.

Gemma 3 (`gemma3_text`; GGUF `gemma3`): sqrt(hidden) embedding scale, GeGLU, norms
before and after attention and MLP, q/k norm, `query_pre_attn_scalar`, local
(sliding) and global layers by `layer_types` (or every `sliding_window_pattern`-th
layer global), each kind with its rope: v4 keeps `rope_theta` (global),
`rope_local_base_freq` and a `rope_scaling` for the global layers; v5 a
`rope_parameters` block per layer type. The global rope may be default, linear or
llama3; the local one must be default. llama.cpp's GGUF has no local base unless
`rope.freq_base_swa` is set (10000 then) and no scalar: it uses head_dim (the
27B's 62 layers: hidden / heads), as llama.cpp does.

Phi-3/4 (`phi3`, both GGUF and HF): fused qkv_proj / gate_up_proj (convert.py
splits them), partial rotary (`partial_rotary_factor`, top level in v4, in
`rope_parameters` in v5; GGUF `rope.dimension_count`) and longrope: the short
factors up to `original_max_position_embeddings`, the long ones past it, and the
attention factor sqrt(1 + ln(max_pos / original) / ln(original)) unless given
(transformers' `_compute_longrope_parameters`). A sliding window, when set,
covers every layer as in transformers (llama.cpp disables Phi's).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from skippy_zmq.config.model import ModelConfig
from skippy_zmq.checkpoint.rope_config import ConvertError, hf_rope

HF_TYPES = ("gemma3_text", "phi3")
GGUF_ARCHS = ("gemma3", "phi3")
LAYER_KINDS = {"full_attention", "sliding_attention"}


def _error(message: str) -> Exception:
    return ConvertError(message)


def _need(config: dict[str, Any], *keys: str) -> None:
    for key in keys:
        if key not in config:
            raise _error(f"config.json lacks {key!r}")


def _refuse(config: dict[str, Any], fields: dict[str, Any]) -> None:
    for key, ours in fields.items():
        value = config.get(key)
        if value is not None and value != ours:
            raise _error(f"config.json {key}={value!r} is not implemented (only {ours!r})")


def _eos(config: dict[str, Any]) -> tuple[int, ...]:
    eos = config.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())


def _common(config: dict[str, Any], name: str, arch: str, head_dim: int, tied: bool) -> dict[str, Any]:
    _need(config, "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    h = config["num_attention_heads"]
    bos = config.get("bos_token_id")
    return dict(arch=arch, n_layers=config["num_hidden_layers"], d_model=config["hidden_size"], n_heads=h,
                n_kv_heads=config.get("num_key_value_heads") or h, head_dim=head_dim,
                ffn_dim=config["intermediate_size"], vocab_size=config["vocab_size"],
                norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                tied_embeddings=bool(config.get("tie_word_embeddings", tied)),
                max_seq_len=int(config.get("max_position_embeddings", 4096)),
                bos_id=int(bos) if bos is not None else -1, eos_ids=_eos(config), name=name)


def hf_config(config: dict[str, Any], name: str = "") -> ModelConfig:
    kind = config["model_type"]
    return gemma3_hf(config, name) if kind == "gemma3_text" else phi3_hf(config, name)


# ---------------------------------------------------------------- Gemma 3


def gemma3_hf(config: dict[str, Any], name: str) -> ModelConfig:
    # attn_logit_softcapping: transformers' Gemma 3 stores it but never applies it, llama.cpp asserts it
    # is unset; which of the two a file means is unknown, so it is refused
    _refuse(config, {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
                     "use_bidirectional_attention": False, "attn_logit_softcapping": None})
    base = _common(config, name, "gemma3", int(config.get("head_dim") or 256), tied=True)
    n_layers = base["n_layers"]
    global_rope, local_rope = _gemma3_rope_blocks(config)
    if local_rope.get("rope_type", local_rope.get("type", "default")) != "default":
        raise _error(f"config.json rope_parameters.sliding_attention {local_rope!r} is not implemented "
                     "(only rope_type default on local layers)")
    layer_types = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % int(config.get("sliding_window_pattern", 6)) else "full_attention"
        for i in range(n_layers)]
    if set(layer_types) - LAYER_KINDS or len(layer_types) != n_layers:
        raise _error(f"config.json layer_types {layer_types!r} is not implemented "
                     "(one of full_attention / sliding_attention per layer)")
    window = int(config.get("sliding_window") or 4096)
    bias = bool(config.get("attention_bias", False))
    return ModelConfig(
        **base, attn_bias=bias, attn_out_bias=bias, qk_norm=True, ffn_act="gelu_tanh", sandwich_norms=True,
        embed_scale=float(base["d_model"] ** 0.5),
        attn_scale=float(config.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_softcap=float(config.get("final_logit_softcapping") or 0.0),
        sliding_window=window if "sliding_attention" in layer_types else 0,
        full_attention_layers=tuple(i for i, t in enumerate(layer_types) if t == "full_attention"),
        rope_local_theta=float(local_rope.get("rope_theta", 10000.0)),
        **hf_rope({"rope_parameters": global_rope}, base["max_seq_len"]))


def _gemma3_rope_blocks(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, local) rope parameters from either layout, with transformers' default bases (1e6, 1e4)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and (set(params) & LAYER_KINDS):
        unknown = sorted(set(params) - LAYER_KINDS)
        if unknown:
            raise _error(f"config.json rope_parameters layer type {unknown[0]!r} is not implemented")
        full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:        # v4: top-level bases, rope_scaling for the global layers
        full = {**(config.get("rope_scaling") or {}), **(params or {})}
        full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
        local = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10000.0)}
    full.setdefault("rope_theta", 1_000_000.0)
    return full, local


def gemma3_gguf(reader: Any, field: Any, head_dim: int, n_layers: int, d_model: int, n_heads: int) -> dict[str, Any]:
    """Gemma 3's ModelConfig fields from GGUF metadata (`field(key, default)` reads gemma3.<key>)."""
    window = int(field("attention.sliding_window", 0) or 0)
    pattern = field("attention.sliding_window_pattern", 6)
    if window and not isinstance(pattern, (int, np.integer)):
        raise _error(f"GGUF gemma3.attention.sliding_window_pattern as a per-layer list is not implemented: {pattern!r}")
    full = tuple(i for i in range(n_layers) if not window or (i + 1) % int(pattern) == 0)
    scalar = d_model / n_heads if n_layers == 62 else head_dim     # llama.cpp: the 27B scales by hidden / heads
    return dict(ffn_act="gelu_tanh", sandwich_norms=True, embed_scale=float(d_model ** 0.5),
                attn_scale=float(scalar) ** -0.5, final_softcap=float(field("final_logit_softcapping", 0.0) or 0.0),
                sliding_window=window, full_attention_layers=full if window else (),
                rope_local_theta=float(field("rope.freq_base_swa", 10000.0)) if window else 0.0)


# ---------------------------------------------------------------- Phi-3 / Phi-4


def phi3_hf(config: dict[str, Any], name: str) -> ModelConfig:
    _refuse(config, {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False})
    _need(config, "hidden_size", "num_attention_heads")
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    base = _common(config, name, "phi3", head_dim, tied=False)
    window = config.get("sliding_window")
    return ModelConfig(**base, sliding_window=int(window or 0), **phi3_rope(config, head_dim, base["max_seq_len"]))


def phi3_rope(config: dict[str, Any], head_dim: int, max_pos: int) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_theta": config.get("rope_theta", 10000.0),
                              "partial_rotary_factor": config.get("partial_rotary_factor", 1.0),
                              "original_max_position_embeddings": config.get("original_max_position_embeddings")}
    for key in ("rope_scaling", "rope_parameters"):
        block = config.get(key) or {}
        if not isinstance(block, dict):
            raise _error(f"config.json {key} {block!r} is not implemented")
        params.update({k: v for k, v in block.items() if v is not None})
    rotary = int(head_dim * float(params["partial_rotary_factor"]))
    kind = params.get("rope_type", params.get("type", "default"))
    kind = "longrope" if kind in ("su", "yarn") else kind     # transformers' Phi-3 reads both as longrope
    out: dict[str, Any] = {"rope_theta": float(params["rope_theta"]),
                           "rotary_dim": rotary if rotary != head_dim else 0}
    if kind == "default":
        return out
    if kind != "longrope":
        raise _error(f"config.json rope_type {kind!r} is not implemented for phi3 (only default, longrope)")
    for key in ("short_factor", "long_factor", "original_max_position_embeddings"):
        if params.get(key) is None:
            raise _error(f"config.json rope_type 'longrope' needs {key!r}")
    original = int(params["original_max_position_embeddings"])
    factor = float(params.get("factor") or max_pos / original)
    attention = params.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return {**out, "rope_type": "longrope", "rope_original_max_pos": original, "rope_attn_factor": float(attention),
            "rope_freq_factors": tuple(float(x) for x in params["short_factor"]),
            "rope_long_freq_factors": tuple(float(x) for x in params["long_factor"])}


def phi3_gguf(reader: Any, field: Any, head_dim: int, max_pos: int) -> dict[str, Any]:
    """Phi-3's rope and window from GGUF: rope.dimension_count, rope_factors_short/long tensors,
    rope.scaling.attn_factor and original_context_length."""
    from gguf import quants

    rotary = int(field("rope.dimension_count", head_dim))
    out: dict[str, Any] = {"rotary_dim": rotary if rotary != head_dim else 0,
                           "sliding_window": int(field("attention.sliding_window", 0) or 0)}
    tensors = {t.name: t for t in reader.tensors}
    short, long = tensors.get("rope_factors_short.weight"), tensors.get("rope_factors_long.weight")
    if short is None and long is None:
        return out
    if short is None or long is None:
        raise _error("GGUF phi3 has only one of rope_factors_short.weight / rope_factors_long.weight")
    original = field("rope.scaling.original_context_length")
    if original is None:
        raise _error("GGUF phi3.rope.scaling.original_context_length is missing (longrope needs it)")

    def factors(t: Any) -> tuple[float, ...]:
        return tuple(float(x) for x in np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32).reshape(-1))

    return {**out, "rope_type": "longrope", "rope_original_max_pos": int(original),
            "rope_attn_factor": float(field("rope.scaling.attn_factor", 1.0)),
            "rope_freq_factors": factors(short), "rope_long_freq_factors": factors(long)}

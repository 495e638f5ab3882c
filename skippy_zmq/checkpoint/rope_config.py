"""What every family's config reading shares: ConvertError and the rope fields of an HF config
(either layout), so checkpoint/families.py and checkpoint/gemma_phi.py both import it without a cycle."""

from __future__ import annotations

from typing import Any

from skippy_zmq.config.model import ROPE_TYPES
from skippy_zmq.files.filecheck import ConvertError  # noqa: F401 (families import it from here)


HF_ROPE_TYPES = tuple(t for t in ROPE_TYPES if t != "longrope")   # longrope: phi3 only (checkpoint/gemma_phi.py)
ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings", "partial_rotary_factor"}


def hf_rope(config: dict[str, Any], max_pos: int) -> dict[str, Any]:
    """The ModelConfig rope fields from either layout: top-level rope_theta + rope_scaling (v4), rope_parameters (v5)."""
    params = {"rope_theta": config.get("rope_theta", 10000.0)}
    for key in ("rope_scaling", "rope_parameters"):
        block = config.get(key) or {}
        if not isinstance(block, dict) or any(isinstance(v, dict) for v in block.values()):
            raise ConvertError(f"config.json {key} per layer type is not implemented: {block!r}")
        params.update(block)
    unknown = sorted(set(params) - ROPE_KEYS)
    if unknown:
        raise ConvertError(f"config.json rope parameter {unknown[0]!r} is not implemented")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConvertError(f"config.json partial_rotary_factor={params['partial_rotary_factor']!r} "
                           "is not implemented (only 1.0)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in HF_ROPE_TYPES:
        raise ConvertError(f"config.json rope_type {rope_type!r} is not implemented "
                           f"(implemented: {', '.join(HF_ROPE_TYPES)}; longrope for phi3)")
    out: dict[str, Any] = {"rope_theta": float(params["rope_theta"]), "rope_type": rope_type}
    if rope_type in ("linear", "llama3"):
        out["rope_factor"] = float(_rope_need(params, "factor"))
    if rope_type == "llama3":
        out.update(rope_low_freq_factor=float(_rope_need(params, "low_freq_factor")),
                   rope_high_freq_factor=float(_rope_need(params, "high_freq_factor")),
                   rope_original_max_pos=int(params.get("original_max_position_embeddings", max_pos)))
    return out


def _rope_need(params: dict[str, Any], key: str) -> Any:
    if key not in params:
        raise ConvertError(f"config.json rope_type {params.get('rope_type', params.get('type'))!r} needs {key!r}")
    return params[key]

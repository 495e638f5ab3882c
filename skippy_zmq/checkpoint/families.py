"""Model config, read in one place: an HF config.json (transformers 4 or 5 layout)
or a GGUF's metadata -> a frozen ModelConfig.

Families (HF model_type / GGUF architecture) and what they switch on:

    family    q/k/v bias         o bias            q/k norm  head_dim default  sliding window
    llama     attention_bias     attention_bias    no        hidden / heads    none
    mistral   no                 no                no        hidden / heads    sliding_window, every layer
    qwen2     yes                no                no        hidden / heads    use_sliding_window, layers per layer_types
    qwen3     attention_bias     attention_bias    yes       128               use_sliding_window, layers per layer_types

and the mixture-of-experts twins, the same attention with an MoE MLP (`_hf_moe`): mixtral
(as mistral), qwen2_moe (as qwen2), qwen3_moe (as qwen3). gpt_oss and deepseek_v2/v3 are
refused by name with what they would need (REFUSED_MOE).

Rope, either layout (checkpoint/rope_config.py): transformers 4 keeps `rope_theta` (and
`partial_rotary_factor`) at the top level and the scaling in `rope_scaling`; transformers 5
keeps all of it in `rope_parameters`. Both are merged (v5 winning) and read once. For these
families rope types `default`, `linear` and `llama3` are implemented (model/rope.py).

GGUF (GGUF_ARCHS): llama (llama.cpp files Mistral and Mixtral under it too; its Q/K rows
come permuted and convert.py undoes that), qwen2, qwen3, qwen2moe and qwen3moe (rows as they
are), and gemma3 and phi3 (checkpoint/gemma_phi.py). Biases and q/k norms are found by tensor
name; `{arch}.rope.scaling.type` may be none or linear; Llama 3 scaling comes as the
`rope_freqs.weight` tensor, kept verbatim as ModelConfig.rope_freq_factors (see model/rope.py).

Gemma 3 (text) and Phi-3/4 are read in checkpoint/gemma_phi.py (their own fields, both
layouts and GGUF); this module dispatches to it. Phi-3/4's longrope and partial rotary
(`rotary_dim`) are implemented there.

Any field that would change the math and is not implemented is refused with a ConvertError
naming it (other activations, MLP biases, yarn/dynamic rope, and for the families here
longrope and partial rotary, logit softcapping, per-layer rope), never converted into a
silently different model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from skippy_zmq.config.model import ModelConfig
from skippy_zmq.checkpoint import gemma_phi
# ConvertError and the rope reading are shared with checkpoint/gemma_phi.py (checkpoint/rope_config.py).
from skippy_zmq.checkpoint.rope_config import ConvertError, hf_rope  # noqa: F401


@dataclass(frozen=True)
class Family:
    """What an HF model_type switches on. None: read the config's `attention_bias`."""

    qkv_bias: bool | None
    out_bias: bool | None
    qk_norm: bool = False
    head_dim: int | None = None        # default when config.json has none (None: hidden / heads)
    window: str = "none"               # "none" | "mistral" (sliding_window) | "qwen" (use_sliding_window)


HF_FAMILIES = {
    "llama": Family(qkv_bias=None, out_bias=None),
    "mistral": Family(qkv_bias=False, out_bias=False, window="mistral"),
    "qwen2": Family(qkv_bias=True, out_bias=False, window="qwen"),
    "qwen3": Family(qkv_bias=None, out_bias=None, qk_norm=True, head_dim=128, window="qwen"),
    # mixture of experts: the same attention as their dense twins, an MoE MLP (_hf_moe)
    "qwen3_moe": Family(qkv_bias=None, out_bias=None, qk_norm=True, head_dim=128, window="qwen"),
    "mixtral": Family(qkv_bias=False, out_bias=False, window="mistral"),
    "qwen2_moe": Family(qkv_bias=True, out_bias=False, window="qwen"),
}
# Mixture-of-experts families we do not implement, refused by name with what they need.
REFUSED_MOE = {
    "gpt_oss": "attention sinks, biased and clamped SwiGLU experts, alternating sliding windows, MXFP4 experts",
    "deepseek_v2": "multi-head latent attention (MLA) and grouped top-k routing",
    "deepseek_v3": "multi-head latent attention (MLA), sigmoid routing with a bias and grouped top-k",
}
GGUF_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe") + gemma_phi.GGUF_ARCHS   # llama.cpp files Mistral and Mixtral
# under "llama"
SUPPORTED_HF_TYPES = tuple(HF_FAMILIES) + gemma_phi.HF_TYPES

# Fields that change the math and the one value we implement (absent or null: transformers' default, ours).
HF_MATH_FIELDS = {
    "hidden_act": "silu",
    "hidden_activation": "silu",
    "mlp_bias": False,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "logits_scaling": 1.0,
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "attention_multiplier": None,
    "partial_rotary_factor": 1.0,
    "use_qk_norm": False,
}


# ---------------------------------------------------------------- HF config.json


def hf_model_config(config: dict[str, Any], name: str = "") -> ModelConfig:
    kind = config.get("model_type")
    if kind == "gemma3" and isinstance(config.get("text_config"), dict):
        raise ConvertError("config.json model_type 'gemma3' (the multimodal model; its text weights live under "
                           "model.language_model) is not implemented: convert a gemma3_text checkpoint")
    if kind in gemma_phi.HF_TYPES:
        return gemma_phi.hf_config(config, name)
    if kind in REFUSED_MOE:
        raise ConvertError(f"HF model_type {kind!r} is a mixture-of-experts family that is not implemented "
                           f"(it needs {REFUSED_MOE[kind]}); supported: {', '.join(SUPPORTED_HF_TYPES)}")
    if kind not in HF_FAMILIES:
        raise ConvertError(f"unsupported HF model_type {kind!r} (supported: {', '.join(SUPPORTED_HF_TYPES)})")
    family = HF_FAMILIES[kind]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in config:
            raise ConvertError(f"config.json lacks {key!r}")
    _refuse_unimplemented(config)
    d, h, n_layers = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    max_pos = int(config.get("max_position_embeddings", 4096))
    bias = bool(config.get("attention_bias", False))
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return ModelConfig(
        arch=kind, n_layers=n_layers, d_model=d, n_heads=h,
        n_kv_heads=config.get("num_key_value_heads") or h,
        head_dim=config.get("head_dim") or family.head_dim or d // h,
        ffn_dim=config["intermediate_size"], vocab_size=config["vocab_size"],
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)), max_seq_len=max_pos,
        attn_bias=bias if family.qkv_bias is None else family.qkv_bias,
        attn_out_bias=bias if family.out_bias is None else family.out_bias, qk_norm=family.qk_norm,
        **_hf_sliding_window(config, family, n_layers),
        bos_id=int(config.get("bos_token_id") or -1), eos_ids=eos_ids, name=name,
        **hf_rope(config, max_pos), **_hf_moe(config, kind, n_layers))


def _hf_moe(config: dict[str, Any], kind: str, n_layers: int) -> dict[str, Any]:
    """The MoE fields, as transformers reads them: Mixtral routes every layer to num_local_experts
    and always renormalises its top-k; Qwen2/3-MoE route layer i unless it is in mlp_only_layers or
    (i + 1) % decoder_sparse_step != 0, renormalise when norm_topk_prob (default false), and
    Qwen2-MoE adds a shared expert."""
    if kind == "mixtral":
        return {"n_experts": int(config.get("num_local_experts", 8)),
                "n_experts_used": int(config.get("num_experts_per_tok", 2)),
                "expert_ffn_dim": int(config["intermediate_size"]), "norm_topk_prob": True}
    if kind not in ("qwen3_moe", "qwen2_moe"):
        return {}
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute map)
    experts = int(config.get("num_experts", config.get("num_local_experts", 128 if kind == "qwen3_moe" else 60)))
    if experts == 0:
        return {}
    step = int(config.get("decoder_sparse_step", 1))
    only = set(config.get("mlp_only_layers") or ())
    out = {"n_experts": experts, "n_experts_used": int(config.get("num_experts_per_tok", 8 if kind == "qwen3_moe" else 4)),
           "expert_ffn_dim": int(config.get("moe_intermediate_size", 768 if kind == "qwen3_moe" else 1408)),
           "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
           "dense_layers": tuple(i for i in range(n_layers) if i in only or (i + 1) % step != 0)}
    if kind == "qwen2_moe":
        out["shared_ffn_dim"] = int(config.get("shared_expert_intermediate_size", 5632))
    return out


def _refuse_unimplemented(config: dict[str, Any]) -> None:
    for key, ours in HF_MATH_FIELDS.items():
        value = config.get(key)
        if value is not None and value != ours:
            raise ConvertError(f"config.json {key}={value!r} is not implemented (only {ours!r})")


def _hf_sliding_window(config: dict[str, Any], family: Family, n_layers: int) -> dict[str, Any]:
    """sliding_window and full_attention_layers, as transformers reads them for the family."""
    window = config.get("sliding_window")
    if family.window == "none":        # as transformers: Llama has no window, whatever the file says
        return {}
    if family.window == "mistral":     # every layer (transformers' Mistral ignores layer_types)
        return {"sliding_window": int(window or 0)}
    layer_types = config.get("layer_types")
    if not config.get("use_sliding_window", False) or window is None:
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise ConvertError(f"config.json layer_types {sorted(set(layer_types))} without a sliding window "
                               "(use_sliding_window false or sliding_window null) is not implemented")
        return {}
    if not layer_types:                # transformers' default: the layers from max_window_layers on slide
        first = int(config.get("max_window_layers", 28))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown or len(layer_types) != n_layers:
        raise ConvertError(f"config.json layer_types {layer_types!r} is not implemented "
                           "(one of full_attention / sliding_attention per layer)")
    return {"sliding_window": int(window),
            "full_attention_layers": tuple(i for i, t in enumerate(layer_types) if t == "full_attention")}


# ---------------------------------------------------------------- GGUF metadata


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_model_config(reader: Any, name: str = "") -> ModelConfig:
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ConvertError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(GGUF_ARCHS)})")

    def need(key: str) -> Any:
        value = gguf_field(reader, f"{arch}.{key}")
        if value is None:
            raise ConvertError(f"GGUF metadata key {arch}.{key} is missing")
        return value

    names = {t.name for t in reader.tensors}
    d_model, n_heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(gguf_field(reader, f"{arch}.attention.key_length", d_model // n_heads))
    extra = _gguf_family_fields(reader, arch, head_dim, d_model, n_heads, int(need("block_count")))
    vocab = gguf_field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].contents())
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    experts = int(gguf_field(reader, f"{arch}.expert_count", 0) or 0)
    if experts:   # llama.cpp routes every layer; it renormalises the top k of qwen3moe and llama (Mixtral),
        # not qwen2moe's, whose shared expert is gated by a sigmoid
        used = int(need("expert_used_count"))
        extra.update(n_experts=experts, n_experts_used=used, norm_topk_prob=arch != "qwen2moe",
                     expert_ffn_dim=int(gguf_field(reader, f"{arch}.expert_feed_forward_length", 0)
                                        or need("feed_forward_length")))
        if arch == "qwen2moe":
            extra["shared_ffn_dim"] = int(gguf_field(reader, f"{arch}.expert_shared_feed_forward_length", 0)
                                          or need("feed_forward_length"))
    elif arch in ("qwen3moe", "qwen2moe"):
        raise ConvertError(f"GGUF {arch} without {arch}.expert_count")
    ours = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}.get(arch, "mixtral" if experts and arch == "llama" else arch)
    return ModelConfig(
        arch=ours, n_layers=int(need("block_count")), d_model=d_model, n_heads=n_heads,
        n_kv_heads=int(gguf_field(reader, f"{arch}.attention.head_count_kv", n_heads)), head_dim=head_dim,
        ffn_dim=int(need("feed_forward_length")), vocab_size=int(vocab),
        norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        tied_embeddings="output.weight" not in names, max_seq_len=int(need("context_length")),
        attn_bias="blk.0.attn_q.bias" in names, attn_out_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_id=int(gguf_field(reader, "tokenizer.ggml.bos_token_id", -1)),
        eos_ids=(int(eos),) if eos is not None else (), name=name,
        **{**gguf_rope(reader, arch, head_dim), **extra})


def _gguf_family_fields(reader: Any, arch: str, head_dim: int, d_model: int, n_heads: int,
                        n_layers: int) -> dict[str, Any]:
    """The ModelConfig fields Gemma 3 / Phi-3 add (the others: refuse what we do not implement)."""
    def field(key: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{arch}.{key}", default)

    if arch == "gemma3":
        if field("attn_logit_softcapping") is not None:
            raise ConvertError(f"GGUF {arch}.attn_logit_softcapping is not implemented")
        return gemma_phi.gemma3_gguf(reader, field, head_dim, n_layers, d_model, n_heads)
    if arch == "phi3":
        return gemma_phi.phi3_gguf(reader, field, head_dim, int(field("context_length", 4096)))
    _refuse_gguf_unimplemented(reader, arch, head_dim)
    return {}


def _refuse_gguf_unimplemented(reader: Any, arch: str, head_dim: int) -> None:
    dims = gguf_field(reader, f"{arch}.rope.dimension_count", head_dim)
    if int(dims) != head_dim:
        raise ConvertError(f"GGUF {arch}.rope.dimension_count={dims} (partial rotary) is not implemented "
                           f"(only head_dim = {head_dim})")
    for key in (f"{arch}.attention.sliding_window", f"{arch}.attn_logit_softcapping",
                f"{arch}.final_logit_softcapping"):
        if gguf_field(reader, key) is not None:
            raise ConvertError(f"GGUF {key} is not implemented")


def gguf_rope(reader: Any, arch: str, head_dim: int) -> dict[str, Any]:
    """Rope fields from GGUF metadata: scaling type none or linear, and llama.cpp's rope_freqs tensor (llama3)."""
    out: dict[str, Any] = {"rope_theta": float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0))}
    old_linear = gguf_field(reader, f"{arch}.rope.scale_linear")     # the key before rope.scaling.*
    kind = gguf_field(reader, f"{arch}.rope.scaling.type") or ("linear" if old_linear not in (None, 1.0) else "none")
    if kind == "linear":
        factor = gguf_field(reader, f"{arch}.rope.scaling.factor") or old_linear
        out.update(rope_type="linear", rope_factor=float(factor))
    elif kind != "none":
        raise ConvertError(f"GGUF {arch}.rope.scaling.type {kind!r} is not implemented (only none, linear)")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        from gguf import quants

        factors = np.asarray(quants.dequantize(freqs.data, freqs.tensor_type), np.float32).reshape(-1)
        if factors.size != head_dim // 2:
            raise ConvertError(f"GGUF rope_freqs.weight has {factors.size} entries, expected {head_dim // 2}")
        out["rope_freq_factors"] = tuple(float(x) for x in factors)
    return out

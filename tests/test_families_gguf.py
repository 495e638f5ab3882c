"""Family features read from GGUF metadata: a fixture written as llama.cpp's converter writes
it (f32 tensors; llama's Q/K rows permuted, qwen3's not; llama3 scaling as a `rope_freqs`
tensor; linear scaling as rope.scaling.*) converts into the model transformers runs. Gemma 3 and
Phi-3 as llama.cpp's converter writes them: Gemma's norms with 1 added, Phi's qkv and gate_up fused,
its longrope factors as rope_factors_short / rope_factors_long tensors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from skippy_zmq.config.model import ModelConfig
from skippy_zmq.checkpoint.convert import LAYER_NAMES, TOP_NAMES, ConvertError, convert_gguf, gguf_model_config
from skippy_zmq.checkpoint.families import hf_model_config
from skippy_zmq.devtools.gguf_writer import llama3_rope_factors, rotary_row_order
from test_families import FIXTURES, RTOL, expected, fixture_config, last_logits, stage_runners

gguf = pytest.importorskip("gguf")

GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}


def write_metadata(w, cfg: ModelConfig, rope_dims: int) -> None:
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(rope_dims)
    if cfg.rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_factor)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"<{i}>" for i in range(cfg.vocab_size)])
    w.add_token_types([1] * cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def write_gguf(name: str, path: Path, extra: dict | None = None, rope_dims: int | None = None) -> Path:
    """Fixture `name` as a f32 GGUF; `extra` (more metadata) and `rope_dims` test refusals."""
    from safetensors.numpy import load_file

    cfg = hf_model_config(fixture_config(name))
    arch = GGUF_ARCH[cfg.arch]
    hf = load_file(str(FIXTURES / name / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), arch)
    write_metadata(w, cfg, rope_dims or cfg.head_dim)
    for key, value in (extra or {}).items():
        w.add_key_value(key, value, gguf.GGUFValueType.STRING if isinstance(value, str) else gguf.GGUFValueType.UINT32)
    for key, (gguf_name, hf_name) in TOP_NAMES.items():
        if hf_name in hf:
            w.add_tensor(gguf_name, hf[hf_name])
    if cfg.rope_type == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    for i in range(cfg.n_layers):
        for key, (gguf_suffix, hf_suffix) in LAYER_NAMES.items():
            t = hf.get(f"model.layers.{i}.{hf_suffix}")
            if t is None:
                continue
            if arch == "llama" and key in ("wq", "bq", "wk", "bk"):
                t = t[rotary_row_order(t.shape[0], cfg.n_heads if key in ("wq", "bq") else cfg.n_kv_heads)]
            w.add_tensor(f"blk.{i}.{gguf_suffix}", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("name", ["llama3", "llama-linear", "qwen3"])
def test_gguf_converts_into_the_model_transformers_runs(name, tmp_path):
    out = tmp_path / "model"
    cfg = convert_gguf(write_gguf(name, tmp_path / f"{name}.gguf"), out)
    hf_cfg = hf_model_config(fixture_config(name))
    assert (cfg.qk_norm, cfg.attn_bias, cfg.attn_out_bias, cfg.head_dim) == \
        (hf_cfg.qk_norm, hf_cfg.attn_bias, hf_cfg.attn_out_bias, hf_cfg.head_dim)
    if name == "llama3":     # scaling arrives as llama.cpp's divisors, not as parameters
        assert cfg.rope_type == "default" and len(cfg.rope_freq_factors) == cfg.head_dim // 2
        assert max(cfg.rope_freq_factors) == 32.0 and min(cfg.rope_freq_factors) == 1.0
    else:
        assert (cfg.rope_type, cfg.rope_factor) == (hf_cfg.rope_type, hf_cfg.rope_factor)
    runners = stage_runners(out)
    for case in expected(name):
        want = case["logits"]
        got = last_logits(runners, case["prompt"], len(want))
        assert np.abs(got - want).max() <= RTOL * np.abs(want).max(), (name, len(case["prompt"]))


@pytest.mark.parametrize("key,value", [("llama.rope.scaling.type", "yarn"),
                                       ("llama.attention.sliding_window", 64)])
def test_gguf_unimplemented_metadata_is_refused_by_name(key, value, tmp_path):
    path = write_gguf("llama", tmp_path / "m.gguf", {key: value})
    with pytest.raises(ConvertError, match=key.replace(".", r"\.")):
        gguf_model_config(gguf.GGUFReader(path))


def test_gguf_partial_rotary_is_refused(tmp_path):
    path = write_gguf("llama", tmp_path / "m.gguf", rope_dims=16)
    with pytest.raises(ConvertError, match="rope.dimension_count"):
        gguf_model_config(gguf.GGUFReader(path))


# HF suffix -> GGUF suffix, as llama.cpp's Gemma3Model / Phi3MiniModel name them (rows as they are)
GGUF_SUFFIXES = {
    "gemma3": {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "post_feedforward_layernorm": "post_ffw_norm"},
    "phi3": {"input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"},
}


def write_family_gguf(name: str, path: Path) -> Path:
    """A gemma3 or phi3 fixture as llama.cpp's converter writes it (f32)."""
    from safetensors.numpy import load_file

    cfg = hf_model_config(fixture_config(name))
    hf = load_file(str(FIXTURES / name / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), cfg.arch)
    write_metadata(w, cfg, cfg.rope_dim)
    shift = 1.0 if cfg.arch == "gemma3" else 0.0        # llama.cpp: Gemma3RMSNorm's (1 + w), precomputed
    if cfg.arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
        w.add_uint32("gemma3.attention.sliding_window_pattern", 2)     # the fixtures' 2 layers: local, global
        if cfg.final_softcap:
            w.add_final_logit_softcapping(cfg.final_softcap)
    else:
        w.add_sliding_window(cfg.sliding_window)
        if cfg.rope_type == "longrope":
            w.add_rope_scaling_orig_ctx_len(cfg.rope_original_max_pos)
            w.add_rope_scaling_attn_factors(cfg.rope_attn_factor)
            w.add_tensor("rope_factors_long.weight", np.asarray(cfg.rope_long_freq_factors, np.float32))
            w.add_tensor("rope_factors_short.weight", np.asarray(cfg.rope_freq_factors, np.float32))
    w.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    for i in range(cfg.n_layers):
        for hf_suffix, gguf_suffix in GGUF_SUFFIXES[cfg.arch].items():
            t = hf[f"model.layers.{i}.{hf_suffix}.weight"]
            w.add_tensor(f"blk.{i}.{gguf_suffix}.weight", t + np.float32(shift) if t.ndim == 1 else t)
    w.add_tensor("output_norm.weight", hf["model.norm.weight"] + np.float32(shift))
    if "lm_head.weight" in hf:
        w.add_tensor("output.weight", hf["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("name", ["gemma3", "phi3", "phi3-window"])
def test_gemma3_and_phi3_gguf_convert_into_the_model_transformers_runs(name, tmp_path):
    """(gemma3-4b's query_pre_attn_scalar 192 has no GGUF key: llama.cpp scales by head_dim, so it is left out.)"""
    out = tmp_path / "model"
    cfg = convert_gguf(write_family_gguf(name, tmp_path / f"{name}.gguf"), out)
    hf_cfg = hf_model_config(fixture_config(name))
    same = ("sliding_window", "full_attention_layers", "rope_local_theta", "rotary_dim", "rope_type", "attn_scale",
            "embed_scale", "sandwich_norms", "ffn_act", "qk_norm", "rope_original_max_pos", "tied_embeddings")
    assert {k: getattr(cfg, k) for k in same} == {k: getattr(hf_cfg, k) for k in same}
    for key in ("rope_freq_factors", "rope_long_freq_factors"):    # f32 tensors in a GGUF
        assert np.array_equal(np.float32(getattr(cfg, key)), np.float32(getattr(hf_cfg, key))), key
    assert cfg.rope_attn_factor == pytest.approx(hf_cfg.rope_attn_factor)
    runners = stage_runners(out)
    for case in expected(name):
        want = case["logits"]
        got = last_logits(runners, case["prompt"], len(want))
        assert np.abs(got - want).max() <= RTOL * np.abs(want).max(), (name, len(case["prompt"]))


def test_a_fused_projection_that_disagrees_with_the_config_is_refused_by_name(tmp_path):
    import json
    import shutil

    from skippy_zmq.checkpoint.convert import convert_hf

    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / "phi3", hf)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 3}))
    with pytest.raises(ConvertError, match="qkv_proj.weight' has 640 rows, the config says 1152"):
        convert_hf(hf, tmp_path / "model")

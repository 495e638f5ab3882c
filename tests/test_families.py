"""Each family's small random checkpoint, saved by transformers 5, converts into the model
transformers runs: the same fp32 logits and greedy ids, in one process and over two stages.

Fixtures: tests/fixtures/families/ (scripts/make_family_fixtures.py wrote them; expected.npz
holds transformers' logits at the last 4 positions of 3 prompts of 9, 40 and 300 tokens and
16 greedy ids after each). Plus config reading: both HF layouts give one ModelConfig, and
every field that changes the math and is not implemented is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import MODEL_DIR
from skippy_zmq.config.model import Buckets, KVConfig, ModelConfig
from skippy_zmq.checkpoint import loader
from skippy_zmq.model import weights
from skippy_zmq.checkpoint.convert import ConvertError, convert_hf, hf_model_config
from skippy_zmq.model.runner import SliceRunner

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "families"
FAMILIES = ("llama", "llama3", "llama-linear", "qwen2", "qwen3", "mistral", "qwen2-window",
            "gemma3", "gemma3-4b", "phi3", "phi3-window", "qwen3-moe", "mixtral", "qwen2-moe")
TF4_LAYOUTS = {"llama3-tf4": "llama3", "gemma3-tf4": "gemma3-4b", "phi3-tf4": "phi3"}   # v4 config -> v5 twin
KV = KVConfig(lanes=1, capacity=512)
BUCKETS = Buckets(prefill_chunks=(64,), decode_rows=(1,), attn_lens=(512,))   # one shape per step kind
RTOL = 1e-4          # max|Δ| ≤ RTOL · max|logit|


def expected(name: str) -> list[dict[str, np.ndarray]]:
    data = np.load(FIXTURES / name / "expected.npz")
    n = len([k for k in data if k.startswith("prompt_")])
    return [{"prompt": data[f"prompt_{i}"], "logits": data[f"logits_{i}"], "greedy": data[f"greedy_{i}"]}
            for i in range(n)]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> converted model dir, converted once per module on first use."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            done[name] = tmp_path_factory.mktemp(name) / "model"
            convert_hf(FIXTURES / name, done[name])
        return done[name]
    return get


def stage_runners(model_dir: Path, cuts: tuple[int, ...] = ()) -> list[SliceRunner]:
    cfg = ModelConfig.load(model_dir / "model.json")
    bounds = [0, *cuts, cfg.n_layers]
    runners = []
    for start, end in zip(bounds, bounds[1:]):
        cfg, params = loader.load_slice(model_dir, start, end)
        runners.append(SliceRunner(cfg, params, start, end, KV, BUCKETS))
    return runners


def prefill(runners: list[SliceRunner], ids: np.ndarray) -> None:
    x: np.ndarray | None = ids
    for r in runners:
        x = r.prefill(0, x, 0, output="none" if r.last else "hidden")


def step(runners: list[SliceRunner], token: int, pos: int) -> np.ndarray:
    """One decode through every stage: the last stage's logits [V]."""
    x = np.array([token])
    for r in runners:
        x = r.decode(np.array([0]), x, np.array([pos]))
    return x[0]


def last_logits(runners: list[SliceRunner], ids: np.ndarray, n: int) -> np.ndarray:
    """Logits of the last n positions: prefill the rest, then decode them one by one (the cached path)."""
    prefill(runners, ids[:-n])
    return np.stack([step(runners, int(ids[i]), i) for i in range(len(ids) - n, len(ids))])


def greedy(runners: list[SliceRunner], ids: np.ndarray, n: int) -> list[int]:
    """Prefill covers prompt[:-1]; the first decode carries the last prompt token (the pipeline's protocol)."""
    prefill(runners, ids[:-1])
    out, token = [], int(ids[-1])
    for pos in range(len(ids) - 1, len(ids) - 1 + n):
        token = int(np.argmax(step(runners, token, pos)))
        out.append(token)
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(name, converted):
    runners = stage_runners(converted(name))
    for case in expected(name):
        want = case["logits"]
        got = last_logits(runners, case["prompt"], len(want))
        rel = np.abs(got - want).max() / np.abs(want).max()
        assert rel <= RTOL, (name, len(case["prompt"]), rel)


@pytest.mark.slow    # each case compiles six steps (~3-7 s on a shared 2-core machine)
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_ids_match_transformers_in_one_process_and_over_two_stages(name, converted):
    one, two = stage_runners(converted(name)), stage_runners(converted(name), cuts=(1,))
    for case in expected(name):
        want = case["greedy"].tolist()
        assert greedy(one, case["prompt"], len(want)) == want, (name, len(case["prompt"]))
        assert greedy(two, case["prompt"], len(want)) == want, (name, len(case["prompt"]))


def test_families_switch_on_their_features(converted):
    cfgs = {name: ModelConfig.load(converted(name) / "model.json") for name in FAMILIES}
    assert (cfgs["llama3"].rope_type, cfgs["llama3"].rope_factor, cfgs["llama3"].rope_original_max_pos) == \
        ("llama3", 32.0, 64)
    assert (cfgs["llama-linear"].rope_type, cfgs["llama-linear"].rope_factor) == ("linear", 4.0)
    assert cfgs["llama-linear"].attn_bias and cfgs["llama-linear"].attn_out_bias
    assert cfgs["qwen2"].attn_bias and not cfgs["qwen2"].attn_out_bias and cfgs["qwen2"].rope_theta == 1e6
    q3 = cfgs["qwen3"]
    assert q3.qk_norm and not q3.attn_bias and (q3.head_dim, q3.n_heads, q3.d_model) == (128, 2, 128)
    assert (cfgs["mistral"].sliding_window, cfgs["mistral"].full_attention_layers) == (64, ())
    assert (cfgs["qwen2-window"].sliding_window, cfgs["qwen2-window"].full_attention_layers) == (64, (0,))
    assert weights.layer_shapes(q3)["q_norm"] == (128,)


def test_gemma3_and_phi3_switch_on_their_features(converted):
    g, g4 = (ModelConfig.load(converted(n) / "model.json") for n in ("gemma3", "gemma3-4b"))
    assert (g.ffn_act, g.sandwich_norms, g.qk_norm, g.tied_embeddings) == ("gelu_tanh", True, True, True)
    assert (g.embed_scale, g.attn_scale, g.final_softcap) == (128 ** 0.5, 256 ** -0.5, 0.0)
    assert (g.sliding_window, g.full_attention_layers, g.rope_local_theta, g.rope_theta) == (64, (1,), 1e4, 1e6)
    assert (g4.rope_type, g4.rope_factor, g4.attn_scale, g4.final_softcap) == ("linear", 8.0, 192 ** -0.5, 30.0)
    assert set(weights.layer_shapes(g)) >= {"post_attn_norm", "post_ffn_norm", "q_norm", "k_norm"}
    p, pw = (ModelConfig.load(converted(n) / "model.json") for n in ("phi3", "phi3-window"))
    assert (p.head_dim, p.rotary_dim, p.rope_type, p.rope_original_max_pos) == (128, 96, "longrope", 512)
    assert p.rope_attn_factor == pytest.approx((1 + np.log(8) / np.log(512)) ** 0.5)
    assert p.rope_freq_factors[1] == 1.05 and p.rope_long_freq_factors[1] == 1.5
    assert (pw.sliding_window, pw.full_attention_layers, pw.rope_type, pw.rotary_dim) == (64, (), "default", 0)


def test_gemma3_norms_hold_one_plus_the_hf_weight(converted):
    """transformers' Gemma3RMSNorm multiplies by (1 + w); the checkpoint keeps 1 + w (as llama.cpp's GGUF)."""
    from safetensors.numpy import load_file

    hf = load_file(str(FIXTURES / "gemma3" / "model.safetensors"))
    _, params = loader.load_slice(converted("gemma3"), 0, 2)
    for ours, theirs in (("post_attn_norm", "post_attention_layernorm"), ("ffn_norm", "pre_feedforward_layernorm"),
                         ("q_norm", "self_attn.q_norm")):
        np.testing.assert_array_equal(np.asarray(params["layers"][1][ours]),
                                      1.0 + hf[f"model.layers.1.{theirs}.weight"])


def test_phi3_fused_projections_split_by_rows(converted):
    from safetensors.numpy import load_file

    hf = load_file(str(FIXTURES / "phi3" / "model.safetensors"))
    _, params = loader.load_slice(converted("phi3"), 0, 2)
    qkv, gate_up = hf["model.layers.0.self_attn.qkv_proj.weight"], hf["model.layers.0.mlp.gate_up_proj.weight"]
    layer = params["layers"][0]      # ours [in, out]
    np.testing.assert_array_equal(np.asarray(layer["wk"]), qkv[384:512].T)     # q: 3 heads * 128, k: 1 * 128
    np.testing.assert_array_equal(np.asarray(layer["w_up"]), gate_up[256:].T)  # [gate | up], ffn 256


def test_longrope_frequencies_equal_transformers_short_and_long():
    """Both factor sets and the attention factor, against transformers' _compute_longrope_parameters."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from skippy_zmq.model import rope

    config = transformers.AutoConfig.from_pretrained(FIXTURES / "phi3")
    cfg = hf_model_config(fixture_config("phi3"))
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=513)
    np.testing.assert_allclose(rope.inv_freq(cfg), short.numpy(), rtol=1e-6)
    np.testing.assert_allclose(rope.long_inv_freq(cfg), long.numpy(), rtol=1e-6)
    assert cfg.rope_attn_factor == pytest.approx(factor)


def test_longrope_switches_to_the_long_factors_at_the_original_context():
    from skippy_zmq.model import rope
    from skippy_zmq.model.llama import model_rope

    cfg = hf_model_config(fixture_config("phi3"))
    cos, _ = model_rope(cfg, np.array([[511, 512]]))
    want = [np.cos(511 * rope.inv_freq(cfg)), np.cos(512 * rope.long_inv_freq(cfg))]
    np.testing.assert_allclose(np.asarray(cos)[0, :, :48] / cfg.rope_attn_factor, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tf4,twin", TF4_LAYOUTS.items())
def test_transformers4_layout_converts_to_the_same_model(tf4, twin, tmp_path, converted):
    """The v5 fixture's config as transformers 4 wrote it (top-level rope_theta, rope_scaling; Gemma's
    rope_local_base_freq and sliding_window_pattern; Phi's partial_rotary_factor): the same model."""
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / twin, hf)
    shutil.copy(FIXTURES / tf4 / "config.json", hf / "config.json")
    cfg = convert_hf(hf, tmp_path / "model")
    assert dataclasses.replace(cfg, name=twin) == ModelConfig.load(converted(twin) / "model.json")


def test_sliding_window_mask_keeps_the_last_window_keys_and_spares_padding():
    from skippy_zmq.model.llama import visible_keys

    positions = np.array([[5, 1, 8]])                      # 8 == capacity: a padding token
    got = np.asarray(visible_keys(positions, 8, 8, window=3))[0]
    assert got[0].tolist() == [False, False, False, True, True, True, False, False]
    assert got[1].tolist() == [True, True] + [False] * 6
    assert got[2].all()


# ---------------------------------------------------------------- config reading


def fixture_config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


@pytest.mark.parametrize("tf4,twin", TF4_LAYOUTS.items())
def test_v4_and_v5_layouts_give_one_model_config(tf4, twin):
    v5, v4 = fixture_config(twin), fixture_config(tf4)
    assert "rope_parameters" in v5 and "rope_theta" not in v5
    assert "rope_scaling" in v4 and "rope_parameters" not in v4
    assert hf_model_config(v4) == hf_model_config(v5)
    assert hf_model_config(v5).rope_theta == {"llama3": 500000.0, "gemma3-4b": 1e6, "phi3": 1e4}[twin]


def test_v5_rope_theta_is_read_from_rope_parameters():
    """The bug this closes: a v5 Qwen config's theta (1e6) used to fall back to 10000."""
    assert hf_model_config(fixture_config("qwen2")).rope_theta == 1e6
    assert hf_model_config(fixture_config("qwen3")).rope_theta == 1e6


def test_v4_legacy_type_key_and_top_level_theta():
    config = {**fixture_config("llama"), "rope_theta": 100000.0, "rope_scaling": {"type": "linear", "factor": 2}}
    config.pop("rope_parameters")
    cfg = hf_model_config(config)
    assert (cfg.rope_theta, cfg.rope_type, cfg.rope_factor) == (100000.0, "linear", 2.0)


def test_llama3_original_context_defaults_to_max_position_embeddings():
    config = fixture_config("llama3")
    config["rope_parameters"].pop("original_max_position_embeddings")
    assert hf_model_config(config).rope_original_max_pos == 1024


def test_qwen_window_layers_follow_max_window_layers_or_layer_types():
    config = {**fixture_config("qwen2"), "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 0}
    config.pop("layer_types")
    assert (hf_model_config(config).sliding_window, hf_model_config(config).full_attention_layers) == (32, ())
    assert hf_model_config({**config, "max_window_layers": 1}).full_attention_layers == (0,)
    explicit = {**config, "layer_types": ["sliding_attention", "full_attention"]}
    assert hf_model_config(explicit).full_attention_layers == (1,)
    assert hf_model_config({**config, "use_sliding_window": False}).sliding_window == 0


def test_old_model_json_loads_with_plain_llama_math():
    data = {"arch": "llama", "n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
            "ffn_dim": 128, "vocab_size": 97, "rope_theta": 10000.0, "norm_eps": 1e-5, "tied_embeddings": True,
            "max_seq_len": 512, "attn_bias": False, "dtype": "float32", "bos_id": 1, "eos_ids": [2], "name": "old"}
    cfg = ModelConfig.from_dict(data)
    assert (cfg.rope_type, cfg.rope_freq_factors, cfg.qk_norm, cfg.attn_out_bias, cfg.sliding_window) == \
        ("default", (), False, False, 0)
    if (MODEL_DIR / "model.json").is_file():
        assert ModelConfig.load(MODEL_DIR / "model.json").rope_type == "default"


def test_model_json_round_trips_new_fields(tmp_path):
    cfg = dataclasses.replace(hf_model_config(fixture_config("qwen3")), rope_freq_factors=(1.0,) * 64)
    cfg.save(tmp_path / "model.json")
    assert ModelConfig.load(tmp_path / "model.json") == cfg


def _with(name: str, **changes) -> dict:
    config = fixture_config(name)
    for key, value in changes.items():
        if key.startswith("rope__"):
            config["rope_parameters"][key[6:]] = value
        else:
            config[key] = value
    return config


REFUSED = [
    (_with("llama", hidden_act="gelu"), "hidden_act"),
    (_with("llama", mlp_bias=True), "mlp_bias"),
    (_with("llama", rope__rope_type="yarn", rope__factor=4.0), "yarn"),
    (_with("llama", rope__rope_type="dynamic", rope__factor=2.0), "dynamic"),
    (_with("llama", rope__rope_type="longrope"), "longrope"),
    (_with("llama", partial_rotary_factor=0.5), "partial_rotary_factor"),
    (_with("llama", rope__partial_rotary_factor=0.5), "partial_rotary_factor"),
    (_with("llama", rope__attention_factor=0.8), "attention_factor"),
    (_with("llama", attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (_with("llama", final_logit_softcapping=30.0), "final_logit_softcapping"),
    (_with("llama", model_type="gemma2"), "model_type"),
    (_with("llama3", rope_parameters={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}),
     "low_freq_factor"),
    (_with("llama", rope_parameters={"full_attention": {"rope_type": "default"},
                                     "sliding_attention": {"rope_type": "default"}}), "rope_parameters"),
    (_with("qwen3", use_sliding_window=True, sliding_window=32,
           layer_types=["full_attention", "chunked_attention"]), "layer_types"),
    (_with("qwen3", use_sliding_window=True, sliding_window=32, layer_types=["sliding_attention"]), "layer_types"),
    (_with("qwen2", layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (_with("gemma3", attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (_with("gemma3", hidden_activation="gelu"), "hidden_activation"),
    (_with("gemma3", rope_parameters={"full_attention": {"rope_type": "default"},
                                      "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     "sliding_attention"),
    (_with("gemma3", rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0},
                                      "sliding_attention": {"rope_type": "default"}}), "yarn"),
    (_with("gemma3", layer_types=["sliding_attention", "chunked_attention"]), "layer_types"),
    (_with("gemma3", use_bidirectional_attention=True), "use_bidirectional_attention"),
    ({"model_type": "gemma3", "text_config": fixture_config("gemma3")}, "multimodal"),
    (_with("phi3", hidden_act="gelu_new"), "hidden_act"),
    (_with("phi3", rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "dynamic"),
    (_with("phi3", rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 48}), "long_factor"),
]


@pytest.mark.parametrize("config,field", REFUSED, ids=[f for _, f in REFUSED])
def test_unimplemented_math_is_refused_by_name(config, field):
    with pytest.raises(ConvertError, match=field):
        hf_model_config(config)


def test_random_model_shapes_of_gemma3_and_phi4_mini_are_the_real_configs():
    from skippy_zmq.devtools.random_model import RandomSpec, model_config

    c = model_config(RandomSpec("gemma-3-1b"))
    assert (c.arch, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size) == \
        ("gemma3", 26, 1152, 4, 1, 256, 6912, 262144)
    assert (c.sliding_window, c.full_attention_layers, c.rope_theta, c.rope_local_theta, c.attn_scale) == \
        (512, (5, 11, 17, 23), 1e6, 1e4, 1 / 16)
    c = model_config(RandomSpec("gemma-3-4b", layers=2))
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.ffn_dim, c.vocab_size, c.sliding_window) == \
        (2, 2560, 8, 4, 10240, 262208, 1024)
    assert (c.rope_type, c.rope_factor, c.full_attention_layers) == ("linear", 8.0, ())
    c = model_config(RandomSpec("phi-4-mini"))
    assert (c.arch, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size) == \
        ("phi3", 32, 3072, 24, 8, 128, 8192, 200064)
    assert (c.rotary_dim, c.rope_type, c.rope_original_max_pos, c.tied_embeddings) == (96, "longrope", 4096, True)
    assert c.rope_attn_factor == pytest.approx((1 + np.log(32) / np.log(4096)) ** 0.5)
    assert len(c.rope_long_freq_factors) == 48 and c.rope_long_freq_factors[-1] == 47.77


def test_random_model_gguf_of_gemma3_is_refused_by_name(tmp_path):
    from skippy_zmq.devtools.random_model import RandomModelError, RandomSpec, write_random_model

    with pytest.raises(RandomModelError, match="--gguf is not implemented for gemma-3-1b"):
        write_random_model(RandomSpec("gemma-3-1b", layers=1), tmp_path / "m", gguf="q4_1")

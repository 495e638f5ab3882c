"""Build the small random checkpoints of tests/fixtures/families/ with transformers.

Needs the parity extra (torch + transformers, see setup.cfg); `make test` never
runs it, the tests read what it committed. Each family gets small widths but its
real head structure (GQA ratio, head_dim, biases, norms, rope scaling), is saved
with `save_pretrained` (safetensors, float32) and gets an `expected.npz`:
transformers' fp32 logits at the last LAST positions of each prompt and its
greedy ids (a cached greedy loop, checked against an uncached argmax).

    .venv/bin/python scripts/make_family_fixtures.py [--out tests/fixtures/families]

Where a feature only matters past some length (llama3 scaling, a sliding
window), the script also runs transformers without it and fails unless the
logits differ: otherwise the fixture would prove nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, models
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB, LAST, NEW = 512, 4, 16
PROMPT_LENS = (9, 40, 300)
SMALL = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             rms_norm_eps=1e-5, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)

FAMILIES = {
    # Llama 2 style: default rope, GQA 2:1, untied head.
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Llama 3.2 style: GQA 4:1, tied, llama3 scaling with a short original context so 300 tokens feel it.
    "llama3": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}),
    # Linear scaling, attention_bias (q/k/v and o biases), multi-head (no GQA).
    "llama-linear": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=4, attention_bias=True,
                         rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    # Qwen2.5 style: q/k/v bias, tied, theta 1e6, GQA 2:1.
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Qwen3 style: per-head q/k RMSNorm, head_dim 128 with heads * head_dim = 2 * hidden, GQA 2:1.
    "qwen3": dict(model_type="qwen3", num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                  tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Mistral 7B v0.1 style: GQA 4:1 and a sliding window (64 here) shorter than the long prompt.
    "mistral": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=1, sliding_window=64,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Qwen2 with use_sliding_window: layers from max_window_layers (1) on see the last 64 keys, layer 0 all.
    "qwen2-window": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         use_sliding_window=True, sliding_window=64, max_window_layers=1,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Gemma 3 1B style: 4 heads, 1 kv head of 256 (q wider than hidden), local layer 0 (window 64, base 1e4)
    # and global layer 1 (base 1e6), query_pre_attn_scalar = head_dim.
    "gemma3": dict(model_type="gemma3_text", num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                   sliding_window=64, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=256,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}),
    # Gemma 3 4B style: GQA 2:1, linear scaling 8 on the global layer; plus what Gemma 3 leaves off but the
    # config can say: a scalar other than head_dim and a final logit softcap.
    "gemma3-4b": dict(model_type="gemma3_text", num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                      sliding_window=64, layer_types=["sliding_attention", "full_attention"],
                      query_pre_attn_scalar=192, final_logit_softcapping=30.0,
                      rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                          "rope_theta": 1000000.0}}),
    # Phi-4-mini style: GQA 3:1 at head_dim 128 (hidden = 3 heads), partial rotary 0.75, longrope with
    # short factors away from 1 (the prompts stay under original_max_position_embeddings = 512), tied.
    "phi3": dict(model_type="phi3", hidden_size=384, num_attention_heads=3, num_key_value_heads=1,
                 tie_word_embeddings=True, pad_token_id=0, max_position_embeddings=4096,
                 original_max_position_embeddings=512,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                  "short_factor": [1.0 + 0.05 * i for i in range(48)],
                                  "long_factor": [1.0 + 0.5 * i for i in range(48)]}),
    # Phi-3-mini-4k style: multi-head, default rope, a sliding window (64 here).
    "phi3-window": dict(model_type="phi3", num_attention_heads=4, num_key_value_heads=4, pad_token_id=0,
                        sliding_window=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Mixture of experts (after the dense ones, so their seeds stay). Qwen3-MoE style: 8 experts, top 2,
    # renormalised, q/k norm, layer 1 dense (mlp_only_layers) between two MoE layers.
    "qwen3-moe": dict(model_type="qwen3_moe", num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                      norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Mixtral style: 8 experts of intermediate_size, top 2 (always renormalised), GQA 2:1, no window.
    "mixtral": dict(model_type="mixtral", num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                    num_experts_per_tok=2, intermediate_size=96, sliding_window=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Qwen2-MoE style: q/k/v bias, 8 routed experts top 3 not renormalised, a sigmoid-gated shared expert;
    # decoder_sparse_step 2: layer 0 dense (intermediate_size), layer 1 routed.
    "qwen2-moe": dict(model_type="qwen2_moe", num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                      num_experts_per_tok=3, moe_intermediate_size=64, shared_expert_intermediate_size=96,
                      norm_topk_prob=False, decoder_sparse_step=2, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}
# Same model run without the feature: its logits must differ on the long prompt.
WITHOUT = {"llama3": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
           "mistral": {"sliding_window": None}, "qwen2-window": {"use_sliding_window": False},
           "gemma3": {"sliding_window": 4096},
           "phi3": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}},
           "phi3-window": {"sliding_window": None}}
GEMMA = ("gemma3_text",)   # norms compute x * (1 + w): w near 0


def prompts() -> list[np.ndarray]:
    rng = np.random.default_rng(1234)
    return [rng.integers(3, VOCAB, size=n).astype(np.int64) for n in PROMPT_LENS]


def build(spec: dict, seed: int) -> torch.nn.Module:
    spec = {**SMALL, **spec}
    kind = spec.pop("model_type")
    config = AutoConfig.for_model(kind, **spec)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomise(model, seed, norm_centre=0.0 if kind in GEMMA else 1.0)
    return model.eval()


def randomise(model: torch.nn.Module, seed: int, norm_centre: float = 1.0) -> None:
    """O(1) activations and well-separated logits (transformers' init is near zero and its biases zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(norm_centre + 0.2 * noise)
            elif p.ndim == 1:
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name:   # small, so a tied head does not just echo the input token
                p.copy_(0.05 * noise)
            else:
                p.copy_(noise / p.shape[1] ** 0.5)


@torch.no_grad()
def last_logits(model: torch.nn.Module, ids: np.ndarray) -> np.ndarray:
    return model(input_ids=torch.from_numpy(ids)[None]).logits[0, -LAST:].numpy()


@torch.no_grad()
def greedy(model: torch.nn.Module, ids: np.ndarray) -> np.ndarray:
    """NEW greedy ids with the KV cache, checked against an uncached argmax over the whole sequence."""
    out = model(input_ids=torch.from_numpy(ids)[None], use_cache=True)
    past, tokens = out.past_key_values, [int(out.logits[0, -1].argmax())]
    for _ in range(NEW - 1):
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        tokens.append(int(out.logits[0, -1].argmax()))
    full = np.concatenate([ids, tokens[:-1]])
    uncached = model(input_ids=torch.from_numpy(full)[None]).logits[0, len(ids) - 1:].argmax(-1).tolist()
    assert uncached == tokens, (uncached, tokens)
    return np.asarray(tokens, np.int32)


def write_tokenizer(directory: Path) -> None:
    """Word-level ids <0>..<511>: the tests feed ids, convert_hf wants a tokenizer.json."""
    vocab = {f"<{i}>": i for i in range(VOCAB)}
    Tokenizer(models.WordLevel(vocab, unk_token="<0>")).save(str(directory / "tokenizer.json"))


def make(name: str, spec: dict, out: Path, seed: int) -> dict:
    model = build(spec, seed)
    directory = out / name
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory)
    write_tokenizer(directory)
    arrays, meta = {}, {"family": name, "transformers": transformers.__version__, "torch": torch.__version__}
    for i, ids in enumerate(prompts()):
        arrays[f"prompt_{i}"] = ids.astype(np.int32)
        arrays[f"logits_{i}"] = last_logits(model, ids)
        arrays[f"greedy_{i}"] = greedy(model, ids)
    if name in WITHOUT:
        plain = build({**spec, **WITHOUT[name]}, seed)
        plain.load_state_dict(model.state_dict())
        long_ids = prompts()[-1]
        delta = np.abs(last_logits(plain, long_ids) - arrays[f"logits_{len(PROMPT_LENS) - 1}"]).max()
        scale = np.abs(arrays[f"logits_{len(PROMPT_LENS) - 1}"]).max()
        assert delta > 1e-2 * scale, f"{name}: the feature does not change the logits ({delta} vs {scale})"
        meta["without_feature_max_delta_over_max_logit"] = float(delta / scale)
        meta["without_feature_greedy_differs"] = bool((greedy(plain, long_ids) != arrays["greedy_2"]).any())
    np.savez_compressed(directory / "expected.npz", **arrays)
    (directory / "expected.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def tf4_layout(out: Path) -> None:
    """llama3-tf4/config.json: the llama3 fixture's config as transformers 4 wrote it (top-level rope_theta,
    rope_scaling); checked here to load into the very same model under transformers 5."""
    config = json.loads((out / "llama3" / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (out / "llama3-tf4").mkdir(exist_ok=True)
    (out / "llama3-tf4" / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        for f in (out / "llama3").glob("*.safetensors"):
            shutil.copy(f, tmp)
        shutil.copy(out / "llama3-tf4" / "config.json", tmp)
        a = AutoModelForCausalLM.from_pretrained(out / "llama3", dtype=torch.float32).eval()
        b = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        ids = prompts()[-1]
        assert np.array_equal(last_logits(a, ids), last_logits(b, ids)), "tf4 layout loads a different model"


def tf4_gemma3_layout(out: Path) -> None:
    """gemma3-tf4/config.json: the gemma3-4b fixture's config as transformers 4 wrote it (rope_theta,
    rope_local_base_freq, rope_scaling for the global layers, sliding_window_pattern instead of layer_types)."""
    config = json.loads((out / "gemma3-4b" / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.pop("layer_types")
    config["sliding_window_pattern"] = 2
    config["rope_theta"] = rope["full_attention"].pop("rope_theta")
    config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    config["rope_scaling"] = rope["full_attention"]
    _check_same_model(out, "gemma3-4b", "gemma3-tf4", config)


def tf4_phi3_layout(out: Path) -> None:
    """phi3-tf4/config.json: the phi3 fixture's config as Phi-4-mini's Hub file has it (top-level rope_theta,
    partial_rotary_factor; rope_scaling with `type`)."""
    config = json.loads((out / "phi3" / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    rope.pop("original_max_position_embeddings", None)
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    _check_same_model(out, "phi3", "phi3-tf4", config)


def _check_same_model(out: Path, source: str, name: str, config: dict) -> None:
    (out / name).mkdir(exist_ok=True)
    (out / name / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        for f in (out / source).glob("*.safetensors"):
            shutil.copy(f, tmp)
        shutil.copy(out / name / "config.json", tmp)
        a = AutoModelForCausalLM.from_pretrained(out / source, dtype=torch.float32).eval()
        b = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        ids = prompts()[-1]
        assert np.array_equal(last_logits(a, ids), last_logits(b, ids)), f"{name} loads a different model"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests/fixtures/families")
    parser.add_argument("--only", nargs="*", help="family names (default: all)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    for seed, (name, spec) in enumerate(FAMILIES.items()):
        if not args.only or name in args.only:
            print(json.dumps(make(name, spec, args.out, seed)))
    tf4_layout(args.out)
    tf4_gemma3_layout(args.out)
    tf4_phi3_layout(args.out)


if __name__ == "__main__":
    main()

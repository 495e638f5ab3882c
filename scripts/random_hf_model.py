"""Write a random Llama-shaped HF model directory (config.json, tokenizer.json, one
safetensors shard per layer), shard by shard, so making a big one takes little memory.

    .venv/bin/python scripts/random_hf_model.py models/scale-src/llama-1b \\
        --hidden 2048 --layers 16 --heads 32 --kv-heads 8 --ffn 8192 --vocab 128256 [--dtype bf16] [--untied]
    .venv/bin/python scripts/random_hf_model.py models/scale-src/qwen3-30b-a3b-L4 \\
        --shape qwen3-30b-a3b --layers 4 --dtype bf16     # a random-model shape: its config, MoE too

For conversion measurements (peak RSS, seconds); the values mean nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}
ROWS = 8192   # embedding / head rows drawn at a time


def config(a: argparse.Namespace) -> dict:
    a.layers = a.layers or 16
    return {"model_type": "llama", "hidden_size": a.hidden, "num_hidden_layers": a.layers,
            "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "intermediate_size": a.ffn,
            "vocab_size": a.vocab, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": not a.untied, "max_position_embeddings": 8192,
            "eos_token_id": 2, "bos_token_id": 1}


def random_matrix(rng: np.random.Generator, shape: tuple[int, int], dtype: type) -> np.ndarray:
    out = np.empty(shape, dtype)
    for r in range(0, shape[0], ROWS):   # f32 temporaries of ROWS rows only
        block = rng.standard_normal((min(ROWS, shape[0] - r), shape[1]), np.float32)
        block *= 0.02
        out[r:r + len(block)] = block
    return out


def shape_config(a: argparse.Namespace) -> dict:
    """A random-model shape's real config (skippy_zmq.devtools.random_model.SHAPES), --layers cutting it;
    the writer's other flags follow it."""
    from skippy_zmq.devtools.random_model import SHAPES

    cfg = dict(SHAPES[a.shape], eos_token_id=2, bos_token_id=1)
    cfg["num_hidden_layers"] = a.layers or cfg["num_hidden_layers"]
    a.hidden, a.layers, a.heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    a.kv_heads, a.ffn, a.vocab = cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["vocab_size"]
    a.untied = not cfg.get("tie_word_embeddings", True)
    return cfg


def mlp_shapes(cfg: dict, a: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """A layer's MLP tensors: dense, or a router and every expert (the hub's per-expert names)."""
    d = a.hidden
    if not cfg.get("num_experts"):
        return {"mlp.gate_proj": (a.ffn, d), "mlp.up_proj": (a.ffn, d), "mlp.down_proj": (d, a.ffn)}
    f = cfg["moe_intermediate_size"]
    out = {"mlp.gate": (cfg["num_experts"], d)}
    for j in range(cfg["num_experts"]):
        out.update({f"mlp.experts.{j}.gate_proj": (f, d), f"mlp.experts.{j}.up_proj": (f, d),
                    f"mlp.experts.{j}.down_proj": (d, f)})
    return out


def write(out: Path, a: argparse.Namespace) -> None:
    from tokenizers import Tokenizer, models

    out.mkdir(parents=True, exist_ok=True)
    cfg = shape_config(a) if a.shape else config(a)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>")).save(str(out / "tokenizer.json"))
    rng, dt = np.random.default_rng(a.seed), DTYPES[a.dtype]
    d = a.hidden
    hd = cfg.get("head_dim") or a.hidden // a.heads
    top = {"model.embed_tokens.weight": random_matrix(rng, (a.vocab, d), dt), "model.norm.weight": np.ones(d, dt)}
    save_file(top, str(out / "model-embed.safetensors"))
    del top
    if a.untied:
        save_file({"lm_head.weight": random_matrix(rng, (a.vocab, d), dt)}, str(out / "model-head.safetensors"))
    shapes = {"self_attn.q_proj": (a.heads * hd, d), "self_attn.k_proj": (a.kv_heads * hd, d),
              "self_attn.v_proj": (a.kv_heads * hd, d), "self_attn.o_proj": (d, a.heads * hd),
              **mlp_shapes(cfg, a)}
    for i in range(a.layers):
        shard = {f"model.layers.{i}.{k}.weight": random_matrix(rng, s, dt) for k, s in shapes.items()}
        shard[f"model.layers.{i}.input_layernorm.weight"] = np.ones(d, dt)
        shard[f"model.layers.{i}.post_attention_layernorm.weight"] = np.ones(d, dt)
        if cfg.get("model_type") in ("qwen3", "qwen3_moe"):
            shard[f"model.layers.{i}.self_attn.q_norm.weight"] = np.ones(hd, dt)
            shard[f"model.layers.{i}.self_attn.k_norm.weight"] = np.ones(hd, dt)
        save_file(shard, str(out / f"model-layer-{i:05d}.safetensors"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    for name, default in [("hidden", 2048), ("layers", 0), ("heads", 32), ("kv-heads", 8), ("ffn", 8192),
                          ("vocab", 128256), ("seed", 0)]:
        p.add_argument(f"--{name}", type=int, default=default)   # --layers 0: 16, or a --shape's depth
    p.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    p.add_argument("--untied", action="store_true")
    p.add_argument("--shape", default=None, help="a random-model shape: its config (--layers cuts it; else its depth)")
    write(p.parse_args().out, p.parse_args())


if __name__ == "__main__":
    main()

"""Weights described once, abstractly; random init, checkpoint layout and the
orbax partial-restore target are all derived from that one description.

On disk (one orbax PyTree checkpoint under `<model_dir>/params`):
    {"embed": [V, D], "norm": [D], ["head": [D, V]],
     "layers": {"0": {...}, "1": {...}, ...}}
Layers are keyed by their global index so a stage restores [start, end) alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from skippy_zmq.config.model import ModelConfig
from skippy_zmq.model import quant

LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down")
ROUTER_KEYS = ("router", "shared_gate")    # MoE routing: f32 under every weights format
BIAS_KEYS = ("bq", "bk", "bv")
QUANT_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "head")   # quantised under quantize=...
QUANTIZE_MODES = (None, "int8", "q4")


def expert_key(j: int, matrix: str) -> str:
    """Expert j's matrix in a layer item (a checkpoint stores each expert on its own)."""
    return f"x{j:03d}.{matrix}"


def expert_of(key: str) -> tuple[int, str] | None:
    """(expert, matrix) of an expert_key, else None."""
    head, dot, matrix = key.partition(".")
    return (int(head[1:]), matrix) if dot and head[:1] == "x" and head[1:].isdigit() else None


def layer_shapes(cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, ...]]:
    """Global layer `layer`'s tensors ([in, out] matrices): a dense MLP, or in an MoE layer a router
    (f32, never quantised), `expert_key(j, w)` for each expert and, with a shared expert, its
    matrices (`shared_w_*`) and gate (`shared_gate`)."""
    d, q, kv, f = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.kv_width, cfg.ffn_dim
    shapes = {"attn_norm": (d,), "wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d), "ffn_norm": (d,)}
    if cfg.is_moe_layer(layer):
        fe, fs = cfg.expert_ffn_dim, cfg.shared_ffn_dim
        shapes["router"] = (d, cfg.n_experts)
        for j in range(cfg.n_experts):
            shapes.update({expert_key(j, "w_gate"): (d, fe), expert_key(j, "w_up"): (d, fe),
                           expert_key(j, "w_down"): (fe, d)})
        if fs:
            shapes.update(shared_gate=(d, 1), shared_w_gate=(d, fs), shared_w_up=(d, fs), shared_w_down=(fs, d))
    else:
        shapes.update(w_gate=(d, f), w_up=(d, f), w_down=(f, d))
    if cfg.attn_bias:
        shapes.update(bq=(q,), bk=(kv,), bv=(kv,))
    if cfg.attn_out_bias:
        shapes.update(bo=(d,))
    if cfg.qk_norm:   # norms (Qwen3): stay float under every weights format, never quantised
        shapes.update(q_norm=(cfg.head_dim,), k_norm=(cfg.head_dim,))
    if cfg.sandwich_norms:   # Gemma: a norm after attention and after the MLP (float, like every norm)
        shapes.update(post_attn_norm=(d,), post_ffn_norm=(d,))
    return shapes


def param_shapes(cfg: ModelConfig, start: int = 0, end: int | None = None) -> dict[str, Any]:
    """Shapes of the parameters a stage owning [start, end) needs (checkpoint keys)."""
    end = cfg.n_layers if end is None else end
    tree: dict[str, Any] = {"layers": {str(i): layer_shapes(cfg, i) for i in range(start, end)}}
    last = end == cfg.n_layers
    if start == 0 or (last and cfg.tied_embeddings):
        tree["embed"] = (cfg.vocab_size, cfg.d_model)
    if last:
        tree["norm"] = (cfg.d_model,)
        if not cfg.tied_embeddings:
            tree["head"] = (cfg.d_model, cfg.vocab_size)
    return tree


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def to_runtime(tree: dict[str, Any], dtype: Any, device: Any = None,
               quantize: str | None = None) -> dict[str, Any]:
    """Checkpoint-keyed numpy tree -> runtime params (layers as an ordered tuple).

    quantize="int8": the big matrices become int8 QTensors (see quant.py), and
    a last stage gets an int8 "head" (the transposed embedding when tied) so the
    logits matmul reads 28 MB instead of 113 MB; "embed" stays float for lookup.
    quantize="q4": the layers' matrices get 4-bit levels, the head stays int8,
    as GGUF Q4 files keep it at 8 bits: a tied head comes from a Q8_0 embedding,
    whose levels int8 holds exactly and 4 bits would not.
    """
    check_quantize(quantize)
    put = (lambda a: jax.device_put(jnp.asarray(a, dtype), device)) if device else (lambda a: jnp.asarray(a, dtype))

    def convert(key: str, a: Any) -> Any:
        if not (quantize and key in QUANT_KEYS):
            return put(a)
        bits = 4 if quantize == "q4" and key != "head" else 8
        qt = quant.to_qtensor(np.asarray(a, np.float32), bits=bits)
        return jax.device_put(qt, device) if device else jax.tree.map(jnp.asarray, qt)

    out = {k: convert(k, v) for k, v in tree.items() if k != "layers"}
    out["layers"] = tuple({k: convert(k, v) for k, v in tree["layers"][i].items()}
                          for i in sorted(tree["layers"], key=int))
    if quantize and "norm" in tree and "head" not in tree:
        out["head"] = convert("head", np.asarray(tree["embed"]).T)
        if "0" not in tree["layers"] and 0 not in tree["layers"]:
            del out["embed"]   # a tied last stage that is not first needs only its int8 head (as checkpoint v2)
    return out


def check_quantize(quantize: str | None) -> None:
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {quantize!r}")


def restore_params(path: Path, cfg: ModelConfig, start: int = 0, end: int | None = None) -> dict[str, Any]:
    """Restore only the arrays a stage [start, end) needs (orbax partial restore)."""
    path = Path(path).absolute()
    shapes = param_shapes(cfg, start, end)
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, np.float32), shapes, is_leaf=_is_shape)
    restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(restore_type=np.ndarray, dtype=np.float32),
                                target)
    ckpt = ocp.PyTreeCheckpointer()
    args = ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
    return ckpt.restore(path, args=args)


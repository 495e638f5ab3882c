"""Test-side model helpers: random weights, slices and saves of a checkpoint-layout tree, a
cache-free reference forward, host copies of a lane's KV. The runtime never needs these: a
stage restores its own layers from a converted checkpoint and reads KV only on the device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from skippy_zmq.checkpoint import checkpoint
from skippy_zmq.checkpoint.formats import to_float
from skippy_zmq.config.model import ModelConfig
from skippy_zmq.model.llama import KVCache, Params, forward_slice, head
from skippy_zmq.model.runner import SliceRunner
from skippy_zmq.model.weights import param_shapes


def random_params(cfg: ModelConfig, seed: int = 0, scale: float = 0.08) -> dict[str, Any]:
    """Random full-model params in checkpoint layout (numpy float32)."""
    rng = np.random.default_rng(seed)

    def make(shape: tuple[int, ...], name: str) -> np.ndarray:
        if name.endswith("norm"):
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    shapes = param_shapes(cfg)
    tree: dict[str, Any] = {k: make(v, k) for k, v in shapes.items() if k != "layers"}
    tree["layers"] = {i: {k: make(s, k) for k, s in layer.items()} for i, layer in shapes["layers"].items()}
    return tree


def slice_tree(tree: dict[str, Any], cfg: ModelConfig, start: int, end: int) -> dict[str, Any]:
    """The part of a full checkpoint-layout tree that a stage [start, end) owns."""
    want = param_shapes(cfg, start, end)
    out = {k: tree[k] for k in want if k != "layers"}
    out["layers"] = {i: tree["layers"][i] for i in want["layers"]}
    return out


def save_params(path: Path, tree: dict[str, Any]) -> None:
    """A tree as one orbax item (the single-item layout weights.restore_params reads)."""
    ocp.PyTreeCheckpointer().save(Path(path).absolute(), tree, force=True)


def restore_stage(model_dir: Path, cfg: ModelConfig, start: int = 0, end: int | None = None) -> dict[str, Any]:
    """A stage's stored items (checkpoint.stage_items) as one tree: layers keyed by str(index)."""
    tree: dict[str, Any] = {"layers": {}}
    for key, stored in checkpoint.stage_items(model_dir, cfg, start, end):
        if isinstance(key, int):
            tree["layers"][str(key)] = stored
        else:
            tree[key] = stored
    return tree


def float_tree(model_dir: Path, cfg: ModelConfig, start: int = 0, end: int | None = None) -> dict[str, Any]:
    """A converted model's stage [start, end) as a checkpoint-layout float32 tree (matrices
    [in, out], layers keyed by index)."""
    def plain(key: str, v: Any) -> np.ndarray:
        if not isinstance(v, dict):
            return np.asarray(v, np.float32)
        w = to_float(v)                                  # [out, in]; the embedding is stored as its rows
        return w if key == "embed" else np.ascontiguousarray(w.T)

    tree = restore_stage(model_dir, cfg, start, end)
    out = {k: plain(k, v) for k, v in tree.items() if k != "layers"}
    out["layers"] = {i: {k: plain(k, v) for k, v in layer.items()} for i, layer in tree["layers"].items()}
    return out


def forward_reference(params: Params, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Whole-sequence forward without a cache: logits for every position, [B, T, V]; a direct
    computation to check the cached, chunked paths against."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    kv = KVCache.create(cfg, len(params["layers"]), b, t, jnp.dtype(cfg.dtype))
    x, _, _ = forward_slice(params, kv, tokens, positions, jnp.arange(b, dtype=jnp.int32), cfg=cfg,
                            start=0, end=cfg.n_layers, attn_len=t, output="hidden")
    return head(params, x, cfg)


def read_kv(runner: SliceRunner, lane: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Host copies of a lane's K and V for positions [0, length): [layers, length, kvh, hd]."""
    k, v = runner.read_kv_device(lane, length)
    return np.asarray(k)[:, :length], np.asarray(v)[:, :length]

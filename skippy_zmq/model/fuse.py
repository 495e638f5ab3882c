"""The projections of a layer that read the same x, fused into one kernel call: q|k|v (or q|k where v's
type differs, as in llama.cpp's `_M` recipes) and gate|up.

Only weights the CPU kernel computes column by column are fused (panels of a QTensor, rows of a
BlockTensor, impl "kernel"): each output of the fused call is the very sum the separate call made, the
same bits, so a fused stage answers exactly as before. What it saves is per call: a SmolLM2 decode step
made 7 matrix calls a layer, each an XLA thunk, a hand-off to the pool's helper and a wait for its last
task, and k and v (3 panels each) left one of two threads idle a third of their time.

Fusing copies the parts into one array, a layer at a time (the parts go when the caller drops its
tree), so a stage holds the same bytes as before.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from skippy_zmq.model.ggml import BlockTensor
from skippy_zmq.model.kernel import kernel_available
from skippy_zmq.model.quant import PANEL, QTensor

FUSE_ENV = "SKIPPY_FUSE"   # on (default) | off: every projection its own call (to compare; the same bits)
# fused name -> its parts, in output order; the first group a layer's weights allow is used
GROUPS = ((("wqkv", ("wq", "wk", "wv")), ("wqk", ("wq", "wk"))), (("w_gate_up", ("w_gate", "w_up")),))


def fusable(ts: list[Any]) -> bool:
    """Whether the kernel can compute these [in, out] weights as one: all panels of one format with
    whole panels (each part's columns start a panel), or all GGUF rows of one type, each impl "kernel"."""
    if all(isinstance(t, QTensor) for t in ts):
        a = ts[0]
        return all(t.impl == "kernel" and t.bits == a.bits and t.n % PANEL == 0 and t.q.shape[1:] == a.q.shape[1:]
                   and t.s.shape[1:] == a.s.shape[1:] and (t.z is None) == (a.z is None)
                   and (t.z is None or t.z.shape[1:] == a.z.shape[1:]) for t in ts)
    if all(isinstance(t, BlockTensor) for t in ts):
        a = ts[0]
        return all(t.impl == "kernel" and t.kind == a.kind and t.blocks.ndim == 2
                   and t.blocks.shape[1] == a.blocks.shape[1] for t in ts)
    return False


def concat(ts: list[Any]) -> Any:
    """One weight whose outputs are the parts' outputs side by side."""
    if isinstance(ts[0], BlockTensor):
        return BlockTensor(np.concatenate([np.asarray(t.blocks) for t in ts]), ts[0].kind, "kernel")
    z = None if ts[0].z is None else np.concatenate([np.asarray(t.z) for t in ts])
    return QTensor(np.concatenate([np.asarray(t.q) for t in ts]), np.concatenate([np.asarray(t.s) for t in ts]), z,
                   sum(t.n for t in ts), "kernel", ts[0].bits)


def fuse_layer(p: dict[str, Any]) -> dict[str, Any]:
    """A layer's params with each group's first fusable choice fused (the parts removed)."""
    for group in GROUPS:
        for name, parts in group:
            if all(k in p for k in parts) and fusable([p[k] for k in parts]):
                p = {**{k: v for k, v in p.items() if k not in parts}, name: concat([p[k] for k in parts])}
                break
    return p


def fuse_params(params: dict[str, Any], consume: bool = False) -> dict[str, Any]:
    """`params` with every layer fused where it can be (fuse_layer; a fused tree stays as it is); with
    SKIPPY_FUSE=off, or where the kernel is not loaded, `params` itself (XLA's fallback dot of a wider
    matrix need not sum in the same order). `consume`: the caller's tree lets go of its layers first, so
    each layer's parts are freed as its fused weights are made and a stage's load never holds a second
    copy of its weights."""
    if os.environ.get(FUSE_ENV, "on").strip().lower() == "off" or not kernel_available() or "layers" not in params:
        return params
    layers = list(params["layers"])
    if consume:
        params["layers"] = ()
    for i, layer in enumerate(layers):
        layers[i] = fuse_layer(layer)
    return {**params, "layers": tuple(layers)}


def split(y: Any, widths: tuple[int, ...]) -> list[Any]:
    """The fused call's output [..., sum(widths)] as its parts' outputs."""
    out, at = [], 0
    for w in widths:
        out.append(y[..., at:at + w])
        at += w
    return out

"""model/fuse.py: a layer's projections that read the same x (q|k|v, or q|k where v's type differs;
gate|up) run as one kernel call, giving each part's outputs bit for bit, under every ISA this CPU has
(the float loops and the int8 ones), for decode and prefill row counts; what cannot be fused is left
alone; a stage loading its weights holds one copy; a runner over fused weights answers with the
unfused runner's bits."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY
from skippy_zmq.config.model import KVConfig
from skippy_zmq.model import fuse, ggml, quant, weights
from skippy_zmq.model.runner import SliceRunner
from model_helpers import random_params
from test_block_kernel import isas, random_blocks, selected

pytestmark = pytest.mark.skipif(not quant.kernel_available(), reason="no C++ compiler for the CPU kernel")

K = 512
WIDTHS = (192, 64, 128)   # q, k, v-like: each a whole number of 64-column panels
ROWS = (1, 3, 6, 13)      # decode rows, then the prefill tiles


def panel_part(rng: np.random.Generator, kind: str, n: int) -> quant.QTensor:
    """A panel weight [K, n] of each format a checkpoint holds: int8 and 4-bit with offsets, GGUF Q5_0's
    5-bit levels and Q8_0's int8 ones with none stored."""
    if kind in ("int8", "q4"):
        return quant.to_qtensor(rng.standard_normal((K, n)).astype(np.float32), "kernel", 8 if kind == "int8" else 4)
    bits, lo, hi = (5, 0, 32) if kind == "Q5_0" else (8, -127, 128)
    levels = rng.integers(lo, hi, (n, K)).astype(np.uint8 if bits == 5 else np.int8)
    scales = rng.uniform(2.0 ** -10, 2.0 ** -4, (n, K // 32)).astype(np.float16)
    return quant.pack_rows(levels, scales, None, "kernel", bits)


DENSE = jax.jit(quant.dense)


@pytest.mark.parametrize("kind", ["int8", "q4", "Q5_0", "Q8_0", "Q4_K", "Q6_K", "Q5_0 rows", "Q8_0 rows"])
def test_a_fused_call_gives_each_parts_outputs_bit_for_bit(kind):
    """Panels (int8, q4, GGUF Q5_0 and Q8_0 as the checkpoint packs them) and GGUF rows read in place."""
    rng = np.random.default_rng(7)
    if kind in ("Q4_K", "Q6_K") or kind.endswith(" rows"):
        name = kind.split()[0]
        parts = [ggml.BlockTensor(random_blocks(rng, name, n, K), name, "kernel") for n in WIDTHS]
    else:
        parts = [panel_part(rng, kind, n) for n in WIDTHS]
    assert fuse.fusable(parts)
    both = jax.tree.map(jnp.asarray, fuse.concat(parts))
    parts = [jax.tree.map(jnp.asarray, p) for p in parts]
    ran = []
    for isa in isas():
        with selected(isa), jax.default_device(jax.devices("cpu")[0]):
            for m in ROWS:
                x = jnp.asarray(rng.standard_normal((m, K)).astype(np.float32))
                got = fuse.split(np.asarray(DENSE(x, both)), WIDTHS)
                for p, g in zip(parts, got):
                    assert np.array_equal(np.asarray(DENSE(x, p)), g), (isa, m)
            ran.append(isa)
    assert ran   # (isas() is empty only where no compiler is, and then this module is skipped)


def test_what_the_kernel_cannot_compute_as_one_is_left_alone():
    rng = np.random.default_rng(8)
    q4, int8 = panel_part(rng, "q4", 128), panel_part(rng, "int8", 128)
    q4_k, q6_k = (ggml.BlockTensor(random_blocks(rng, k, 64, K), k, "kernel") for k in ("Q4_K", "Q6_K"))
    assert not fuse.fusable([q4, int8])                                  # two panel formats
    assert not fuse.fusable([q4_k, q6_k])                                # two GGUF types
    assert not fuse.fusable([q4, q4_k])                                  # panels and rows
    assert not fuse.fusable([panel_part(rng, "q4", 100), q4])            # a part ending inside a panel
    assert not fuse.fusable([q4, quant.to_qtensor(rng.standard_normal((K, 64)).astype(np.float32), "xla", 4)])
    assert not fuse.fusable([jnp.zeros((K, 64)), jnp.zeros((K, 64))])    # f32 weights: XLA's dot, left as they are
    layer = {"wq": q4_k, "wk": q4_k, "wv": q6_k, "w_gate": q4, "w_up": int8, "attn_norm": jnp.ones(K)}
    fused = fuse.fuse_layer(layer)
    assert sorted(fused) == ["attn_norm", "w_gate", "w_up", "wqk", "wv"]  # v's type differs: q|k only
    assert fused["wqk"].blocks.shape == (128, q4_k.blocks.shape[1]) and fused["wv"] is q6_k
    assert sorted(fuse.fuse_layer({**layer, "wv": q4_k, "w_up": q4})) == ["attn_norm", "w_gate_up", "wqkv"]
    assert fuse.fuse_layer(fused) == fused                               # a fused layer stays as it is


def test_a_consuming_fuse_lets_go_of_the_callers_layers_as_it_goes(monkeypatch):
    rng = np.random.default_rng(9)
    params = {"layers": tuple({"wq": panel_part(rng, "q4", 64), "wk": panel_part(rng, "q4", 64),
                               "wv": panel_part(rng, "q4", 64)} for _ in range(3)), "norm": np.ones(4)}
    monkeypatch.setenv(fuse.FUSE_ENV, "off")
    assert fuse.fuse_params(params, consume=True) is params and len(params["layers"]) == 3
    monkeypatch.delenv(fuse.FUSE_ENV)
    kept = fuse.fuse_params(params)
    assert [sorted(l) for l in kept["layers"]] == [["wqkv"]] * 3 and len(params["layers"]) == 3
    fused = fuse.fuse_params(params, consume=True)
    assert params["layers"] == () and fused["norm"] is params["norm"]
    assert all(np.array_equal(a["wqkv"].q, b["wqkv"].q) for a, b in zip(fused["layers"], kept["layers"]))


def test_a_runner_over_fused_weights_answers_with_the_unfused_bits(monkeypatch):
    """A TINY-like model with 64-wide keys and values, its matrices in 4-bit panels: the runner fuses
    q|k|v and gate|up; its prefill and decode logits equal those of a runner whose weights stay apart,
    bit for bit."""
    cfg = dataclasses.replace(TINY, n_kv_heads=4)
    params = weights.to_runtime(random_params(cfg, seed=3), jnp.float32, quantize="q4")
    ids = np.arange(3, 40, dtype=np.int32)
    logits = {}
    for label, fusing in (("fused", fuse.fuse_params), ("apart", lambda p, consume=False: p)):
        monkeypatch.setattr(fuse, "fuse_params", fusing)
        r = SliceRunner(cfg, params, 0, cfg.n_layers, KVConfig(lanes=2, capacity=128))
        assert sorted(r.params["layers"][0]) == (["attn_norm", "ffn_norm", "w_down", "w_gate_up", "wo", "wqkv"]
                                                 if label == "fused" else
                                                 ["attn_norm", "ffn_norm", "w_down", "w_gate", "w_up", "wk", "wo",
                                                  "wq", "wv"])
        first = np.asarray(r.prefill(0, ids, 0, output="logits"))
        steps = [np.asarray(r.decode(np.arange(1), np.array([5 + i], np.int32), np.array([len(ids) + i])))
                 for i in range(4)]
        logits[label] = [first, *steps]
    assert all(np.array_equal(a, b) for a, b in zip(logits["fused"], logits["apart"]))

"""Every GGUF type we keep: our numpy and jitted jnp dequantisers give gguf-py's float32 values bit for
bit, on random blocks, on blocks gguf-py quantises, and on the edge cases (zero blocks, every byte 0xFF,
subnormal / largest / negative f16 scales and mins, NaN and infinity scales).

Bit for bit means every value's float32 bits, NaN's sign and payload aside: where a block's scale is a
NaN, the result is NaN at the same places, but which operand's payload a NaN product carries is the
compiler's choice of operand order (XLA reorders commutative operands; x86 returns the first NaN)."""

from __future__ import annotations

import functools

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from skippy_zmq.model import ggml

# byte offsets of each type's f16 fields (scales d and mins / dmin), where the edge cases go
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
              "F16": (0,), "BF16": (), "F32": ()}
EDGE_F16 = (0x0001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x8001, 0x0000, 0x8000, 0x7C00, 0x7E00)


def reference(raw: np.ndarray, name: str) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(raw, GGMLQuantizationType[name]), np.float32)


@functools.cache
def jitted(name: str):
    return jax.jit(lambda b: ggml.dequantize(b, name, jnp))


def assert_bits_equal(raw: np.ndarray, name: str) -> None:
    want = reference(raw, name)
    for got in (ggml.dequantize(raw, name), np.asarray(jitted(name)(raw))):
        assert got.dtype == np.float32 and got.shape == want.shape
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan), name
        assert np.array_equal(np.where(nan, 0, got.view(np.uint32)), np.where(nan, 0, want.view(np.uint32))), name


def random_rows(name: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    t = ggml.TYPES[name]
    return np.random.default_rng(seed).integers(0, 256, (rows, blocks * t.nbytes), dtype=np.uint8)


def test_the_types_are_gguf_types():
    assert set(ggml.TYPES) == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                               "IQ4_NL", "IQ4_XS", "F16", "BF16", "F32"}
    for name, t in ggml.TYPES.items():
        assert ggml.TYPE_IDS[name] == GGMLQuantizationType[name].value
        assert (t.block, t.nbytes) == GGML_QUANT_SIZES[GGMLQuantizationType[name]]


@pytest.mark.parametrize("name", sorted(ggml.TYPES))
def test_random_blocks_are_bit_equal(name):
    with np.errstate(invalid="ignore", over="ignore"):
        for seed in range(3):
            assert_bits_equal(random_rows(name, 6, 5, seed), name)


@pytest.mark.parametrize("name", sorted(ggml.TYPES))
def test_edge_blocks_are_bit_equal(name):
    t = ggml.TYPES[name]
    rows = [np.zeros(t.nbytes, np.uint8), np.full(t.nbytes, 255, np.uint8)]
    base = random_rows(name, 1, 1, 7)[0]
    for value in EDGE_F16:
        for fields in ([(f,) for f in F16_FIELDS[name]] + [F16_FIELDS[name]]):
            for body in (base, np.zeros_like(base), np.full_like(base, 255)):
                row = body.copy()
                for f in fields:
                    row[f:f + 2] = np.array([value], "<u2").view(np.uint8)
                rows.append(row)
    with np.errstate(invalid="ignore", over="ignore"):
        assert_bits_equal(np.stack(rows), name)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16"])
def test_blocks_gguf_py_quantises_are_bit_equal(name):
    """Real blocks (gguf-py's own quantiser, where it has one) of weights with outliers and zeros."""
    w = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32) * 0.05
    w[0, :32] = 0.0
    w[1, 5] = 40.0
    w[2] = np.float32(1e-6) * w[2]
    raw = np.asarray(gguf.quants.quantize(w, GGMLQuantizationType[name])).view(np.uint8)
    assert_bits_equal(raw, name)


def test_leading_axes_and_row_bytes():
    raw = random_rows("Q4_K", 4, 2, 3)
    assert ggml.row_bytes("Q4_K", 512) == raw.shape[1]
    stacked = np.stack([raw, raw])
    assert ggml.dequantize(stacked, "Q4_K").shape == (2, 4, 512)
    with pytest.raises(ValueError, match="multiple of 256"):
        ggml.row_bytes("Q6_K", 100)
    with pytest.raises(ValueError, match="IQ2_XXS is not one we keep"):
        ggml.block_type("IQ2_XXS")


def test_block_tensor_dense_and_rows_use_the_dequantised_values():
    raw = random_rows("Q6_K", 5, 1, 4)
    raw[:, 208:210] = np.array([0x1400], "<u2").view(np.uint8)    # a sane scale: finite products
    w = ggml.BlockTensor(jnp.asarray(raw), "Q6_K")
    assert w.shape == (5, 256)
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    want = reference(raw, "Q6_K")
    np.testing.assert_array_equal(np.asarray(jax.jit(ggml.block_dense)(jnp.asarray(x), w)),
                                  np.asarray(jnp.asarray(x) @ jnp.asarray(want).T))
    ids = jnp.asarray([[4, 0], [2, 2]])
    np.testing.assert_array_equal(np.asarray(ggml.block_rows(w, ids)), want[np.asarray(ids)])

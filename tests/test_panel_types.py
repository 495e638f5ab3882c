"""GGUF types a CPU stage repacks at load into the kernel's column panels (ggml.PANEL_TYPES: Q5_0 as
5-bit panels, model/quant_kernel_isa.cc `Q5`), and a tied Q8_0 head packed once:

- the panels hold gguf-py's values bit for bit (dequantised, and the rows an embedding lookup gathers);
- on every instruction set this CPU runs, x @ W.T equals the float64 product of gguf-py's dequantised W
  within float32 rounding, for decode rows, row tiles and widths that are not a multiple of 64 or 256;
  the XLA path (any other device) gives the same within rounding;
- the panels store no offsets (-16 d, made from d), so they hold Q5_0's 5.5 bits a weight;
- a stage of a GGUF holding Q5_0 matrices and a tied Q8_0 embedding runs every matrix in the kernel,
  greedy ids equal to f32's on the dequantised weights, its bytes what placement counts."""

from __future__ import annotations

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from skippy_zmq.checkpoint import checkpoint
from skippy_zmq.checkpoint.convert import convert_gguf
from skippy_zmq.checkpoint.runtime import panel_qtensor
from skippy_zmq.config.model import ModelConfig
from skippy_zmq.model import ggml, quant
from test_block_kernel import isas, random_blocks, selected
from test_convert_gguf_types import CFG, TYPES, greedy, runners, write_kept_gguf

DENSE = jax.jit(quant.dense)


def q5_cases(rng) -> list[tuple[int, np.ndarray]]:
    """(rows of x, Q5_0 blocks [out, bytes]) at decode and tile heights, odd widths and zero blocks."""
    cases = [(m, random_blocks(rng, "Q5_0", n, k)) for m, n, k in
             [(1, 40, 512), (1, 1536 // 8, 576), (2, 17, 256), (3, 130, 96), (5, 64, 32), (9, 7, 576)]]
    zero = random_blocks(rng, "Q5_0", 70, 256)
    zero[3] = 0                                  # a row of zero blocks: d = 0
    zero[5, 22:44] = 255                         # a block of levels 31 (qh and qs all ones)...
    zero[5, 22:24] = np.array([0x3C00], "<u2").view(np.uint8)    # ... and d = 1
    return cases + [(4, zero)]


def test_q5_panels_hold_gguf_values_exactly():
    rng = np.random.default_rng(1)
    for _, raw in q5_cases(rng):
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_0)
        t = panel_qtensor({"blocks": raw})
        assert t.bits == 5 and t.q.shape[-1] == 40 and t.n == raw.shape[0]
        assert np.array_equal(np.asarray(quant.dequantize(t)).T, want)
        ids = np.array([0, raw.shape[0] - 1, raw.shape[0] // 2])
        assert np.array_equal(np.asarray(quant.qtensor_rows(t, jnp.asarray(ids))), want[ids])


def test_q5_panels_take_the_extreme_scales_and_store_no_offsets():
    """-16 d is made from d in float32 (the largest float16 d too, whose -16 d float16 cannot hold); the
    panels hold 5 bits a weight and an f16 d per 32, Q5_0's own 5.5 bits."""
    raw = random_blocks(np.random.default_rng(2), "Q5_0", 64, 64)
    for row, value in enumerate((0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x0000)):
        raw[row, :2] = np.array([value], "<u2").view(np.uint8)
    t = panel_qtensor({"blocks": raw})
    assert np.array_equal(np.asarray(quant.dequantize(t)).T, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_0))
    assert t.z is None and not quant.stored_z(t) and t.nbytes * 8 == 64 * 64 * 5.5


def check_q5_products() -> float:
    """The worst error of the kernel's (and XLA's) products relative to sum |x||w|, under the ISA now."""
    rng = np.random.default_rng(3)
    worst = 0.0
    for m, raw in q5_cases(rng):
        w = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_0), np.float64)
        x = rng.standard_normal((m, w.shape[1])).astype(np.float32)
        t = panel_qtensor({"blocks": raw})
        want, bound = x.astype(np.float64) @ w.T, np.abs(x).astype(np.float64) @ np.abs(w).T
        for impl in ("kernel", "xla"):
            got = np.asarray(DENSE(jnp.asarray(x), dataclasses.replace(t, impl=impl)))
            worst = max(worst, float((np.abs(got - want) / np.maximum(bound, 1e-30)).max()))
    return worst


@pytest.mark.parametrize("isa", quant.kernel_isas())
def test_q5_panels_match_the_dequantised_product_on_every_isa(isa):
    if isa not in isas():
        pytest.skip(f"this CPU (or a missing compiler) does not run the {isa} loops")
    with selected(isa), jax.default_device(jax.devices("cpu")[0]):
        worst = check_q5_products()
    if isa == "avx512vnni":   # int8 activations: within their rounding (their exact arithmetic: test_quant_kernel)
        assert 1e-4 < worst < 3e-2
    else:
        assert worst < 1e-5, isa


def test_a_q5_0_stage_with_a_tied_q8_0_head_runs_every_matrix_in_the_kernel(tmp_path, monkeypatch):
    """Q5_0 attention and FFN matrices (576-wide rows make llama-quantize fall back to Q5_0) and a tied
    Q8_0 embedding, as SmolLM2 Q4_K_M holds: on a CPU every product runs in the kernel (Q5_0 as 5-bit
    panels, the head as int8 panels whose columns serve the lookup: one copy), the greedy ids are f32's
    on the dequantised weights, 1 stage and 2, and each stage holds what placement counts."""
    monkeypatch.delenv(ggml.DEQUANTISE_ENV, raising=False)
    if not quant.kernel_available():
        pytest.skip("no C++ compiler: the kernel is not built")
    types = {i: {key: "Q5_0" for key in layer} for i, layer in TYPES.items()}
    write_kept_gguf(tmp_path / "m.gguf", types, {"embed": "Q8_0"}, seed=5)
    convert_gguf(tmp_path / "m.gguf", tmp_path / "gguf")
    convert_gguf(tmp_path / "m.gguf", tmp_path / "f32", "f32")
    cfg = ModelConfig.load(tmp_path / "gguf" / "model.json")
    assert cfg.tied_embeddings
    ids = np.random.default_rng(6).integers(3, CFG.vocab_size, 7)
    want = greedy(runners(tmp_path / "f32", "f32"), ids, 10)
    kept = checkpoint.kept_types(tmp_path / "gguf")
    for cuts in ((), (1,)):
        rs = runners(tmp_path / "gguf", "auto", cuts)
        assert greedy(rs, ids, 10) == want, cuts
        for r in rs:
            paths = quant.matrix_paths(r.params)
            assert r.kernels()["matrices"] == "kernel" and set(paths) <= {"kernel q5 panels", "kernel q8 panels"}
            assert paths["kernel q5 panels"] == 4 * (r.end - r.start), paths   # q|k|v, o, gate|up, down (fuse.py)
            assert paths.get("kernel q8 panels", 0) == int(r.last)          # the tied head
            held = sum(a.nbytes for a in {id(a): a for a in jax.tree.leaves(r.params)}.values())
            assert held == checkpoint.stage_nbytes(cfg, r.start, r.end, "gguf", "gguf", types=kept)
    one = runners(tmp_path / "gguf", "auto")[0].params
    assert one["head"] is one["embed"] and isinstance(one["head"], quant.QTensor)


def test_under_avx2int8_q5_0_and_q8_0_stay_blocks_on_int8_activations(tmp_path, monkeypatch):
    """SKIPPY_KERNEL_ISA=avx2int8 (opt-in) runs Q5_0 and Q8_0 blocks on int8 activations and has no int8
    panel loops, so a stage there keeps both as the file's blocks (ggml.int8_block_kinds) where every other
    ISA repacks Q5_0 into 5-bit panels and packs Q8_0 (here the tied head, whose blocks then serve the
    lookup too: one copy). The logits stay within int8 rounding of the float panels' on the same stage
    (not the same bits: the activations are rounded to 8 bits), and the stage holds the same bytes."""
    monkeypatch.delenv(ggml.DEQUANTISE_ENV, raising=False)
    if "avx2int8" not in isas():
        pytest.skip("this CPU (or a missing compiler) does not run the avx2int8 loops")
    types = {i: {key: "Q5_0" for key in layer} for i, layer in TYPES.items()}
    write_kept_gguf(tmp_path / "m.gguf", types, {"embed": "Q8_0"}, seed=5)
    convert_gguf(tmp_path / "m.gguf", tmp_path / "gguf")
    ids = np.random.default_rng(6).integers(3, CFG.vocab_size, 7)
    [panels] = runners(tmp_path / "gguf", "auto")
    assert set(quant.matrix_paths(panels.params)) == {"kernel q5 panels", "kernel q8 panels"}
    monkeypatch.setattr(ggml, "kernel_isa", lambda: "avx2int8")   # what a stage started with it sees
    assert ggml.int8_block_kinds() == ggml.INT8_BLOCK_TYPES_AVX2
    [blocks] = runners(tmp_path / "gguf", "auto")
    paths = quant.matrix_paths(blocks.params)
    assert paths == {"kernel Q5_0 blocks": 4 * (blocks.end - blocks.start), "kernel Q8_0 blocks": 1}, paths
    assert blocks.params["head"] is blocks.params["embed"] and isinstance(blocks.params["head"], ggml.BlockTensor)
    nbytes = [sum(a.nbytes for a in {id(a): a for a in jax.tree.leaves(r.params)}.values()) for r in (panels, blocks)]
    assert nbytes[0] == nbytes[1], nbytes
    with selected("avx2int8"), jax.default_device(jax.devices("cpu")[0]):
        got, want = last_logits(blocks, ids), last_logits(panels, ids)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert 1e-5 < err < 3e-2, err   # (above 1e-5: the int8 loops did run)


def last_logits(r, ids: np.ndarray) -> np.ndarray:
    """One stage's logits for the last of `ids` after a prefill of the rest."""
    r.prefill(0, ids[:-1], 0, output="none")
    return np.asarray(r.decode(np.array([0]), np.array([ids[-1]]), np.array([len(ids) - 1])))[0]

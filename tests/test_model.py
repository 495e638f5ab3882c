"""The JAX slice model on a tiny random model: caches, chunks and slices agree."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY, counting_compiles, random_ids
from skippy_zmq.config.model import Buckets, KVConfig
from skippy_zmq.checkpoint import loader
from skippy_zmq.model import weights
from skippy_zmq.checkpoint.convert import convert_hf, unpermute_rows
from skippy_zmq.model.llama import forward_jit
from skippy_zmq.model.runner import SliceRunner
from model_helpers import forward_reference, read_kv, save_params, slice_tree

KV = KVConfig(lanes=3, capacity=256)


def runner(tree: dict, start: int = 0, end: int = TINY.n_layers, buckets: Buckets = Buckets()) -> SliceRunner:
    params = weights.to_runtime(slice_tree(tree, TINY, start, end), jnp.float32)
    return SliceRunner(TINY, params, start, end, KV, buckets)


def reference_logits(tree: dict, ids: np.ndarray) -> np.ndarray:
    params = weights.to_runtime(tree, jnp.float32)
    return np.asarray(forward_reference(params, jnp.asarray(ids)[None], TINY))[0]


def test_prefill_then_decode_equals_full_forward(tiny_tree):
    ids = random_ids(40, TINY.vocab_size)
    want = reference_logits(tiny_tree, ids)
    r = runner(tiny_tree)
    r.prefill(1, ids[:-5], 0, output="none")
    for i in range(len(ids) - 5, len(ids)):
        got = r.decode(np.array([1]), ids[i:i + 1], np.array([i]))[0]
        np.testing.assert_allclose(got, want[i], rtol=2e-4, atol=2e-4)


def test_chunked_prefill_equals_one_shot(tiny_tree):
    ids = random_ids(100, TINY.vocab_size, seed=1)
    one = runner(tiny_tree, buckets=Buckets(prefill_chunks=(128,)))
    many = runner(tiny_tree, buckets=Buckets(prefill_chunks=(16,)))
    one.prefill(0, ids[:-1], 0, output="none")
    many.prefill(2, ids[:-1], 0, output="none")
    a = one.decode(np.array([0]), ids[-1:], np.array([99]))
    b = many.decode(np.array([2]), ids[-1:], np.array([99]))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    k1, _ = read_kv(one, 0, 99)
    k2, _ = read_kv(many, 2, 99)
    np.testing.assert_allclose(k1, k2, rtol=1e-5, atol=1e-5)


def test_layer_slices_compose_bit_for_bit(tiny_tree):
    ids = random_ids(30, TINY.vocab_size, seed=2)
    full = runner(tiny_tree)
    head, tail = runner(tiny_tree, 0, 1), runner(tiny_tree, 1, TINY.n_layers)
    full.prefill(0, ids[:-1], 0, output="none")
    hidden = head.prefill(0, ids[:-1], 0, output="hidden")
    tail.prefill(0, hidden, 0, output="none")
    want = full.decode(np.array([0]), ids[-1:], np.array([29]))
    act = head.decode(np.array([0]), ids[-1:], np.array([29]))
    got = tail.decode(np.array([0]), act, np.array([29]))
    np.testing.assert_array_equal(got, want)


def test_batched_decode_rows_match_single_rows(tiny_tree):
    prompts = [random_ids(n, TINY.vocab_size, seed=n) for n in (9, 17, 30)]
    batch = runner(tiny_tree)
    singles = []
    for lane, ids in enumerate(prompts):
        batch.prefill(lane, ids[:-1], 0, output="none")
        solo = runner(tiny_tree)
        solo.prefill(0, ids[:-1], 0, output="none")
        singles.append(solo.decode(np.array([0]), ids[-1:], np.array([len(ids) - 1]))[0])
    lanes = np.array([0, 1, 2])
    got = batch.decode(lanes, np.array([p[-1] for p in prompts]), np.array([len(p) - 1 for p in prompts]))
    for row, want in zip(got, singles):
        np.testing.assert_allclose(row, want, rtol=1e-5, atol=1e-5)


def test_padding_never_touches_other_lanes(tiny_tree):
    r = runner(tiny_tree, buckets=Buckets(decode_rows=(4,)))
    ids = random_ids(20, TINY.vocab_size, seed=3)
    r.prefill(0, ids, 0, output="none")
    r.prefill(1, ids, 0, output="none")
    lane0, lane1 = read_kv(r, 0, 256), read_kv(r, 1, 256)
    r.decode(np.array([2]), ids[:1], np.array([0]))   # 1 row, then 3 padding rows on lane 0 at "capacity"
    r.prefill(2, ids[:5], 0, output="none")            # 5 tokens padded to 16
    r.prefill(2, ids[:5], 250, output="none")          # a window clamped at the end of the arena
    for before, after in zip(lane0 + lane1, read_kv(r, 0, 256) + read_kv(r, 1, 256)):
        np.testing.assert_array_equal(before, after)


def test_chunk_at_the_end_of_the_arena_lands_on_its_own_positions(tiny_tree):
    """A 5-token chunk at 250 pads to 16 and its window is clamped to [240, 256): no shift, no clobber."""
    ids = random_ids(256, TINY.vocab_size, seed=6)
    want = reference_logits(tiny_tree, ids)
    r = runner(tiny_tree, buckets=Buckets(prefill_chunks=(16, 64)))
    r.prefill(1, ids[:250], 0, output="none")
    r.prefill(1, ids[250:255], 250, output="none")
    got = r.decode(np.array([1]), ids[255:], np.array([255]))[0]     # the arena's last position
    np.testing.assert_allclose(got, want[255], rtol=2e-4, atol=2e-4)


def test_bf16_kv_is_stored_as_bits_and_restores_bit_for_bit(tiny_tree):
    """A bf16 arena holds uint16 bits (no f32 round trip per update) yet reads and restores as bf16."""
    ids = random_ids(30, TINY.vocab_size, seed=7)
    params = weights.to_runtime(tiny_tree, jnp.float32)
    half = SliceRunner(TINY, params, 0, TINY.n_layers, KVConfig(lanes=2, capacity=256, dtype="bfloat16"))
    full = runner(tiny_tree)
    assert half.kv.k[0].dtype == jnp.uint16 and half.kv.dtype == "bfloat16"
    half.prefill(0, ids[:-1], 0, output="none")
    full.prefill(0, ids[:-1], 0, output="none")
    got = half.decode(np.array([0]), ids[-1:], np.array([29]))
    np.testing.assert_allclose(got, full.decode(np.array([0]), ids[-1:], np.array([29])), atol=0.05)
    k, v = read_kv(half, 0, 30)
    assert k.dtype == jnp.bfloat16
    half.write_kv(1, k, v)
    np.testing.assert_array_equal(half.decode(np.array([1]), ids[-1:], np.array([29])), got)


def test_no_recompiles_after_warmup(tiny_tree):
    r = runner(tiny_tree)
    r.warmup(rows=(1, 2), chunks=(16,), attn_lens=(256,))
    ids = random_ids(12, TINY.vocab_size, seed=4)
    with counting_compiles() as compiles:
        r.prefill(0, ids[:-1], 0, output="none")
        r.decode(np.array([0, 1]), ids[:2], np.array([11, 0]))
        r.decode(np.array([0]), ids[-1:], np.array([12]))
    assert compiles == []


def test_capacity_overflow_is_a_clear_error(tiny_tree):
    r = runner(tiny_tree)
    with pytest.raises(ValueError, match="exceeds the KV capacity of 256"):
        r.decode(np.array([0]), np.array([5]), np.array([256]))


def test_orbax_partial_restore_reads_only_the_range(tmp_path, tiny_tree):
    save_params(tmp_path / "params", tiny_tree)
    part = weights.restore_params(tmp_path / "params", TINY, 1, 3)
    assert sorted(part["layers"]) == ["1", "2"]
    assert "embed" not in part and "norm" not in part
    np.testing.assert_array_equal(part["layers"]["2"]["wq"], tiny_tree["layers"]["2"]["wq"])
    last = weights.restore_params(tmp_path / "params", TINY, 3, 4)
    assert "embed" in last and "norm" in last     # tied head lives with the last stage


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    n_head = 2
    permuted = w.reshape(n_head, 2, 2, 3).swapaxes(1, 2).reshape(8, 3)   # convert_hf_to_gguf's permute
    np.testing.assert_array_equal(unpermute_rows(permuted, n_head), w)


def test_hf_layout_random_model_matches_direct_computation(tmp_path, tiny_tree):
    """Write a random model as HF safetensors, convert it, compare logits with a numpy forward."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models

    hf = tmp_path / "hf"
    hf.mkdir()
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 97, "rope_theta": 10000.0,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "max_position_embeddings": 512,
              "eos_token_id": 2, "bos_token_id": 1}
    (hf / "config.json").write_text(json.dumps(config))
    names = {"attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
             "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    tensors = {"model.embed_tokens.weight": tiny_tree["embed"], "model.norm.weight": tiny_tree["norm"]}
    for i, layer in tiny_tree["layers"].items():
        for key, hf_name in names.items():
            w = layer[key]
            tensors[f"model.layers.{i}.{hf_name}.weight"] = np.ascontiguousarray(w.T if w.ndim == 2 else w)
    save_file(tensors, str(hf / "model.safetensors"))
    Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>")).save(str(hf / "tokenizer.json"))
    out = tmp_path / "converted"
    cfg = convert_hf(hf, out)
    assert cfg.n_layers == 4 and cfg.n_kv_heads == 2 and cfg.tied_embeddings
    _, params = loader.load_slice(out)
    ids = random_ids(12, 97, seed=5)
    got = np.asarray(forward_reference(params, jnp.asarray(ids)[None], cfg))[0]
    np.testing.assert_allclose(got, numpy_forward(tiny_tree, ids), rtol=1e-4, atol=1e-4)


def numpy_forward(tree: dict, ids: np.ndarray) -> np.ndarray:
    """Plain numpy Llama forward (HF semantics), independent of the JAX code."""
    c = TINY
    x = tree["embed"][ids].astype(np.float64)
    t = len(ids)
    inv = 1.0 / (c.rope_theta ** (np.arange(0, c.head_dim, 2) / c.head_dim))
    ang = np.arange(t)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def norm(v, w):
        return w * v / np.sqrt((v * v).mean(-1, keepdims=True) + c.norm_eps)

    def rope(v):
        half = v.shape[-1] // 2
        rot = np.concatenate([-v[..., half:], v[..., :half]], -1)
        return v * cos[:, None] + rot * sin[:, None]

    for i in range(c.n_layers):
        p = tree["layers"][str(i)]
        h = norm(x, p["attn_norm"])
        q = rope((h @ p["wq"]).reshape(t, c.n_heads, c.head_dim))
        k = rope((h @ p["wk"]).reshape(t, c.n_kv_heads, c.head_dim))
        v = (h @ p["wv"]).reshape(t, c.n_kv_heads, c.head_dim)
        rep = c.n_heads // c.n_kv_heads
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(c.head_dim)
        s = np.where(np.tril(np.ones((t, t), bool))[None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", s, v).reshape(t, -1) @ p["wo"]
        h = norm(x, p["ffn_norm"])
        g = h @ p["w_gate"]
        x = x + ((g / (1 + np.exp(-g))) * (h @ p["w_up"])) @ p["w_down"]
    return norm(x, tree["norm"]) @ tree["embed"].T

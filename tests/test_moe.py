"""Mixture of experts (llama.moe / routed_experts): the routed sum equals a dense reference over
every expert, an expert no token chose is never read, quantised experts run through the kernel,
and the MoE config fields read as transformers reads them. Parity with transformers itself is in
test_families (qwen3-moe, mixtral, qwen2-moe fixtures)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from skippy_zmq.config.model import ModelConfig
from skippy_zmq.model import quant, weights
from skippy_zmq.checkpoint.convert import ConvertError, hf_model_config
from skippy_zmq.model.llama import mlp, routed_experts

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "families"
E, D, F, K = 8, 64, 32, 2


def stacked_experts(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w_gate": rng.standard_normal((E, D, F)).astype(np.float32) / D ** 0.5,
            "w_up": rng.standard_normal((E, D, F)).astype(np.float32) / D ** 0.5,
            "w_down": rng.standard_normal((E, F, D)).astype(np.float32) / F ** 0.5}


def reference(experts: dict[str, np.ndarray], xs: np.ndarray, chosen: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Every expert on every token, masked to the chosen ones: what routing must equal."""
    out = np.zeros_like(xs)
    for e in range(E):
        ye = np.asarray(mlp({k: jnp.asarray(v[e]) for k, v in experts.items()}, jnp.asarray(xs)))
        weight = np.where(chosen == e, w, 0.0).sum(axis=1)
        out += weight[:, None] * ye
    return out


def routing(n: int, seed: int, only: tuple[int, ...] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((n, D)).astype(np.float32)
    pool = np.array(only if only is not None else range(E))
    chosen = np.stack([rng.choice(pool, K, replace=False) for _ in range(n)]).astype(np.int32)
    w = rng.random((n, K)).astype(np.float32)
    return xs, chosen, w


@pytest.mark.parametrize("n", [1, 3, 8, 64, 200])
def test_routed_sum_equals_every_expert_masked(n):
    """Decode rows (1, 3, 8 tokens: one pair per block) and prefill chunks (64, 200 tokens: several
    pairs per block, groups crossing block edges)."""
    experts = stacked_experts()
    xs, chosen, w = routing(n, seed=n)
    got = np.asarray(routed_experts({k: jnp.asarray(v) for k, v in experts.items()}, jnp.asarray(xs),
                                    jnp.asarray(chosen), jnp.asarray(w), E))
    np.testing.assert_allclose(got, reference(experts, xs, chosen, w), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("n", [1, 5, 100])
def test_an_expert_no_token_chose_is_never_read(n):
    """NaN weights in every expert but 1, 4 and 6: any read of them would turn the output NaN."""
    experts = stacked_experts(1)
    used = (1, 4, 6)
    poisoned = {k: np.where(np.isin(np.arange(E), used)[:, None, None], v, np.nan).astype(np.float32)
                for k, v in experts.items()}
    xs, chosen, w = routing(n, seed=7, only=used)
    got = np.asarray(routed_experts({k: jnp.asarray(v) for k, v in poisoned.items()}, jnp.asarray(xs),
                                    jnp.asarray(chosen), jnp.asarray(w), E))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, reference(experts, xs, chosen, w), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl", ["kernel", "xla"])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantised_experts_run_through_the_kernel_as_their_levels(bits, impl):
    """Stacked QTensors (q4 / int8 levels, as a q4 or int8 stage holds them) give what the same
    levels, dequantised to floats, give: the kernel's one call (quant.moe_ffn) and XLA's loop over
    sliced experts compute what a matmul computes."""
    if impl == "kernel" and not quant.kernel_available():
        pytest.skip("the native kernel is not built here")
    experts = stacked_experts(2)
    qts = {k: [quant.to_qtensor(v[e], impl=impl, bits=bits) for e in range(E)] for k, v in experts.items()}
    stacked = {k: jax.tree.map(lambda *a: jnp.stack(a), *ts) for k, ts in qts.items()}
    floats = {k: np.stack([np.asarray(quant.dequantize(t)) for t in ts]) for k, ts in qts.items()}
    xs, chosen, w = routing(16, seed=3)
    got = np.asarray(routed_experts(stacked, jnp.asarray(xs), jnp.asarray(chosen), jnp.asarray(w), E))
    np.testing.assert_allclose(got, reference(floats, xs, chosen, w), rtol=1e-4, atol=1e-4)


def fixture_config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def test_moe_configs_read_as_transformers_reads_them():
    q3 = hf_model_config(fixture_config("qwen3-moe"))
    assert (q3.n_experts, q3.n_experts_used, q3.expert_ffn_dim, q3.norm_topk_prob, q3.dense_layers) == \
        (8, 2, 64, True, (1,))
    assert q3.qk_norm and q3.shared_ffn_dim == 0 and [q3.is_moe_layer(i) for i in range(3)] == [True, False, True]
    mx = hf_model_config(fixture_config("mixtral"))
    assert (mx.n_experts, mx.n_experts_used, mx.expert_ffn_dim, mx.norm_topk_prob, mx.dense_layers) == \
        (8, 2, 96, True, ())
    q2 = hf_model_config(fixture_config("qwen2-moe"))
    assert (q2.n_experts, q2.n_experts_used, q2.norm_topk_prob, q2.shared_ffn_dim, q2.dense_layers) == \
        (8, 3, False, 96, (0,))
    assert q2.attn_bias and not q2.attn_out_bias and q2.ffn_dim == 256
    shapes = weights.layer_shapes(q2, 1)
    assert shapes["router"] == (128, 8) and shapes["shared_gate"] == (128, 1) and shapes["x007.w_down"] == (64, 128)
    assert "w_gate" in weights.layer_shapes(q2, 0) and "router" not in weights.layer_shapes(q2, 0)
    assert ModelConfig.from_dict(json.loads(json.dumps(q3.to_dict()))) == q3


def test_the_hub_config_layout_gives_the_same_moe_config():
    """Qwen3-30B-A3B's config.json on the Hub: top-level rope_theta and `num_experts` (transformers 5
    writes `num_local_experts` and rope_parameters)."""
    v5 = fixture_config("qwen3-moe")
    v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "num_local_experts")}
    v4.update(rope_theta=v5["rope_parameters"]["rope_theta"], num_experts=v5["num_local_experts"])
    assert hf_model_config(v4) == hf_model_config(v5)


@pytest.mark.parametrize("kind, words", [("gpt_oss", "attention sinks"), ("deepseek_v3", "multi-head latent"),
                                         ("deepseek_v2", "multi-head latent")])
def test_moe_families_we_do_not_implement_are_refused_by_name(kind, words):
    with pytest.raises(ConvertError, match=f"'{kind}' is a mixture-of-experts family that is not implemented") as e:
        hf_model_config({**fixture_config("mixtral"), "model_type": kind})
    assert words in str(e.value)


@pytest.mark.parametrize("fmt", ["f32", "q4"])
def test_a_stage_holds_the_bytes_the_plan_counts_for_moe_layers(fmt, tmp_path):
    """checkpoint.stage_nbytes (placement's weight bytes) is what an MoE stage holds: every expert of
    its layers, the router in f32 under every format."""
    from skippy_zmq.checkpoint import loader
    from skippy_zmq.checkpoint.checkpoint import stage_nbytes
    from skippy_zmq.checkpoint.convert import convert_hf

    cfg = convert_hf(FIXTURES / "qwen2-moe", tmp_path / "m", fmt=fmt)
    for start, end in ((0, 1), (1, 2)):
        _, params = loader.load_slice(tmp_path / "m", start, end, fmt=fmt)
        held = sum(a.nbytes for a in jax.tree.leaves(params))
        assert held == stage_nbytes(cfg, start, end, fmt), (start, end)
        if end == 2:
            assert params["layers"][0]["router"].dtype == jnp.float32
            gate = params["layers"][0]["experts"]["w_gate"]     # stacked: the expert axis first
            assert (gate.q.shape[0] if fmt == "q4" else gate.shape[0]) == 8


def test_random_moe_shapes_are_the_real_configs():
    from skippy_zmq.devtools.random_model import RandomSpec, model_config

    q3 = model_config(RandomSpec("qwen3-30b-a3b"))
    assert (q3.n_layers, q3.d_model, q3.n_heads, q3.n_kv_heads, q3.head_dim, q3.vocab_size) == (48, 2048, 32, 4, 128, 151936)
    assert (q3.n_experts, q3.n_experts_used, q3.expert_ffn_dim, q3.norm_topk_prob, q3.dense_layers) == \
        (128, 8, 768, True, ())
    mx = model_config(RandomSpec("mixtral-8x7b"))
    assert (mx.arch, mx.n_experts, mx.n_experts_used, mx.expert_ffn_dim, mx.vocab_size) == ("mixtral", 8, 2, 14336, 32000)
    q2 = model_config(RandomSpec("qwen2-57b-a14b", layers=4))
    assert (q2.n_layers, q2.n_experts, q2.n_experts_used, q2.expert_ffn_dim, q2.shared_ffn_dim) == (4, 64, 8, 2560, 20480)


def test_a_random_moe_model_is_written_loaded_and_decodes(tmp_path, monkeypatch):
    """A small qwen3_moe shape through random-model: every expert stored, a stage holds what the plan
    counts, and one process and two stages decode the same greedy ids; --gguf is refused for MoE."""
    from skippy_zmq.checkpoint import loader
    from skippy_zmq.devtools import random_model
    from skippy_zmq.checkpoint.checkpoint import stage_nbytes
    from skippy_zmq.model.runner import SliceRunner
    from skippy_zmq.config.model import Buckets, KVConfig

    tiny = {**random_model.SHAPES["qwen3-30b-a3b"], "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_experts": 6, "num_experts_per_tok": 2, "mlp_only_layers": [1], "vocab_size": 256}
    monkeypatch.setitem(random_model.SHAPES, "tiny-moe", tiny)
    spec = random_model.RandomSpec("tiny-moe", weights="q4")
    with pytest.raises(random_model.RandomModelError, match="dense layers"):
        random_model.write_random_model(spec, tmp_path / "g", gguf="q4_1")
    cfg = random_model.write_random_model(spec, tmp_path / "m")
    assert cfg.dense_layers == (1,) and cfg.n_experts == 6
    buckets = Buckets(prefill_chunks=(16,), decode_rows=(1,), attn_lens=(64,))

    def runners(cuts: tuple[int, ...]) -> list[SliceRunner]:
        bounds, out = [0, *cuts, cfg.n_layers], []
        for start, end in zip(bounds, bounds[1:]):
            c, params = loader.load_slice(tmp_path / "m", start, end, fmt="q4")
            assert sum(a.nbytes for a in jax.tree.leaves(params)) == stage_nbytes(cfg, start, end, "q4")
            out.append(SliceRunner(c, params, start, end, KVConfig(lanes=1, capacity=64), buckets))
        return out

    prefill_routed: list[int] = []

    def greedy(rs: list[SliceRunner]) -> list[int]:
        ids, token, out = np.arange(3, 12), 12, []
        x = ids
        for r in rs:
            x = r.prefill(0, x, 0, output="none" if r.last else "hidden")
        prefill_routed[:] = [r.stats.moe_experts_routed for r in rs]
        for pos in range(9, 17):
            x = np.array([token])
            for r in rs:
                x = r.decode(np.array([0]), x, np.array([pos]))
            token = int(np.argmax(x[0]))
            out.append(token)
        return out

    one = runners(())
    want = greedy(one)
    routed_in_prefill = prefill_routed[0]
    assert greedy(runners((2,))) == want
    # /metrics' moe_experts_routed: layers 0 and 2 route (1 is dense); one 16-token prefill chunk
    # (9 real tokens: its 7 padding rows are not counted) and 8 one-row decode steps, each 2 experts
    stats = one[0].stats
    assert one[0].moe_layers == 2 and stats.moe_layer_passes == 2 * (1 + 8)
    assert 2 * 2 <= routed_in_prefill <= 2 * 6
    assert stats.moe_experts_routed - routed_in_prefill == 8 * 2 * 2
    # ... which the stage's heartbeat status carries to the driver's /metrics (skippy_stage_moe_*)
    from skippy_zmq.engine.pipeline_metrics import STAGE_COUNTERS
    from skippy_zmq.stage.sessions import SessionTable
    from skippy_zmq.stage.worker import StageInfo, StageWorker

    status = StageWorker(StageInfo("s0", first=True, last=True, width=64), one[0], SessionTable(1), None).status()
    assert (status["moe_layer_passes"], status["moe_experts_routed"]) == (18, stats.moe_experts_routed)
    assert {"moe_layer_passes", "moe_experts_routed"} <= set(STAGE_COUNTERS)


TINY_MOE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 32, "vocab_size": 256}


@pytest.mark.parametrize("shape, extra", [
    ("qwen3-30b-a3b", {"intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 6,
                       "num_experts_per_tok": 2}),
    ("mixtral-8x7b", {"intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2}),
    ("qwen2-57b-a14b", {"intermediate_size": 96, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
                        "num_experts": 5, "num_experts_per_tok": 2}),
])
def test_a_random_moe_gguf_converts_back_to_the_very_same_weights(shape, extra, tmp_path, monkeypatch):
    """random-model --gguf q4_1 writes llama.cpp's MoE layout (qwen3moe; Mixtral under llama with
    expert_count; qwen2moe with its shared expert): `ffn_gate_inp` f32, the experts as 3-D Q4_1
    `ffn_*_exps` tensors. convert --gguf reads
    it back into the same config and, expert by expert, the same levels: every runtime array equal."""
    from skippy_zmq.checkpoint import loader
    from skippy_zmq.devtools import random_model
    from skippy_zmq.checkpoint.convert import convert_gguf

    monkeypatch.setitem(random_model.SHAPES, "tiny", {**random_model.SHAPES[shape], **TINY_MOE, **extra})
    cfg = random_model.write_random_model(random_model.RandomSpec("tiny", weights="q4"), tmp_path / "m", gguf="q4_1")
    import gguf

    reader = gguf.GGUFReader(tmp_path / "m" / "model.gguf")
    arch = reader.fields["general.architecture"].contents()
    assert arch == {"qwen3-30b-a3b": "qwen3moe", "mixtral-8x7b": "llama", "qwen2-57b-a14b": "qwen2moe"}[shape]
    tensors = {t.name: t for t in reader.tensors}
    experts = tensors["blk.1.ffn_down_exps.weight"]
    assert experts.tensor_type.name == "Q4_1" and tuple(int(x) for x in experts.shape)[::-1] == \
        (cfg.n_experts, cfg.d_model, cfg.expert_ffn_dim)
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    if cfg.shared_ffn_dim:   # Qwen2-MoE: the shared expert, its gate a vector
        assert tuple(int(x) for x in tensors["blk.0.ffn_gate_inp_shexp.weight"].shape) == (cfg.d_model,)
        assert tensors["blk.1.ffn_down_shexp.weight"].tensor_type.name == "Q4_1"
    back = convert_gguf(tmp_path / "m" / "model.gguf", tmp_path / "back", fmt="q4")
    skip = ("name", "norm_eps")          # GGUF keeps the epsilon as f32
    assert {k: v for k, v in back.to_dict().items() if k not in skip} == \
        {k: v for k, v in cfg.to_dict().items() if k not in skip}
    assert back.norm_eps == pytest.approx(cfg.norm_eps, rel=1e-6)
    _, ours = loader.load_slice(tmp_path / "m", fmt="q4")
    _, theirs = loader.load_slice(tmp_path / "back", fmt="q4")
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("bits", [4, 8])
def test_the_kernel_reads_only_chosen_experts_in_place(bits):
    """quant.moe_ffn (the whole routed sum in one call) and quant.expert_dense (one expert of a stack,
    sliced): NaN scales in every expert no token chose leave the output finite and equal to the reference."""
    if not quant.kernel_available():
        pytest.skip("the native kernel is not built here")
    experts = stacked_experts(4)
    qts = {k: [quant.to_qtensor(v[e], bits=bits) for e in range(E)] for k, v in experts.items()}
    floats = {k: np.stack([np.asarray(quant.dequantize(t)) for t in ts]) for k, ts in qts.items()}
    used = (0, 3, 5)
    nan = np.float16(np.nan)

    def poisoned(ts: list) -> quant.QTensor:
        t = jax.tree.map(lambda *a: jnp.stack(a), *ts)
        bad = ~np.isin(np.arange(E), used)
        return dataclasses.replace(t, s=jnp.asarray(np.where(bad[:, None, None, None], nan, np.asarray(t.s))))

    stacked = {k: poisoned(ts) for k, ts in qts.items()}
    assert quant.moe_fits(stacked)
    for n in (1, 7, 50):
        xs, chosen, w = routing(n, seed=11 + n, only=used)
        got = np.asarray(jax.jit(quant.moe_ffn)(jnp.asarray(xs), jnp.asarray(chosen), jnp.asarray(w), stacked))
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, reference(floats, xs, chosen, w), rtol=1e-4, atol=1e-4)
    x = jnp.asarray(routing(3, seed=2)[0])
    for e in used:
        np.testing.assert_allclose(np.asarray(quant.expert_dense(x, stacked["w_up"], jnp.int32(e))),
                                   np.asarray(x) @ floats["w_up"][e], rtol=1e-4, atol=1e-4)


def test_a_dense_random_gguf_keeps_llama_cpp_dense_names(tmp_path):
    """The MoE names never leak into a dense GGUF: its MLP is ffn_gate / ffn_up / ffn_down, as llama.cpp
    loads it (a dense model written with `_exps` names once failed to load in llama-bench)."""
    import gguf

    from skippy_zmq.devtools import random_model

    random_model.write_random_model(random_model.RandomSpec("smollm2-135m", layers=1), tmp_path / "m", gguf="q4_1")
    names = {t.name for t in gguf.GGUFReader(tmp_path / "m" / "model.gguf").tensors}
    assert {"blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight"} <= names
    assert not any("exps" in n or "gate_inp" in n for n in names)

"""Memory placement: predicted bytes against what a stage really holds, splits to budgets, refusals."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import yaml

from conftest import TINY
from procs import free_endpoint, running_pipeline, write_topology
from skippy_zmq.ops import placement
from skippy_zmq.config.model import ModelConfig
from skippy_zmq.checkpoint import loader
from skippy_zmq.model import weights
from skippy_zmq.model.llama import KVCache
from skippy_zmq.ops.placement import GiB, MiB, PlacementError, StageSettings
from skippy_zmq.ops.planner import PlanRequest, plan, plan_text
from skippy_zmq.stage import factory
from skippy_zmq.stage.factory import build_worker
from skippy_zmq.stage.loop import StageLoop, run_stage
from skippy_zmq.config.topology import TopologyError
from skippy_zmq.config.topology_yaml import load_topology, parse_topology
from model_helpers import random_params, save_params

SMOLLM2 = ModelConfig(arch="llama", n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536,
                      vocab_size=49152, rope_theta=100000.0, norm_eps=1e-5, tied_embeddings=True, max_seq_len=8192)


@pytest.mark.parametrize("text, expected", [("6GiB", 6 * GiB), ("512MiB", 512 * MiB), ("1.5 GiB", 3 * GiB // 2),
                                            ("8GB", 8 * 10**9), ("100kb", 100_000), ("123", 123), (7, 7)])
def test_parse_bytes(text, expected):
    assert placement.parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["6 gigs", "GiB", "-1", "0", 0, "1e9", True])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError):
        placement.parse_bytes(text)


def test_format_bytes():
    assert [placement.format_bytes(n) for n in (5 * GiB + GiB // 10, 300 * MiB, 12 * 1024, 10)] == \
        ["5.1 GiB", "300.0 MiB", "12 KiB", "10 B"]


# ------------------------------------------------------------ against the real arrays


@pytest.mark.parametrize("kv_dtype, jnp_dtype", [("f32", jnp.float32), ("bf16", jnp.bfloat16)])
def test_kv_bytes_equal_the_runner_kv_cache(kv_dtype, jnp_dtype):
    kv = KVCache.create(SMOLLM2, 10, 2, 1024, jnp_dtype)
    assert placement.kv_bytes(SMOLLM2, 10, 1024, 2, kv_dtype) == kv.nbytes == 2 * 10 * 3 * 64 * 1025 * 2 * \
        (4 if kv_dtype == "f32" else 2)   # 1024 positions and the spare slot (config.KV_SPARE_SLOTS)
    assert kv.capacity == 1024
    assert placement.kv_bytes(SMOLLM2, 10, 100_000, 1) == placement.kv_bytes(SMOLLM2, 10, 8192, 1)  # max_seq_len caps


@pytest.mark.parametrize("fmt, start, end", [
    ("f32", 0, 10), ("f32", 10, 20), ("f32", 20, 30), ("int8", 0, 10), ("int8", 10, 20), ("q4", 0, 10),
    ("q4", 10, 20), ("q4", 0, 30),
    ("int8", 20, 30), ("q4", 20, 30)])
def test_predicted_weight_bytes_equal_the_loaded_slice(model_dir, fmt, start, end):
    from skippy_zmq.checkpoint.checkpoint import stored_weights

    cfg, params = loader.load_slice(model_dir, start, end, "float32", None, None if fmt == "f32" else fmt)
    held = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    assert placement.weight_bytes(cfg, start, end, fmt, "float32", stored_weights(model_dir)) == held


# ------------------------------------------------------------ splitting to budgets


def needs_for(budgets, **kw):
    return placement.fit_layers(SMOLLM2, budgets, [StageSettings(**kw)] * len(budgets))


def test_equal_budgets_split_about_evenly_and_fit():
    needs = needs_for([2 * GiB] * 3, weights="q4", context=4096, lanes=8)
    assert [(n.start, n.end) for n in needs] == [(0, 10), (10, 20), (20, 30)]
    assert all(n.total <= 2 * GiB for n in needs)


def test_a_bigger_budget_takes_more_layers():
    small, big = needs_for([1600 * MiB, 4 * GiB], context=4096, lanes=8, cache_bytes=0)
    assert big.end - big.start > 2 * (small.end - small.start)
    assert small.total <= 1600 * MiB and big.total <= 4 * GiB


def test_fit_minimises_the_worst_need_over_budget():
    budgets = [1100 * MiB, 1600 * MiB, 1000 * MiB]
    s = StageSettings(weights="int8", context=2048, lanes=4, cache_bytes=64 * MiB)
    needs = placement.fit_layers(SMOLLM2, budgets, [s] * 3)
    best = min(max(placement.stage_need(SMOLLM2, a, b, s).total / budgets[i]
                   for i, (a, b) in enumerate([(0, x), (x, y), (y, 30)]))
               for x, y in itertools.combinations(range(1, 30), 2))
    assert max(n.total / b for n, b in zip(needs, budgets)) == pytest.approx(best)


def test_an_impossible_fit_is_refused_with_the_numbers():
    with pytest.raises(PlacementError) as exc:
        needs_for([1 * GiB, 1 * GiB, 800 * MiB], weights="q4", context=4096, lanes=8)
    text = str(exc.value)
    assert "stage s2 needs at least 1.6 GiB for layers [23, 30) (weights" in text
    assert "but its memory budget is 800.0 MiB" in text
    assert "total need 5.7 GiB > 2.8 GiB of budgets" in text


def test_budgets_below_one_layer_each_say_so():
    with pytest.raises(PlacementError, match=r"stage s0 needs at least .* for layers \[0, 1\)"):
        needs_for([100 * MiB] * 30)


def test_need_adds_cache_and_overhead():
    s = StageSettings(weights="f32", context=2048, lanes=8, cache_bytes=256 * MiB)
    need = placement.stage_need(SMOLLM2, 10, 20, s)
    assert need.kv == 240 * MiB * 2049 // 2048 and need.cache == int(placement.CACHE_RSS * 256 * MiB)   # + spare slot
    shapes = s.step_shapes(SMOLLM2)
    assert shapes == 4 * (3 + 4)    # 4 attention lengths x (3 prefill chunks + decode rows 1, 2, 4, 8)
    assert need.overhead == placement.OVERHEAD_BASE + 10 * placement.OVERHEAD_PER_LAYER + shapes * (
        placement.OVERHEAD_PER_SHAPE + 10 * placement.OVERHEAD_PER_SHAPE_LAYER)
    assert need.total == need.serving == need.weights + need.kv + need.cache + need.overhead


def test_a_float_checkpoint_quantised_at_load_can_peak_while_loading():
    """Last stage, run q4 from f32: the f32 tree plus LOAD_QUANTISE f32 heads in flight (module docstring)."""
    s = StageSettings(weights="q4", context=256, lanes=1, cache_bytes=0, stored="f32")
    need = placement.stage_need(SMOLLM2, 29, 30, s)
    head = SMOLLM2.vocab_size * SMOLLM2.d_model
    layer = sum(math.prod(shape) for shape in weights.layer_shapes(SMOLLM2).values())
    assert need.load == 4 * (head + SMOLLM2.d_model + layer) + placement.LOAD_QUANTISE * 4 * head
    assert need.total == need.loading > need.serving and "loading it peaks higher" in need.breakdown()
    stored_q4 = placement.stage_need(SMOLLM2, 29, 30, dataclasses.replace(s, stored="q4"))
    assert stored_q4.load == max(placement.LOAD_ITEMS * _layer_q4_bytes(), int(placement.LOAD_HEAD * _head_int8_bytes())
                                 - stored_q4.weights) < need.load


def _layer_q4_bytes() -> int:
    from skippy_zmq.checkpoint.formats import runtime_nbytes

    return sum(runtime_nbytes(shape[::-1], "q4", key) for key, shape in weights.layer_shapes(SMOLLM2).items()
               if len(shape) == 2)


def _head_int8_bytes() -> int:
    padded = -(-SMOLLM2.vocab_size // 64) * 64
    return padded * SMOLLM2.d_model + 2 * 2 * padded * (SMOLLM2.d_model // 32)   # levels + f16 s and z


# ------------------------------------------------------------ plan


def test_plan_to_memory_budgets_records_them_and_stays_valid_yaml(model_dir):
    req = PlanRequest(model_dir, memory=(3 * GiB, 3 * GiB, 2 * GiB), weights="q4", context=4096, lanes=8)
    text = plan_text(req)
    assert text.startswith("# predicted bytes per stage")
    assert "#   s2 layers [" in text and "of 2.0 GiB budget" in text
    topo = parse_topology(yaml.safe_load(text))
    assert [s.memory for s in topo.stages] == [3 * GiB, 3 * GiB, 2 * GiB]
    assert {(s.weights, s.kv_lanes) for s in topo.stages} == {("q4", 8)}
    assert topo.driver.max_context == 4096 and topo.driver.max_sessions == 8


def test_plan_split_with_memory_checks_the_fit(model_dir):
    topo, needs = plan(PlanRequest(model_dir, split=(2, 1, 1), memory=(3 * GiB, 2 * GiB, 2 * GiB)))
    assert [(s.start, s.end) for s in topo.stages] == [(0, 15), (15, 23), (23, 30)]
    with pytest.raises(PlacementError, match="stage s0 needs at least"):
        plan(PlanRequest(model_dir, split=(2, 1, 1), memory=(1 * GiB, 2 * GiB, 2 * GiB)))


def test_plan_stage_counts_must_agree(model_dir):
    with pytest.raises(TopologyError, match="disagree on the stage count: \\[2, 3\\]"):
        plan(PlanRequest(model_dir, stages=2, memory=(GiB, GiB, GiB)))


def test_plan_cli_flags():
    from skippy_zmq.cli import build_parser

    args = build_parser().parse_args(["plan", "--weights", "q4", "--memory", "6GiB,6GiB,4GiB", "--context", "4096",
                                      "--lanes", "8", "--split", "2,1,1"])
    assert (args.weights, args.memory, args.context, args.lanes, args.split) == \
        ("q4", "6GiB,6GiB,4GiB", 4096, 8, "2,1,1")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--weights", "2,1,1"])   # --weights is a format everywhere


# ------------------------------------------------------------ a stage with a budget


@pytest.fixture()
def tiny_model(tmp_path) -> Path:
    cfg = dataclasses.replace(TINY, n_layers=2)
    cfg.save(tmp_path / "model.json")
    save_params(tmp_path / "params", random_params(cfg, seed=0))
    (tmp_path / "source.json").write_text(json.dumps({"sha256": "tiny"}))
    return tmp_path


def tiny_topology(model: Path, tmp: Path, **stage):
    data = {"model": str(model), "driver": {"return": free_endpoint(), "max_sessions": 2, "prefill_chunk": 16,
                                            "max_context": 64},
            "stages": [{"id": "s0", "layers": [0, 2], "listen": free_endpoint(), "kv_lanes": 2,
                        "cache": {"mode": "disabled"}, **stage}]}
    path = tmp / "tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_topology(path)


def test_a_stage_over_its_budget_fails_before_loading(tiny_model, tmp_path):
    topo = tiny_topology(tiny_model, tmp_path, memory="100MiB")
    with pytest.raises(PlacementError) as exc:
        build_worker(topo, topo.stages[0])
    assert str(exc.value).startswith("stage s0 needs 360.6 MiB") and "for layers [0, 2) (weights" in str(exc.value)
    assert str(exc.value).endswith("but its memory budget is 100.0 MiB")
    assert run_stage(topo, "s0") == 3     # the process exits non-zero after one logged line


def test_ready_and_heartbeats_carry_weight_kv_and_rss_bytes(tiny_model, tmp_path):
    topo = tiny_topology(tiny_model, tmp_path, memory="1GiB")
    worker = build_worker(topo, topo.stages[0])
    cfg = ModelConfig.load(tiny_model / "model.json")
    loop = StageLoop(topo, topo.stages[0], worker)
    try:
        for msg in (loop.ready_message(), loop.heartbeat_message()):
            info = msg.extras["info"]
            # 2 layers of 36,992 floats + embedding 97 x 64 + norm 64, 4 bytes each
            assert info["weight_bytes"] == placement.weight_bytes(cfg, 0, 2, "f32", "float32", "f32") == 321_024
            assert info["kv_bytes"] == placement.kv_bytes(cfg, 2, 64, 2) == 65_536 * 65 // 64   # + the spare slot
            assert info["memory_budget_bytes"] == GiB
            shapes = factory.stage_settings(topo, topo.stages[0]).step_shapes(cfg)
            serving = 321_024 + 65_536 + placement.overhead_bytes(2, shapes)
            assert info["predicted_bytes"] == factory.predict(topo, topo.stages[0]).total >= serving
            assert info["rss_bytes"] > 100 * MiB
    finally:
        loop.sockets.close()


@pytest.mark.slow
def test_launch_names_the_stage_and_its_reason(model_dir, tmp_path):
    path = write_topology(tmp_path, model_dir, 2, memory="300MiB")
    with pytest.raises(RuntimeError) as exc:
        with running_pipeline(path, tmp_path / "run", timeout=60):
            pass
    assert "exited with code 3 during startup" in str(exc.value)
    assert "cannot start: stage s" in str(exc.value) and "but its memory budget is 300.0 MiB" in str(exc.value)



def test_prefill_chunks_are_capped_to_a_small_kv_capacity(tiny_model, tmp_path):
    """A 32-position cache under the default 256 chunk: the stage's chunks stop at 32, so it starts
    (a 256 chunk's KV write cannot compile against 32 positions) and a prompt that fits runs."""
    topo = tiny_topology(tiny_model, tmp_path)
    topo = dataclasses.replace(topo, driver=dataclasses.replace(topo.driver, prefill_chunk=256, max_context=32))
    worker = build_worker(topo, topo.stages[0])
    assert worker.runner.buckets.prefill_chunks == (16, 32)
    worker.runner.prefill(0, jnp.arange(30, dtype=jnp.int32), 0, "none")


def test_restored_rows_are_aligned_so_jax_adopts_them_without_a_copy():
    """checkpoint.aligned_empty: JAX's CPU client takes a 64-byte aligned numpy buffer as it is (the
    embedding's rows are then held once while a stage loads, not twice)."""
    from skippy_zmq.checkpoint.checkpoint import aligned_empty

    rows = aligned_empty((1000, 64), jnp.int8)
    rows[:] = 3
    assert rows.ctypes.data % 64 == 0 and rows.flags.c_contiguous
    on_device = jax.device_put(rows, jax.devices("cpu")[0])
    assert on_device.unsafe_buffer_pointer() == rows.ctypes.data
    assert int(on_device.sum()) == 3 * 64_000


# Stage processes after their idle warm-up and bench scale's requests, 2026-12-03 (placement.py's
# comment): model, layers, weights format, max_context, prefix-store budget, max_draft, VmHWM (GiB)
MEASURED_PEAKS = {
    "1B q4, 1 stage": ("1b", 0, 16, "q4", 656, 256, 0, 3.09), "1B q4, 1 stage, no store": ("1b", 0, 16, "q4", 656, 0, 0, 2.572),
    "1B q4, s0 of 2": ("1b", 0, 8, "q4", 656, 256, 0, 1.75), "1B q4, s1 of 2": ("1b", 8, 16, "q4", 656, 256, 0, 1.75),
    "1B q4, s0 of 3": ("1b", 0, 6, "q4", 656, 256, 0, 1.64), "1B q4, s1 of 3": ("1b", 6, 11, "q4", 656, 256, 0, 1.23),
    "1B q4, s2 of 3": ("1b", 11, 16, "q4", 656, 256, 0, 1.47),
    "1B q4, s0 of 2, drafts": ("1b", 0, 8, "q4", 656, 256, 8, 2.124), "1B q4, s1 of 2, drafts": ("1b", 8, 16, "q4", 656, 256, 8, 2.08),
    "SmolLM2 f32, 1 stage": ("smol", 0, 30, "f32", 2048, 256, 0, 3.227),
    "SmolLM2 f32, 1 stage, no store": ("smol", 0, 30, "f32", 2048, 0, 0, 2.834),
    "SmolLM2 f32, s0 of 2, drafts": ("smol", 0, 15, "f32", 2048, 256, 15, 2.889),
    "SmolLM2 f32, s1 of 2, drafts": ("smol", 15, 30, "f32", 2048, 256, 15, 2.769)}
LLAMA_1B = ModelConfig(arch="llama", n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, head_dim=64, ffn_dim=8192,
                       vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, tied_embeddings=True, max_seq_len=131072)


@pytest.mark.parametrize("name", MEASURED_PEAKS)
def test_overhead_constants_hold_the_measured_peaks(name):
    model, start, end, fmt, context, cache_mib, max_draft, peak = MEASURED_PEAKS[name]
    cfg = LLAMA_1B if model == "1b" else SMOLLM2
    s = StageSettings(fmt, "float32", "f32", context, 8, cache_mib * MiB, fmt, 256, max_draft)
    predicted = placement.stage_need(cfg, start, end, s).total / GiB
    assert 0.94 <= peak / predicted <= 1.06, (name, round(peak / predicted, 3))


def test_step_shapes_count_what_a_stage_compiles(tiny_model, tmp_path):
    """Buckets.step_shapes (the plan's count) is the number of shapes a stage has compiled once its
    idle warm-up is done, with speculation on and off."""
    for spec in ({"method": "ngram", "max_draft": 7}, {"method": "off"}):
        path = write_topology(tmp_path, tiny_model, 1, name="shapes", kv_lanes=4, driver__max_sessions=4,
                              driver__max_context=384, driver__speculative=spec, idle_warmups=True)
        topo = load_topology(path)
        worker = build_worker(topo, topo.stages[0])
        for warm in worker.warm_later:
            warm()
        cfg = ModelConfig.load(tiny_model / "model.json")
        assert len(worker.runner.stats.shapes) == factory.stage_settings(topo, topo.stages[0]).step_shapes(cfg)
    # idle_warmups: false (the suite's own pipelines): after READY only the compiles started before it
    topo = load_topology(write_topology(tmp_path, tiny_model, 1, name="cold", kv_lanes=4, driver__max_sessions=4,
                                        driver__max_context=384, driver__speculative={"method": "off"}))
    assert topo.stages[0].idle_warmups is False
    worker = build_worker(topo, topo.stages[0])
    assert worker.warm_later == [worker.runner.join_behind]
    assert worker.runner.behind_command is None   # 4 layers: compiled in the stage's thread, no child
    worker.runner.join_behind()   # the compiles begun before READY end here

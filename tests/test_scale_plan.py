"""scripts/scale_plan.py (docs/scale.md): a few of its numbers, checked by hand."""

import pytest
from scripts_helper import load_script


@pytest.fixture(scope="module")
def sp():
    return load_script("scale_plan")


def test_70b_weights_and_bytes(sp):
    s = sp.LLAMA_70B
    assert sp.layer_weights(s) == 855_638_016
    assert sp.total_weights(s) == 70_553_706_496
    # Q4_1 on disk: 20 bytes per 32 weights, norms f32
    q4 = sp.model_bytes(s, sp.MODES["gguf_q4_1"])
    assert q4 == pytest.approx((70_553_706_496 - 1_318_912) * 0.625 + 1_318_912 * 4)
    assert sp.BPW["q4_f32_scales"] == 0.75 and sp.BPW["q4_f16_scales"] == 0.625
    assert sp.model_bytes(s, sp.MODES["bf16"]) == pytest.approx(70_553_706_496 * 2)
    # the runtime q4 before 2026-12-01: 16 B of levels + f32 scale and offset per 32 weights; norms f32
    assert sp.layer_bytes(s, sp.MODES["q4_f32scales"]) == 855_638_016 * 0.75 + 2 * 8192 * 4


def test_own_formulas_match_placement(sp):
    """Where skippy_zmq/ops/placement.py exists the script uses it; its own fallback must give the same bytes."""
    if sp._placement is None:
        pytest.skip("skippy_zmq/ops/placement.py not in this tree")
    s = sp.LLAMA_70B
    for key in ("q4_f16", "bf16"):
        m = sp.MODES[key]
        assert sp.layer_bytes(s, m) == sp.layer_bytes(s, m, own=True)
        assert sp.head_bytes(s, m) == sp.head_bytes(s, m, own=True)
        assert sp.embed_bytes(s, m) == sp.embed_bytes(s, m, own=True)
    assert sp.kv_bytes(s, 10, 1024, 4) == sp.kv_bytes(s, 10, 1024, 4, own=True)


def test_wire_and_kv(sp):
    p = sp.plan()
    per_hop = {r["wire_dtype"]: r["bytes_per_token_per_hop"] for r in p["wire"]}
    assert per_hop == {"f32": 32768, "f16": 16384, "bf16": 16384, "q8": 8196}
    kv = {r["kv_dtype"]: r["per_stage_per_1k_tokens"] for r in p["kv"]}
    assert kv == {"f32": 10 * 1024 * 2 * 8 * 128 * 4, "bf16": 10 * 1024 * 2 * 8 * 128 * 2}
    assert p["split_even"] == [10] * 8 and sum(p["split_balanced_q4"]) == 80


def test_hop_model(sp):
    # 8 stages: 9 hops of RTT/2 + overhead, 7 activation transfers
    t = sp.hop_time_ms(8, 1000.0, 16384, rtt_ms=20.0, link_mbit=100.0, overhead_ms=0.0)
    assert t["hops"] == 9
    assert t["ms_per_token"] == pytest.approx(1000 + 9 * 10 + 7 * 16384 * 8 / 1e8 * 1000)
    assert sp.micro_batch_tok_s(1000.0, 125.0, 8) == pytest.approx(8.0)
    assert sp.micro_batch_tok_s(1000.0, 200.0, 8) == pytest.approx(5.0)
    assert "Time per token" in sp.markdown(dict(sp.plan(), calibration=sp.calibration()))

"""cluster/measure.py on a tiny checkpoint: one layer's items read, a random head in the run
format, every figure a JSON number the planner takes; and the CPU quota read from cgroup files."""

from __future__ import annotations

import json

import pytest
from conftest import TINY
from test_checkpoint import write_tree

from skippy_zmq.cluster.measure import ROWS, SCHEMA, cpu_quota_cores, measure_host
from skippy_zmq.ops.speed import HostSpeed, Links, Stage, predict


@pytest.mark.parametrize("fmt", ["f32", "q4"])
def test_measure_host_on_a_tiny_model(tmp_path, tiny_tree, fmt):
    model = write_tree(tmp_path / "m", tiny_tree, fmt)
    m = measure_host(model, weights=fmt, repeats=2, name="tiny-host")
    assert json.loads(json.dumps(m)) == m                      # plain JSON all the way down
    assert m["schema"] == SCHEMA and m["name"] == "tiny-host" and m["weights"] == fmt and m["layers"] == TINY.n_layers
    assert sorted(m["decode"], key=int) == [str(r) for r in ROWS]
    for row in m["decode"].values():
        assert set(row) == {"layer_ms", "step_ms", "head_ms", "sample_ms", "message_ms", "software_ms", "cpu"}
        cpu = row.pop("cpu")    # the same calls' process CPU, split alike (recorded, not planned with)
        assert set(cpu) == {"layer_ms", "step_ms", "head_ms"}
        assert all(isinstance(v, float) and v >= 0 for v in cpu.values())
        assert cpu["layer_ms"] + cpu["step_ms"] > 0
        assert all(isinstance(v, float) and v >= 0 for v in row.values())
        assert row["software_ms"] > 0              # a real StageWorker's receive-to-send besides compute
        assert row["layer_ms"] + row["step_ms"] > 0            # a step takes some time
    assert m["prefill"]["chunk"] == 64 and m["prefill"]["layer_ms_per_token"] >= 0
    assert m["cores"] >= 1 and m["memory_total"] > 0 and m["memory_available"] > 0
    assert 1 <= m["cpu_threads"] <= m["cores_usable"]          # the JAX pool it ran (config/cpus.py)
    assert set(m["kernels"]) == {"matmul", "decode_attention", "matrices"}
    matrices, n = m["kernels"]["matrices"], m["kernels"]["matrices"].split()[0]
    assert matrices == ("kernel" if fmt == "q4" else f"{n} of {n} through XLA"), matrices   # f32: every one
    assert fmt == "q4" or int(n) >= 7                        # (a layer's seven matrices at least)
    host = HostSpeed.from_measure(m, memory=1 << 30)
    assert host.rows == ROWS and host.memory == 1 << 30
    assert host.software_ms == tuple(m["decode"][str(r)]["software_ms"] for r in ROWS)
    assert host.stage_ms(2, False) == pytest.approx(host.step_ms[0] + host.software_ms[0] + 2 * host.layer_ms[0])
    p = predict((Stage("tiny-host", 0, TINY.n_layers),), {"tiny-host": host}, TINY.n_layers, Links())
    assert p.ms_per_token_1 > 0 and p.tok_s_n > 0


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q4"])
def test_measure_host_from_model_json_alone(tmp_path, tiny_tree, fmt):
    """A cluster worker measures before it holds any weights: model.json is all it has."""
    only = tmp_path / "only"
    only.mkdir()
    (only / "model.json").write_text((write_tree(tmp_path / "m", tiny_tree, "f32") / "model.json").read_text())
    m = measure_host(only, weights=fmt, repeats=2, name="bare", source="random", seed=3)
    assert m["source"] == "random" and m["weights"] == fmt and m["layers"] == TINY.n_layers
    assert sorted(m["decode"], key=int) == [str(r) for r in ROWS]
    assert all(row["layer_ms"] + row["step_ms"] > 0 for row in m["decode"].values())
    assert HostSpeed.from_measure(m).rows == ROWS
    with pytest.raises(FileNotFoundError):   # the checkpoint's own layer is not there to read
        measure_host(only, weights=fmt, repeats=1)
    with pytest.raises(ValueError, match="measure source must be one of"):
        measure_host(only, weights=fmt, repeats=1, source="disk")


def test_cpu_quota_cores_reads_v1_and_v2(tmp_path):
    proc = tmp_path / "cgroup"
    (tmp_path / "cpu" / "slow").mkdir(parents=True)
    (tmp_path / "cpu" / "slow" / "cpu.cfs_quota_us").write_text("2500\n")
    (tmp_path / "cpu" / "slow" / "cpu.cfs_period_us").write_text("10000\n")
    proc.write_text("4:memory:/x\n1:cpu:/slow\n0::/\n")
    assert cpu_quota_cores(proc, tmp_path) == 0.25
    (tmp_path / "cpu" / "slow" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota_cores(proc, tmp_path) is None             # uncapped
    (tmp_path / "svc").mkdir()
    (tmp_path / "svc" / "cpu.max").write_text("50000 100000\n")
    proc.write_text("0::/svc\n")
    assert cpu_quota_cores(proc, tmp_path) == 0.5
    assert cpu_quota_cores(tmp_path / "absent", tmp_path) is None

"""Topology YAML: shipped files, round-trips, every validation error, the planner."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from skippy_zmq.config.model import KVConfig
from skippy_zmq.config.topology import CacheConfig, Topology, TopologyError
from skippy_zmq.config.topology_yaml import dump_topology, load_topology, parse_topology, plan_topology, split_layers

TOPOLOGIES = sorted((Path(__file__).resolve().parents[1] / "topologies").glob("*.yaml"))

BASE = {
    "model": "models/smollm2-135m-instruct",
    "n_layers": 30,
    "driver": {"return": "tcp://127.0.0.1:5600", "http": "127.0.0.1:8000", "max_sessions": 4},
    "stages": [
        {"id": "s0", "layers": [0, 15], "listen": "tcp://127.0.0.1:5601", "cache": {"mode": "record"}},
        {"id": "s1", "layers": [15, 30], "listen": "tcp://127.0.0.1:5602"},
    ],
}


def load_mutated(tmp_path: Path, mutate) -> Topology:
    """Write BASE, changed by `mutate(data)`, to a file and load it."""
    data = copy.deepcopy(BASE)
    mutate(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_topology(path)


def expect_error(tmp_path: Path, mutate, *fragments: str) -> str:
    with pytest.raises(TopologyError) as info:
        load_mutated(tmp_path, mutate)
    message = str(info.value)
    assert message.startswith(str(tmp_path / "bad.yaml") + ": "), message
    for fragment in fragments:
        assert fragment in message, message
    return message


# ------------------------------------------------------------ shipped files


def test_shipped_topologies_exist():
    names = {p.name for p in TOPOLOGIES}
    assert {"smollm2-1stage.yaml", "smollm2-2stage.yaml", "smollm2-3stage.yaml"} <= names


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.name)
def test_shipped_topology_validates(path):
    topology = load_topology(path)
    topology.check_model(30)
    assert topology.n_layers == 30
    assert topology.first.is_first and topology.last.is_last
    assert topology.model_path == Path(topology.model).resolve()
    assert topology.source == str(path)


def test_shipped_topologies_can_run_side_by_side():
    addresses = []
    for path in TOPOLOGIES:
        t = load_topology(path)
        addresses += [t.driver.return_endpoint, f"tcp://{t.driver.http}"] + [s.listen for s in t.stages]
    assert len(addresses) == len(set(addresses))


def test_shipped_layer_splits():
    ranges = {p.name: [(s.start, s.end) for s in load_topology(p).stages] for p in TOPOLOGIES}
    assert ranges["smollm2-1stage.yaml"] == [(0, 30)]
    assert ranges["smollm2-2stage.yaml"] == [(0, 15), (15, 30)]
    assert ranges["smollm2-3stage.yaml"] == [(0, 10), (10, 20), (20, 30)]


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.name)
def test_dump_parse_roundtrip(path):
    topology = load_topology(path)
    text = dump_topology(topology)
    assert parse_topology(yaml.safe_load(text)) == topology
    assert "layers: [0, " in text  # ranges stay readable


# ------------------------------------------------------------ parsed values


def test_defaults_and_accessors():
    t = parse_topology(copy.deepcopy(BASE))
    s0, s1 = t.stages
    assert t.source == "<dict>" and t.security == "curve" and t.keys_dir is None
    assert s0.kv_lanes == 4 == t.driver.max_sessions  # kv_lanes defaults to max_sessions
    assert s0.host == "127.0.0.1" and s0.device == "cpu" and s0.dtype == "float32" and s0.kv_dtype == "f32"
    assert s0.cache == CacheConfig(mode="record") and not s0.cache.lookup and s0.cache.record
    assert s1.cache == CacheConfig() and s1.cache.lookup
    assert t.wire.activation_dtype == "f32" and t.driver.reply_timeout_s == 30.0
    assert (t.driver.http_host, t.driver.http_port) == ("127.0.0.1", 8000)
    assert s0.is_first and not s0.is_last and s1.is_last and not s1.is_first
    assert t.stage("s1") is s1 and t.first is s0 and t.last is s1
    assert t.next_stage("s0") is s1 and t.next_stage("s1") is None


def test_kv_dtype_defaults_to_the_stage_dtype_and_can_be_set():
    raw = copy.deepcopy(BASE)
    raw["stages"][0]["dtype"] = "bfloat16"
    raw["stages"][1]["kv_dtype"] = "bf16"
    s0, s1 = parse_topology(raw).stages
    assert s0.kv_dtype == "bf16" and s1.kv_dtype == "bf16" and s1.dtype == "float32"
    assert KVConfig(dtype=s1.kv_dtype) == KVConfig(dtype="bfloat16")


def test_unknown_stage_id_lists_ids():
    t = parse_topology(copy.deepcopy(BASE))
    with pytest.raises(KeyError, match=r"no stage 's9' \(stages: s0, s1\)"):
        t.stage("s9")


def test_n_layers_optional_is_inferred():
    data = copy.deepcopy(BASE)
    del data["n_layers"]
    t = parse_topology(data)
    assert t.n_layers == 30 and t.last.is_last


def test_check_model_rejects_other_layer_count():
    t = parse_topology(copy.deepcopy(BASE))
    t.check_model(30)
    with pytest.raises(TopologyError, match=r"stages cover layers \[0, 30\) but the model has 32 layers"):
        t.check_model(32)


def test_host_defaults_to_listen_host_unless_wildcard():
    data = copy.deepcopy(BASE)
    data["stages"][0]["listen"] = "tcp://10.0.0.7:5601"
    data["stages"][1]["listen"] = "tcp://*:5602"
    s0, s1 = parse_topology(data).stages
    assert s0.host == "10.0.0.7" and s0.connect == "tcp://10.0.0.7:5601"
    assert s1.host == "127.0.0.1" and s1.connect == "tcp://127.0.0.1:5602"


def test_advertised_endpoints_are_what_peers_dial_and_round_trip(tmp_path):
    def mutate(d):
        d["driver"]["return"] = "tcp://*:5600"
        d["driver"]["return_advertise"] = "tcp://gateway.lan:7600"
        d["stages"][1]["listen"] = "tcp://*:5602"
        d["stages"][1]["advertise"] = "tcp://127.0.0.1:7602"
    topo = load_mutated(tmp_path, mutate)
    s0, s1 = topo.stages
    assert s0.connect == "tcp://127.0.0.1:5601" and s1.connect == "tcp://127.0.0.1:7602"
    assert s1.listen == "tcp://*:5602" and topo.driver.return_connect == "tcp://gateway.lan:7600"
    assert load_mutated(tmp_path, lambda d: None).driver.return_connect == "tcp://127.0.0.1:5600"
    assert parse_topology(yaml.safe_load(dump_topology(topo))) == topo
    assert "advertise" not in topo.to_dict()["stages"][0]


def test_idle_warmups_default_on_can_be_turned_off_and_round_trip(tmp_path):
    topo = load_mutated(tmp_path, lambda d: d["stages"][1].update(idle_warmups=False))
    assert [s.idle_warmups for s in topo.stages] == [True, False]
    assert parse_topology(yaml.safe_load(dump_topology(topo))) == topo
    assert "idle_warmups" not in topo.to_dict()["stages"][0] and topo.to_dict()["stages"][1]["idle_warmups"] is False
    expect_error(tmp_path, lambda d: d["stages"][0].update(idle_warmups="no"),
                 "stages[0].idle_warmups: must be true or false, got 'no'")


@pytest.mark.parametrize("where, fragment", [
    (lambda d: d["stages"][0].update(advertise="tcp://*:7601"), "stages[0].advertise: a peer cannot dial the wildcard"),
    (lambda d: d["driver"].update(return_advertise="tcp://0.0.0.0:7600"), "driver.return_advertise: a peer cannot"),
    (lambda d: d["stages"][1].update(advertise="udp://x:1"), "stages[1].advertise: expected tcp://host:port"),
])
def test_advertised_endpoints_must_be_dialable(tmp_path, where, fragment):
    expect_error(tmp_path, where, fragment)


def test_ipc_and_inproc_endpoints_and_curve():
    data = copy.deepcopy(BASE)
    data.update(security="curve", keys_dir="keys")
    data["driver"]["return"] = "ipc:///tmp/skippy-return"
    data["stages"][0]["listen"] = "inproc://s0"
    t = parse_topology(data)
    assert t.security == "curve" and t.keys_dir == "keys"
    assert parse_topology(yaml.safe_load(dump_topology(t))) == t


# ------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "mutate, fragments",
    [
        (lambda d: d.update(modle="x"), ["modle: unknown key (allowed: cluster, driver, keys_dir, model"]),
        (lambda d: d["driver"].update(retrun="tcp://127.0.0.1:1"), ["driver.retrun: unknown key", "return"]),
        (lambda d: d.update(wire={"hwn": 1}), ["wire.hwn: unknown key (allowed: activation_dtype, hwm,"]),
        (
            lambda d: d["stages"][1].update(layrs=[15, 30]),
            ["stages[1].layrs: unknown key (allowed: advertise, cache, cpus, device, dtype, host, id, idle_warmups, kv_dtype, kv_lanes, "
             "layers, listen, memory, weights)"],
        ),
        (lambda d: d["stages"][0]["cache"].update(strid=64), ["stages[0].cache.strid: unknown key", "stride"]),
    ],
    ids=["top", "driver", "wire", "stage", "cache"],
)
def test_unknown_keys_name_key_and_file(tmp_path, mutate, fragments):
    expect_error(tmp_path, mutate, *fragments)


def test_gap_between_stages(tmp_path):
    expect_error(
        tmp_path,
        lambda d: d["stages"][1].update(layers=[16, 30]),
        "stages[1].layers starts at 16 but the previous stage ends at 15",
    )


def test_overlapping_stages(tmp_path):
    expect_error(
        tmp_path,
        lambda d: d["stages"][1].update(layers=[14, 30]),
        "stages[1].layers starts at 14 but the previous stage ends at 15",
    )


def test_first_stage_must_start_at_zero(tmp_path):
    expect_error(tmp_path, lambda d: d["stages"][0].update(layers=[1, 15]), "stages[0].layers starts at 1")


def test_last_end_must_equal_n_layers(tmp_path):
    expect_error(tmp_path, lambda d: d["stages"][1].update(layers=[15, 29]), "ends at 29 but n_layers is 30")


def test_empty_or_reversed_range(tmp_path):
    expect_error(tmp_path, lambda d: d["stages"][0].update(layers=[15, 15]), "stages[0].layers: [15, 15) is empty")
    expect_error(tmp_path, lambda d: d["stages"][0].update(layers=[0]), "stages[0].layers: expected [start, end]")


def test_duplicate_stage_id(tmp_path):
    expect_error(tmp_path, lambda d: d["stages"][1].update(id="s0"), "stages[1].id: duplicate stage id 's0'")


def test_duplicate_endpoint(tmp_path):
    expect_error(
        tmp_path,
        lambda d: d["stages"][1].update(listen="tcp://127.0.0.1:5600"),
        "stages[1].listen 'tcp://127.0.0.1:5600' is already used by driver.return",
    )
    expect_error(
        tmp_path,
        lambda d: d["driver"].update(http="127.0.0.1:5601"),
        "stages[0].listen 'tcp://127.0.0.1:5601' is already used by driver.http",
    )


@pytest.mark.parametrize(
    "mutate, fragments",
    [
        (lambda d: d["stages"][0].update(device="cuda"), ["stages[0].device: expected cpu, gpu:N or tpu:N, got 'cud"]),
        (lambda d: d["stages"][0].update(device="gpu:"), ["stages[0].device"]),
        (lambda d: d["stages"][1].update(dtype="float16"), ["stages[1].dtype: expected one of float32, bfloat16"]),
        (lambda d: d["stages"][1].update(kv_dtype="bfloat16"), ["stages[1].kv_dtype: expected one of f32, bf16"]),
        (lambda d: d["driver"].update(max_sessions="eight"), ["driver.max_sessions: expected an integer, got 'eight'"]),
        (lambda d: d["driver"].update(max_sessions=True), ["driver.max_sessions: expected an integer, got True"]),
        (lambda d: d["driver"].update(max_sessions=0), ["driver.max_sessions: must be at least 1, got 0"]),
        (lambda d: d["driver"].update(reply_timeout_s="30s"), ["driver.reply_timeout_s: expected a number"]),
        (lambda d: d["driver"].update(heartbeat_s=-1), ["driver.heartbeat_s: must be a positive number"]),
        (lambda d: d["driver"].update(dead_after_s=0.25), ["driver.dead_after_s: must exceed heartbeat_s"]),
        (lambda d: d["driver"].update(http="localhost"), ["driver.http: expected host:port"]),
        (lambda d: d["driver"].update(**{"return": "udp://x:1"}), ["driver.return: expected tcp://host:port"]),
        (lambda d: d["stages"][0].update(listen="tcp://127.0.0.1:70000"), ["stages[0].listen: port 70000"]),
        (lambda d: d["stages"][0].update(listen="tcp://127.0.0.1:0"), ["stages[0].listen: port 0"]),
        (lambda d: d.update(wire={"activation_dtype": "int4"}), ["wire.activation_dtype: expected one of f32"]),
        (lambda d: d["stages"][0]["cache"].update(mode="lookup"), ["stages[0].cache.mode: expected one of disabled"]),
        (lambda d: d["stages"][0]["cache"].update(max_bytes=0), ["stages[0].cache.max_bytes: must be at least 1"]),
        (lambda d: d["stages"][0].update(kv_lanes=2), ["stages[0].kv_lanes: 2 lanes cannot hold", "max_sessions (4)"]),
        (lambda d: d.update(security="tls"), ["security: expected one of none, curve"]),
        (lambda d: d.update(n_layers="30"), ["n_layers: expected an integer, got '30'"]),
        (lambda d: d.update(stages=[]), ["stages: expected a non-empty list"]),
        (lambda d: d.update(driver=[1]), ["driver: expected a mapping"]),
        (lambda d: d["stages"].__setitem__(1, "s1"), ["stages[1]: expected a mapping"]),
        (lambda d: d["stages"][1].pop("listen"), ["stages[1].listen: required key is missing"]),
        (lambda d: d.pop("model"), ["model: required key is missing"]),
    ],
)
def test_bad_values_name_key_and_file(tmp_path, mutate, fragments):
    expect_error(tmp_path, mutate, *fragments)


def test_yaml_problems_name_the_file(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("model: a\nmodel: b\nstages: []\n")
    with pytest.raises(TopologyError, match=r"dup\.yaml: invalid YAML: .*duplicate key 'model'"):
        load_topology(path)
    path.write_text("")
    with pytest.raises(TopologyError, match=r"dup\.yaml: expected a mapping, got None"):
        load_topology(path)
    with pytest.raises(TopologyError, match=r"missing\.yaml: cannot read"):
        load_topology(tmp_path / "missing.yaml")


def test_topology_error_is_value_error():
    assert issubclass(TopologyError, ValueError)


def test_imports_neither_jax_nor_zmq():
    code = "import sys, skippy_zmq.config.topology; assert not {'jax', 'zmq'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_cli_parser_and_a_worker_import_no_jax():
    """Every CLI process builds the whole parser, and a worker or driver process needs no JAX: importing
    it (through random_model's or the manifest's imports) cost each ~1.3 CPU s at its start."""
    code = ("import sys, skippy_zmq.cli as cli, skippy_zmq.cluster.worker; cli.build_parser(); "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('skippy'))")
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------ planner


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4, 7])
def test_plan_even_split(n_stages):
    t = plan_topology(30, n_stages)
    t.check_model(30)
    sizes = [s.end - s.start for s in t.stages]
    assert len(sizes) == n_stages and sum(sizes) == 30
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # remainder goes to the earliest stages
    assert t.driver.return_endpoint == "tcp://127.0.0.1:5600"
    assert [s.listen for s in t.stages] == [f"tcp://127.0.0.1:{5601 + i}" for i in range(n_stages)]
    assert parse_topology(yaml.safe_load(dump_topology(t))) == t


def test_plan_7_stages_exact():
    assert split_layers(30, [1] * 7) == [(0, 5), (5, 10), (10, 14), (14, 18), (18, 22), (22, 26), (26, 30)]


def test_plan_split():
    t = plan_topology(30, 3, split=[2, 1, 1], base_port=6000, host="127.0.0.2")
    assert [(s.start, s.end) for s in t.stages] == [(0, 15), (15, 23), (23, 30)]
    assert t.stages[2].listen == "tcp://127.0.0.2:6003" and t.stages[2].host == "127.0.0.2"


@pytest.mark.parametrize(
    "split", [[1, 2, 3, 4], [0.3, 0.7], [5, 1, 1, 1, 1, 1], [1.5, 2.5, 3.5], [1, 100, 1], [1e-6, 1, 1]]
)
def test_plan_split_is_proportional(split):
    ranges = split_layers(30, split)
    sizes = [end - start for start, end in ranges]
    assert ranges[0][0] == 0 and ranges[-1][1] == 30 and sum(sizes) == 30
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert min(sizes) >= 1
    quotas = [30 * w / sum(split) for w in split]
    assert all(abs(size - max(quota, 1)) < 2 for size, quota in zip(sizes, quotas))


def test_plan_every_layer_its_own_stage():
    assert split_layers(30, [1] * 30) == [(i, i + 1) for i in range(30)]


@pytest.mark.parametrize(
    "args, kwargs, fragment",
    [
        ((30, 31), {}, "cannot split 30 layers into 31 stages"),
        ((30, 0), {}, "need at least one stage"),
        ((30, 3), {"split": [1, 1]}, r"got 2 stage sizes \(--split\) for 3 stages"),
        ((30, 2), {"split": [1, 0]}, "positive finite"),
        ((30, 2), {"split": [1, -2]}, "positive finite"),
        ((30, 2), {"split": [1, float("inf")]}, "positive finite"),
        ((30, 2), {"base_port": 65534}, "port 65536"),
    ],
)
def test_plan_impossible(args, kwargs, fragment):
    with pytest.raises(TopologyError, match=fragment):
        plan_topology(*args, **kwargs)


def test_stage_cpus_pin_and_round_trip(tmp_path):
    topo = load_mutated(tmp_path, lambda d: d["stages"][1].update(cpus=[1, 0]))
    assert topo.stages[0].cpus == () and topo.stages[1].cpus == (1, 0)
    assert topo.to_dict()["stages"][1]["cpus"] == [1, 0] and "cpus" not in topo.to_dict()["stages"][0]


@pytest.mark.parametrize("value, fragment", [([], "non-empty list of CPU numbers"), ([0, 0], "lists a CPU twice"),
                                             ([-1], "non-empty list"), ("0", "non-empty list"),
                                             ([True], "non-empty list")])
def test_stage_cpus_errors(tmp_path, value, fragment):
    with pytest.raises(TopologyError, match=r"stages\[0\]\.cpus") as exc:
        load_mutated(tmp_path, lambda d: d["stages"][0].update(cpus=value))
    assert fragment in str(exc.value)


def test_a_stage_pinned_to_a_missing_cpu_says_so(tmp_path):
    from skippy_zmq.stage.loop import pin_cpus

    topo = load_mutated(tmp_path, lambda d: d["stages"][0].update(cpus=[4096]))
    with pytest.raises(RuntimeError, match=r"stage s0: cpus \[4096\] are not available here"):
        pin_cpus(topo.stages[0])


@pytest.mark.parametrize("value, expected", [("6GiB", 6 << 30), ("512 MiB", 512 << 20), ("1.5GB", 1_500_000_000),
                                             (4096, 4096), ("4096", 4096)])
def test_stage_memory_budget_parses_and_round_trips(tmp_path, value, expected):
    topo = load_mutated(tmp_path, lambda d: d["stages"][1].update(memory=value))
    assert topo.stages[0].memory is None and topo.stages[1].memory == expected
    assert topo.to_dict()["stages"][1]["memory"] == expected and "memory" not in topo.to_dict()["stages"][0]
    assert parse_topology(yaml.safe_load(dump_topology(topo))) == topo


@pytest.mark.parametrize("value, fragment", [("6 gigs", "expected bytes such as 6GiB"), (0, "must be positive"),
                                             (-5, "must be positive"), ("0GiB", "must be positive"),
                                             (True, "expected bytes"), ([1], "expected bytes")])
def test_stage_memory_budget_errors(tmp_path, value, fragment):
    with pytest.raises(TopologyError, match=r"stages\[0\]\.memory") as exc:
        load_mutated(tmp_path, lambda d: d["stages"][0].update(memory=value))
    assert fragment in str(exc.value)


def test_plan_records_stage_and_driver_keys():
    t = plan_topology(30, 2, ranges=[(0, 12), (12, 30)], driver_keys={"max_context": 4096, "max_sessions": 4},
                      stage_keys=[{"memory": "2GiB", "weights": "q4", "kv_lanes": 4}] * 2)
    assert [(s.start, s.end) for s in t.stages] == [(0, 12), (12, 30)]
    assert [(s.memory, s.weights, s.kv_lanes) for s in t.stages] == [(2 << 30, "q4", 4)] * 2
    assert t.driver.max_context == 4096


def test_driver_speculative_parses_and_round_trips(tmp_path):
    from skippy_zmq.config.speculative import SpeculativeConfig

    assert load_mutated(tmp_path, lambda d: None).driver.speculative == SpeculativeConfig()
    topo = load_mutated(tmp_path, lambda d: d["driver"].update(speculative={"method": "ngram", "max_draft": 4}))
    assert topo.driver.speculative == SpeculativeConfig(method="ngram", max_draft=4)
    assert topo.to_dict()["driver"]["speculative"]["max_draft"] == 4
    assert parse_topology(yaml.safe_load(dump_topology(topo))) == topo
    path = tmp_path / "off.yaml"   # YAML 1.1 reads a bare `off` as false
    path.write_text(dump_topology(topo).replace("method: ngram", "method: off"))
    assert load_topology(path).driver.speculative.method == "off"


@pytest.mark.parametrize("speculative, fragment", [
    ({"max_drafts": 4}, "driver.speculative.max_drafts: unknown key (allowed: depth, long_match, max_draft, max_match, method,"),
    ({"max_draft": 64}, "driver.speculative.max_draft: must be at most 32, got 64"),
    ({"method": "eagle"}, "driver.speculative.method: expected one of off, ngram, suffix, got 'eagle'"),
    ({"min_match": 4, "max_match": 3}, "driver.speculative.max_match: must be at least min_match (4), got 3"),
    ("ngram", "driver.speculative: expected a mapping, got 'ngram'"),
])
def test_driver_speculative_errors_name_the_yaml_path(tmp_path, speculative, fragment):
    expect_error(tmp_path, lambda d: d["driver"].update(speculative=speculative), fragment)

"""The HTTP edge's configuration: API keys from a file, the environment or argv; the topology's
`driver.http_edge`; the driver's flags; and the driver process itself, started by the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from loguru import logger
from test_http_edge import API_KEY, APP_ORIGIN, METRICS_KEY, _chat_body

from skippy_zmq.config.http import EdgeConfig, EdgeConfigError, split_host
from skippy_zmq.api.http_guard import ApiKeys, KeySourceError, resolve_keys
from skippy_zmq.config.topology import TopologyError
from skippy_zmq.config.topology_yaml import parse_topology, plan_topology


def test_key_sources_file_env_argv(tmp_path, monkeypatch):
    seen: list[str] = []
    sink = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    try:
        key_file = tmp_path / "key"
        key_file.write_text(API_KEY + "\n")
        key_file.chmod(0o600)
        assert resolve_keys(None, str(key_file), None, {}) == ApiKeys(API_KEY.encode(), None)
        assert not seen
        key_file.chmod(0o644)   # readable by others: works, with a warning naming the mode
        assert resolve_keys(None, str(key_file), None, {}).api == API_KEY.encode()
        assert any("mode 644" in m and "chmod 600" in m for m in seen)
        seen.clear()
        assert resolve_keys("argv-key", None, None, {}).api == b"argv-key"   # works, but `ps` shows it
        assert any("`ps`" in m for m in seen)
        keys = resolve_keys(None, None, None, {"SKIPPY_API_KEY": "env-key", "SKIPPY_METRICS_KEY": "m"})
        assert keys == ApiKeys(b"env-key", b"m")
    finally:
        logger.remove(sink)
    (tmp_path / "empty").write_text("\n")
    for bad_file, reason in ((tmp_path / "empty", "is empty"), (tmp_path / "absent", "cannot read")):
        with pytest.raises(KeySourceError, match=reason):
            resolve_keys(None, str(bad_file), None, {})
    with pytest.raises(KeySourceError, match="visible ASCII"):
        ApiKeys.of("schlüssel")


def test_http_edge_in_topology_round_trips_and_is_checked(tmp_path):
    edge = {"allowed_hosts": ["api.example", "LOCALHOST:8000"], "allowed_origins": "http://a.example/,http://b.example",
            "max_connections": 100, "header_timeout_s": 5, "metrics_public": True}
    topology = plan_topology(2, 2, base_port=5700, driver_keys={"http_edge": edge})
    parsed = topology.driver.http_edge
    assert parsed.allowed_hosts == ("api.example", "localhost:8000")
    assert parsed.allowed_origins == ("http://a.example", "http://b.example")
    assert (parsed.max_connections, parsed.header_timeout_s, parsed.metrics_public) == (100, 5.0, True)
    again = parse_topology(json.loads(json.dumps(topology.to_dict())))
    assert again.driver.http_edge == parsed
    for bad, says in (({"max_connections": 0}, "driver.http_edge.max_connections: must be at least 1"),
                      ({"body_timeout_s": -1}, "body_timeout_s: must be a positive number"),
                      ({"allowed_hosts": ["a b"]}, "allowed_hosts: expected a name without spaces"),
                      ({"allowed_hosts": ["a:b"]}, "allowed_hosts: expected name, name:port"),
                      ({"allowed_origins": ["evil.example"]}, "allowed_origins: expected scheme://host"),
                      ({"bogus": 1}, "bogus: unknown key")):
        with pytest.raises(TopologyError, match=says):
            plan_topology(2, 2, base_port=5700, driver_keys={"http_edge": bad})
    with pytest.raises(EdgeConfigError, match="metrics_public: expected true or false"):
        EdgeConfig.from_dict({"metrics_public": "yes"})


def test_split_host():
    assert split_host("LocalHost:8000") == ("localhost", 8000)
    assert split_host("[::1]:80") == ("[::1]", 80) and split_host("[::1]") == ("[::1]", None)
    assert split_host("a.example") == ("a.example", None)
    for bad in ("", ":80", "a:b", "a:1:2", "[::1", "a:1234567"):
        assert split_host(bad) is None, bad


def test_cli_driver_flags_reach_the_server(tmp_path, monkeypatch):
    from skippy_zmq.cli import build_parser
    from skippy_zmq.api.main import http_edge

    key_file = tmp_path / "key"
    key_file.write_text(API_KEY)
    key_file.chmod(0o600)
    args = build_parser().parse_args(["driver", "--topology", "t.yaml", "--api-key-file", str(key_file),
                                      "--allowed-hosts", "api.example", "--allowed-origins", APP_ORIGIN,
                                      "--metrics-public"])
    monkeypatch.delenv("SKIPPY_API_KEY", raising=False)
    keys, edge = http_edge(args, plan_topology(2, 2, base_port=5700))
    assert keys.api == API_KEY.encode() and edge.metrics_public
    assert edge.allowed_hosts == ("api.example",) and edge.allowed_origins == (APP_ORIGIN,)
    named = plan_topology(2, 2, base_port=5700, driver_keys={"http": "box.lan:8123"})
    args = build_parser().parse_args(["driver", "--topology", "t.yaml"])
    assert http_edge(args, named)[1].allowed_hosts == ("box.lan:8123", "localhost:8123", "127.0.0.1:8123",
                                                        "[::1]:8123")
    assert os.environ.get("SKIPPY_API_KEY") is None and Path(key_file).stat().st_mode & 0o777 == 0o600


# ---------------------------------------------------------------- the driver process

def test_driver_process_takes_its_key_from_a_file_not_argv(small_model_dir, tmp_path):
    """`skippy-zmq driver --api-key-file`: the key guards /v1 and /metrics (a metrics key from the
    environment opens /metrics alone), Hosts are checked, and the key is nowhere in the process's argv."""
    from procs import write_topology
    from skippy_zmq.ops.launch import spawn_stages, stop_processes, wait_http_ready
    from skippy_zmq.ops.lifetime import tied_env
    from skippy_zmq.config.topology_yaml import load_topology

    topo_path = write_topology(tmp_path, small_model_dir, 1, name="edge", driver__http_edge={"max_connections": 16})
    topology = load_topology(topo_path)
    key_file = tmp_path / "api.key"
    key_file.write_text(API_KEY + "\n")
    key_file.chmod(0o600)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    procs = spawn_stages(topology, topo_path, run_dir)
    with open(run_dir / "driver.log", "ab") as log:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "skippy_zmq.cli", "driver", "--topology", str(topo_path), "--api-key-file",
             str(key_file)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**{k: v for k, v in tied_env(True).items() if k != "SKIPPY_API_KEY"},
                 "SKIPPY_METRICS_KEY": METRICS_KEY}))
    url = f"http://{topology.driver.http}"
    try:
        wait_http_ready(url, procs, run_dir, timeout=300)
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {METRICS_KEY}"}).status_code == 200
        assert httpx.get(f"{url}/health", headers={"host": "evil.example"}).status_code == 421
        chat = httpx.post(f"{url}/v1/chat/completions", json=_chat_body(max_tokens=2, temperature=0),
                          headers={"authorization": f"Bearer {API_KEY}"}, timeout=120)
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 2
        assert API_KEY.encode() not in Path(f"/proc/{procs[-1].pid}/cmdline").read_bytes()
    finally:
        stop_processes(procs)

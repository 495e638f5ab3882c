"""Cluster: join tokens, the checkpoint manifest, the worker's cache, and real workers (processes,
CURVE over real ZeroMQ) that join a driver, fetch only their stage's items and serve them."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import TINY
from loguru import logger

from procs import free_endpoint, write_topology
from skippy_zmq.checkpoint.checkpoint import CheckpointWriter
from skippy_zmq.checkpoint.manifest import (MANIFEST_FILE, ManifestError, build_manifest, check_manifest, item_files,
                                            load_manifest, model_digest, stage_item_names)
from skippy_zmq.cluster import token as tokens
from skippy_zmq.cluster.assign import place_stage, placed_topology
from skippy_zmq.cluster.cache import CacheError, ModelCache
from skippy_zmq.config.topology import TopologyError
from skippy_zmq.config.topology_yaml import parse_topology
from skippy_zmq.devtools.random_model import word_tokenizer
from model_helpers import random_params
from skippy_zmq.ops.lifetime import tied_env

SERVER_KEY = b"rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """TINY (4 layers, width 64) with random weights and a word-level tokenizer, as `convert` writes it."""
    out = tmp_path_factory.mktemp("tiny") / "m"
    tree = random_params(TINY, seed=0)
    w = CheckpointWriter(out, TINY, "f32", rows_per_block=40)
    w.add_top("norm", tree["norm"])
    w.add_top("embed", tree["embed"])
    for i in range(TINY.n_layers):
        for k, v in tree["layers"][str(i)].items():
            w.put_layer_tensor(i, k, v.T if v.ndim == 2 else v)
        w.end_layer(i)
    word_tokenizer(TINY.vocab_size).save(out)
    w.finish({"format": "test", "sha256": "0" * 64})
    return out


# ---------------------------------------------------------------- tokens


def test_a_token_round_trips_and_expires():
    made = tokens.issue("tcp://10.0.0.5:5590", SERVER_KEY, ttl_s=60, now=1000.0)
    text = made.text()
    assert text.startswith("skz1.") and all(c.isalnum() or c in "-_." for c in text)
    back = tokens.parse(text)
    assert (back.endpoint, back.server_key, back.secret, back.expires_at) == (made.endpoint, SERVER_KEY, made.secret, 1060)
    assert back.public == made.public != SERVER_KEY
    assert not back.expired(now=1059.0) and back.expired(now=1060.0)
    assert made.secret.decode() not in repr(back)                      # a log line never shows the secret


def _forge(body: dict) -> str:
    return "skz1." + base64.urlsafe_b64encode(json.dumps(body).encode()).decode().rstrip("=")


@pytest.mark.parametrize("text, says", [
    ("hello", "must start with 'skz1.'"),
    ("skz1.%%%", "damaged"),
    ("skz1." + "A" * 3000, "characters"),
    (_forge({"e": "tcp://h:1", "k": "x"}), "expected the fields e, k, s, x"),
    (_forge({"e": "ipc:///tmp/x", "k": SERVER_KEY.decode(), "s": SERVER_KEY.decode(), "x": 1}), "not tcp://host:port"),
    (_forge({"e": "tcp://h:1", "k": "short", "s": SERVER_KEY.decode(), "x": 1}), "keys are damaged"),
    (_forge({"e": "tcp://h:1", "k": SERVER_KEY.decode(), "s": SERVER_KEY.decode(), "x": "soon"}), "expiry"),
])
def test_a_malformed_token_is_refused_with_its_reason(text, says):
    with pytest.raises(tokens.TokenError, match=says.replace("(", r"\(").replace("'", "'")):
        tokens.parse(text)


# ---------------------------------------------------------------- manifest, items, cache


def test_convert_writes_a_manifest_and_a_stage_needs_only_its_items(tiny_model):
    manifest = load_manifest(tiny_model)
    assert manifest == build_manifest(tiny_model)                 # written at convert time, and recomputable
    files = manifest["files"]
    assert {"model.json", "source.json", "params/format.json", "tokenizer.json"} <= set(files)
    assert len(model_digest(manifest)) == 64
    first = item_files(manifest, stage_item_names(TINY, 0, 2))
    last = item_files(manifest, stage_item_names(TINY, 2, 4))
    assert all(p.startswith(("params/layer_00000/", "params/layer_00001/", "params/embed/")) or
               p in ("model.json", "source.json", "params/format.json") for p in first)
    assert not any("layer_00002" in p or "tokenizer" in p or "params/top" in p for p in first)
    assert any(p.startswith("params/top/") for p in last) and "tokenizer.json" in last
    assert any(p.startswith("params/embed/") for p in last)          # tied head: the last stage reads the embedding
    assert not any(p.startswith(("params/layer_00000/", "params/layer_00001/")) for p in last)


def test_a_checkpoint_without_a_manifest_gets_one(tiny_model, tmp_path):
    import shutil

    copy = tmp_path / "old"
    shutil.copytree(tiny_model, copy)
    (copy / MANIFEST_FILE).unlink()
    with pytest.raises(ManifestError, match="no manifest"):
        load_manifest(copy)
    assert load_manifest(copy, build=True) == load_manifest(tiny_model)
    assert (copy / MANIFEST_FILE).is_file()
    bad = json.loads((copy / MANIFEST_FILE).read_text())
    bad["files"]["../../etc/passwd"] = {"bytes": 1, "sha256": "0" * 64}
    with pytest.raises(ManifestError, match="not a checkpoint path"):
        check_manifest(bad, "x")


def test_the_cache_resumes_a_partial_file_and_checks_its_hash(tiny_model, tmp_path):
    manifest = load_manifest(tiny_model)
    rel, entry = max(manifest["files"].items(), key=lambda kv: kv[1]["bytes"])
    data = (tiny_model / rel).read_bytes()
    cache = ModelCache(tmp_path, model_digest(manifest))
    assert cache.missing({rel: entry}) == {rel: entry}
    part = cache.open(rel, entry)
    half = len(data) // 2
    part.append(0, data[:half])
    part.close()                                                   # a broken transfer
    part = cache.open(rel, entry)
    assert part.offset == half                                     # resumes where it stopped
    with pytest.raises(CacheError, match="does not continue"):
        part.append(0, data[:10])
    part.append(half, data[half:])
    part.finish()
    assert (cache.dir / rel).read_bytes() == data and cache.missing({rel: entry}) == {}
    assert ModelCache(tmp_path, model_digest(manifest)).missing({rel: entry}) == {}   # by its stamp
    wrong = {**entry, "sha256": "f" * 64}
    other = ModelCache(tmp_path / "b", model_digest(manifest)).open(rel, wrong)
    other.append(0, data)
    with pytest.raises(CacheError, match="sha256"):
        other.finish()
    with pytest.raises(CacheError, match="not a path inside"):
        cache.path("../x")


# ---------------------------------------------------------------- topology


def test_a_topology_may_have_a_cluster_section(tiny_model, tmp_path):
    data = yaml.safe_load(write_topology(tmp_path, tiny_model, 2).read_text())
    assert parse_topology(data).cluster is None                   # existing topologies are unchanged
    data["cluster"] = {"listen": "tcp://0.0.0.0:5590", "token_ttl_s": 600}
    topology = parse_topology(data)
    assert topology.cluster.listen == "tcp://0.0.0.0:5590" and topology.cluster.max_chunk_bytes == 1 << 20
    assert parse_topology(topology.to_dict()) == topology
    for bad, says in [({"listn": "x"}, "cluster.listn: unknown key"), ({"listen": "ipc:///x"}, "cluster.listen"),
                      ({"max_chunk_bytes": 10}, "at least 4096"),
                      ({"max_chunk_bytes": 1 << 30}, "at most 16777216"),
                      ({"listen": data["driver"]["return"]}, "already used"),
                      ({"split": "fastest"}, "cluster.split: expected one of topology, measured"),
                      ({"objective": "cheap"}, "cluster.objective: expected one of latency, throughput"),
                      ({"streams": 0}, "cluster.streams")]:
        with pytest.raises(TopologyError, match=says):
            parse_topology({**data, "cluster": bad})


def test_a_stage_is_placed_on_its_workers_address(tiny_model, tmp_path):
    topology = parse_topology(yaml.safe_load(write_topology(tmp_path, tiny_model, 2).read_text()))
    port = topology.stages[1].listen.rsplit(":", 1)[1]
    moved = place_stage(topology.stages[1], "10.1.2.3")
    assert (moved.listen, moved.connect, moved.host) == (f"tcp://0.0.0.0:{port}", f"tcp://10.1.2.3:{port}", "10.1.2.3")
    assert place_stage(topology.stages[1], "127.0.0.1") == topology.stages[1]
    placed = placed_topology(topology, {"s0": "127.0.0.1", "s1": "10.1.2.3"})
    assert placed.stages[0] == topology.stages[0] and placed.stages[1].connect == f"tcp://10.1.2.3:{port}"


# ---------------------------------------------------------------- real workers


def cluster_topology(tmp: Path, model: Path, n_stages: int, **cluster) -> Path:
    path = write_topology(tmp, model, n_stages, name=f"cluster{n_stages}")
    data = yaml.safe_load(path.read_text())
    data["cluster"] = {"listen": free_endpoint(beside=path), **cluster}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def start_worker(token_text: str, cache: Path, log: Path, *extra: str,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """A real `skippy-zmq worker` process, tied to this one (it dies with the test run)."""
    cmd = [sys.executable, "-m", "skippy_zmq.cli", "worker", "--join", token_text, "--cache", str(cache),
           "--no-measure", "--join-timeout", "120", *extra]
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**tied_env(), **(env or {})})


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def items_bytes(server, stage_id: str) -> int:
    return sum(e["bytes"] for e in server.stage_files[stage_id].values())


@pytest.fixture
def driver_log():
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="INFO")
    yield lines
    logger.remove(sink)


@pytest.mark.slow
def test_a_wrong_or_expired_token_is_refused_and_gets_no_byte(tiny_model, tmp_path, driver_log):
    from skippy_zmq.cluster.server import ClusterServer
    from skippy_zmq.config.topology_yaml import load_topology

    server = ClusterServer(load_topology(cluster_topology(tmp_path, tiny_model, 1)))
    try:
        wrong = tokens.issue(server.token.endpoint, server.server_key, ttl_s=600)     # a key this driver never issued
        expired = server.issue_token(expires_at=time.time() - 1)
        other_driver = tokens.issue(server.token.endpoint, tokens.issue("tcp://h:1", SERVER_KEY, 1).public, 600)
        cases = [(wrong, "refused this join token", "refused a worker", "not issued by this driver"),
                 (expired, "refused this join token", "refused a worker", "expired at"),
                 (other_driver, "driver key is not this driver's", "failed the CURVE handshake", "another driver")]
        for i, (made, worker_says, driver_says, why) in enumerate(cases):
            log = tmp_path / f"w{i}.log"
            proc = start_worker(made.text(), tmp_path / f"cache{i}", log, "--no-devices")
            assert proc.wait(300) == 3
            assert worker_says in log.read_text()
            assert any(driver_says in line and why in line for line in driver_log), driver_log[-5:]
        assert server.rejected >= 2 and server.handshake_failures >= 1
        assert server.workers == {} and server.sent_bytes == 0
        assert not [p for i in range(3) for p in (tmp_path / f"cache{i}").rglob("*") if p.is_file()]   # no file
    finally:
        server.close()


@pytest.mark.slow
def test_a_transfer_killed_halfway_resumes_and_resends_at_most_one_chunk(tiny_model, tmp_path):
    import threading

    from skippy_zmq.cluster.server import ClusterServer
    from skippy_zmq.config.topology_yaml import load_topology

    topology = load_topology(cluster_topology(tmp_path, tiny_model, 1, max_chunk_bytes=4096))
    halfway, resume = threading.Event(), threading.Event()
    need = {}

    def on_chunk(name: str, sent: int) -> None:
        if not halfway.is_set() and sent >= need["bytes"] // 2:
            halfway.set()
            resume.wait(30)               # the worker is killed while the driver holds the next chunk

    server = ClusterServer(topology, on_chunk=on_chunk)
    need["bytes"] = items_bytes(server, "s0")
    try:
        cache = tmp_path / "cache"
        proc = start_worker(server.token.text(), cache, tmp_path / "w.log", "--no-devices", "--chunk-bytes", "4096")
        assert halfway.wait(300)
        proc.kill()
        proc.wait()
        resume.set()
        proc = start_worker(server.token.text(), cache, tmp_path / "w.log", "--no-devices", "--chunk-bytes", "4096")
        (record,) = server.workers.values()
        assert server.wait_until(lambda: record.started is not None, 300), (tmp_path / "w.log").read_text()[-3000:]
        resent = record.sent_bytes - need["bytes"]
        assert 0 <= resent <= 4096, resent
        assert 0 < record.started["fetched_bytes"] <= need["bytes"] // 2 + 4096
        stop(proc)
    finally:
        server.close()


@pytest.mark.slow
def test_a_worker_reports_its_measured_link_to_the_driver(tiny_model, tmp_path, driver_log):
    """A real worker process measures round trip and bandwidth over its authenticated link before
    HELLO (PINGs answered by PONGs); the numbers are in its report and in the driver's join line."""
    from skippy_zmq.cluster.probe import TRANSFER_BYTES
    from skippy_zmq.cluster.server import ClusterServer
    from skippy_zmq.cluster.split import links_of
    from skippy_zmq.config.topology_yaml import load_topology
    from skippy_zmq.ops.speed import DRIVER

    server = ClusterServer(load_topology(cluster_topology(tmp_path, tiny_model, 1)))
    proc = start_worker(server.token.text(), tmp_path / "cache", tmp_path / "w.log", "--no-devices", "--name", "w1")
    try:
        assert server.wait_until(lambda: "w1" in server.workers, 300), (tmp_path / "w.log").read_text()[-3000:]
        found = server.workers["w1"].report["links"]["driver"]
        assert found["transfer_bytes"] == TRANSFER_BYTES
        assert 0 < found["rtt_ms"] < 1000                  # loopback: well under a second, never zero
        assert 1e6 < found["bytes_per_s"] < 1e12           # loopback moves more than 1 MB/s
        assert any("worker w1 joined" in line and "link to the driver: round trip" in line for line in driver_log)
        assert "link to the driver: round trip" in (tmp_path / "w.log").read_text()
        links = links_of({"w1": server.workers["w1"].report})
        assert links.ms(DRIVER, "w1") == pytest.approx(found["rtt_ms"] / 2)
    finally:
        stop(proc)
        server.close()


def gone(pid: int, timeout: float) -> bool:
    """The process `pid` has exited within `timeout` seconds (a liveness poll)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def wait_ready(engine, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not engine.wait_ready(0.5):
        assert time.monotonic() < deadline, f"pipeline not ready: {engine.not_ready_reason()}"


def greedy(engine, request_id: str, prompt: list[int], n: int) -> list[int]:
    from skippy_zmq.engine.request import GenRequest

    events = engine.generate_blocking(GenRequest(request_id, tuple(prompt), max_tokens=n, ignore_eos=True))
    return [e.token_id for e in events if e.token_id is not None]


@pytest.mark.slow
def test_two_workers_serve_a_model_as_one_process_does(tiny_model, tmp_path):
    """Driver + 2 workers on this machine: each fetches exactly its stage's items, greedy output equals
    the one-process engine's; a restarted worker fetches nothing and the pipeline resumes."""
    from skippy_zmq.api.main import open_engine
    from skippy_zmq.cluster.server import ClusterServer
    from skippy_zmq.config.topology_yaml import load_topology
    from skippy_zmq.engine.generate import LocalEngine
    from skippy_zmq.sampling import SamplingParams

    prompt = [5, 17, 33, 8, 61, 40, 12]
    expected = LocalEngine(tiny_model).generate(prompt, SamplingParams(), 12, True).token_ids
    server = ClusterServer(load_topology(cluster_topology(tmp_path, tiny_model, 2)))
    procs, engine = {}, None
    try:
        for name in ("a", "b"):
            procs[name] = start_worker(server.token.text(), tmp_path / name, tmp_path / f"{name}.log", "--name", name,
                                       *(["--no-devices"] if name == "b" else []))
        placed = server.wait_placed(400)
        assert placed is not None, [(tmp_path / f"{n}.log").read_text()[-2000:] for n in procs]
        assert server.wait_until(lambda: all(w.started for w in server.workers.values()), 300)
        a = server.workers["a"]
        assert sorted(w.stage for w in server.workers.values()) == ["s0", "s1"]     # in the order they joined
        assert a.report["cores"] >= 1 and a.report["memory"]["total"] > a.report["memory"]["available"] > 0
        assert a.report["disk_free"] > 0 and [d["platform"] for d in a.report["devices"]] == ["cpu"]
        for w in server.workers.values():
            need = items_bytes(server, w.stage)
            assert 1.0 <= w.sent_bytes / need <= 1.01 and w.started["fetched_bytes"] == w.sent_bytes
        engine, _ = open_engine(placed)
        wait_ready(engine, 400)
        assert greedy(engine, "one", prompt, 12) == expected
        last = next(w for w in server.workers.values() if w.stage == "s1")
        procs[last.name].kill()                            # SIGKILL: its stage must die with it all the same
        procs[last.name].wait()
        assert gone(last.started["pid"], 60)
        sent, before = server.sent_bytes, last.started
        procs[last.name] = start_worker(server.token.text(), tmp_path / last.name, tmp_path / f"{last.name}.log",
                                        "--name", last.name, "--no-devices")
        assert server.wait_until(lambda: last.started not in (None, before), 300)
        assert last.stage == "s1" and last.started["fetched_bytes"] == 0 and server.sent_bytes == sent   # moves nothing
        wait_ready(engine, 400)
        assert greedy(engine, "two", prompt, 12) == expected
    finally:
        if engine is not None:
            engine.close()
        for proc in procs.values():
            stop(proc)
        server.close()


def read_line(stream, timeout: float) -> str:
    """One line from a child's pipe within `timeout` seconds ('' if none came)."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        return stream.readline().decode().strip() if sel.select(timeout) else ""


def serving(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/readyz", timeout=30).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.slow
def test_the_driver_command_prints_a_token_that_workers_join_with(tiny_model, tmp_path):
    """The user's flow: `skippy-zmq driver --cluster` prints a token, two `skippy-zmq worker --join` use
    it, and the OpenAI API answers greedily as one process does."""
    import httpx

    from skippy_zmq.config.topology_yaml import load_topology
    from skippy_zmq.engine.generate import LocalEngine
    from skippy_zmq.sampling import SamplingParams
    from skippy_zmq.text.tokenizer import TextTokenizer

    prompt = [5, 17, 33, 8, 61, 40, 12]
    expected = LocalEngine(tiny_model).generate(prompt, SamplingParams(), 12, True).token_ids
    path = write_topology(tmp_path, tiny_model, 2, name="plain")          # no cluster: section: --cluster's defaults
    data = yaml.safe_load(path.read_text())
    listen = free_endpoint(beside=path)
    data["cluster"] = {"listen": listen}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    url = f"http://{load_topology(path).driver.http}"
    with open(tmp_path / "driver.log", "ab") as log:
        driver = subprocess.Popen([sys.executable, "-m", "skippy_zmq.cli", "driver", "--topology", str(path),
                                   "--cluster"], stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                  env=tied_env())
    workers = []
    try:
        token_text = read_line(driver.stdout, 300)
        assert tokens.parse(token_text).endpoint == listen, (tmp_path / "driver.log").read_text()[-2000:]
        workers = [start_worker(token_text, tmp_path / n, tmp_path / f"{n}.log", "--no-devices") for n in "ab"]
        deadline = time.monotonic() + 400
        while not serving(url):   # a liveness poll: the driver serves HTTP once every stage has a worker
            assert driver.poll() is None and time.monotonic() < deadline, (tmp_path / "driver.log").read_text()[-3000:]
            time.sleep(0.5)
        reply = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == TextTokenizer.load(tiny_model).decode(expected)
    finally:
        for proc in [*workers, driver]:
            stop(proc)


def test_a_worker_gets_only_its_own_stages_files_within_the_caps(tiny_model, tmp_path):
    """A DEALER holding a live token (as a worker would): what it may ask for is its stage's files,
    at most max_chunk_bytes at a time, and nothing before it has said HELLO."""
    import zmq

    from skippy_zmq.cluster import link
    from skippy_zmq.cluster.server import ClusterServer
    from skippy_zmq.config.topology_yaml import load_topology
    from skippy_zmq.protocol.security import SocketSecurity
    from skippy_zmq.protocol.transport import make_socket

    server = ClusterServer(load_topology(cluster_topology(tmp_path, tiny_model, 2, max_chunk_bytes=4096)))
    ctx = zmq.Context()
    t = server.token
    sock = make_socket(ctx, zmq.DEALER, t.endpoint, bind=False, security=SocketSecurity(
        "curve", t.public, t.secret, server=False, server_key=t.server_key))

    def ask(kind: str, header: dict) -> link.Message:
        sock.send_multipart(link.frames(link.Message(kind, header)))
        assert sock.poll(30_000), f"no answer to {kind}"
        return link.parse(sock.recv_multipart())

    try:
        layer0 = "params/layer_00000/_METADATA"
        assert "FETCH before HELLO" in ask("FETCH", {"path": layer0, "offset": 0, "length": 10}).header["reason"]
        assign = ask("HELLO", {"name": "probe", "report": {}})
        assert assign.kind == "ASSIGN" and assign.header["stage"] == "s0"
        assert set(assign.header["files"]) == set(server.stage_files["s0"])
        chunk = ask("FETCH", {"path": layer0, "offset": 0, "length": 10})
        assert chunk.kind == "CHUNK" and bytes(chunk.data) == (tiny_model / layer0).read_bytes()[:10]
        refusals = [({"path": "params/layer_00003/_METADATA", "offset": 0, "length": 10}, "not a file of stage s0"),
                    ({"path": "../../etc/passwd", "offset": 0, "length": 10}, "not a file of stage s0"),
                    ({"path": layer0, "offset": 0, "length": 5000}, "chunk cap (4096)"),
                    ({"path": layer0, "offset": 10**9, "length": 10}, "past its"),
                    ({"path": layer0, "offset": -1, "length": 10}, "at least 0")]
        for header, says in refusals:
            reply = ask("FETCH", header)
            assert reply.kind == "REFUSED" and says in reply.header["reason"], reply.header
        assert server.sent_bytes == 10
    finally:
        sock.close(linger=0)
        ctx.term()
        server.close()


def test_malformed_link_messages_are_named():
    from skippy_zmq.cluster import link

    for parts, says in [([b"HELLO"], "expected 2 or 3 frames"), ([b"NOPE", b"{}"], "unknown message kind"),
                        ([b"HELLO", b"[1]"], "not a JSON object"), ([b"HELLO", b"{x"], "not JSON"),
                        ([b"CHUNK", b"{}"], "a data frame is required"), ([b"FETCH", b"{}", b"x"], "unexpected data"),
                        ([b"PING", b'{"size": 4}', b"x"], "unexpected data")]:
        with pytest.raises(link.LinkError, match=says):
            link.parse(parts)
    assert link.parse([b"PONG", b'{"size": 3}', b"abc"]).data == b"abc"    # a link probe's answer carries bytes
    assert link.parse([b"PONG", b'{"size": 0}']).data is None
    msg = link.parse([b"FETCH", b'{"offset": true}'])
    with pytest.raises(link.LinkError, match="'offset' must be int"):
        link.field(msg, "offset", int)


# ---------------------------------------------------------------- split: measured


def fake_measure(name: str, layer_ms: float) -> dict:
    """A measure_host-shaped result: `layer_ms` per layer at 1 row (more rows cost more)."""
    decode = {str(r): {"layer_ms": layer_ms * (1 + r / 8), "step_ms": 0.2, "head_ms": 0.5, "sample_ms": 0.01,
                       "message_ms": 0.05} for r in (1, 4, 8)}
    return {"name": name, "decode": decode, "prefill": {"chunk": 64, "layer_ms_per_token": layer_ms / 50},
            "memory_available": 8 << 30}


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_a_measured_split_gives_the_slow_host_fewer_layers(tiny_model, tmp_path, objective):
    from skippy_zmq.cluster.split import plan_measured
    from skippy_zmq.config.topology_yaml import load_topology

    topology = load_topology(cluster_topology(tmp_path, tiny_model, 2, split="measured"))
    split = plan_measured(topology, {"fast": fake_measure("x", 1.0), "slow": fake_measure("y", 4.0)}, objective)
    layers = {w: s.end - s.start for w, s in zip(split.workers, split.topology.stages)}
    assert sorted(split.workers) == ["fast", "slow"] and layers["slow"] < layers["fast"]
    assert layers == {"fast": 3, "slow": 1}
    new = split.topology
    assert [(s.id, s.listen) for s in new.stages] == [(s.id, s.listen) for s in topology.stages]   # ids, ports kept
    assert new.stages[0].start == 0 and new.stages[0].end == new.stages[1].start and new.stages[1].end == 4
    assert parse_topology(new.to_dict()) == new                   # a valid topology
    assert split.prediction.ms_per_token_1 > 0 and split.prediction.tok_s_n > 0


@pytest.mark.slow
def test_workers_split_by_measured_speed_serve_as_one_process_does(tiny_model, tmp_path, driver_log):
    """split: measured, 2 real workers measuring from model.json alone; one reports 10x slower
    (SKIPPY_TEST_SPEED_SCALE, for tests only): it gets fewer layers, fetches only its new stage's
    items, and greedy output equals the one-process engine's."""
    from skippy_zmq.api.main import open_engine
    from skippy_zmq.cluster.measure import TEST_SAMPLE_S_ENV
    from skippy_zmq.cluster.server import ClusterServer
    from skippy_zmq.config.topology_yaml import load_topology
    from skippy_zmq.engine.generate import LocalEngine
    from skippy_zmq.sampling import SamplingParams

    prompt = [5, 17, 33, 8, 61, 40, 12]
    expected = LocalEngine(tiny_model).generate(prompt, SamplingParams(), 12, True).token_ids
    topology = load_topology(cluster_topology(tmp_path, tiny_model, 2))
    assert [(s.start, s.end) for s in topology.stages] == [(0, 2), (2, 4)]
    server = ClusterServer(topology, split="measured")
    procs, engine = {}, None
    try:
        # the slow one joins first: s0 by join order; timing samples of 20 ms, not 100 (10x apart needs no precision)
        for name, scale in (("slow", {"SKIPPY_TEST_SPEED_SCALE": "10"}), ("fast", {})):
            procs[name] = start_worker(server.token.text(), tmp_path / name, tmp_path / f"{name}.log", "--name", name,
                                       "--no-devices", env={TEST_SAMPLE_S_ENV: "0.02", **scale})
        placed = server.wait_placed(400)
        assert placed is not None, [(tmp_path / f"{n}.log").read_text()[-2000:] for n in procs]
        assert server.wait_until(lambda: all(w.started for w in server.workers.values()), 300)
        slow, fast = server.workers["slow"], server.workers["fast"]
        assert slow.measured["source"] == "random" and slow.measured["test_speed_scale"] == 10.0
        # before planning each measured its link to the other's probe endpoint (cluster/peers.py)
        assert slow.peer_links["fast"]["rtt_ms"] > 0 and fast.peer_links["slow"]["bytes_per_s"] > 0
        assert any("measured its links: to fast round trip" in line for line in driver_log)
        span = {w.name: placed.stage(w.stage).end - placed.stage(w.stage).start for w in (slow, fast)}
        assert span == {"slow": 1, "fast": 3}
        assert any("split by measured speed" in line and "ms per token" in line for line in driver_log)
        for w in (slow, fast):
            need = items_bytes(server, w.stage)
            assert 1.0 <= w.sent_bytes / need <= 1.01 and w.started["fetched_bytes"] == w.sent_bytes
        engine, _ = open_engine(placed)
        wait_ready(engine, 400)
        assert greedy(engine, "one", prompt, 12) == expected
    finally:
        if engine is not None:
            engine.close()
        for proc in procs.values():
            stop(proc)
        server.close()

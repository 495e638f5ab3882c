"""bench peers' engines, each started as a user runs it and always stopped: llama-server, llama.cpp's
pipeline over rpc-servers, and ours (stages and driver), optionally with every hop held by a relay."""

from __future__ import annotations

import json
import subprocess
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator

THREADS = 2          # llama.cpp's threads (llama-server -t -tb, rpc-server -t, llama-bench -t)
START_S = 600.0      # bound on any engine's start


def free_port() -> int:
    from skippy_zmq.devtools.harness import free_base_port

    return free_base_port(1)


def _http_ok(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _port_open(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
        return True
    except OSError:
        return False


def _wait(ready: Any, what: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Until `ready()` (a server answering), failing at once if its process exits, or at the deadline."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(f"{log.stem} exited with {proc.returncode}; see {log}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout:g} s; see {log}")
        time.sleep(0.2)    # the server is loading; nothing to block on


def llama_server_command(binary: str, gguf: Path, port: int, slots: int, context: int,
                         spec_type: str | None = None) -> list[str]:
    """llama-server as a user runs it on this CPU: THREADS threads, `slots` parallel slots with
    `context` positions each (the total is divided among slots), continuous batching (its default)."""
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(THREADS),
           "-tb", str(THREADS), "-np", str(slots), "-c", str(context * slots), "-ngl", "0", "--no-webui"]
    return cmd + (["--spec-type", spec_type] if spec_type else [])


def llama_bench(binary: str, gguf: Path, prompt_tokens: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    """llama-bench on THREADS threads: prefill of `prompt_tokens` from an empty context, and decode of
    `new_tokens` after that many (-d), as ours is measured; tokens/s averaged over `repeats`."""
    def avg_ts(*flags: str) -> float:
        out = subprocess.run([binary, "-m", str(gguf), "-t", str(THREADS), "-r", str(repeats), "-o", "json", *flags],
                             capture_output=True, text=True, check=True)
        return round(float(json.loads(out.stdout)[0]["avg_ts"]), 2)

    return {"prefill_tok_s": avg_ts("-p", str(prompt_tokens), "-n", "0"),
            "decode_tok_s": avg_ts("-p", "0", "-n", str(new_tokens), "-d", str(prompt_tokens))}



@contextmanager
def llama_server(binary: str, gguf: Path, port: int, run_dir: Path, slots: int = 1, context: int = 1024,
                 spec_type: str | None = None) -> Iterator[str]:
    """A llama-server process; yields its API base URL; always stopped."""
    from skippy_zmq.ops.launch import stop_processes

    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / f"llama-server-np{slots}{'-' + spec_type if spec_type else ''}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(llama_server_command(binary, gguf, port, slots, context, spec_type),
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: _http_ok(f"http://127.0.0.1:{port}/health"), f"llama-server on port {port}", proc, log, START_S)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop_processes([proc])


@contextmanager
def llama_rpc(binaries: dict[str, str], gguf: Path, hosts: int, run_dir: Path, context: int,
              hop_ms: float = 0.0) -> Iterator[str]:
    """llama.cpp's pipeline across processes: `hosts` rpc-servers on localhost (THREADS threads each)
    and a llama-server that puts every layer on them, split evenly (`-ts 1,1,...`), as a user splits
    a model across machines; with `hop_ms`, llama-server dials each rpc-server through a relay that
    holds every byte that long each way. Yields the API base URL."""
    from skippy_zmq.ops.launch import stop_processes

    run_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    with ExitStack() as stack:
        stack.callback(lambda: stop_processes(procs[::-1]))
        ports = []
        for i in range(hosts):
            port, log = free_port(), run_dir / f"rpc-server-{hosts}-{i}.log"
            with open(log, "w") as f:
                procs.append(subprocess.Popen([binaries["rpc-server"], "-H", "127.0.0.1", "-p", str(port), "-t",
                                               str(THREADS)], stdout=f, stderr=subprocess.STDOUT))
            _wait(lambda p=port: _port_open(p), f"rpc-server on port {port}", procs[-1], log, START_S)
            ports.append(port)
        ports = stack.enter_context(_delayed(ports, hop_ms))
        port, log = free_port(), run_dir / f"llama-server-rpc{hosts}.log"
        cmd = llama_server_command(binaries["llama-server"], gguf, port, 1, context)
        cmd[cmd.index("-ngl") + 1] = "999"
        cmd += ["--rpc", ",".join(f"127.0.0.1:{p}" for p in ports), "-ts", ",".join(["1"] * hosts)]
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT))
        _wait(lambda: _http_ok(f"http://127.0.0.1:{port}/health"), f"llama-server on port {port}", procs[-1], log,
              START_S)
        yield f"http://127.0.0.1:{port}/v1"


@contextmanager
def _delayed(ports: list[int], hop_ms: float) -> Iterator[list[int]]:
    """The ports to dial for `ports` on localhost: themselves at 0 ms, else one relay each that holds
    every byte `hop_ms` each way (bench/relay.py)."""
    from skippy_zmq.devtools.bench.relay import relays

    if not hop_ms:
        yield ports
        return
    from skippy_zmq.devtools.harness import free_base_port

    base = free_base_port(len(ports))
    fronts = list(range(base, base + len(ports)))
    with relays([(front, "127.0.0.1", port) for front, port in zip(fronts, ports)], hop_ms):
        yield fronts


@contextmanager
def our_server(model: Path, stages: int, run_dir: Path, lanes: int, context: int,
               hop_ms: float = 0.0, weights: str = "q4") -> Iterator[str]:
    """Our stages and driver (speculation available per request), warmed; with `hop_ms`, every stage
    and the driver's return endpoint are dialled through a relay that holds every byte that long each
    way (the topology's `advertise` keys). Yields the API base URL."""
    import yaml

    from skippy_zmq.devtools.harness import write_topology
    from skippy_zmq.ops.launch import spawn_driver, spawn_stages, stop_processes, wait_http_ready
    from skippy_zmq.devtools.soak import wait_warmed
    from skippy_zmq.config.topology_yaml import load_topology

    run_dir.mkdir(parents=True, exist_ok=True)
    path = write_topology(run_dir, model.absolute(), stages, name=f"peers-{stages}", weights=weights,
                          kv_lanes=lanes, driver__max_sessions=lanes, driver__max_context=context,
                          driver__speculative={"method": "ngram"}, driver__request_timeout_s=900.0,
                          driver__reply_timeout_s=300.0, driver__dead_after_s=60.0)
    topology = load_topology(path)
    endpoints = [topology.driver.return_endpoint] + [s.listen for s in topology.stages]
    with _delayed([int(e.rsplit(":", 1)[1]) for e in endpoints], hop_ms) as fronts:
        if hop_ms:
            data = yaml.safe_load(path.read_text())
            data["driver"]["return_advertise"] = f"tcp://127.0.0.1:{fronts[0]}"
            for stage, front in zip(data["stages"], fronts[1:]):
                stage["advertise"] = f"tcp://127.0.0.1:{front}"
            path.write_text(yaml.safe_dump(data, sort_keys=False))
            topology = load_topology(path)
        procs = spawn_stages(topology, path, run_dir, ["--log-level", "INFO"])
        try:
            procs.append(spawn_driver(path, run_dir, ["--log-level", "INFO"]))
            url = f"http://{topology.driver.http_host}:{topology.driver.http_port}"
            wait_http_ready(url, procs, run_dir, START_S)
            wait_warmed(url + "/v1", START_S)
            yield url + "/v1"
        finally:
            stop_processes(procs)

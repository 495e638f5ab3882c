"""Real stage processes on free loopback ports for end-to-end tests."""

from __future__ import annotations

import socket
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import yaml

from skippy_zmq.driver.main import open_engine
from skippy_zmq.launch import check_alive, spawn_stages, stop_processes
from skippy_zmq.topology import dump_topology, load_topology, plan_topology


def free_base_port(count: int) -> int:
    """A base port with `count` consecutive free ports after it."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count >= 65000:
            continue
        try:
            for p in range(base, base + count):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


def write_topology(tmp: Path, model_dir: Path, n_stages: int, name: str = "topo", **overrides) -> Path:
    base = free_base_port(n_stages + 3)
    data = plan_topology(30, n_stages, model=str(model_dir), base_port=base).to_dict()
    data["driver"]["http"] = f"127.0.0.1:{base + n_stages + 2}"
    for key, value in overrides.items():
        section, _, field = key.partition("__")
        if field:
            data[section][field] = value
        else:
            for stage in data["stages"]:
                stage[section] = value
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    load_topology(path)   # validate
    return path


@contextmanager
def running_pipeline(topology_path: Path, run_dir: Path, timeout: float = 240.0) -> Iterator:
    """Stage processes + an in-process PipelineEngine; yields (engine, tokenizer, topology, procs)."""
    topology = load_topology(topology_path)
    procs: list[subprocess.Popen] = spawn_stages(topology, topology_path, run_dir, ["--log-level", "INFO"])
    engine = None
    try:
        engine, tokenizer = open_engine(topology)
        waited = 0.0
        while not engine.wait_ready(0.5):
            check_alive(procs, run_dir)
            waited += 0.5
            if waited > timeout:
                raise TimeoutError(f"pipeline not ready: {engine.not_ready_reason()}")
        yield engine, tokenizer, topology, procs
    finally:
        if engine is not None:
            engine.close()
        stop_processes(procs)

"""Local pipelines for tests and benchmarks: free loopback ports, a throwaway
topology for any converted model, and stage processes + an in-process driver
engine in a `with` block.

Serving code never imports this module; it builds on launch.py (processes)
and driver/main.py (the engine).
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import yaml

from skippy_zmq.config.model import ModelConfig
from skippy_zmq.api.main import open_engine
from skippy_zmq.ops.launch import check_alive, spawn_stages, stop_processes
from skippy_zmq.config.topology_yaml import load_topology, plan_topology


def free_base_port(count: int) -> int:
    """A base port with `count` consecutive free ports after it.

    Chosen below the kernel's ephemeral range, so that no outgoing connection
    (a PUSH socket reconnecting somewhere) can take one of them between this
    check and the stage's bind.
    """
    ephemeral_low = _ephemeral_range()[0]
    lo, hi = port_slice(max(1024, ephemeral_low - 12_000), ephemeral_low)
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(lo, hi - count)
        try:
            for p in range(base, base + count):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


PORT_SLICE_ENV = "SKIPPY_PORT_SLICE"


def port_slice(low: int, high: int) -> tuple[int, int]:
    """[low, high), or its slice `i` of `n` when SKIPPY_PORT_SLICE is "i/n": processes that pick ports
    side by side (the suite's parallel workers) each pick from their own slice, so no two can take
    the same free port between one's check and its stage's bind."""
    spec = os.environ.get(PORT_SLICE_ENV, "")
    try:
        i, n = (int(v) for v in spec.split("/")) if spec else (0, 1)
    except ValueError:
        raise RuntimeError(f"{PORT_SLICE_ENV}={spec!r}: expected 'i/n', e.g. '0/2'") from None
    if not 0 <= i < n:
        raise RuntimeError(f"{PORT_SLICE_ENV}={spec!r}: i must be in [0, n)")
    width = (high - low) // n
    return low + i * width, low + (i + 1) * width


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def model_layers(model_dir: Path | str) -> int:
    """The layer count of a converted model (its model.json)."""
    return ModelConfig.load(Path(model_dir) / "model.json").n_layers


def write_topology(tmp: Path, model_dir: Path | str, n_stages: int, name: str = "topo",
                   n_layers: int | None = None, **overrides) -> Path:
    """A local topology on free loopback ports; `section__key=value`, `stage_key=value` or
    `security=...` / `keys_dir=...` (top level) overrides. CURVE keys are made when it is launched.

    The layers split evenly; `n_layers` defaults to the model's own count (its model.json).
    """
    base = free_base_port(n_stages + 3)
    n_layers = model_layers(model_dir) if n_layers is None else n_layers
    data = plan_topology(n_layers, n_stages, model=str(model_dir), base_port=base).to_dict()
    data["driver"]["http"] = f"127.0.0.1:{base + n_stages + 2}"
    data["driver"]["micro_batches"] = 1   # every stage shares this machine's cores (see topologies/)
    for key, value in overrides.items():
        section, _, field = key.partition("__")
        if key in ("security", "keys_dir"):
            data[key] = value
        elif field:
            data[section][field] = value
        else:
            for stage in data["stages"]:
                stage[section] = value
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    load_topology(path)   # validate
    return path


def wait_warmed(engine: Any, timeout: float, procs: list[subprocess.Popen] | None = None,
                run_dir: Path | None = None) -> float:
    """Wait until every stage reports (in its heartbeats) no idle warm-up compile left, so what is
    measured next neither waits on a compile nor misses the memory the compiles take; seconds waited."""
    t0 = time.monotonic()
    while True:
        pending = {sid: s.info.get("warmups_pending", 0) for sid, s in engine.stages.items()}
        if not any(pending.values()):
            return time.monotonic() - t0
        if procs and run_dir is not None:
            check_alive(procs, run_dir)
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"stages still warming up after {timeout:g} s: {pending}")
        time.sleep(0.25)    # heartbeats refresh the counts every heartbeat_s; nothing to block on


@contextmanager
def running_pipeline(topology_path: Path, run_dir: Path, timeout: float = 240.0, warm: bool = False) -> Iterator:
    """Stage processes + an in-process PipelineEngine; yields (engine, tokenizer, topology, procs).
    `warm`: also wait for every stage's idle warm-up compiles (benchmarks: no compile in a timing)."""
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
        if warm:
            wait_warmed(engine, timeout, procs, run_dir)
        yield engine, tokenizer, topology, procs
    finally:
        if engine is not None:
            engine.close()
        stop_processes(procs)

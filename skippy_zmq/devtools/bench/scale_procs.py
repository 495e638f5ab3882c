"""Process measurements for the scale bench (and its recipes): a pipeline whose stages start one
after another, its topology, one measured stream through it, a subprocess's wall time and peak RSS,
a live process's peak RSS, and a stage's start times from its log. Linux (/proc, wait4)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np

# stage/factory.py: "stage s0 layers [0, 16) on cpu: restored in 3.2s, compiled in 11.0s"
START_LINE = re.compile(r"stage (\S+) layers \[(\d+), (\d+)\) on \S+: restored in ([\d.]+)s, compiled in ([\d.]+)s")


def run_measured(cmd: list[str], log: Path) -> dict[str, Any]:
    """Run cmd to completion (output to `log`); exit code, wall seconds and its peak RSS in bytes
    (wait4's ru_maxrss for this child alone, KiB on Linux)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1), "peak_rss": usage.ru_maxrss * 1024}


def logged_peak_gib(log: Path) -> float | None:
    """The last "peak RSS X GiB" a command logged of itself (convert and random-model do), or None."""
    try:
        found = re.findall(r"peak RSS ([\d.]+) GiB", log.read_text(errors="replace"))
    except OSError:
        return None
    return float(found[-1]) if found else None


def peak_rss_bytes(pid: int) -> int | None:
    """VmHWM (the process's peak resident set) from /proc/<pid>/status; None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def stage_start_times(log: Path) -> dict[str, dict[str, float]]:
    """Per stage id in a stage log: the last start's restore and compile seconds."""
    found: dict[str, dict[str, float]] = {}
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return found
    for m in START_LINE.finditer(text):
        found[m.group(1)] = {"restored_s": float(m.group(4)), "compiled_s": float(m.group(5))}
    return found


@contextmanager
def staggered_pipeline(topology_path: Path, run_dir: Path, timeout: float = 1800.0) -> Iterator:
    """Like harness.running_pipeline, but each stage (downstream first) starts only once the one
    before it is READY: restores never overlap, so a big model's restore transients are paid once,
    not once per stage at the same time, and each stage's start time is its own. Yields (engine,
    topology, procs by stage id, seconds from spawn to READY by stage id)."""
    from skippy_zmq.api.main import open_engine
    from skippy_zmq.devtools.harness import wait_warmed
    from skippy_zmq.ops.launch import spawn_stage, stop_processes
    from skippy_zmq.config.topology_yaml import load_topology

    topology = load_topology(topology_path)
    engine, _ = open_engine(topology)
    procs: dict[str, subprocess.Popen] = {}
    ready_s: dict[str, float] = {}
    try:
        for stage in reversed(topology.stages):
            t0 = time.perf_counter()
            procs[stage.id] = spawn_stage(topology_path, stage, run_dir, ["--log-level", "INFO"])
            _wait_stage_ready(engine, stage.id, procs[stage.id], run_dir, timeout)
            ready_s[stage.id] = round(time.perf_counter() - t0, 1)
        if not engine.wait_ready(timeout):
            raise TimeoutError(engine.not_ready_reason())
        wait_warmed(engine, timeout, list(procs.values()), run_dir)   # peaks include every reachable shape
        yield engine, topology, procs, ready_s
    finally:
        engine.close()
        stop_processes(list(procs.values()))


def _wait_stage_ready(engine: Any, stage_id: str, proc: subprocess.Popen, run_dir: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not engine.stages[stage_id].ready:   # set by the stage's READY (the driver thread)
        if proc.poll() is not None:
            raise RuntimeError(f"stage {stage_id} exited with code {proc.returncode} during startup; "
                               f"see {run_dir / (stage_id + '.log')}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"stage {stage_id} not READY after {timeout:g} s")
        engine.wait_ready(0.25)   # a bounded wait on the driver's ready event (set only when all are)


def prompt_ids(vocab: int, n: int, seed: int = 1) -> list[int]:
    """n token ids drawn uniformly from the vocabulary (a random model has no text to encode)."""
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def topology_for(tmp: Path, model: Path, n: int, case: Any, weights: str = "q4") -> Path:
    """q4 stages (or `weights`), a lane per stream (case.streams), context for the case (a
    scale.ScaleCase). At least 256 positions: a stage whose KV capacity is below its prefill chunk (256) fails compiling that chunk at start. Timeouts are long:
    an 8B stage on 2 shared cores compiling a new bucket (8 rows at the long attention length)
    stays silent for minutes, past the default 30 s reply timeout."""
    from skippy_zmq.devtools.harness import write_topology

    return write_topology(tmp, model.absolute(), n, name=f"scale-{n}", weights=weights, kv_lanes=case.streams,
                          driver__max_sessions=case.streams, driver__max_context=max(256, case.context + case.new_tokens + 16),
                          driver__dead_after_s=120.0, driver__request_timeout_s=3600.0,
                          driver__reply_timeout_s=900.0)


def one_stream(engine: Any, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """Greedy tokens, prefill tok/s and decode tok/s of one request through the pipeline."""
    from skippy_zmq.devtools.bench import greedy
    from skippy_zmq.devtools.bench.pipeline import measure

    got = measure(engine, [prompt], new_tokens)
    tokens = greedy.pipeline_tokens(engine, [prompt], min(new_tokens, 16))[0]
    return {"prefill_tok_s": round(len(prompt) / (got["ttft_ms"] / 1000), 1),
            # tokens that reach the reader together (a verify window accepted at once) make the median gap
            # 0 (a cold run's 4-token request did): then the stream's own rate over its decode
            "decode_tok_s": round(1000 / got["itl_p50_ms"], 2) if got["itl_p50_ms"] > 0 else got["per_stream_tok_s"],
            "tokens": tokens}


def model_vocab(model: Path) -> int:
    """A checkpoint's vocabulary size (model.json)."""
    return int(json.loads((model / "model.json").read_text())["vocab_size"])

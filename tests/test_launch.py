"""scripts/launch.sh and scripts/stop.sh with real processes; a stage killed mid-request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import pytest

from conftest import REPO
from procs import write_topology
from skippy_zmq.devtools.bench.hops import DELAY_ENV

HOP_DELAY_MS = 20


def pgrep(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.fixture()
def launched(small_model_dir, tmp_path):
    # The stream below must outlast the kill and its detection (dead_after 2 s + resume 1 s): 1000 tokens
    # (1024 positions) with every hop delayed HOP_DELAY_MS take at least 20 s on any machine.
    topo = write_topology(tmp_path, small_model_dir, 2, name="launch-test", driver__resume_timeout_s=1.0,
                          driver__max_context=1024)
    run_dir = tmp_path / "run"
    out = subprocess.run([str(REPO / "scripts" / "launch.sh"), str(topo), str(run_dir)], capture_output=True,
                         text=True, timeout=400, cwd=REPO, env={**os.environ, DELAY_ENV: str(HOP_DELAY_MS)})
    assert out.returncode == 0, out.stderr[-3000:]
    url = out.stdout.strip().splitlines()[-1]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
    try:
        yield url, run_dir, topo
    finally:
        subprocess.run([str(REPO / "scripts" / "stop.sh"), str(run_dir)], timeout=60)


def test_killed_stage_fails_the_stream_quickly_and_stop_leaves_nothing(launched):
    url, run_dir, topo = launched
    assert httpx.get(url.removesuffix("/v1") + "/readyz").status_code == 200
    pids = {f.stem: int(f.read_text()) for f in run_dir.glob("*.pid")}
    assert set(pids) == {"s0", "s1", "driver"}
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    events = []
    with httpx.stream("POST", url + "/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 3:
                    break
        os.kill(pids["s1"], signal.SIGKILL)
        killed_at = time.monotonic()
        for line in lines:
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    elapsed = time.monotonic() - killed_at
    assert "error" in events[-1], events[-1]
    assert "s1" in events[-1]["error"]["message"] and "unreachable" in events[-1]["error"]["message"]
    assert elapsed < 6.0           # dead_after 2 s + resume_timeout 1 s + slack
    ready = httpx.get(url.removesuffix("/v1") + "/readyz")
    assert ready.status_code == 503
    subprocess.run([str(REPO / "scripts" / "stop.sh"), str(run_dir)], check=True, timeout=60)
    assert not [p for p in pids.values() if _alive(p)]
    assert pgrep(str(topo)) == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is not a stray process
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"

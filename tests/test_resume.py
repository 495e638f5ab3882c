"""A stage dies mid-stream: requests pause, a replacement resumes them with identical output;
without a replacement they end with a clear error within resume_timeout."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import httpx
import pytest

from conftest import REPO
from procs import write_topology

BODY = {"model": "m", "prompt": "List the planets of the solar system and describe each one:", "max_tokens": 160,
        "ignore_eos": True, "temperature": 0, "stream": True}


# Bounds on waits for a process to load and compile the real model on a busy 2-core machine (a restart
# included): they stop a hang, they assume no speed.
START_S = 900.0


@pytest.fixture()
def launched(small_model_dir, tmp_path, request):
    # the small random model of SmolLM2's shape: a restart's identity is the point, not the tokens
    overrides = {"driver__resume_timeout_s": START_S, **getattr(request, "param", {})}
    topo = write_topology(tmp_path, small_model_dir, 2, name="resume", **overrides)
    run_dir = tmp_path / "run"
    out = subprocess.run([str(REPO / "scripts" / "launch.sh"), str(topo), str(run_dir)], capture_output=True,
                         text=True, timeout=START_S, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    try:
        yield out.stdout.strip().splitlines()[-1], run_dir
    finally:
        subprocess.run([str(REPO / "scripts" / "stop.sh"), str(run_dir)], timeout=60)


def stream(url: str, on_event=None) -> tuple[str, list[dict]]:
    events = []
    with httpx.stream("POST", url + "/completions", json=BODY, timeout=START_S) as resp:   # a restart streams nothing
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if on_event:
                    on_event(len(events))
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    return text, events


def test_last_stage_killed_and_restarted_gives_identical_output(launched):
    url, run_dir = launched
    clean, _ = stream(url)
    victim = int((run_dir / "s1.pid").read_text())
    marks = {}

    def fault(n):
        if n == 20:
            os.kill(victim, signal.SIGKILL)
            marks["killed"] = time.monotonic()
            subprocess.run([str(REPO / "scripts" / "restart-stage.sh"), str(run_dir), "s1"], check=True, timeout=30)

    text, events = stream(url, fault)
    assert not any("error" in e for e in events), events[-1]
    assert text == clean
    metrics = httpx.get(url.removesuffix("/v1") + "/metrics").text
    detect = float(re.search(r"^skippy_last_failure_detect_seconds ([0-9.e+-]+)$", metrics, re.M).group(1))
    resume = float(re.search(r"^skippy_last_failure_resume_seconds ([0-9.e+-]+)$", metrics, re.M).group(1))
    print(f"time to detect {detect:.2f} s, time to resume {resume:.2f} s")
    assert detect <= 3.0


@pytest.mark.parametrize("launched", [{"driver__resume_timeout_s": 3.0}], indirect=True)
def test_no_replacement_ends_with_a_clear_error_within_resume_timeout(launched):
    url, run_dir = launched
    victim = int((run_dir / "s1.pid").read_text())
    marks = {}

    def fault(n):
        if n == 5:
            os.kill(victim, signal.SIGKILL)
            marks["killed"] = time.monotonic()

    _, events = stream(url, fault)
    elapsed = time.monotonic() - marks["killed"]
    assert "error" in events[-1]
    message = events[-1]["error"]["message"]
    assert "stage s1 is unreachable" in message and "no replacement within 3 s" in message
    assert elapsed < 2.0 + 3.0 + 2.0       # dead_after + resume_timeout + slack

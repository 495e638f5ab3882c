"""Process measurements for the scale bench: a subprocess's wall time and peak RSS, a live
process's peak RSS, and a stage's start times from its log. Linux (/proc, wait4)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

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

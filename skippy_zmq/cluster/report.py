"""What a worker has: cores, memory, devices, free disk under its cache (and, where the speed module
exists, its measured speed), reported to the driver as it joins.

Devices are listed by a short child process, never in the worker itself: importing JAX on a GPU
host would make the worker take most of the accelerator's memory its stages need.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from loguru import logger

DEVICE_PROBE_TIMEOUT_S = 60.0
_PROBE = ("import json, jax; print(json.dumps([{'platform': d.platform, 'kind': d.device_kind} "
          "for d in jax.devices()]))")


def memory_bytes() -> dict[str, int]:
    """MemTotal and MemAvailable from /proc/meminfo (0 where the system has no such file)."""
    found = {"MemTotal": 0, "MemAvailable": 0}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in found:
                found[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return {"total": found["MemTotal"], "available": found["MemAvailable"]}


def list_devices(timeout_s: float = DEVICE_PROBE_TIMEOUT_S) -> list[dict[str, str]]:
    """jax.devices() of this host, from a child process ([] with a logged reason if it fails)."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s,
                             env=env, stdin=subprocess.DEVNULL)
        devices = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError, IndexError, OSError) as exc:
        logger.warning("could not list this host's devices: {}", exc)
        return []
    if devices is None:
        logger.warning("could not list this host's devices: {}", out.stderr.strip()[-500:])
        return []
    return devices


MEASURE_TIMEOUT_S = 600.0


def measure_speed(model_dir: Path, weights: str, device: str) -> dict[str, Any] | None:
    """HOOK for the speed planner: skippy_zmq.cluster.measure.measure_host(model_dir, weights=,
    device=) in a child process (JAX stays out of the worker) when that module exists; None when
    it does not or fails (logged). The driver receives the result in the worker's STARTED message."""
    if importlib.util.find_spec("skippy_zmq.cluster.measure") is None:
        return None
    code = ("import json, sys; from skippy_zmq.cluster.measure import measure_host; "
            "print(json.dumps(measure_host(sys.argv[1], weights=sys.argv[2], device=sys.argv[3])))")
    try:
        out = subprocess.run([sys.executable, "-c", code, str(model_dir), weights, device], capture_output=True,
                             text=True, timeout=MEASURE_TIMEOUT_S, stdin=subprocess.DEVNULL)
        if out.returncode == 0:
            return json.loads(out.stdout.strip().splitlines()[-1])
        logger.warning("measuring this host's speed failed: {}", out.stderr.strip()[-500:])
    except (subprocess.TimeoutExpired, ValueError, IndexError, OSError) as exc:
        logger.warning("measuring this host's speed failed: {}", exc)
    return None


def host_report(cache_dir: Path, devices: bool = True) -> dict[str, Any]:
    """Cores (the ones this process may use, and the machine's), memory, free disk of the cache, devices."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"cores": usable, "cpus": os.cpu_count() or usable, "memory": memory_bytes(),
            "disk_free": shutil.disk_usage(cache_dir).free, "devices": list_devices() if devices else [],
            "platform": sys.platform}

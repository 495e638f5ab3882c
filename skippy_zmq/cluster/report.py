"""What a worker has: cores, memory, devices, free disk under its cache, and its measured speed,
reported to the driver as it joins (and, with `split: measured`, before any stage is given).

Devices are listed by a short child process, never in the worker itself: importing JAX on a GPU
host would make the worker take most of the accelerator's memory its stages need.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from loguru import logger

from skippy_zmq.config.cpus import size_jax_threads

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


# FOR TESTS ONLY: multiplies every time this worker reports measuring (a fast machine posing as a
# slow host, so a test can check the split follows the measurements). Never set it in production.
TEST_SPEED_SCALE_ENV = "SKIPPY_TEST_SPEED_SCALE"
_TIMES = ("layer_ms", "step_ms", "head_ms", "sample_ms", "message_ms", "software_ms")


def scaled_for_tests(speed: dict[str, Any]) -> dict[str, Any]:
    """`speed` with its times multiplied by $SKIPPY_TEST_SPEED_SCALE (for tests only; unset: as is)."""
    raw = os.environ.get(TEST_SPEED_SCALE_ENV)
    if not raw:
        return speed
    scale = float(raw)
    for row in speed.get("decode", {}).values():
        row.update({k: v * scale for k, v in row.items() if k in _TIMES})
        if isinstance(row.get("cpu"), dict):
            row["cpu"] = {k: v * scale for k, v in row["cpu"].items()}
    prefill = speed.get("prefill", {})
    prefill.update({k: v * scale for k, v in prefill.items() if k in ("layer_ms_per_token", "step_ms")})
    speed["test_speed_scale"] = scale
    logger.warning("reporting this host's measured times x{} (${} is for tests only)", scale, TEST_SPEED_SCALE_ENV)
    return speed


def measure_speed(model_dir: Path, weights: str, device: str, source: str = "checkpoint",
                  dtype: str = "float32") -> dict[str, Any] | None:
    """skippy_zmq.cluster.measure.measure_host(model_dir, weights=, device=, source=) in a child
    process (JAX stays out of the worker); None when it fails (logged). source "random": from
    model.json alone, before the worker holds weights (the driver's `split: measured` asks so)."""
    # configure_jax: the persistent compile cache, as a stage's (a measurement's ~11 step shapes were
    # compiled again by every worker's every measurement: ~10 of its 12 CPU s on the tiny test model)
    code = ("import json, sys; from skippy_zmq.cli import configure_jax; configure_jax(); "
            "from skippy_zmq.cluster.measure import measure_host; "
            "print(json.dumps(measure_host(sys.argv[1], weights=sys.argv[2], device=sys.argv[3], "
            "source=sys.argv[4], dtype=sys.argv[5])))")
    try:
        env = dict(os.environ)
        size_jax_threads(env)   # the child's JAX pool sized as the stages' are (cli.configure_jax)
        out = subprocess.run([sys.executable, "-c", code, str(model_dir), weights, device, source, dtype],
                             capture_output=True, text=True, timeout=MEASURE_TIMEOUT_S, stdin=subprocess.DEVNULL,
                             env=env)
        if out.returncode == 0:
            return scaled_for_tests(json.loads(out.stdout.strip().splitlines()[-1]))
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

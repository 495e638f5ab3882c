"""The suite's CPU profile, opt-in: `SKIPPY_CPU_PROFILE=<folder> pytest ...` appends, per pytest process,
to cpu-<pid>.jsonl as each test ends (an interrupted run keeps what it measured): for each test the CPU seconds of its setup, call and teardown in the pytest process
(RUSAGE_SELF) and in the children it reaped meanwhile (RUSAGE_CHILDREN: a child counts once reaped, so a
module's pipeline counts at the teardown that stops it, a session's at the worker's last teardown), and
every process started under it (cpu_profile/sitecustomize.py). scripts/cpu_profile_table.py sums them by
file. Nothing here runs without the variable."""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path

import pytest

PROFILE_ENV = "SKIPPY_CPU_PROFILE"
PROFILE_DIR = os.environ.get(PROFILE_ENV, "")
SITE_DIR = Path(__file__).resolve().parent / "cpu_profile"


def cpu_now() -> tuple[float, float]:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


if PROFILE_DIR:
    Path(PROFILE_DIR).mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), os.environ.get("PYTHONPATH")) if p)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        before = cpu_now()
        yield
        after = cpu_now()
        record = {"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                  "self_s": after[0] - before[0], "children_s": after[1] - before[1], "last": nextitem is None}
        with open(Path(PROFILE_DIR) / f"cpu-{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

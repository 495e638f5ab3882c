"""Start and stop the processes of a topology (downstream first, no sleeps).

Stages on this machine are child processes; a stage whose `host` is not
local is started over ssh in the same working directory. Before anything is
spawned the topology's CURVE keys are made if they do not exist yet (first
launch, keystore.py), so the driver and every local stage share them; a
remote stage reads them from the same path on its host, where the key folder
must have been copied (keys never travel over ssh). Helpers for tests and
benchmarks (free ports, throwaway topologies, a pipeline in a `with`) live in
harness.py, which builds on this module and never the other way round.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from loguru import logger

from skippy_zmq.ops.lifetime import tied_env
from skippy_zmq.config.topology import StageConfig, Topology, is_local
from skippy_zmq.config.topology_yaml import load_topology



def stage_command(topology_path: Path, stage: StageConfig, extra: list[str] | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "skippy_zmq.cli", *(extra or []), "stage", "--topology", str(topology_path),
           "--stage", stage.id]
    if is_local(stage.host):
        return cmd
    remote = f"cd {shlex.quote(os.getcwd())} && " + " ".join(shlex.quote(c) for c in cmd)
    return ["ssh", "-o", "BatchMode=yes", "--", stage.host, remote]   # `--`: the host is never an option


def prepare_keys(topology_path: Path, stage: StageConfig | None = None) -> None:
    """Make the topology's CURVE keys on first launch; for a remote `stage`, name the folder to copy."""
    from skippy_zmq.protocol.keystore import ensure_keys

    folder = ensure_keys(load_topology(topology_path))
    if folder is not None and stage is not None and not is_local(stage.host):
        logger.warning("stage {} runs on {}: it reads its keys from {} there (copy that folder with `scp -rp` "
                       "to the same path on that host, once)", stage.id, stage.host, folder)


def spawn_stage(topology_path: Path, stage: StageConfig, run_dir: Path,
                extra: list[str] | None = None, tied: bool = True) -> subprocess.Popen:
    """One stage in the background, logging to RUN_DIR/<id>.log; its pid in RUN_DIR/<id>.pid.

    `tied`: a local stage exits when this process dies, by any signal (skippy_zmq/ops/lifetime.py);
    detached (`launch`, `restart-stage`) and remote stages keep running on their own."""
    prepare_keys(topology_path, stage)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "topology").write_text(f"{Path(topology_path).absolute()}\n")
    log = open(run_dir / f"{stage.id}.log", "ab")
    proc = subprocess.Popen(stage_command(topology_path, stage, extra), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            env=tied_env(tied and is_local(stage.host)))
    log.close()
    (run_dir / f"{stage.id}.pid").write_text(f"{proc.pid}\n")
    logger.info("started stage {} (pid {}), log {}", stage.id, proc.pid, run_dir / f"{stage.id}.log")
    return proc


def spawn_stages(topology: Topology, topology_path: Path, run_dir: Path,
                 extra: list[str] | None = None, tied: bool = True) -> list[subprocess.Popen]:
    """Every stage, last first (downstream first)."""
    return [spawn_stage(topology_path, stage, run_dir, extra, tied) for stage in reversed(topology.stages)]


def restart_stage(run_dir: Path, stage_id: str) -> subprocess.Popen:
    """Start a replacement for a stage of a launched run (it announces a new incarnation); like
    `launch`'s, it runs on its own (the `restart-stage` command exits at once)."""
    topology_path = Path((run_dir / "topology").read_text().strip())
    stage = load_topology(topology_path).stage(stage_id)
    return spawn_stage(topology_path, stage, run_dir, tied=False)


def stop_processes(procs: list[subprocess.Popen], timeout: float = 10.0) -> None:
    """SIGTERM (stages drain and exit), then SIGKILL whatever is left after `timeout`."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("pid {} did not stop in {:g} s; killing it", proc.pid, timeout)
            proc.kill()
            proc.wait(timeout=5)


def check_alive(procs: list[subprocess.Popen], run_dir: Path) -> None:
    """Raise, naming the process and the last line it logged (a stage says why it cannot start), if one died."""
    for proc in procs:
        if proc.poll() is not None:
            name, last = _last_words(proc.pid, run_dir)
            raise RuntimeError(f"{name} exited with code {proc.returncode} during startup"
                               f"{': ' + last if last else ''}; see logs in {run_dir}")


def _last_words(pid: int, run_dir: Path) -> tuple[str, str]:
    """('stage s1', its log's last line) for a pid spawned into run_dir, else ('a stage', '')."""
    for pid_file in Path(run_dir).glob("*.pid"):
        if pid_file.read_text().strip() == str(pid):
            log = run_dir / f"{pid_file.stem}.log"
            lines = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
            who = "the driver" if pid_file.stem == "driver" else f"stage {pid_file.stem}"
            return who, lines[-1].strip() if lines else ""
    return "a stage", ""


def spawn_driver(topology_path: Path, run_dir: Path, extra: list[str] | None = None,
                 tied: bool = True) -> subprocess.Popen:
    """The driver in the background (`tied`: it exits when this process dies, as spawn_stage's)."""
    prepare_keys(topology_path)
    log = open(run_dir / "driver.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "skippy_zmq.cli", *(extra or []), "driver", "--topology",
                             str(topology_path)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=tied_env(tied))
    log.close()
    (run_dir / "driver.pid").write_text(f"{proc.pid}\n")
    return proc


def wait_http_ready(url: str, procs: list[subprocess.Popen], run_dir: Path, timeout: float) -> None:
    """Poll /readyz until 200; fail fast if a process died; bounded by `timeout`."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check_alive(procs, run_dir)
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)   # polling an HTTP endpoint; not synchronisation between our processes
    raise TimeoutError(f"{url}/readyz not ready after {timeout:g} s; see logs in {run_dir}")


def launch(topology: Topology, topology_path: Path, run_dir: Path, timeout: float = 300.0,
           extra: list[str] | None = None, tied: bool = True) -> str:
    """Stages then driver in the background; returns the API base URL once /readyz is 200.
    `tied`: they exit with this process (soak); `skippy-zmq launch` leaves them running."""
    procs = spawn_stages(topology, topology_path, run_dir, extra, tied)
    procs.append(spawn_driver(topology_path, run_dir, extra, tied))
    url = f"http://{topology.driver.http_host}:{topology.driver.http_port}"
    try:
        wait_http_ready(url, procs, run_dir, timeout)
    except Exception:
        stop_processes(procs)
        raise
    return url + "/v1"

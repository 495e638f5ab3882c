"""Files and scripts that cannot be turned against the user: caches of compiled code checked for owner
and mode, tar members kept inside the staging folder, topology ids and hosts that cannot become paths
or ssh options, and stop.sh signalling only the run's own processes (the real script, real processes)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import REPO
from skippy_zmq.devtools.llama_cpp_models import extract_under
from skippy_zmq.ops.launch import stage_command
from skippy_zmq.model import quant
from skippy_zmq.files.private_dirs import private_cache_dir, unsafe_reason
from skippy_zmq.config.topology import TopologyError
from skippy_zmq.config.topology_yaml import parse_topology

# ---------------------------------------------------------------- caches of compiled code


def test_kernel_in_a_group_writable_cache_is_not_loaded(tmp_path, monkeypatch):
    cache = tmp_path / "kernels"
    cache.mkdir(mode=0o700)
    planted = cache / "quant_kernel-x.so"
    planted.write_bytes(b"not a library")
    planted.chmod(0o644)
    monkeypatch.setenv(quant.CACHE_ENV, str(cache))
    assert quant._kernel_path(planted.name) == planted          # ours, 0700 folder, 0644 file: used
    cache.chmod(0o770)                                            # the folder: group-writable
    elsewhere = quant._kernel_path(planted.name)
    assert elsewhere.parent != cache and oct(elsewhere.parent.stat().st_mode & 0o777) == "0o700"
    assert not elsewhere.exists()                                 # to be built there, not loaded
    assert quant._kernel_path(planted.name) == elsewhere          # one private folder a process, not one a lookup
    cache.chmod(0o700)
    planted.chmod(0o666)                                          # the file: world-writable
    assert quant._kernel_path(planted.name).parent != cache
    planted.chmod(0o644)
    planted.unlink()
    planted.symlink_to(tmp_path / "elsewhere.so")                 # a link: never a cache entry we wrote
    assert quant._kernel_path(planted.name).parent != cache


@pytest.mark.slow
def test_the_private_kernel_folder_goes_with_its_process(tmp_path):
    """A process whose kernel cache is unsafe builds in a 0700 folder of its own, one for all its
    lookups, and leaves nothing behind in the temporary folder when it exits (a real process)."""
    cache = tmp_path / "kernels"
    cache.mkdir()
    cache.chmod(0o770)                                            # group-writable: not used
    code = ("from skippy_zmq.model import quant\n"
            "a, b = quant._kernel_path('x.so'), quant._kernel_path('y.so')\n"
            "assert a.parent == b.parent and a.parent.is_dir()\n"
            "print(a.parent)\n")
    env = {**os.environ, quant.CACHE_ENV: str(cache), "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    folder = Path(out.stdout.strip())
    assert folder.parent == tmp_path and folder.name.startswith("skippy-kernel-"), out.stdout
    assert not folder.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["kernels"]


def test_unsafe_reason_names_the_fault(tmp_path):
    folder = tmp_path / "c"
    folder.mkdir(mode=0o700)
    assert unsafe_reason(folder) is None
    folder.chmod(0o777)
    assert unsafe_reason(folder) == "is writable by others (mode 0777)"
    folder.chmod(0o770)
    assert unsafe_reason(folder) == "is writable by its group (mode 0770)"
    assert private_cache_dir(folder, "test cache") is None
    fresh = private_cache_dir(tmp_path / "new" / "cache", "test cache")
    assert fresh is not None and oct(fresh.stat().st_mode & 0o777) == "0o700"


def test_jax_cache_in_a_world_writable_folder_is_not_used(tmp_path):
    shared = tmp_path / "jax-cache"
    shared.mkdir()
    shared.chmod(0o777)
    own = tmp_path / "own-cache"
    code = ("import sys, jax; from skippy_zmq.cli import configure_jax\n"
            "configure_jax(sys.argv[1]); print(jax.config.jax_compilation_cache_dir)")
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    for folder, used in ((shared, None), (own, str(own))):
        out = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True,
                             timeout=120, env=env, check=True)
        assert out.stdout.strip().splitlines()[-1] == str(used)
        assert ("is writable by others (mode 0777): not loading compiled code" in out.stderr) == (used is None)
    assert oct(own.stat().st_mode & 0o777) == "0o700"


# ---------------------------------------------------------------- tar members


def tar_with(members: list[tarfile.TarInfo], payload: bytes = b"x") -> tarfile.TarFile:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for m in members:
            if m.isfile():
                m.size = len(payload)
                tar.addfile(m, io.BytesIO(payload))
            else:
                tar.addfile(m)
    buf.seek(0)
    return tarfile.open(fileobj=buf)


def test_tar_members_that_leave_the_staging_folder_are_refused(tmp_path):
    prefix = "vendor/llama.cpp/models/"
    outside = tmp_path / "outside"

    def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
        m = tarfile.TarInfo(f"pkg-1.0/{prefix}{name}")
        m.type, m.linkname = kind, link
        return m

    archive = tar_with([
        member("ok/vocab.gguf"),
        member(f"/{outside}/abs"),                        # models//tmp/...: absolute once joined
        member("../../escaped"), member("a/../../escaped2"), member("./dot"),
        member("link", tarfile.SYMTYPE, str(outside)),
        member("hard", tarfile.LNKTYPE, "/etc/passwd"),
        member("dev", tarfile.CHRTYPE),
    ])
    staged = tmp_path / "staged"
    assert extract_under(archive, prefix, staged) == 1
    assert sorted(str(p.relative_to(staged)) for p in staged.rglob("*")) == ["ok", "ok/vocab.gguf"]
    assert not outside.exists() and not (tmp_path / "escaped").exists()


# ---------------------------------------------------------------- topology ids and hosts


def topology_with(**stage: object) -> dict:
    data = {"model": "m", "n_layers": 4, "driver": {"return": "tcp://127.0.0.1:5600"},
            "stages": [{"id": "s0", "layers": [0, 2], "listen": "tcp://127.0.0.1:5601"},
                       {"id": "s1", "layers": [2, 4], "listen": "tcp://127.0.0.1:5602"}]}
    data["stages"][1].update(stage)
    return data


@pytest.mark.parametrize("stage_id", ["../x", "-rf", ".hidden", "a b", "a/b", "", "x" * 65, 7, "s\n1"])
def test_hostile_stage_ids_are_refused(stage_id):
    with pytest.raises(TopologyError, match=r"stages\[1\]\.id: expected a name of letters"):
        parse_topology(topology_with(id=stage_id))


@pytest.mark.parametrize("host", ["-oProxyCommand=sh", "-x", "a b", "host;rm", "user@-x", "", "$(id)",
                                  "a\nb", "@host"])
def test_hostile_hosts_are_refused(host):
    with pytest.raises(TopologyError, match=r"stages\[1\]\.host: expected a hostname"):
        parse_topology(topology_with(host=host))


def test_a_hostile_host_in_listen_is_refused_too():
    with pytest.raises(TopologyError, match=r"stages\[1\]\.listen: expected a hostname"):
        parse_topology(topology_with(listen="tcp://-oProxyCommand:5000"))


@pytest.mark.parametrize("host", ["gpu-box", "10.0.0.7", "[fe80::1]", "::1", "me@node-2.lan", "n_1.example"])
def test_ordinary_hosts_pass_and_ssh_gets_them_after_double_dash(tmp_path, host):
    topology = parse_topology(topology_with(host=host, id="stage.b-1"))
    cmd = stage_command(tmp_path / "t.yaml", topology.stages[1])
    if cmd[0] == "ssh":
        assert cmd[cmd.index("--") + 1] == host


# ---------------------------------------------------------------- stop.sh


def run_stop(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / "scripts" / "stop.sh"), str(run_dir)], capture_output=True, text=True,
                          timeout=60)


def test_stop_skips_a_pid_that_is_not_the_runs_process(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        (run_dir / "s0.pid").write_text(f"{bystander.pid}\n")
        (run_dir / "driver.pid").write_text("-1\n")              # `kill -TERM -1` would signal everything
        out = run_stop(run_dir)
        assert out.returncode == 0 and "stopped 0 process(es)" in out.stdout
        assert f"pid {bystander.pid} is not this run's s0" in out.stderr
        assert "'-1' is not a pid" in out.stderr
        assert bystander.poll() is None                          # still running
    finally:
        bystander.kill()
        bystander.wait()


def test_stop_signals_the_runs_own_stage(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "topology").write_text(f"{tmp_path / 'two.yaml'}\n")
    # a stand-in with a stage's command line: skippy_zmq.cli ... --topology two.yaml --stage s1
    stage = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "skippy_zmq.cli", "stage",
                              "--topology", str(tmp_path / "two.yaml"), "--stage", "s1"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "skippy_zmq.cli", "stage",
                              "--topology", str(tmp_path / "other.yaml"), "--stage", "s1"])
    try:
        (run_dir / "s1.pid").write_text(f"{stage.pid}\n")
        (run_dir / "s0.pid").write_text(f"{other.pid}\n")        # another run's stage, another id
        out = run_stop(run_dir)
        assert "stopped 1 process(es)" in out.stdout, out.stderr
        assert stage.wait(timeout=30) == -signal.SIGTERM
        assert other.poll() is None
    finally:
        for proc in (stage, other):
            proc.kill()
            proc.wait()

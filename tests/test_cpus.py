"""config/cpus.py: the threads a process under a CPU quota runs, ceil(quota) and its CPUs at most,
read from cgroup v1 and v2 files (fixtures laid out as /proc/self/cgroup and /sys/fs/cgroup are);
and a real process in a 25% cgroup whose JAX pool, and with it the native kernel, runs one thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from skippy_zmq.config.cpus import JAX_THREADS_ENV, THREADS_ENV, cpu_quota, cpu_threads, jax_threads, size_jax_threads, \
    threads_here, usable_cpus


def v1_group(root: Path, path: str, quota_us: int, period_us: int = 10_000, mount: str = "cpu") -> None:
    group = root / mount / path.strip("/")
    group.mkdir(parents=True, exist_ok=True)
    (group / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
    (group / "cpu.cfs_period_us").write_text(f"{period_us}\n")


def proc_cgroup(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "self-cgroup"
    path.write_text(text)
    return path


def test_v1_quota_below_a_core_is_one_thread(tmp_path):
    root = tmp_path / "fs"
    v1_group(root, "/", -1)
    v1_group(root, "/skh1-2", 2500)
    proc = proc_cgroup(tmp_path, "4:memory:/x\n2:cpuacct:/\n1:cpu:/skh1-2\n0::/\n")
    assert cpu_quota(proc, root) == (0.25, 10.0)
    assert threads_here(proc, root) == 1
    v1_group(root, "/skh1-2", 15_000)              # 1.5 cores: two threads (on a machine of two or more)
    assert cpu_quota(proc, root) == (1.5, 10.0)
    assert threads_here(proc, root) == min(2, usable_cpus())


def test_v1_mounted_as_cpu_cpuacct_and_an_ancestors_quota_binds(tmp_path):
    root = tmp_path / "fs"
    v1_group(root, "/svc", 50_000, 100_000, mount="cpu,cpuacct")
    v1_group(root, "/svc/job", -1, 100_000, mount="cpu,cpuacct")   # the process's own group: no cap
    proc = proc_cgroup(tmp_path, "3:cpu,cpuacct:/svc/job\n")
    assert cpu_quota(proc, root) == (0.5, 100.0)
    v1_group(root, "/svc/job", 20_000, 100_000, mount="cpu,cpuacct")   # tighter below: it binds
    assert cpu_quota(proc, root) == (0.2, 100.0)


def test_v2_cpu_max(tmp_path):
    root = tmp_path / "fs"
    (root / "pod" / "app").mkdir(parents=True)
    (root / "pod" / "cpu.max").write_text("max 100000\n")
    (root / "pod" / "app" / "cpu.max").write_text("50000 100000\n")
    proc = proc_cgroup(tmp_path, "0::/pod/app\n")
    assert cpu_quota(proc, root) == (0.5, 100.0)
    assert threads_here(proc, root) == 1
    (root / "pod" / "app" / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(proc, root) is None and threads_here(proc, root) == usable_cpus()
    (root / "unified" / "pod" / "app").mkdir(parents=True)       # hybrid: v2 beside v1
    (root / "unified" / "pod" / "app" / "cpu.max").write_text("25000 100000\n")
    assert cpu_quota(proc, root) == (0.25, 100.0)


def test_no_limit_or_nothing_readable(tmp_path):
    root = tmp_path / "fs"
    v1_group(root, "/", -1)
    assert cpu_quota(proc_cgroup(tmp_path, "1:cpu:/\n0::/\n"), root) is None
    assert cpu_quota(tmp_path / "absent", root) is None
    assert cpu_quota(proc_cgroup(tmp_path, "garbage\n1:cpu:/gone\n"), root) is None   # (inside a netns' sysfs)
    assert threads_here(tmp_path / "absent", root) == usable_cpus()


@pytest.mark.parametrize("quota, usable, want", [(0.25, 2, 1), (0.5, 2, 1), (1.0, 2, 1), (1.01, 4, 2), (1.5, 2, 2),
                                                 (3.0, 2, 2), (None, 3, 3), (0.001, 1, 1), (0.0, 4, 4), (2.0, 0, 1)])
def test_cpu_threads_is_ceil_quota_within_the_cpus(quota, usable, want):
    assert cpu_threads(quota, usable) == want


def test_size_jax_threads_sets_the_pool_only_to_cap_it():
    env: dict[str, str] = {}
    assert size_jax_threads(env, threads=1) == 1 and env == {JAX_THREADS_ENV: "1"}
    env = {JAX_THREADS_ENV: "8"}
    assert size_jax_threads(env, threads=1) == 1 and env[JAX_THREADS_ENV] == "1"     # a larger pool shrinks
    env = {JAX_THREADS_ENV: "1"}
    assert size_jax_threads(env, threads=4) == 1 and env[JAX_THREADS_ENV] == "1"     # an operator's smaller one stays
    env = {}
    assert size_jax_threads(env, threads=usable_cpus()) == usable_cpus() and env == {}   # nothing to cap
    env = {THREADS_ENV: "2", JAX_THREADS_ENV: "1"}
    assert size_jax_threads(env, threads=1) == 2 and env[JAX_THREADS_ENV] == "2"     # the operator's choice wins
    with pytest.raises(ValueError, match="SKIPPY_CPU_THREADS must be a whole number of threads >= 1, got '0'"):
        size_jax_threads({THREADS_ENV: "0"})
    assert jax_threads({JAX_THREADS_ENV: "3"}) == 3
    assert jax_threads({JAX_THREADS_ENV: "lots"}) == jax_threads({}) == usable_cpus()


# In a 25% group: the CLI's JAX setup, then a head-sized kernel call with sharing from any size: how
# many threads XLA's pool has, and whether the kernel offered the call to a helper.
PROBE = """
import json, os
import numpy as np, jax, jax.numpy as jnp
from skippy_zmq.cli import configure_jax
configure_jax("off")
from skippy_zmq.model import kernel, quant
kernel.set_min_parallel(0)
rng = np.random.default_rng(0)
w = quant.pack_rows(rng.integers(-127, 128, (4096, 576), dtype=np.int8), np.full((4096, 18), 1e-3, np.float32),
                    np.zeros((4096, 18), np.float32), bits=8)
x = jnp.asarray(rng.standard_normal((1, 576)), jnp.float32)
f = jax.jit(quant.dense)
for _ in range(20):
    f(x, w).block_until_ready()
print(json.dumps({"nproc": os.environ.get("PJRT_NPROC"), **kernel.helper_stats()}))
"""


@pytest.mark.slow
def test_a_process_in_a_quarter_core_group_runs_one_thread():
    from skippy_zmq.devtools.hosts import CpuGroup, cpu_cgroup_problem
    from skippy_zmq.model import kernel

    if cpu_cgroup_problem() or not kernel.kernel_available():
        pytest.skip(f"needs a writable cgroup v1 cpu controller and the kernel: {cpu_cgroup_problem()}")
    group = CpuGroup(f"skz-cpus-{id(PROBE) % 100000}", 0.25)
    try:
        out = subprocess.run(group.wrap([sys.executable, "-c", PROBE]), capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got == {"nproc": "1", "shared_calls": 0, "helper_tasks": 0, "backoffs": 0}
        # the same probe with the env the group's wrap passes taken away: the CLI reads the quota itself
        unwrapped = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group.path), sys.executable,
                     "-c", PROBE]
        out = subprocess.run(unwrapped, capture_output=True, text=True, timeout=300,
                             env={k: v for k, v in os.environ.items() if k != JAX_THREADS_ENV})
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout.strip().splitlines()[-1])["nproc"] == "1"
    finally:
        group.remove()


def test_a_stage_pinned_to_one_cpu_shrinks_its_pool():
    """stage/loop.pin_cpus after cli.configure_jax sized the pool for more CPUs: one CPU, one thread."""
    code = ("import os, types; os.environ['PJRT_NPROC'] = '2'\n"
            "from skippy_zmq.stage.loop import pin_cpus\n"
            "pin_cpus(types.SimpleNamespace(id='s0', cpus=(min(os.sched_getaffinity(0)),)))\n"
            "print(os.environ['PJRT_NPROC'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != THREADS_ENV})
    assert out.returncode == 0 and out.stdout.split()[-1] == "1", out.stderr[-2000:]

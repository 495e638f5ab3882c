"""The kernel's hot helpers (quant_kernel.cc RunTasks / HelperLoop): a call's tasks are shared by the
caller and pool threads that stay hot between calls. Which thread runs a task must change no result:
the same bits whether every call runs on its caller alone or every call of two tasks or more is
shared, for decode-sized panel and block products and calls XLA may run at once."""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from skippy_zmq.checkpoint.runtime import panel_qtensor
from skippy_zmq.model import ggml, kernel, quant
from test_block_kernel import random_blocks

pytestmark = pytest.mark.skipif(not kernel.kernel_available(), reason="needs the CPU kernel (a C++ compiler)")
ALONE = 1 << 62   # no call is worth a helper


@contextlib.contextmanager
def min_parallel(work: int):
    old = kernel.set_min_parallel(work)
    try:
        yield
    finally:
        assert kernel.set_min_parallel(old) == work


def layer_like(x, wq, wk, gate, up, down):
    """A decode layer's products: q and k (XLA may run them at once), then gate * up into a K-block down."""
    h = quant.dense(x, gate) * quant.dense(x, up)
    return quant.dense(x, wq), quant.dense(x, wk), ggml.block_dense(h, down)


def test_shared_calls_give_the_callers_own_bits():
    rng = np.random.default_rng(7)
    ws = [panel_qtensor({"blocks": random_blocks(rng, "Q5_0", n, 576)}) for n in (576, 192, 1536, 1536)]
    down = ggml.BlockTensor(jnp.asarray(random_blocks(rng, "Q4_K", 576, 1536)), "Q4_K", "kernel")
    step = jax.jit(layer_like)
    xs = [jnp.asarray(rng.standard_normal((m, 576)), jnp.float32) for m in (1, 1, 3)]
    with min_parallel(ALONE):
        alone = [jax.tree.map(np.asarray, step(x, *ws, down)) for x in xs]
    before = kernel.helper_stats()
    with min_parallel(0):
        for _ in range(20):   # back to back, as a decode step's calls come: the helper stays hot
            shared = [jax.tree.map(np.asarray, step(x, *ws, down)) for x in xs]
            for a, b in zip(alone, shared):
                for u, v in zip(a, b):
                    assert np.array_equal(u, v)
    if (os.cpu_count() or 1) > 1:   # XLA's pool has a thread to share with: the calls were offered to it
        assert kernel.helper_stats()["shared_calls"] > before["shared_calls"]


def test_set_min_parallel_returns_the_old_value():
    with min_parallel(123):
        assert kernel.set_min_parallel(456) == 123
        kernel.set_min_parallel(123)


def test_the_share_threshold_comes_from_the_environment(tmp_path):
    """SKIPPY_KERNEL_SHARE_FROM sets the threshold at load; a bad value names the variable."""
    import subprocess
    import sys

    code = "from skippy_zmq.model import kernel; print(kernel.set_min_parallel(0))"
    env = {**os.environ, kernel.SHARE_ENV: "4194304"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split()[-1] == "4194304", out.stderr[-2000:]
    env[kernel.SHARE_ENV] = "lots"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "SKIPPY_KERNEL_SHARE_FROM must be a whole number" in out.stderr


def test_decode_projections_are_shared_by_default_on_two_cpus_and_not_on_one():
    """Unset, the threshold is SHARE_DEFAULT in a process that may use 2 CPUs or more; pinned to one
    CPU (no helper to share with) the kernel keeps its own 4194304."""
    import subprocess
    import sys

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    code = "from skippy_zmq.model import kernel; print(kernel.set_min_parallel(0))"
    env = {k: v for k, v in os.environ.items() if k != kernel.SHARE_ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split()[-1] == str(kernel.SHARE_DEFAULT), out.stderr[-2000:]
    one = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         preexec_fn=lambda: os.sched_setaffinity(0, {one}))
    assert out.returncode == 0 and out.stdout.split()[-1] == "4194304", out.stderr[-2000:]

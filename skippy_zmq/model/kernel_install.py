"""`skippy-zmq build-kernel`: the native CPU kernel built at install time (`make install` runs it),
into the installation (model/kernel.py installed_kernel_dir: the venv's share/skippy_zmq/kernel), where
a stage looks first. Without it a new user's first stage start compiled it (7 compiler runs, ~9 CPU s)
while its weights restored; that stays the fallback, for a worker on another CPU or a changed source.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from loguru import logger


def cmd_build_kernel(args: argparse.Namespace) -> int:
    import subprocess

    from skippy_zmq.model.kernel import install_kernel, installed_kernel_dir

    t0 = time.perf_counter()
    try:
        built = install_kernel()
    except subprocess.CalledProcessError as exc:
        logger.error("the kernel failed to build into {}:\n{}", installed_kernel_dir(), (exc.stderr or "")[-2000:])
        return 1
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        logger.error("the kernel was not built into {}: {}", installed_kernel_dir(), exc)
        return 1
    logger.info("kernel {} ready in {:.1f} s", built, time.perf_counter() - t0)
    print(built)
    return 0


def add_build_kernel_parser(sub: Any) -> None:
    p = sub.add_parser("build-kernel", help="build the native CPU kernel into the installation (make install runs "
                       "it; stages load it from there instead of building it at their first start)")
    p.set_defaults(func=cmd_build_kernel)

"""Caches of compiled code (the CPU kernel's .so, JAX's compilation cache) are code we run: before
loading from one, check that it is ours and that no one else can write it. A folder or file owned
by another user, or writable by the group or others, is not used (the caller builds elsewhere or
goes without the cache), and the log says why.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from loguru import logger


def unsafe_reason(path: Path, follow: bool = True, owners: tuple[int, ...] | None = None) -> str | None:
    """Why `path` must not be trusted as a cache of code, or None when it is ours and writable only
    by us. follow=False: a symlink itself is refused (a cache entry we wrote is a plain file).
    owners: the uids trusted to own it (default: this user's alone; an installation's files may be root's)."""
    st = os.stat(path) if follow else os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if st.st_uid not in (owners or (os.getuid(),)):
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} " \
               f"(mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def private_cache_dir(path: Path, what: str, mode: int = 0o700) -> Path | None:
    """`path`, created with `mode` if missing (0700; an installation's folder 0755: others may load
    from it, no one else may write it), when it is safe to load code from; else None, logged."""
    path = Path(path)
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
        reason = unsafe_reason(path)
    except OSError as exc:
        reason = f"cannot be used: {exc.strerror or exc}"
    if reason is None:
        return path
    logger.warning("{} {} {}: not loading compiled code from it", what, path, reason)
    return None

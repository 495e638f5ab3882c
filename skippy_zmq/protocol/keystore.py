"""Where a topology's CURVE keys live, and making them on first launch.

Each party ("driver" and every stage id) has one CURVE keypair: NAME.key
(public) and NAME.key_secret (secret, mode 0600). A topology names its key
folder with `keys_dir`; without one, its keys live in a private folder of
their own, KEYS_HOME/<digest of the topology's parties and endpoints>, where
KEYS_HOME is $SKIPPY_KEYS_HOME, else $XDG_STATE_HOME/skippy_zmq/keys, else
~/.local/state/skippy_zmq/keys. Whoever launches (launch.py, `skippy-zmq up`,
the harness) calls `ensure_keys` before spawning anything, so the driver and
the local stages find the same keys; stages and the driver only read them.

A generated folder is checked before every use: a real directory (no
symlink), owned by this user, with no access for group or others; each secret
too. Stages on another host need the folder copied there at the same path
(`scp -rp DIR host:DIR`): keys are never sent over ssh.

No sockets, no JAX.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import zmq.auth
from loguru import logger

from skippy_zmq.config.topology import Topology

DRIVER = "driver"
KEYS_HOME_ENV = "SKIPPY_KEYS_HOME"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class SecurityError(RuntimeError):
    """Keys are missing, unreadable, unsafe or inconsistent with the topology."""


@dataclass(frozen=True)
class Identity:
    """This process's CURVE keypair (Z85 bytes, as libzmq's socket options take them)."""

    name: str
    public: bytes
    secret: bytes = field(repr=False)


def party_names(topology: Topology) -> list[str]:
    """"driver" and every stage id, checked to be safe file names."""
    names = [DRIVER, *(s.id for s in topology.stages)]
    if DRIVER in names[1:]:
        raise SecurityError(f"{topology.source}: a stage may not be called {DRIVER!r}: that is the driver's key")
    for name in names:
        if not _NAME.fullmatch(name):
            raise SecurityError(f"{topology.source}: stage id {name!r} cannot name a key file "
                                "(use letters, digits, '_', '.', '-')")
    return names


# ------------------------------------------------------------------ where


def keys_home() -> Path:
    """The folder that holds generated key folders (one per topology)."""
    if os.environ.get(KEYS_HOME_ENV):
        return Path(os.environ[KEYS_HOME_ENV])
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "skippy_zmq" / "keys"


def topology_digest(topology: Topology) -> str:
    """Names the pipeline: its parties and the endpoints they meet on (not its tuning knobs, so
    changing max_sessions or a cache budget keeps the keys)."""
    parties = {"return": topology.driver.return_endpoint, "stages": [[s.id, s.listen] for s in topology.stages]}
    return hashlib.sha256(json.dumps(parties, sort_keys=True).encode()).hexdigest()[:20]


def keys_dir_of(topology: Topology) -> Path:
    """The topology's key folder: its keys_dir, else its generated folder under keys_home()."""
    return Path(topology.keys_dir) if topology.keys_dir is not None else keys_home() / topology_digest(topology)


def _key_files(names: Iterable[str], folder: Path) -> list[Path]:
    return [folder / f"{n}{ext}" for n in names for ext in (".key", ".key_secret")]


def check_private(path: Path, what: str) -> None:
    """Refuse a key folder or secret that another user owns or could read, or a symlink."""
    try:
        st = path.lstat()
    except OSError as exc:
        raise SecurityError(f"{path}: cannot read {what} ({exc.strerror or exc})") from exc
    if stat.S_ISLNK(st.st_mode):
        raise SecurityError(f"{path}: {what} is a symbolic link; refusing to use it")
    if st.st_uid != os.getuid():
        raise SecurityError(f"{path}: {what} is owned by uid {st.st_uid}, not by this user ({os.getuid()})")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise SecurityError(f"{path}: {what} has mode {stat.S_IMODE(st.st_mode):04o}; other users could read "
                            f"or replace keys (chmod {'700' if stat.S_ISDIR(st.st_mode) else '600'} it)")


def private_mkdirs(folder: Path) -> None:
    """Create `folder` and its missing parents 0700; the folder itself must then be private."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(folder, "the key store")


# ------------------------------------------------------------------ make


def generate_keys(topology: Topology, out_dir: str | Path, force: bool = False) -> list[Path]:
    """Write NAME.key and NAME.key_secret for the driver and every stage; return the paths.

    Refuses (FileExistsError, nothing written) if any of those files exists,
    unless `force`: replacing keys means every host needs the new public keys.
    Each pair is written inside a private (0700) temporary directory, the
    secret chmod'ed to 0600, then moved into place, so a secret is never
    readable by others even for a moment.
    """
    names = party_names(topology)
    out = Path(out_dir)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    existing = [p for p in _key_files(names, out) if p.exists()]
    if existing and not force:
        raise FileExistsError(f"refusing to overwrite existing keys ({', '.join(map(str, existing))}); "
                              "pass --force to replace them (every host then needs the new public keys)")
    written: list[Path] = []
    tmp = Path(tempfile.mkdtemp(prefix=".keys-", dir=out))
    try:
        for name in names:
            public, secret = (Path(p) for p in zmq.auth.create_certificates(tmp, name))
            os.chmod(secret, 0o600)
            os.chmod(public, 0o644)
            for path in (public, secret):
                os.replace(path, out / path.name)
                written.append(out / path.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return written


def ensure_keys(topology: Topology) -> Path | None:
    """The topology's key folder, its keys generated now if none exist (first launch); None for
    `security: none`. Safe to call from several processes at once: a generated folder appears
    whole (made aside, then renamed into place) and the first one wins."""
    if topology.security == "none":
        return None
    folder = keys_dir_of(topology)
    names = party_names(topology)
    present = [p.exists() for p in _key_files(names, folder)]
    if all(present):
        if topology.keys_dir is None:
            check_private(folder, "the key folder")
        return folder
    if any(present):
        missing = [p.name for p, ok in zip(_key_files(names, folder), present) if not ok]
        raise SecurityError(f"{folder}: some CURVE keys are missing ({', '.join(missing)}); copy them from the "
                            "host that made them, or replace them all with `skippy-zmq keys --force`")
    if topology.keys_dir is not None:
        generate_keys(topology, folder)
    else:
        private_mkdirs(folder.parent)
        staging = Path(tempfile.mkdtemp(prefix=".new-", dir=folder.parent))
        generate_keys(topology, staging)
        try:
            staging.rename(folder)
        except OSError:   # another launcher of the same topology made them first: theirs are the keys
            shutil.rmtree(staging, ignore_errors=True)
    logger.info("generated CURVE keys for {} in {} (first launch of this topology)", ", ".join(names), folder)
    return folder


# ------------------------------------------------------------------ read


def load_identity(keys_dir: str | Path, name: str, strict: bool = False) -> Identity:
    """Read NAME.key_secret (public and secret key) from `keys_dir`. `strict` (generated
    folders): the secret must be this user's and private, else SecurityError."""
    path = Path(keys_dir) / f"{name}.key_secret"
    public, secret = _load_certificate(path)
    if not secret:
        raise SecurityError(f"{path}: holds no secret key (is it a public certificate?)")
    if strict:
        check_private(path, "the secret key")
    elif stat.S_IMODE(path.stat().st_mode) & 0o077:
        logger.warning("{} is readable by other users; chmod 600 it", path)
    return Identity(name, public, secret)


def load_public_keys(keys_dir: str | Path, names: Iterable[str]) -> dict[str, bytes]:
    """Public keys by party name, from NAME.key in `keys_dir`."""
    return {name: _load_certificate(Path(keys_dir) / f"{name}.key")[0] for name in names}


def _load_certificate(path: Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise SecurityError(f"{path}: cannot load CURVE certificate ({exc}); launch the topology with "
                            "`skippy-zmq launch` / `up` (they make keys on first launch), or run "
                            "`skippy-zmq keys --topology T`; a stage on another host needs the launching "
                            "host's key folder copied to the same path") from exc

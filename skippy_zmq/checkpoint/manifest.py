"""A checkpoint's manifest: every file a stage may need, with its size and sha256, grouped into items.

    MODEL/manifest.json  {"version": 1, "files": {"params/layer_00000/_METADATA": {"bytes": 812,
                          "sha256": "..."}, ...}}

It is written at convert time (CheckpointWriter.finish) and computed for a checkpoint that has none
(`load_manifest(..., build=True)`), so checkpoints converted before it still travel. Each file belongs
to one item (`item_of`): "meta" (model.json, source.json, params/format.json: every stage reads
them), "tokenizer" (the other top-level files: the last stage's constraint engine reads them),
"top" (the final norm), "embed" and "head" (their row blocks), and "layer:N" (a layer's item and its
streamed parts). A stage [start, end) needs `stage_item_names` of them, nothing more; the model's
digest is the hash of the manifest's file table, so the same bytes always have the same digest.

GGUF files beside a checkpoint (random-model --gguf) are sources, not checkpoint: left out.
No sockets, no JAX.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable

from skippy_zmq.config.model import ModelConfig
from skippy_zmq.files.filecheck import read_json_capped

MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20          # ~300k files: far above any checkpoint we write
HASH_BLOCK = 1 << 20                   # bytes read per step while hashing a file
META_FILES = ("model.json", "source.json", "params/format.json")
_LAYER = re.compile(r"params/layer_(\d{5})(\.part\d{3})?/")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ManifestError(ValueError):
    """A manifest is missing, malformed, or disagrees with the files it lists."""


def item_of(relpath: str) -> str | None:
    """The item a checkpoint file belongs to, or None for files that are not part of the checkpoint."""
    if relpath in META_FILES:
        return "meta"
    if (m := _LAYER.match(relpath)) is not None:
        return f"layer:{int(m[1])}"
    for item in ("top", "embed", "head"):
        if relpath.startswith(f"params/{item}/"):
            return item
    top_level = "/" not in relpath
    if top_level and relpath != MANIFEST_FILE and not relpath.startswith(".") and not relpath.endswith(".gguf"):
        return "tokenizer"
    return None


def sha256_file(path: Path) -> str:
    """A file's sha256, read a block at a time (never the whole file in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def build_manifest(model_dir: Path) -> dict[str, Any]:
    """Hash every checkpoint file under `model_dir` (symlinks and other non-regular files refused)."""
    model_dir = Path(model_dir)
    files: dict[str, dict[str, Any]] = {}
    for root, dirs, names in os.walk(model_dir):
        dirs.sort()
        for name in sorted(names):
            path = Path(root) / name
            rel = path.relative_to(model_dir).as_posix()
            if item_of(rel) is None:
                continue
            if path.is_symlink() or not path.is_file():
                raise ManifestError(f"{path}: not a regular file; a checkpoint holds only regular files")
            files[rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    if "model.json" not in files:
        raise ManifestError(f"{model_dir}: no model.json (not a converted model)")
    return {"version": MANIFEST_VERSION, "files": files}


def write_manifest(model_dir: Path) -> dict[str, Any]:
    """Build the manifest and write it beside the checkpoint (atomically: a reader sees all or nothing)."""
    manifest = build_manifest(model_dir)
    tmp = Path(model_dir) / f".{MANIFEST_FILE}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, Path(model_dir) / MANIFEST_FILE)
    return manifest


def load_manifest(model_dir: Path, build: bool = False) -> dict[str, Any]:
    """The checkpoint's manifest, checked; `build`: compute and write it when there is none
    (a checkpoint converted before manifests; an unwritable folder keeps it in memory only)."""
    path = Path(model_dir) / MANIFEST_FILE
    if not path.is_file():
        if not build:
            raise ManifestError(f"{path}: no manifest (run `skippy-zmq manifest --model {model_dir}`)")
        try:
            return write_manifest(model_dir)
        except OSError:
            return build_manifest(model_dir)
    return check_manifest(read_json_capped(path, MANIFEST_FILE, MAX_MANIFEST_BYTES), str(path))


def check_manifest(manifest: Any, where: str) -> dict[str, Any]:
    """A manifest's shape, every field checked (it also arrives over the network)."""
    if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION:
        raise ManifestError(f"{where}: not a version-{MANIFEST_VERSION} manifest")
    files = manifest.get("files")
    if not isinstance(files, dict) or "model.json" not in files:
        raise ManifestError(f"{where}: files: expected a table that lists model.json")
    for rel, entry in files.items():
        if not safe_relpath(rel) or item_of(rel) is None:
            raise ManifestError(f"{where}: files: {rel!r} is not a checkpoint path")
        if not (isinstance(entry, dict) and type(entry.get("bytes")) is int and entry["bytes"] >= 0
                and isinstance(entry.get("sha256"), str) and _SHA256.fullmatch(entry["sha256"])):
            raise ManifestError(f"{where}: files[{rel!r}]: expected {{bytes: int >= 0, sha256: 64 hex}}")
    return manifest


def safe_relpath(rel: Any) -> bool:
    """A relative path that stays inside its folder: no absolute path, no '..', no empty part."""
    return (isinstance(rel, str) and 0 < len(rel) <= 512 and not rel.startswith("/") and "\\" not in rel
            and all(part not in ("", ".", "..") for part in rel.split("/")))


def model_digest(manifest: dict[str, Any]) -> str:
    """The checkpoint's identity: the hash of its file table (paths, sizes and contents)."""
    table = json.dumps(manifest["files"], sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(table).hexdigest()


def stage_item_names(cfg: ModelConfig, start: int, end: int) -> list[str]:
    """The items a stage [start, end) reads (checkpoint.stage_items' choice), "meta" first."""
    # imported here: model.weights imports JAX, which a worker (it checks manifests, never plans
    # stages) would otherwise import at its start, ~1.3 CPU s of every worker process
    from skippy_zmq.model import weights

    shapes = weights.param_shapes(cfg, start, end)
    names = ["meta", *(item for key, item in (("norm", "top"), ("embed", "embed"), ("head", "head"))
                       if key in shapes)]
    if end == cfg.n_layers:
        names.append("tokenizer")
    return names + [f"layer:{i}" for i in range(start, end)]


def item_files(manifest: dict[str, Any], items: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The manifest's entries of the files in `items`."""
    wanted = set(items)
    return {rel: entry for rel, entry in manifest["files"].items() if item_of(rel) in wanted}

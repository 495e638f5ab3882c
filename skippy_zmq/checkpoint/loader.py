"""Load a stage's slice of a converted model: its config and runtime params.

Its own module because it builds on both weights (the description) and
checkpoint (the stored formats), and checkpoint builds on weights: here
neither has to import the other lazily.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from skippy_zmq.config.model import ModelConfig
from skippy_zmq.checkpoint import checkpoint, runtime
from skippy_zmq.model import weights
from skippy_zmq.files.filecheck import ModelFileError, read_json_capped


def model_digest(model_dir: Path) -> str:
    """Identity of a converted model (the source file's hash), for prefix-cache keys. Here, not in
    convert.py: a stage that imported convert for it took the GGUF reader, tokenizers, tqdm and jinja2
    along (0.3-0.5 CPU s of every stage start)."""
    return json.loads((Path(model_dir) / "source.json").read_text())["sha256"]


def load_slice(model_dir: Path, start: int = 0, end: int | None = None, dtype: str = "float32",
               device: Any = None, quantize: str | None = None,
               fmt: str | None = None) -> tuple[ModelConfig, dict[str, Any]]:
    """Config (with the runtime dtype) and runtime params of layers [start, end) of a converted model.

    fmt: the weights format the stage runs, "gguf" | "f32" | "bf16" | "int8" | "q4" (see
    checkpoint.py); it must be the checkpoint's format or a coarser one; "auto": the
    checkpoint's own. None: `quantize` (the older spelling: None for f32, "int8" or "q4").
    Reads only this stage's items; raises checkpoint.CheckpointError for a finer format.
    """
    weights.check_quantize(quantize)
    model_dir = Path(model_dir)
    if not (model_dir / "model.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no model.json (convert a model first: `make model`)")
    cfg = dataclasses.replace(read_model_json(model_dir / "model.json"), dtype=dtype)
    end = cfg.n_layers if end is None else end
    fmt = (quantize or "f32") if fmt is None else checkpoint.resolve_weights(model_dir, fmt)
    return cfg, runtime.load_stage(model_dir, cfg, start, end, fmt, jnp.dtype(dtype), device)


def read_model_json(path: Path) -> ModelConfig:
    """A converted model's model.json; a malformed one is a ModelFileError naming the file."""
    data = read_json_capped(path, "model.json", 1 << 20)
    try:
        return ModelConfig.from_dict(data)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ModelFileError(path, "model.json", None, f"not a model config: {exc!r}") from None

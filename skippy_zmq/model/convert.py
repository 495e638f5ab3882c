"""Import a GGUF file or an HF safetensors directory into our layout:

    OUT/model.json           frozen ModelConfig
    OUT/params/              orbax checkpoint (layers keyed by index; partial restore)
    OUT/tokenizer.json       `tokenizers` tokenizer
    OUT/tokenizer_meta.json  chat template, special ids
    OUT/source.json          what it came from and the model digest
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from loguru import logger
from tqdm import tqdm

from skippy_zmq.config import ModelConfig
from skippy_zmq.fetch import sha256_file
from skippy_zmq.model import weights
# The families and their config reading live in model/families.py; imported here for callers of convert.
from skippy_zmq.model.families import (ConvertError, GGUF_ARCHS, SUPPORTED_HF_TYPES,  # noqa: F401
                                       gguf_model_config, hf_model_config)

SUPPORTED_GGUF_ARCHS = GGUF_ARCHS

# Our per-layer key -> (GGUF suffix, HF suffix)
LAYER_NAMES = {
    "attn_norm": ("attn_norm.weight", "input_layernorm.weight"),
    "wq": ("attn_q.weight", "self_attn.q_proj.weight"),
    "wk": ("attn_k.weight", "self_attn.k_proj.weight"),
    "wv": ("attn_v.weight", "self_attn.v_proj.weight"),
    "wo": ("attn_output.weight", "self_attn.o_proj.weight"),
    "bq": ("attn_q.bias", "self_attn.q_proj.bias"),
    "bk": ("attn_k.bias", "self_attn.k_proj.bias"),
    "bv": ("attn_v.bias", "self_attn.v_proj.bias"),
    "bo": ("attn_output.bias", "self_attn.o_proj.bias"),
    "q_norm": ("attn_q_norm.weight", "self_attn.q_norm.weight"),   # norms: never permuted, never quantised
    "k_norm": ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    "ffn_norm": ("ffn_norm.weight", "post_attention_layernorm.weight"),
    "w_gate": ("ffn_gate.weight", "mlp.gate_proj.weight"),
    "w_up": ("ffn_up.weight", "mlp.up_proj.weight"),
    "w_down": ("ffn_down.weight", "mlp.down_proj.weight"),
}
TOP_NAMES = {"embed": ("token_embd.weight", "model.embed_tokens.weight"),
             "norm": ("output_norm.weight", "model.norm.weight"),
             "head": ("output.weight", "lm_head.weight")}


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary -> HF rotate-half)."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def to_checkpoint_tree(cfg: ModelConfig, get: Callable[[str, str], np.ndarray | None],
                       unpermute: bool) -> dict[str, Any]:
    """Assemble our tree from a lookup `get(kind, our_key)`; kind is 'top' or a layer index.

    Linear weights arrive as [out, in] (PyTorch / GGUF numpy order) and are stored [in, out].
    """
    shapes = weights.param_shapes(cfg)
    tree: dict[str, Any] = {"layers": {}}
    for key in shapes:
        if key == "layers":
            continue
        w = get("top", key)
        if w is None:
            raise ConvertError(f"missing tensor {TOP_NAMES[key][0]!r} / {TOP_NAMES[key][1]!r}")
        tree[key] = w.T if key == "head" else w
    for i, layer_shapes in shapes["layers"].items():
        layer = {}
        for key in layer_shapes:
            w = get(i, key)
            if w is None:
                raise ConvertError(f"missing tensor for layer {i}: {key} "
                                   f"(GGUF blk.{i}.{LAYER_NAMES[key][0]}, HF model.layers.{i}.{LAYER_NAMES[key][1]})")
            if unpermute and key in ("wq", "bq"):
                w = unpermute_rows(w, cfg.n_heads)
            elif unpermute and key in ("wk", "bk"):
                w = unpermute_rows(w, cfg.n_kv_heads)
            layer[key] = np.ascontiguousarray(w.T) if w.ndim == 2 else w
        tree["layers"][i] = layer
    _check_shapes(tree, shapes)
    return tree


def _check_shapes(tree: dict[str, Any], shapes: dict[str, Any], path: str = "") -> None:
    for key, want in shapes.items():
        got = tree[key]
        if isinstance(want, dict):
            _check_shapes(got, want, f"{path}{key}.")
        elif tuple(got.shape) != tuple(want):
            raise ConvertError(f"tensor {path}{key} has shape {tuple(got.shape)}, expected {tuple(want)}")


# ---------------------------------------------------------------- GGUF


def convert_gguf(path: Path, out: Path) -> ModelConfig:
    import gguf
    from gguf import quants

    from skippy_zmq.model.tokenizer import TextTokenizer, tokenizer_from_gguf

    path = Path(path)
    if not path.is_file():
        raise ConvertError(f"{path}: no such file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ConvertError(f"{path} is not a GGUF file (bad magic)")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises assorted errors on truncated files
        raise ConvertError(f"{path}: cannot read GGUF: {exc}") from exc
    cfg = gguf_model_config(reader, name=path.stem)
    tensors = {t.name: t for t in reader.tensors}
    progress = tqdm(total=len(tensors), desc=f"convert {path.name}", unit="tensor")

    def get(where: str, key: str) -> np.ndarray | None:
        name = TOP_NAMES[key][0] if where == "top" else f"blk.{where}.{LAYER_NAMES[key][0]}"
        t = tensors.get(name)
        if t is None:
            return None
        try:
            w = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise ConvertError(f"tensor {name}: cannot dequantise type {t.tensor_type.name}") from exc
        progress.update(1)
        return np.asarray(w, np.float32)

    tree = to_checkpoint_tree(cfg, get, unpermute=cfg.arch == "llama")
    progress.close()
    TextTokenizer(*tokenizer_from_gguf(reader)).save(out)
    _write(out, cfg, tree, {"format": "gguf", "file": path.name, "sha256": sha256_file(path)})
    return cfg


# ---------------------------------------------------------------- HF safetensors


def _hf_tensors(directory: Path) -> Iterator[tuple[str, np.ndarray]]:
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"{directory}: no *.safetensors files")
    for file in files:
        # The flax framework reads bf16, which numpy alone cannot.
        with safe_open(str(file), framework="flax") as f:
            for name in f.keys():
                yield name, np.asarray(f.get_tensor(name), np.float32)


def convert_hf(directory: Path, out: Path) -> ModelConfig:
    from skippy_zmq.model.tokenizer import TextTokenizer

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise ConvertError(f"{directory}: no config.json (expected an HF model directory)")
    cfg = hf_model_config(json.loads((directory / "config.json").read_text()), name=directory.name)
    tensors = dict(tqdm(_hf_tensors(directory), desc=f"read {directory.name}", unit="tensor"))

    def get(where: str, key: str) -> np.ndarray | None:
        name = TOP_NAMES[key][1] if where == "top" else f"model.layers.{where}.{LAYER_NAMES[key][1]}"
        return tensors.get(name)

    tree = to_checkpoint_tree(cfg, get, unpermute=False)
    digest = hashlib.sha256()
    for file in sorted(directory.glob("*.safetensors")):
        digest.update(sha256_file(file).encode())
    TextTokenizer.from_hf_dir(directory).save(out)
    _write(out, cfg, tree, {"format": "hf", "dir": str(directory), "sha256": digest.hexdigest()})
    return cfg


def _write(out: Path, cfg: ModelConfig, tree: dict[str, Any], source: dict[str, Any]) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    logger.info("writing orbax checkpoint to {}", out / "params")
    weights.save_params(out / "params", tree)
    (out / "source.json").write_text(json.dumps(source, indent=2) + "\n")
    cfg.save(out / "model.json")   # written last: its presence means the conversion finished


def model_digest(model_dir: Path) -> str:
    """Identity of a converted model (the source file's hash), for prefix-cache keys."""
    return json.loads((Path(model_dir) / "source.json").read_text())["sha256"]

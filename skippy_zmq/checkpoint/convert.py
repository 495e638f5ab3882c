"""Import a GGUF file or an HF safetensors directory into our layout:

    OUT/model.json           frozen ModelConfig
    OUT/params/              orbax items, one per layer and per row block of the embedding /
                             head, in the --weights format (checkpoint.py; a GGUF's default keeps
                             every tensor in its own type); stages restore their own
    OUT/tokenizer.json       `tokenizers` tokenizer
    OUT/tokenizer_meta.json  chat template, special ids
    OUT/source.json          what it came from and the model digest

The tokenizer (and template) is read and checked before the first weight, and
everything is written into a temporary directory beside OUT, renamed to OUT
only when complete: a failure is a ConvertError and leaves nothing behind.

Conversion streams: one tensor in, one tensor out (the embedding and head in
blocks of rows), so peak memory is about one layer, whatever the model size.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from loguru import logger
from tqdm import tqdm

from skippy_zmq.config.model import ModelConfig
from skippy_zmq.files.fetch import sha256_file
from skippy_zmq.checkpoint import sources
from skippy_zmq.model import weights
from skippy_zmq.checkpoint.checkpoint import CheckpointError, CheckpointWriter, Encoded
from skippy_zmq.checkpoint.formats import KEEP, Blocks, check_format
from skippy_zmq.checkpoint.requant import check_kept_types, report_gguf
from skippy_zmq.files.filecheck import ModelFileError, read_json_capped
from skippy_zmq.files.gguf_layout import read_gguf_layout
# The families and their config reading live in model/families.py; imported here for callers of convert.
from skippy_zmq.checkpoint.families import ConvertError, GGUF_ARCHS, SUPPORTED_HF_TYPES, gguf_model_config, hf_model_config
from skippy_zmq.text.tokenizer import TextTokenizer, tokenizer_from_gguf

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
    # Gemma 3's extra norms, and the names its ffn_norm has (source_key maps our key there)
    "post_attn_norm": ("post_attention_norm.weight", "post_attention_layernorm.weight"),
    "post_ffn_norm": ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"),
    "pre_ffn_norm": ("ffn_norm.weight", "pre_feedforward_layernorm.weight"),
    # Phi-3's fused projections (GGUF keeps them fused too): split into our keys by rows
    "wqkv": ("attn_qkv.weight", "self_attn.qkv_proj.weight"),
    "w_gate_up": ("ffn_up.weight", "mlp.gate_up_proj.weight"),
}
# an MoE layer's router, and each expert matrix's 3-D tensor in llama.cpp (an expert is one slice of it)
ROUTER_NAME = "ffn_gate_inp.weight"
EXPERT_NAMES = {"w_gate": "ffn_gate_exps.weight", "w_up": "ffn_up_exps.weight", "w_down": "ffn_down_exps.weight"}
# Qwen2-MoE's shared expert; its gate is a vector [D] in llama.cpp (ours [1, D] as [out, in])
SHARED_NAMES = {"shared_gate": "ffn_gate_inp_shexp.weight", "shared_w_gate": "ffn_gate_shexp.weight",
                "shared_w_up": "ffn_up_shexp.weight", "shared_w_down": "ffn_down_shexp.weight"}
TOP_NAMES = {"embed": ("token_embd.weight", "model.embed_tokens.weight"),
             "norm": ("output_norm.weight", "model.norm.weight"),
             "head": ("output.weight", "lm_head.weight")}


MIXTRAL_PROJ = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}
HF_PROJ = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


def hf_layer_name(cfg: ModelConfig, key: str) -> str:
    """The HF tensor (under model.layers.N.) holding our layer key. MoE layers as the Hub's files
    (and transformers 5's save_pretrained) keep them: one tensor per expert; Mixtral's under
    block_sparse_moe (w1 gate, w3 up, w2 down), Qwen's under mlp, with Qwen2-MoE's shared expert."""
    moe = "block_sparse_moe" if cfg.arch == "mixtral" else "mlp"
    if (which := weights.expert_of(key)) is not None:
        j, matrix = which
        return f"{moe}.experts.{j}.{(MIXTRAL_PROJ if cfg.arch == 'mixtral' else HF_PROJ)[matrix]}.weight"
    if key == "router":
        return f"{moe}.gate.weight"
    if key == "shared_gate":
        return "mlp.shared_expert_gate.weight"
    if key.startswith("shared_w_"):
        return f"mlp.shared_expert.{HF_PROJ[key[len('shared_'):]]}.weight"
    return LAYER_NAMES[key][1]


def source_key(cfg: ModelConfig, key: str) -> tuple[str, tuple[int, int] | None]:
    """Where our layer key comes from in cfg's family: (LAYER_NAMES key, rows of it or None for all).

    Phi-3: wq, wk, wv are row blocks of qkv_proj ([q | k | v]); w_gate, w_up of gate_up_proj
    ([gate | up], transformers' chunk(2)). Gemma 3: our ffn_norm is its pre_feedforward_layernorm.
    """
    q, kv, f = cfg.n_heads * cfg.head_dim, cfg.kv_width, cfg.ffn_dim
    if cfg.arch == "phi3":
        rows = {"wq": ("wqkv", (0, q)), "wk": ("wqkv", (q, q + kv)), "wv": ("wqkv", (q + kv, q + 2 * kv)),
                "w_gate": ("w_gate_up", (0, f)), "w_up": ("w_gate_up", (f, 2 * f))}
        if key in rows:
            return rows[key]
    if cfg.arch == "gemma3" and key == "ffn_norm":
        return "pre_ffn_norm", None
    return key, None


def fused_rows(cfg: ModelConfig, fused: str) -> int:
    return cfg.n_heads * cfg.head_dim + 2 * cfg.kv_width if fused == "wqkv" else 2 * cfg.ffn_dim


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary -> HF rotate-half)."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermuted(w: np.ndarray | Encoded | Blocks, n_heads: int) -> np.ndarray | Encoded | Blocks:
    """unpermute_rows for a float tensor, an exact grid (levels and scales) or GGUF blocks (rows of
    blocks): it moves whole rows, so it is exact for every type."""
    if isinstance(w, Encoded):
        return Encoded(w.fmt, *(unpermute_rows(a, n_heads) for a in (w.q, w.d, w.m)))
    if isinstance(w, Blocks):
        return Blocks(w.kind, unpermute_rows(w.raw, n_heads))
    return unpermute_rows(w, n_heads)


def stream_checkpoint(cfg: ModelConfig, src: Any, name_of: Callable[[str | int, str], str],
                      writer: CheckpointWriter, unpermute: bool) -> None:
    """Read tensor by tensor (the embedding and head in row blocks) from `src` into `writer`.

    `src` is a sources.SafetensorsSource or GGUFSource; `name_of(where, key)` names our key
    there (where: "top" or a layer index). Tensors arrive [out, in] and go in that way.
    """
    def need(where: str | int, key: str) -> str:
        name = name_of(where, key)
        if src.shape(name) is None:
            raise ConvertError(f"missing tensor {name!r} (our {key}{'' if where == 'top' else f' of layer {where}'})")
        return name

    heads = {"wq": cfg.n_heads, "bq": cfg.n_heads, "wk": cfg.n_kv_heads, "bk": cfg.n_kv_heads}
    # Gemma's norms compute x * (1 + w): an HF file holds w, a GGUF (llama.cpp) 1 + w; we keep 1 + w
    shift = 1.0 if cfg.arch == "gemma3" and isinstance(src, sources.SafetensorsSource) else 0.0
    progress = tqdm(total=cfg.n_layers + 2, desc=f"convert {cfg.name}", unit="item")
    writer.add_top("norm", src.read(need("top", "norm")) + np.float32(shift))
    for key in ("embed",) + (() if cfg.tied_embeddings else ("head",)):
        name = need("top", key)
        for r in range(0, cfg.vocab_size, writer.rows_per_block):
            writer.add_rows(key, r, src.read(name, r, r + writer.rows_per_block))
        progress.update(1)
    for i in range(cfg.n_layers):
        for key, shape in weights.layer_shapes(cfg, i).items():
            where, rows = source_key(cfg, key)
            name = need(i, where)
            if (which := weights.expert_of(key)) is not None and len(src.shape(name)) == 3:
                w = sources.read_part(src, name, which[0])    # GGUF: one expert of a 3-D `_exps` tensor
            else:
                w = src.read(name, *rows) if rows else src.read(name)
            if rows and src.shape(name)[0] != fused_rows(cfg, where):
                raise ConvertError(f"tensor {name!r} has {src.shape(name)[0]} rows, the config says "
                                   f"{fused_rows(cfg, where)} (our {key} is rows {rows[0]}..{rows[1]} of it)")
            if key == "shared_gate" and w.ndim == 1:     # GGUF keeps Qwen2-MoE's shared gate as a vector
                w = w[None]
            if len(shape) == 1 and key.endswith("norm") and shift:
                w = w + np.float32(shift)
            writer.put_layer_tensor(i, key, _unpermuted(w, heads[key]) if unpermute and key in heads else w)
            del w
        writer.end_layer(i)
        progress.update(1)
    progress.close()


# ---------------------------------------------------------------- GGUF


def convert_gguf(path: Path, out: Path, fmt: str | None = None) -> ModelConfig:
    """GGUF -> our checkpoint. `fmt` None ("gguf"): every tensor in its own type and blocks (model/ggml.py),
    a type we do not keep refused by name before any weight is written; "f32" | "bf16" | "int8" | "q4":
    dequantised or requantised (Q4_0 / Q4_1 / Q8_0 blocks keep their levels when `fmt` holds them),
    logged and recorded in source.json as such.

    Every failure that is the file's is a ModelFileError naming it (a ConvertError)."""
    fmt = check_format(fmt or KEEP)

    path = Path(path)
    if not path.is_file():
        raise ConvertError(f"{path}: no such file")
    # every length and offset checked first (a bad file is a ModelFileError); its fields and tensors
    # are then read from that layout, never through gguf.GGUFReader (slow on a real vocabulary)
    reader = sources.GGUFFile(read_gguf_layout(path))
    with naming_the_file(path, "metadata"):
        cfg = gguf_model_config(reader, name=path.stem)
    src = sources.GGUFSource(path, reader)
    check_embedding(path, cfg, src, TOP_NAMES["embed"][0])
    with naming_the_file(path, "tensors"):
        check_kept_types(src, fmt)
    tokenizer = _read_tokenizer(path, lambda: TextTokenizer(*tokenizer_from_gguf(reader)))

    def name_of(where: str | int, key: str) -> str:
        if where == "top":
            return TOP_NAMES[key][0]
        which = weights.expert_of(key)
        if which:
            return f"blk.{where}.{EXPERT_NAMES[which[1]]}"
        return f"blk.{where}.{ROUTER_NAME if key == 'router' else SHARED_NAMES.get(key) or LAYER_NAMES[key][0]}"

    source = {"format": "gguf", "file": path.name, "weights": fmt, "sha256": sha256_file(path)}
    with naming_the_file(path, "tensors"):
        _convert(cfg, src, name_of, out, fmt, cfg.arch in ("llama", "mixtral"), source, tokenizer,
                 lambda work: report_gguf(src, fmt, work, TOP_NAMES))
    return cfg


@contextlib.contextmanager
def naming_the_file(path: Path, field: str) -> Iterator[None]:
    """Turn a conversion failure that comes from `path`'s contents into a ModelFileError naming it
    (and `field`: "metadata" for the model's fields, "tensors" for names and shapes)."""
    try:
        yield
    except ModelFileError:
        raise
    except (ConvertError, CheckpointError, sources.SourceError) as exc:
        raise ModelFileError(path, field, None, str(exc)) from exc
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as exc:
        raise ModelFileError(path, field, None, f"a bad value: {exc!r}") from exc


def check_embedding(path: Path, cfg: ModelConfig, src: Any, name: str) -> None:
    """The metadata's vocabulary and width against the embedding tensor, before anything is sized by
    them (a tokenizer of `vocab_size` words, the checkpoint's row blocks)."""
    shape = src.shape(name)
    if shape != (cfg.vocab_size, cfg.d_model):
        raise ModelFileError(path, "metadata", None, f"vocab_size {cfg.vocab_size} x hidden size {cfg.d_model} "
                                                     f"does not match tensor {name!r} of shape {shape}")


# ---------------------------------------------------------------- HF safetensors


def convert_hf(directory: Path, out: Path, fmt: str | None = None) -> ModelConfig:
    """HF safetensors directory (f32, f16 or bf16) -> our checkpoint in `fmt` (default f32)."""
    fmt = check_format(fmt or "f32")
    if fmt == KEEP:
        raise ConvertError(f"--weights {KEEP} keeps a GGUF file's block types; an HF directory has none "
                           "(use f32, bf16, int8 or q4)")
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise ConvertError(f"{directory}: no config.json (expected an HF model directory)")
    config = read_json_capped(directory / "config.json", "config.json")
    with naming_the_file(directory / "config.json", "metadata"):
        cfg = hf_model_config(config, name=directory.name)
    with naming_the_file(directory, "safetensors"):
        src = sources.SafetensorsSource(directory)    # headers checked (ModelFileError), no data read
    check_embedding(directory / "config.json", cfg, src, TOP_NAMES["embed"][1])
    tokenizer = _read_tokenizer(directory / "tokenizer.json", lambda: TextTokenizer.from_hf_dir(directory))

    def name_of(where: str | int, key: str) -> str:
        return TOP_NAMES[key][1] if where == "top" else f"model.layers.{where}.{hf_layer_name(cfg, key)}"

    digest = hashlib.sha256()
    for file in src.files:
        digest.update(sha256_file(file).encode())
    source = {"format": "hf", "dir": str(directory), "weights": fmt, "sha256": digest.hexdigest()}
    with naming_the_file(directory, "tensors"):
        _convert(cfg, src, name_of, out, fmt, False, source, tokenizer)
    return cfg


def _read_tokenizer(where: Path, build: Callable[[], TextTokenizer]) -> TextTokenizer:
    """The tokenizer (and template), read and checked before any weight; a failure names the file."""
    try:
        return build()
    except ConvertError:
        raise
    except Exception as exc:  # tokenizers and the GGUF reader raise assorted errors on bad input
        raise ModelFileError(where, "tokenizer", None, f"cannot build the tokenizer: {exc}") from exc


def _convert(cfg: ModelConfig, src: Any, name_of: Callable[[str | int, str], str], out: Path, fmt: str,
             unpermute: bool, source: dict[str, Any], tokenizer: TextTokenizer,
             report: Callable[[Path], dict[str, Any]] | None = None) -> None:
    """Write the checkpoint into a temporary directory beside `out`, renamed into place only when
    complete: a failure leaves no partial directory (and an earlier `out` as it was). `report(work)`,
    after the weights are written: what the conversion kept and changed, added to source.json."""
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        writer = CheckpointWriter(work, cfg, fmt)
        logger.info("writing a {} orbax checkpoint to {}, item by item", fmt, out / "params")
        tokenizer.save(work)
        stream_checkpoint(cfg, src, name_of, writer, unpermute)
        if report is not None:
            source = {**source, **report(work)}
        writer.finish(source)   # model.json last: its presence means the conversion finished
        _replace_dir(work, out)
    except (CheckpointError, sources.SourceError) as exc:
        raise ConvertError(str(exc)) from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _replace_dir(new: Path, out: Path) -> None:
    """Rename `new` to `out`, an existing `out` moved aside first and removed after."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        out.rename(old / out.name)
    new.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)



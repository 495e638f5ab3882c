"""A GGUF file streamed from Q4_1 blocks (formats.Encoded, fmt "q4") that llama.cpp runs: the same
blocks our checkpoint holds (random_model.py makes both), or their values as F16 (`tensor_type
"f16"`), the input llama.cpp's `llama-quantize` makes its recipes from (Q4_K_M, Q6_K, IQ4_XS...;
bench/recipes.py). Test and bench tooling: the runtime reads GGUF files (checkpoint/convert.py),
never writes them.

Tensor infos are written up front (shapes are known from the config), then each
tensor's data as it is generated, so nothing but the current tensor is in memory.
What llama.cpp expects, and this writes:

- arch `llama` (Llama, Mistral): Q and K rows in llama.cpp's rotary order, i.e.
  permuted the way llama.cpp's HF converter permutes them (our convert.py's
  `unpermute_rows` is the inverse); llama3 rope scaling as a `rope_freqs` tensor
  of per-frequency divisors. Arch `qwen2`: rows as they are, q/k/v biases.
- norms and biases f32, every 2-D weight Q4_1 or F16 (the embedding too; an
  untied head as `output.weight`); an MoE router f32 (llama.cpp keeps it so).
- `tokenizer.ggml.model = "no_vocab"` with `{arch}.vocab_size`: prompts go in as ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:   # checkpoint.formats imports JAX, which the CLI parser (random_cli, through random_model)
    from skippy_zmq.checkpoint.formats import Encoded   # must not: a worker or driver process needs none

BLOCK = 32        # weights per Q4_1 block
Q4_1_BYTES = 20   # per block of 32: f16 d, f16 m, 16 bytes of nibbles
TENSOR_TYPES = ("q4_1", "f16")   # what the 2-D weights are written as
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "mixtral": "llama", "qwen3_moe": "qwen3moe",
             "qwen2_moe": "qwen2moe"}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to make: where it goes in our tree ("top" or a layer index, key) and its GGUF name/shape."""

    where: str
    key: str
    gguf_name: str
    shape: tuple[int, ...]     # numpy / GGUF order: [out, in] for 2-D
    part: int = -1             # an expert: its slice of the GGUF tensor [parts, out, in]
    parts: int = 0
    f32: bool = False          # stored as f32 in the GGUF (an MoE router, as llama.cpp keeps it)

    @property
    def is_matrix(self) -> bool:
        return len(self.shape) == 2

    @property
    def gguf_shape(self) -> tuple[int, ...]:
        if self.key == "shared_gate":
            return self.shape[1:]
        return (self.parts, *self.shape) if self.parts else self.shape


def q4_1_bytes(t: Encoded) -> np.ndarray:
    """GGUF Q4_1 data, uint8 [rows, cols / 32 * 20]: per block d, m, then byte j = level j | level j+16 << 4."""
    rows, cols = t.shape
    nb = cols // BLOCK
    lv = t.q.reshape(rows, nb, BLOCK)
    qs = lv[..., :BLOCK // 2] | (lv[..., BLOCK // 2:] << np.uint8(4))
    d = t.d.reshape(rows, nb, 1).view(np.uint8)
    m = t.m.reshape(rows, nb, 1).view(np.uint8)
    return np.concatenate([d, m, qs], axis=-1).reshape(rows, nb * Q4_1_BYTES)


def rotary_row_order(rows: int, n_heads: int) -> np.ndarray:
    """Row order of llama.cpp's Q/K permutation: gguf_rows = hf_rows[order] (per head: the two halves interleaved)."""
    head_dim = rows // n_heads
    return np.arange(rows).reshape(n_heads, 2, head_dim // 2).swapaxes(1, 2).reshape(rows)


def llama3_rope_factors(cfg: Any) -> np.ndarray:
    """llama.cpp's `rope_freqs` for llama3 scaling, as its HF converter computes them: per frequency,
    1 (short wavelengths), `factor` (long ones) or the smooth divisor between."""
    dim = cfg.head_dim
    freqs = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old = cfg.rope_original_max_pos
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _nbytes(spec: TensorSpec, tensor_type: str) -> int:
    n = max(1, spec.parts)
    if spec.is_matrix and not spec.f32:
        rows, cols = spec.shape
        return n * rows * cols * 2 if tensor_type == "f16" else n * rows * cols // BLOCK * Q4_1_BYTES
    return n * 4 * int(np.prod(spec.shape))


def matrix_bytes(tensor: Encoded, tensor_type: str) -> np.ndarray:
    """A matrix's GGUF data: Q4_1 blocks, or its values (q * d + m, exact in f32) rounded to f16."""
    if tensor_type == "f16":
        from skippy_zmq.checkpoint.formats import dequantize_grid

        return dequantize_grid(tensor).astype(np.float16)
    return q4_1_bytes(tensor)


class GGUFStream:
    """GGUFStream(path, cfg, specs, name[, tensor_type]); then write(spec, tensor) for every spec in
    order; then close()."""

    def __init__(self, path: Path, cfg: Any, specs: list[TensorSpec], name: str, tensor_type: str = "q4_1") -> None:
        import gguf

        if tensor_type not in TENSOR_TYPES:
            raise ValueError(f"GGUF tensor type must be one of {TENSOR_TYPES}, got {tensor_type!r}")
        self.cfg, self.tensor_type = cfg, tensor_type
        self.arch = GGUF_ARCH[cfg.arch]
        self.permute = self.arch == "llama"
        self.writer = gguf.GGUFWriter(str(path), self.arch)
        self._metadata(name)
        types = gguf.GGMLQuantizationType
        matrix, F32 = types.F16 if tensor_type == "f16" else types.Q4_1, types.F32
        factors = llama3_rope_factors(cfg) if cfg.rope_type == "llama3" else None
        if factors is not None:
            self.writer.add_tensor_info("rope_freqs.weight", factors.shape, np.float32, factors.nbytes, F32)
        for spec in specs:
            if spec.part > 0:
                continue          # an expert after the first: the same 3-D tensor
            self.writer.add_tensor_info(spec.gguf_name, spec.gguf_shape, np.float32, _nbytes(spec, tensor_type),
                                        matrix if spec.is_matrix and not spec.f32 else F32)
        self.pending = [s.gguf_name for s in specs if s.part <= 0]
        self.parts: list[np.ndarray] = []    # a 3-D expert tensor's slices so far
        self.writer.write_header_to_file()
        self.writer.write_kv_data_to_file()
        self.writer.write_ti_data_to_file()
        if factors is not None:
            self.writer.write_tensor_data(factors)

    def _metadata(self, name: str) -> None:
        import gguf

        w, cfg = self.writer, self.cfg
        w.add_name(name)
        w.add_context_length(cfg.max_seq_len)
        w.add_embedding_length(cfg.d_model)
        w.add_block_count(cfg.n_layers)
        w.add_feed_forward_length(cfg.ffn_dim)
        w.add_head_count(cfg.n_heads)
        w.add_head_count_kv(cfg.n_kv_heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_layer_norm_rms_eps(cfg.norm_eps)
        w.add_vocab_size(cfg.vocab_size)
        file_type = gguf.LlamaFileType
        w.add_file_type(file_type.MOSTLY_F16 if self.tensor_type == "f16" else file_type.MOSTLY_Q4_1)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_tokenizer_model("no_vocab")
        if cfg.n_experts:   # llama.cpp renormalises the top k of qwen3moe and llama (Mixtral), never qwen2moe's
            qwen2 = self.arch == "qwen2moe"
            if cfg.norm_topk_prob == qwen2 or cfg.dense_layers or bool(cfg.shared_ffn_dim) != qwen2:
                raise ValueError("llama.cpp's MoE: every layer routed; qwen3moe and llama renormalise the top k and "
                                 "have no shared expert, qwen2moe does not renormalise and has one")
            w.add_expert_count(cfg.n_experts)
            w.add_expert_used_count(cfg.n_experts_used)
            w.add_expert_feed_forward_length(cfg.expert_ffn_dim)
            if qwen2:
                w.add_expert_shared_feed_forward_length(cfg.shared_ffn_dim)

    def write(self, spec: TensorSpec, tensor: Encoded | np.ndarray) -> None:
        from skippy_zmq.checkpoint.formats import Encoded

        if not self.pending or self.pending[0] != spec.gguf_name or spec.part not in (-1, len(self.parts)):
            raise ValueError(f"GGUF tensors must come in order: expected {self.pending[:1]} part {len(self.parts)}, "
                             f"got {spec.gguf_name} part {spec.part}")
        if spec.f32 and isinstance(tensor, Encoded):
            from skippy_zmq.checkpoint.formats import dequantize_grid

            tensor = dequantize_grid(tensor)       # the same values, as f32
        if spec.parts:                             # an expert: the 3-D tensor goes out once all are here
            self.parts.append(self._data(tensor))
            if len(self.parts) < spec.parts:
                return
            data, self.parts = np.concatenate(self.parts), []
            self.pending.pop(0)
            self.writer.write_tensor_data(data)
            return
        self.pending.pop(0)
        if self.permute and spec.key in ("wq", "wk", "bq", "bk"):
            heads = self.cfg.n_heads if spec.key in ("wq", "bq") else self.cfg.n_kv_heads
            order = rotary_row_order(spec.shape[0], heads)
            tensor = Encoded(tensor.fmt, tensor.q[order], tensor.d[order], tensor.m[order]) \
                if isinstance(tensor, Encoded) else tensor[order]
        self.writer.write_tensor_data(self._data(tensor))

    def _data(self, tensor: Encoded | np.ndarray) -> np.ndarray:
        from skippy_zmq.checkpoint.formats import Encoded

        if isinstance(tensor, Encoded):
            return matrix_bytes(tensor, self.tensor_type)
        return np.ascontiguousarray(tensor, np.float32)

    def close(self) -> None:
        if self.pending:
            raise ValueError(f"GGUF closed with {len(self.pending)} tensors unwritten (first {self.pending[0]})")
        self.writer.close()

"""Frozen, hashable configuration dataclasses. Imports nothing of ours.

Frozen so they can be static arguments to jitted functions and keys of
compile caches.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3", "longrope")   # model/rope.py turns each into inverse frequencies


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3/4).

    Fields after `name` came with more families; their defaults are the plain
    Llama math, so model.json files written before them load unchanged.
    """

    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float
    norm_eps: float
    tied_embeddings: bool
    max_seq_len: int
    attn_bias: bool = False
    dtype: str = "float32"
    bos_id: int = -1
    eos_ids: tuple[int, ...] = ()
    name: str = ""
    rope_type: str = "default"              # one of ROPE_TYPES
    rope_factor: float = 1.0                # linear and llama3: how far the context was stretched
    rope_low_freq_factor: float = 1.0       # llama3 only
    rope_high_freq_factor: float = 4.0      # llama3 only
    rope_original_max_pos: int = 0          # llama3 only: the pretraining context
    rope_freq_factors: tuple[float, ...] = ()   # GGUF rope_freqs: inv_freq[i] is divided by it (head_dim / 2)
    attn_out_bias: bool = False             # a bias on the output projection (Llama attention_bias)
    qk_norm: bool = False                   # Qwen3: RMSNorm of each q and k head over head_dim, before rope
    sliding_window: int = 0                 # 0: full causal; else a layer sees only the last `sliding_window` keys
    full_attention_layers: tuple[int, ...] = ()   # layers (global indices) that attend fully despite the window
    ffn_act: str = "silu"                   # "silu" (SwiGLU) | "gelu_tanh" (Gemma's GeGLU, gelu_pytorch_tanh)
    sandwich_norms: bool = False            # Gemma: norms after attention and MLP too (post_attn_norm, post_ffn_norm)
    embed_scale: float = 1.0                # Gemma: embeddings times sqrt(d_model), in the compute dtype
    attn_scale: float = 0.0                 # score scale; 0: 1 / sqrt(head_dim) (Gemma: query_pre_attn_scalar ** -0.5)
    final_softcap: float = 0.0              # 0: none; else logits -> cap * tanh(logits / cap)
    rope_local_theta: float = 0.0           # Gemma: windowed layers use default rope at this base (0: the global rope)
    rotary_dim: int = 0                     # partial rotary (Phi-4-mini): the first rotary_dim dims rotate; 0: head_dim
    rope_attn_factor: float = 1.0           # longrope: cos and sin are multiplied by it
    rope_long_freq_factors: tuple[float, ...] = ()   # longrope: divisors for positions >= rope_original_max_pos
    # Mixture of experts (Qwen3-MoE, Mixtral, Qwen2-MoE): 0 experts is a dense model
    n_experts: int = 0                      # routed experts per MoE layer
    n_experts_used: int = 0                 # top-k experts per token
    expert_ffn_dim: int = 0                 # each routed expert's intermediate size
    norm_topk_prob: bool = False            # renormalise the top-k routing weights to sum to 1
    shared_ffn_dim: int = 0                 # Qwen2-MoE: a shared expert (gated by sigmoid) of this size; 0: none
    dense_layers: tuple[int, ...] = ()      # layers (global indices) with the dense MLP (ffn_dim) in an MoE model

    def __post_init__(self) -> None:
        problems = []
        for key in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "max_seq_len"):
            if getattr(self, key) <= 0:
                problems.append(f"{key} must be positive, got {getattr(self, key)}")
        if self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            problems.append(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.rope_type not in ROPE_TYPES:
            problems.append(f"rope_type must be one of {', '.join(ROPE_TYPES)}, got {self.rope_type!r}")
        for key in ("rope_freq_factors", "rope_long_freq_factors"):
            if getattr(self, key) and len(getattr(self, key)) != self.rope_dim // 2:
                problems.append(f"{key} has {len(getattr(self, key))} entries, "
                                f"expected rotary dims / 2 = {self.rope_dim // 2}")
        if not 0 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            problems.append(f"rotary_dim must be even and in 0..head_dim, got {self.rotary_dim}")
        if self.ffn_act not in ("silu", "gelu_tanh"):
            problems.append(f"ffn_act must be silu or gelu_tanh, got {self.ffn_act!r}")
        if self.sliding_window < 0:
            problems.append(f"sliding_window must be >= 0, got {self.sliding_window}")
        if self.n_experts and not (0 < self.n_experts_used <= self.n_experts and self.expert_ffn_dim > 0):
            problems.append(f"an MoE config needs 0 < n_experts_used <= n_experts and expert_ffn_dim > 0, got "
                            f"{self.n_experts_used} of {self.n_experts}, expert_ffn_dim {self.expert_ffn_dim}")
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))

    @property
    def rope_dim(self) -> int:
        """How many dims of a head rotate (head_dim unless partial rotary)."""
        return self.rotary_dim or self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` routes to experts (else its MLP is dense, ffn_dim wide)."""
        return self.n_experts > 0 and layer not in self.dense_layers

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["eos_ids"] = list(self.eos_ids)
        out["rope_freq_factors"] = list(self.rope_freq_factors)
        out["full_attention_layers"] = list(self.full_attention_layers)
        out["rope_long_freq_factors"] = list(self.rope_long_freq_factors)
        out["dense_layers"] = list(self.dense_layers)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys: {', '.join(unknown)}")
        data = dict(data)
        if "eos_ids" in data:
            data["eos_ids"] = tuple(int(x) for x in data["eos_ids"])
        for key in ("rope_freq_factors", "rope_long_freq_factors"):
            if key in data:
                data[key] = tuple(float(x) for x in data[key])
        for key in ("full_attention_layers", "dense_layers"):
            if key in data:
                data[key] = tuple(int(x) for x in data[key])
        return cls(**data)

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "ModelConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))


_SHORT_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


# Positions an arena holds beyond its capacity, never attended to: a step that read a whole arena
# (attention length == arena length) ran 2.2-3.6x slower on XLA:CPU than one reading all but its last
# position (scripts/attn_arena.py measures it side by side).
KV_SPARE_SLOTS = 1


@dataclass(frozen=True)
class KVConfig:
    """Per-stage KV arena: `lanes` sessions of `capacity` positions each, values in `dtype`.

    `dtype` also takes the topology's short names (f32, bf16, f16), kept as the long ones.
    """

    lanes: int = 8
    capacity: int = 2048
    dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _SHORT_DTYPES.get(self.dtype, self.dtype))
        if self.lanes <= 0 or self.capacity <= 0:
            raise ValueError(f"invalid KVConfig: lanes and capacity must be positive, "
                             f"got {self.lanes} and {self.capacity}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"invalid KVConfig: dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


# A DECODE with several rows pads them all to its longest verify window; the driver holds rows x
# window to this many padded tokens (driver/scheduler.py), so the stages know which shapes can come.
BATCH_TOKENS = 16
_GROUP_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def widest_window(group: int, window_lens: tuple[int, ...], batch_tokens: int = BATCH_TOKENS) -> int:
    """The longest window bucket a DECODE of `group` rows may carry: rows (rounded up to a power of
    two) x window within batch_tokens; one row may use any window."""
    rows = next((n for n in _GROUP_ROWS if n >= group), group)
    return max([n for n in window_lens if rows * n <= max(batch_tokens, rows)] or [1])


def decode_shapes(decode_rows: tuple[int, ...], windows: tuple[int, ...],
                  batch_tokens: int = BATCH_TOKENS) -> tuple[tuple[int, int], ...]:
    """Every (rows, tokens) a DECODE can reach a stage with: each row bucket with one token a row,
    and with each verify window (`windows`, > 1 token) that the driver lets a group of that many rows
    carry (the smallest group padded to a bucket is the one allowed the widest window)."""
    shapes, below = [], 0
    for r in decode_rows:
        widest = widest_window(below + 1, tuple(sorted({1, *windows})), batch_tokens)
        shapes += [(r, 1)] + [(r, t) for t in windows if t <= widest]
        below = r
    return tuple(sorted(shapes, key=lambda s: (s[0] * s[1], s)))


@dataclass(frozen=True)
class Buckets:
    """Shape buckets so the steady state never recompiles."""

    prefill_chunks: tuple[int, ...] = (16, 64, 256)
    decode_rows: tuple[int, ...] = (1, 2, 4, 8, 16)
    window_lens: tuple[int, ...] = (1, 2, 4, 8, 16)   # tokens per row of a DECODE (a verify window: k+1)
    attn_lens: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)

    def chunk_for(self, n: int) -> int:
        """Smallest chunk bucket holding n tokens (callers split longer runs)."""
        for size in self.prefill_chunks:
            if n <= size:
                return size
        return self.prefill_chunks[-1]

    def window_for(self, n: int) -> int:
        for size in self.window_lens:
            if n <= size:
                return size
        raise ValueError(f"a row of {n} tokens exceeds the largest window {self.window_lens[-1]}")

    def rows_for(self, n: int) -> int:
        for size in self.decode_rows:
            if n <= size:
                return size
        raise ValueError(f"{n} decode rows exceed the largest bucket {self.decode_rows[-1]}")

    def attn_for(self, n: int, capacity: int) -> int:
        for size in self.attn_lens:
            if n <= size and size <= capacity:
                return size
        return capacity

    def attn_sizes(self, capacity: int, upto: int | None = None) -> tuple[int, ...]:
        """The attention lengths a step can use for sequences of up to `upto` positions (default:
        the capacity), smallest first: every bucket attn_for can return on the way there."""
        upto = capacity if upto is None else max(1, min(upto, capacity))
        out = []
        for size in sorted({b for b in self.attn_lens if b <= capacity} | {capacity}):
            out.append(size)
            if size >= upto:
                break
        return tuple(out)

    @classmethod
    def for_stage(cls, prefill_chunk: int, lanes: int, capacity: int) -> Buckets:
        """Prefill chunks up to the driver's chunk, decode rows up to the stage's lanes. A chunk never
        exceeds the stage's KV capacity: a 256 chunk over a 128-position cache cannot compile (its KV
        write is a dynamic_update_slice larger than the cache), and no prompt that fits needs it."""
        chunk = min(prefill_chunk, capacity)
        chunks = tuple(c for c in (16, 64, 256, 512, 1024) if c < chunk) + (chunk,)
        rows = tuple(r for r in (1, 2, 4, 8, 16, 32, 64) if r < lanes) + (lanes,)
        return cls(prefill_chunks=tuple(sorted(set(chunks))), decode_rows=tuple(sorted(set(rows))))

    def spec_windows(self, max_draft: int) -> tuple[int, ...]:
        """The verify windows (> 1 token) a driver drafting up to max_draft tokens sends (0: none)."""
        return tuple(n for n in self.window_lens if 1 < n <= max_draft + 1) if max_draft > 0 else ()

    def step_shapes(self, capacity: int, max_draft: int) -> int:
        """How many step shapes a warmed stage has compiled: every prefill chunk and every decode shape
        (decode_shapes) at every attention length up to the capacity."""
        decode = decode_shapes(self.decode_rows, self.spec_windows(max_draft))
        return len(self.attn_sizes(capacity)) * (len(self.prefill_chunks) + len(decode))

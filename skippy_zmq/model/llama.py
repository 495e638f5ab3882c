"""Llama-family decoder as pure JAX functions over parameter pytrees.

`forward_slice` runs layers [start, end) of the model for a batch of rows
(sessions), each row a run of T tokens at absolute positions. With
`start == 0` the input is token ids, otherwise activations; with
`end == n_layers` the output can be logits (final norm + head).

Parameter layout (linear weights stored as [in, out] so that y = x @ w):
    {"embed": [V, D],                      # when first, or last with a tied head
     "layers": ({"attn_norm", "wq", "wk", "wv", "wo", ["bq", "bk", "bv"],
                 "ffn_norm", "w_gate", "w_up", "w_down"}, ...),   # end-start dicts
     "norm": [D], ["head": [D, V]]}       # when last ("head" only if untied, or int8)

Any linear weight may instead be a QTensor (model/quant.py: weight-only int8);
every matmul goes through `dense`, which handles both.

Rows that are padding carry position == capacity: their KV writes fall out of
bounds and are dropped by the scatter, so padding never touches a real lane.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from skippy_zmq.config import ModelConfig
from skippy_zmq.model.quant import dense

Params = dict[str, Any]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per-layer K and V arenas, each [lanes, capacity, n_kv_heads, head_dim].

    One buffer per layer: a single stacked buffer measured ~2x slower on CPU
    because every update then rewrites through one huge array.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def lanes(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)

    @classmethod
    def create(cls, cfg: ModelConfig, n_layers: int, lanes: int, capacity: int,
               dtype: Any = jnp.float32, device: Any = None) -> "KVCache":
        shape = (lanes, capacity, cfg.n_kv_heads, cfg.head_dim)
        make = functools.partial(jnp.zeros, shape, dtype, device=device)
        return cls(k=tuple(make() for _ in range(n_layers)), v=tuple(make() for _ in range(n_layers)))


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin of shape [B, T, head_dim] in the HF rotate-half layout."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, heads, hd]; cos/sin: [B, T, hd]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


def attention(p: Params, x: jax.Array, ck: jax.Array, cv: jax.Array, positions: jax.Array,
              lanes: jax.Array, rope: tuple[jax.Array, jax.Array], attn_len: int,
              cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    b, t, _ = x.shape
    h, kvh, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q, k, v = dense(x, p["wq"]), dense(x, p["wk"]), dense(x, p["wv"])
    if "bq" in p:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    q = apply_rope(q.reshape(b, t, h, hd), *rope)
    k = apply_rope(k.reshape(b, t, kvh, hd), *rope)
    v = v.reshape(b, t, kvh, hd)
    # Write this step's K/V at (lane, absolute position); padding rows are dropped.
    ck = ck.at[lanes[:, None], positions].set(k.astype(ck.dtype), mode="drop")
    cv = cv.at[lanes[:, None], positions].set(v.astype(cv.dtype), mode="drop")
    keys = ck[lanes, :attn_len].astype(x.dtype)   # [B, L, kvh, hd]
    vals = cv[lanes, :attn_len].astype(x.dtype)
    qg = q.reshape(b, t, kvh, h // kvh, hd)
    scores = jnp.einsum("btkgd,blkd->bkgtl", qg, keys, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / (hd ** 0.5))
    causal = jnp.arange(attn_len)[None, None, :] <= positions[:, :, None]  # [B, T, L]
    scores = jnp.where(causal[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bkgtl,blkd->btkgd", probs, vals).reshape(b, t, h * hd)
    return dense(out, p["wo"]), ck, cv


def mlp(p: Params, x: jax.Array) -> jax.Array:
    return dense(jax.nn.silu(dense(x, p["w_gate"])) * dense(x, p["w_up"]), p["w_down"])


def head(params: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    x = rms_norm(x, params["norm"], cfg.norm_eps)
    if "head" in params:
        return dense(x, params["head"]).astype(jnp.float32)
    return jnp.einsum("...d,vd->...v", x, params["embed"], preferred_element_type=jnp.float32)


def forward_slice(params: Params, kv: KVCache, inputs: jax.Array, positions: jax.Array,
                  lanes: jax.Array, *, cfg: ModelConfig, start: int, end: int, attn_len: int,
                  output: str = "hidden") -> tuple[jax.Array | None, KVCache]:
    """Run layers [start, end) on `inputs` ([B, T] ids if start == 0, else [B, T, D]).

    output: "hidden" -> [B, T, D] activations; "logits" -> [B, V] float32 logits
    of each row's last token (needs end == n_layers); "none" -> KV only.
    """
    dtype = jnp.dtype(cfg.dtype)
    x = params["embed"][inputs].astype(dtype) if start == 0 else inputs.astype(dtype)
    rope = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
    ks, vs = list(kv.k), list(kv.v)
    for i, p in enumerate(params["layers"]):
        a, ks[i], vs[i] = attention(p, rms_norm(x, p["attn_norm"], cfg.norm_eps), ks[i], vs[i],
                                    positions, lanes, rope, attn_len, cfg)
        x = x + a
        x = x + mlp(p, rms_norm(x, p["ffn_norm"], cfg.norm_eps))
    kv = KVCache(k=tuple(ks), v=tuple(vs))
    if output == "none":
        return None, kv
    if output == "logits":
        if end != cfg.n_layers:
            raise ValueError("logits requested from a stage that does not end the model")
        return head(params, x[:, -1], cfg), kv
    return x, kv


forward_jit = jax.jit(forward_slice, static_argnames=("cfg", "start", "end", "attn_len", "output"),
                      donate_argnames=("kv",))


def forward_reference(params: Params, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Whole-sequence forward without a cache: logits for every position, [B, T, V].

    A direct computation used to check the cached, chunked paths.
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    kv = KVCache.create(cfg, len(params["layers"]), b, t, jnp.dtype(cfg.dtype))
    x, _ = forward_slice(params, kv, tokens, positions, jnp.arange(b, dtype=jnp.int32), cfg=cfg,
                         start=0, end=cfg.n_layers, attn_len=t, output="hidden")
    return head(params, x, cfg)

"""Llama-family decoder as pure JAX functions over parameter pytrees.

`forward_slice` runs layers [start, end) of the model for a batch of rows
(sessions), each row a run of T tokens at absolute positions. With
`start == 0` the input is token ids, otherwise activations; with
`end == n_layers` the output can be logits (final norm + head).

Parameter layout (linear weights stored as [in, out] so that y = x @ w):
    {"embed": [V, D],                      # when first, or last with a tied head
     "layers": ({"attn_norm", "wq", "wk", "wv", "wo", ["bq", "bk", "bv"], ["bo"],
                 ["q_norm", "k_norm"], ["post_attn_norm"], "ffn_norm", "w_gate", "w_up", "w_down",
                 ["post_ffn_norm"]}, ...),   # end-start dicts
     "norm": [D], ["head": [D, V]]}       # when last ("head" only if untied, or int8)

Any linear weight may instead be a QTensor (model/quant.py: weight-only int8);
every matmul goes through `dense`, which handles both.

KV is read and written in place: each row writes its tokens with one masked
`dynamic_update_slice` at (lane, position) and attention slices only the first
`attn_len` positions of the lanes it needs, so a decode step moves no more KV
than it attends to. Rows and tokens that are padding carry position ==
capacity: their writes are masked off (the window keeps its old contents), so
padding never touches a real lane.

Families differ only in what the config switches on: q/k/v biases (Qwen2,
Llama attention_bias) and an output bias (Llama attention_bias), a per-head
RMSNorm of q and k before rope (Qwen3), the rope type (model/rope.py) and a
sliding attention window (Mistral: every layer; Qwen: the layers not in
`full_attention_layers`).

Gemma 3 adds: embeddings scaled by sqrt(d_model), norms after attention and after
the MLP as well as before (`sandwich_norms`; its (1 + w) norm weights arrive with
the 1 added, as llama.cpp stores them), GeGLU, query_pre_attn_scalar as the score
scale, an optional final logit softcap, and windowed layers with their own rope base.
Phi-3/4 adds partial rotary and longrope (model/rope.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from skippy_zmq.config.model import KV_SPARE_SLOTS, ModelConfig
from skippy_zmq.model import fuse, quant
from skippy_zmq.model import rope as rope_freqs
from skippy_zmq.model.quant import dense, embed_rows, expert_dense

Params = dict[str, Any]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per-layer K and V arenas, each [lanes, n_kv_heads, capacity + KV_SPARE_SLOTS, head_dim].

    Head-major: a lane's first L positions of one head are one contiguous block,
    so attention feeds its slice straight to the dot with no transpose copy
    (attention measured ~2x cheaper than with [lanes, capacity, heads, dim] on
    CPU). One buffer per layer: a single stacked buffer measured ~2x slower on
    CPU because every update then rewrites through one huge array.

    `dtype` is the KV's value dtype. A 16-bit dtype is stored as its raw uint16
    bits: XLA:CPU otherwise upcasts the whole bf16 arena to f32 and back around
    every update (float normalisation), which measured 2-3x slower than f32.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    dtype: str = dataclasses.field(default="float32", metadata=dict(static=True))

    @property
    def lanes(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        """Positions a lane holds; the arena has KV_SPARE_SLOTS more, which no attention length reaches."""
        return self.k[0].shape[2] - KV_SPARE_SLOTS

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)

    @classmethod
    def create(cls, cfg: ModelConfig, n_layers: int, lanes: int, capacity: int,
               dtype: Any = jnp.float32, device: Any = None) -> "KVCache":
        shape = (lanes, cfg.n_kv_heads, capacity + KV_SPARE_SLOTS, cfg.head_dim)
        make = functools.partial(jnp.zeros, shape, _storage(dtype), device=device)
        return cls(k=tuple(make() for _ in range(n_layers)), v=tuple(make() for _ in range(n_layers)),
                   dtype=jnp.dtype(dtype).name)

    def encode(self, x: jax.Array) -> jax.Array:
        """Values -> the arena's storage dtype."""
        x = x.astype(self.dtype)
        return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 else x

    def decode(self, a: jax.Array) -> jax.Array:
        """Stored values (any slice of an arena) -> `dtype`."""
        return jax.lax.bitcast_convert_type(a, jnp.dtype(self.dtype)) if a.dtype == jnp.uint16 else a

    def write(self, layer: int, k: jax.Array, v: jax.Array, positions: jax.Array,
              lanes: jax.Array) -> "KVCache":
        """Write one layer's K and V [B, T, kvh, hd] in place (see `write_rows`)."""
        ks, vs = list(self.k), list(self.v)
        ks[layer] = write_rows(ks[layer], self.encode(k), positions, lanes, self.capacity)
        vs[layer] = write_rows(vs[layer], self.encode(v), positions, lanes, self.capacity)
        return KVCache(k=tuple(ks), v=tuple(vs), dtype=self.dtype)

    def read(self, layer: int, lanes: jax.Array, length: int) -> tuple[jax.Array, jax.Array]:
        """One layer's K and V for the first `length` positions of each row's lane, [B, kvh, length, hd]."""
        return (self.decode(read_lanes(self.k[layer], lanes, length)),
                self.decode(read_lanes(self.v[layer], lanes, length)))


def _storage(dtype: Any) -> Any:
    return jnp.uint16 if jnp.dtype(dtype).itemsize == 2 else jnp.dtype(dtype)


def write_rows(cache: jax.Array, new: jax.Array, positions: jax.Array, lanes: jax.Array, cap: int) -> jax.Array:
    """Write `new` [B, T, kvh, hd] into `cache` [lanes, kvh, >= cap, hd] in place, one update per row.

    Row i's real tokens sit at consecutive positions from positions[i, 0]; tokens at
    position >= cap (the capacity) are padding and are masked off, so they never change any
    lane. A row whose window would run past cap (a short chunk near the end of the arena) is
    written at cap - T with its tokens rolled into place, because dynamic_update_slice would
    clamp it anyway and shift real tokens onto the wrong positions.
    """
    t = new.shape[1]
    new = new.astype(cache.dtype).transpose(0, 2, 1, 3)         # [B, kvh, T, hd]

    def row(i: jax.Array | int, cache: jax.Array) -> jax.Array:
        first = jnp.minimum(positions[i, 0], cap)
        start = jnp.clip(first, 0, cap - t)
        shift = first - start                                     # 0 unless the window is clamped
        keep = roll(positions[i] < cap, shift, 0)                 # [T]: which window slots are real
        block = roll(new[i], shift, 1)[None]
        index = (lanes[i], 0, start, 0)
        old = jax.lax.dynamic_slice(cache, index, block.shape)
        return jax.lax.dynamic_update_slice(cache, jnp.where(keep[:, None], block, old), index)

    if new.shape[0] == 1:
        return row(0, cache)
    # A loop, not a Python unroll: 16 unrolled rows took XLA ~250 s to compile the model.
    return jax.lax.fori_loop(0, new.shape[0], row, cache)


def roll(a: jax.Array, shift: jax.Array, axis: int) -> jax.Array:
    """jnp.roll by a traced shift. jnp.roll first tries the shift as a constant and, to word
    the error it then catches, walks the trace so far: that was ~40% of a stage's trace time."""
    n = a.shape[axis]
    return jax.lax.dynamic_slice_in_dim(jnp.concatenate([a, a], axis), (-shift) % n, n, axis)


def read_lanes(cache: jax.Array, lanes: jax.Array, length: int) -> jax.Array:
    """The first `length` positions of each row's lane, [B, kvh, length, hd]: a slice, never the arena.

    One row slices its lane; several gather theirs in one op (measured as fast as a
    slice per row, and one dot for the batch instead of one per row).
    """
    if lanes.shape[0] == 1:
        size = (1, cache.shape[1], length, cache.shape[3])
        return jax.lax.dynamic_slice(cache, (lanes[0], 0, 0, 0), size)
    return cache[lanes, :, :length]


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def rope_tables(positions: jax.Array, inv_freq: Any, factor: float = 1.0, long_freq: Any = None,
                long_from: int = 0) -> tuple[jax.Array, jax.Array]:
    """cos/sin of shape [B, T, rotary dims] in the HF rotate-half layout; inv_freq: [rotary dims / 2].

    long_freq (longrope): the frequencies of tokens at positions >= long_from; factor scales cos and sin.
    """
    def angles(freq: Any) -> jax.Array:
        a = positions.astype(jnp.float32)[..., None] * jnp.asarray(freq, jnp.float32)
        return jnp.concatenate([a, a], axis=-1)

    a = angles(inv_freq)
    if long_freq is not None:
        a = jnp.where((positions >= long_from)[..., None], angles(long_freq), a)
    if factor != 1.0:
        return jnp.cos(a) * factor, jnp.sin(a) * factor
    return jnp.cos(a), jnp.sin(a)


def model_rope(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The rope of the config's global (or only) layers."""
    return rope_tables(positions, rope_freqs.inv_freq(cfg), cfg.rope_attn_factor, rope_freqs.long_inv_freq(cfg),
                       cfg.rope_original_max_pos)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, heads, hd]; cos/sin: [B, T, rot]: the first rot dims rotate (partial rotary), the rest pass."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


def attention(p: Params, x: jax.Array, kv: KVCache, layer: int, positions: jax.Array,
              lanes: jax.Array, rope: tuple[jax.Array, jax.Array], attn_len: int,
              cfg: ModelConfig, window: int = 0) -> tuple[jax.Array, KVCache]:
    """One layer's attention; `layer` indexes this stage's KV, `window` > 0 limits each query to its last keys."""
    b, t, _ = x.shape
    h, kvh, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q, k, v = qkv(p, x, h * hd, kvh * hd)
    if "bq" in p:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    q, k = q.reshape(b, t, h, hd), k.reshape(b, t, kvh, hd)
    if cfg.qk_norm:
        q, k = rms_norm(q, p["q_norm"], cfg.norm_eps), rms_norm(k, p["k_norm"], cfg.norm_eps)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    kv = kv.write(layer, k, v.reshape(b, t, kvh, hd), positions, lanes)
    scale = cfg.attn_scale or 1.0 / (hd ** 0.5)
    if t == 1 and not window and kv.dtype == "float32" and quant.decode_attention_fits(h, kvh, hd):
        # decode: the CPU kernel reads each row's keys in place, up to its own position (no
        # slice copy of the bucket, no padded keys); other devices keep the XLA attention below
        def on_cpu(q: jax.Array) -> jax.Array:
            return quant.decode_attention(q[:, 0], kv.k[layer], kv.v[layer], lanes, positions[:, 0],
                                          scale=scale, limit=attn_len).astype(q.dtype)

        def elsewhere(q: jax.Array) -> jax.Array:
            return _attend(q, kv, layer, positions, lanes, attn_len, scale, window, cfg)[:, 0]

        out = jax.lax.platform_dependent(q, cpu=on_cpu, default=elsewhere).reshape(b, t, h * hd)
    else:
        out = _attend(q, kv, layer, positions, lanes, attn_len, scale, window, cfg).reshape(b, t, h * hd)
    out = dense(out, p["wo"])
    return (out + p["bo"] if "bo" in p else out), kv


def qkv(p: Params, x: jax.Array, q_width: int, kv_width: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x's queries, keys and values: one call where the stage fused the weights (model/fuse.py)."""
    if "wqkv" in p:
        return tuple(fuse.split(dense(x, p["wqkv"]), (q_width, kv_width, kv_width)))
    if "wqk" in p:
        q, k = fuse.split(dense(x, p["wqk"]), (q_width, kv_width))
        return q, k, dense(x, p["wv"])
    return dense(x, p["wq"]), dense(x, p["wk"]), dense(x, p["wv"])


def _attend(q: jax.Array, kv: KVCache, layer: int, positions: jax.Array, lanes: jax.Array, attn_len: int,
            scale: float, window: int, cfg: ModelConfig) -> jax.Array:
    """XLA attention of q [B, T, h, hd] over the first attn_len keys of each row's lane: [B, T, h, hd]."""
    b, t, h, hd = q.shape
    kvh = cfg.n_kv_heads
    keys, vals = kv.read(layer, lanes, attn_len)                  # [B, kvh, L, hd]
    qg = q.reshape(b, t, kvh, h // kvh, hd)
    scores = jnp.einsum("btkgd,bkld->bkgtl", qg, keys.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = scores * scale
    scores = jnp.where(visible_keys(positions, attn_len, kv.capacity, window)[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    # probs on the left, so the value slice feeds the dot as it lies (no transpose copy)
    out = jnp.einsum("bkgtl,bkld->bkgtd", probs, vals.astype(q.dtype))
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, hd)


def layer_window(cfg: ModelConfig, layer: int) -> int:
    """The sliding window of global layer `layer` (0: it attends to every earlier key)."""
    return 0 if layer in cfg.full_attention_layers else cfg.sliding_window


def visible_keys(positions: jax.Array, attn_len: int, capacity: int, window: int) -> jax.Array:
    """[B, T, L]: which keys each query sees: causal, and within the last `window` keys if window > 0.

    Padding queries (position == capacity) keep the plain causal mask, so a window
    never leaves them with no key at all (a softmax over nothing is NaN).
    """
    keys, pos = jnp.arange(attn_len)[None, None, :], positions[:, :, None]
    visible = keys <= pos
    if window:
        visible &= (keys > pos - window) | (pos >= capacity)
    return visible


def mlp(p: Params, x: jax.Array, act: str = "silu") -> jax.Array:
    if "w_gate_up" in p:   # one call where the stage fused the weights (model/fuse.py)
        both = dense(x, p["w_gate_up"])
        gate, up = fuse.split(both, (both.shape[-1] // 2,) * 2)
    else:
        gate, up = dense(x, p["w_gate"]), dense(x, p["w_up"])
    gate = jax.nn.silu(gate) if act == "silu" else jax.nn.gelu(gate, approximate=True)
    return dense(gate * up, p["w_down"])


def moe(p: Params, x: jax.Array, cfg: ModelConfig, real: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """A mixture-of-experts MLP (Qwen3-MoE, Mixtral, Qwen2-MoE), as transformers computes it: the
    router's softmax in f32, the top n_experts_used, renormalised when norm_topk_prob, then each
    token's experts' SwiGLU outputs weighted and summed; Qwen2-MoE adds a shared expert gated by a
    sigmoid. Only the experts some token routes to are computed (`routed_experts`).

    Returns (output, routed): routed = how many distinct experts the real tokens (`real`, [B, T]
    bool; None: all) chose, the stage's `moe_experts_routed` telemetry."""
    b, t, d = x.shape
    xs = x.reshape(b * t, d)
    probs = jax.nn.softmax(jnp.dot(xs.astype(jnp.float32), p["router"]), axis=-1)
    top, chosen = jax.lax.top_k(probs, cfg.n_experts_used)
    if cfg.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    out = routed_experts(p["experts"], xs, chosen, top.astype(x.dtype), cfg.n_experts)
    mask = jnp.ones((b * t, 1), bool) if real is None else real.reshape(b * t, 1)
    hits = jnp.zeros(cfg.n_experts, jnp.int32).at[chosen.reshape(-1)].add(
        jnp.broadcast_to(mask, chosen.shape).reshape(-1).astype(jnp.int32))
    routed = jnp.sum(hits > 0, dtype=jnp.int32)
    if "shared_gate" in p:
        shared = mlp({k[len("shared_"):]: v for k, v in p.items() if k.startswith("shared_w_")}, xs)
        out = out + jax.nn.sigmoid(jnp.dot(xs.astype(jnp.float32), p["shared_gate"])).astype(x.dtype) * shared
    return out.reshape(b, t, d), routed


def routed_experts(experts: Params, xs: jax.Array, chosen: jax.Array, weights: jax.Array,
                   n_experts: int) -> jax.Array:
    """sum_k weights[i, k] * expert_{chosen[i, k]}(xs[i]) for every token i, [N, D].

    The (token, expert) pairs are sorted by expert and cut into blocks of `rows` pairs of one expert;
    a loop runs only as many blocks as the pairs need, each one expert's SwiGLU on its block, so an
    expert no token chose is never read and a decode step reads only its rows' experts (never a
    dense pass over all of them: XLA:CPU lowers lax.ragged_dot to one, measured). `rows` grows
    with the pairs per expert (1 for decode, more for a prefill chunk), so a block's rows are
    mostly real pairs. Each block's expert is one index into the stacked weights ([E, ...] floats or
    QTensors; quant.expert_dense). Quantised experts on the CPU skip the loop: one kernel call does
    the grouping and reads every chosen expert in place (quant.moe_ffn; a decode step's loop of 8
    blocks cost 2.2 ms a layer on Qwen3-30B-A3B's shape, the fused call about 0.8).
    """
    if quant.moe_fits(experts):
        return quant.moe_ffn(xs, chosen, weights, experts)
    n, k = chosen.shape
    pairs = n * k
    rows = min(64, max(1, 1 << max(0, (pairs // n_experts).bit_length() - 1)))
    expert = chosen.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(expert, stable=True)
    token = (jnp.arange(pairs, dtype=jnp.int32) // k)[order]
    weight = weights.reshape(-1)[order]
    sizes = jnp.bincount(expert, length=n_experts)
    starts = jnp.cumsum(sizes) - sizes
    blocks_of = (sizes + rows - 1) // rows                        # blocks each expert needs
    first_block = jnp.cumsum(blocks_of) - blocks_of
    n_blocks = jnp.sum(blocks_of)
    # block j: its expert (the last whose first block is <= j), where it starts, how many pairs it holds
    most = -(-pairs // rows) + n_experts
    j = jnp.arange(most, dtype=jnp.int32)
    block_expert = jnp.clip(jnp.searchsorted(first_block, j, side="right") - 1, 0, n_experts - 1)
    within = j - first_block[block_expert]
    block_start = starts[block_expert] + within * rows
    block_count = jnp.clip(sizes[block_expert] - within * rows, 0, rows)
    x_pad = jnp.concatenate([xs[token], jnp.zeros((rows, xs.shape[1]), xs.dtype)])
    w_pad = jnp.concatenate([weight, jnp.zeros((rows,), weight.dtype)])
    t_pad = jnp.concatenate([token, jnp.zeros((rows,), token.dtype)])

    def block(i: jax.Array, out: jax.Array) -> jax.Array:
        e, at, count = block_expert[i], block_start[i], block_count[i]
        xb = jax.lax.dynamic_slice_in_dim(x_pad, at, rows)
        h = jax.nn.silu(expert_dense(xb, experts["w_gate"], e)) * expert_dense(xb, experts["w_up"], e)
        yb = expert_dense(h, experts["w_down"], e) * jax.lax.dynamic_slice_in_dim(w_pad, at, rows)[:, None]
        yb = jnp.where((jnp.arange(rows) < count)[:, None], yb, jnp.zeros_like(yb))
        return out.at[jax.lax.dynamic_slice_in_dim(t_pad, at, rows)].add(yb.astype(out.dtype))

    return jax.lax.fori_loop(0, n_blocks, block, jnp.zeros_like(xs))


def head(params: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    x = rms_norm(x, params["norm"], cfg.norm_eps)
    if "head" in params:
        logits = dense(x, params["head"]).astype(jnp.float32)
    else:
        logits = jnp.einsum("...d,vd->...v", x, params["embed"], preferred_element_type=jnp.float32)
    if cfg.final_softcap:
        logits = jnp.tanh(logits / cfg.final_softcap) * cfg.final_softcap
    return logits


def decoder_layer(p: Params, x: jax.Array, kv: KVCache, i: int, window: int, positions: jax.Array,
                  lanes: jax.Array, rope: tuple[jax.Array, jax.Array], attn_len: int,
                  cfg: ModelConfig) -> tuple[jax.Array, KVCache, jax.Array]:
    """One block: x + attn(norm(x)), then + mlp(norm(x)); Gemma also norms each branch's output.
    `i` indexes `kv`'s layers; `window` is the layer's sliding window (0: none). The third result
    is the MoE layer's count of routed experts (0 for a dense layer)."""
    a, kv = attention(p, rms_norm(x, p["attn_norm"], cfg.norm_eps), kv, i, positions, lanes, rope,
                      attn_len, cfg, window)
    if cfg.sandwich_norms:
        a = rms_norm(a, p["post_attn_norm"], cfg.norm_eps)
    x = x + a
    h = rms_norm(x, p["ffn_norm"], cfg.norm_eps)
    if "router" in p:   # padding positions (at or past the KV capacity) are not counted as routed
        m, routed = moe(p, h, cfg, positions < kv.capacity)
    else:
        m, routed = mlp(p, h, cfg.ffn_act), jnp.zeros((), jnp.int32)
    if cfg.sandwich_norms:
        m = rms_norm(m, p["post_ffn_norm"], cfg.norm_eps)
    return x + m, kv, routed


def _block(p: Params, x: jax.Array, kv: KVCache, positions: jax.Array, lanes: jax.Array,
           rope: tuple[jax.Array, jax.Array], *, window: int, attn_len: int,
           cfg: ModelConfig) -> tuple[jax.Array, KVCache, jax.Array]:
    return decoder_layer(p, x, kv, 0, window, positions, lanes, rope, attn_len, cfg)


# One block over its own layer's KV, jitted on its own so that a slice's trace holds one traced block
# per distinct (shapes, window), reused by every layer like it: unrolled in the slice's trace, each of a
# stage's layers was traced and lowered again for every compiled shape (two thirds of a warm stage
# start, measured by scripts/stage_start.py). XLA inlines the calls, so the compiled step is the same.
_block_jit = jax.jit(_block, static_argnames=("window", "attn_len", "cfg"))


def embed(params: Params, ids: jax.Array, cfg: ModelConfig) -> jax.Array:
    dtype = jnp.dtype(cfg.dtype)
    x = embed_rows(params["embed"], ids).astype(dtype)
    # Gemma: the scale is rounded to the compute dtype first, as transformers does
    return x * jnp.asarray(cfg.embed_scale, dtype) if cfg.embed_scale != 1.0 else x


def forward_slice(params: Params, kv: KVCache, inputs: jax.Array, positions: jax.Array,
                  lanes: jax.Array, *, cfg: ModelConfig, start: int, end: int, attn_len: int,
                  output: str = "hidden") -> tuple[jax.Array | None, KVCache, jax.Array]:
    """Run layers [start, end) on `inputs` ([B, T] ids if start == 0, else [B, T, D]).

    output: "hidden" -> [B, T, D] activations; "logits" -> [B, T, V] float32 logits
    at every position (needs end == n_layers; a verify window needs each one); "normed" -> the
    final norm's [B, T, D] float32 output, what the head reads (embeddings pool it); "none" -> KV only.
    The third result: routed experts summed over the slice's MoE layers (int32; 0 when dense).
    """
    x, rope, local = slice_inputs(params, inputs, positions, cfg, start)
    ks, vs = list(kv.k), list(kv.v)
    routed = jnp.zeros((), jnp.int32)
    for i, p in enumerate(params["layers"]):
        window = layer_window(cfg, start + i)
        one = KVCache(k=(ks[i],), v=(vs[i],), dtype=kv.dtype)
        x, one, n = _block_jit(p, x, one, positions, lanes, local if window else rope, window=window,
                               attn_len=attn_len, cfg=cfg)
        ks[i], vs[i], routed = one.k[0], one.v[0], routed + n
    return slice_output(params, x, cfg, end, output), KVCache(k=tuple(ks), v=tuple(vs), dtype=kv.dtype), routed


def slice_inputs(params: Params, inputs: jax.Array, positions: jax.Array, cfg: ModelConfig,
                 start: int) -> tuple[jax.Array, tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    """What a slice's first layer reads: activations [B, T, D] (embedded ids when start == 0) and
    the rope tables of the global and the windowed (local) layers."""
    x = embed(params, inputs, cfg) if start == 0 else inputs.astype(jnp.dtype(cfg.dtype))
    rope = model_rope(cfg, positions)
    local_freq = rope_freqs.local_inv_freq(cfg)
    local = rope if local_freq is None else rope_tables(positions, local_freq)
    # Computed once, read by every layer: without the barrier XLA fuses cos and sin into each layer's
    # q rope and K write, one cos and one sin per element of q and k (120 such fusions a SmolLM2
    # decode step), where the tables hold one per rotary dim. The same ops on the same values: no bit moves.
    return (x, *jax.lax.optimization_barrier((rope, local)))


def slice_output(params: Params, x: jax.Array, cfg: ModelConfig, end: int, output: str) -> jax.Array | None:
    """The last layer's activations as `output` asks (forward_slice)."""
    if output == "none":
        return None
    if output in ("logits", "normed") and end != cfg.n_layers:
        raise ValueError(f"{'logits' if output == 'logits' else 'the final norm'} requested from a stage "
                         "that does not end the model")
    if output == "logits":
        return head(params, x, cfg)
    if output == "normed":
        return rms_norm(x, params["norm"], cfg.norm_eps).astype(jnp.float32)
    return x


forward_jit = jax.jit(forward_slice, static_argnames=("cfg", "start", "end", "attn_len", "output"),
                      donate_argnames=("kv",))

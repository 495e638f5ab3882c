"""A KV arena's lane copies (SliceRunner's prefix recording, restore, an n-choice fork): read a
lane's first `span` positions out, copy them to another lane, write blocks in."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from skippy_zmq.model.llama import KVCache


# Blocks leave and enter as [layers, span, kvh, hd] in the KV dtype; the arena itself is head-major.
@functools.partial(jax.jit, static_argnames=("span",))
def read_lane(kv: KVCache, lane: jax.Array, span: int) -> tuple[jax.Array, jax.Array]:
    def take(a: jax.Array) -> jax.Array:
        block = jax.lax.dynamic_slice(a, (lane, 0, 0, 0), (1, a.shape[1], span, a.shape[3]))
        return kv.decode(block[0]).swapaxes(0, 1)
    return jnp.stack([take(a) for a in kv.k]), jnp.stack([take(a) for a in kv.v])


@functools.partial(jax.jit, static_argnames=("span",), donate_argnames=("kv",))
def copy_lane(kv: KVCache, src: jax.Array, dst: jax.Array, span: int) -> KVCache:
    def copy(a: jax.Array) -> jax.Array:
        block = jax.lax.dynamic_slice(a, (src, 0, 0, 0), (1, a.shape[1], span, a.shape[3]))
        return jax.lax.dynamic_update_slice(a, block, (dst, 0, 0, 0))
    return KVCache(k=tuple(copy(a) for a in kv.k), v=tuple(copy(a) for a in kv.v), dtype=kv.dtype)


@functools.partial(jax.jit, donate_argnames=("kv",))
def write_lane(kv: KVCache, lane: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
    def put(a: jax.Array, block: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice(a, kv.encode(block).swapaxes(0, 1)[None], (lane, 0, 0, 0))
    return KVCache(k=tuple(put(a, k[i]) for i, a in enumerate(kv.k)),
                   v=tuple(put(a, v[i]) for i, a in enumerate(kv.v)), dtype=kv.dtype)

"""A slice's step run layer by layer from Python: the stop-gap a stage serves with while its
whole-slice step (llama.forward_jit) is still compiling.

forward_jit compiles every layer of the slice into one executable: XLA compiles the slice's
layers inlined, about 1 s a shape for SmolLM2's 30 layers on XLA:CPU (24 shapes: 24 s of a cold
start before this). Here each part is its own small compiled function: the inputs (embedding,
rope tables), one decoder layer per distinct (shape, window, layer kind), reused by every layer
like it with that layer's weights and its own K and V (donated, so the update stays in place),
and the output (head). A new shape compiles one layer instead of thirty (about 0.1-0.3 s), but
each step makes a call per layer from Python: a SmolLM2 1-row decode step measured about 25%
slower (33 ms against 27, XLA:CPU). So a stage uses it only for the shapes whose whole-slice step
is not compiled yet (SliceRunner.stopgap), and switches to the fused step shape by shape.

The results are forward_slice's, computed by the same functions (llama.decoder_layer,
slice_inputs, slice_output): only the compiled units differ.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from skippy_zmq.config.model import ModelConfig
from skippy_zmq.model import llama
from skippy_zmq.model.llama import KVCache, Params

# the parameters the inputs' and the output's functions read: passing only these keeps each
# call's argument flattening to a few arrays (the whole tree holds every layer's)
INPUT_KEYS = ("embed",)
OUTPUT_KEYS = ("norm", "head", "embed")


@functools.partial(jax.jit, static_argnames=("cfg", "start"))
def _inputs(params: Params, inputs: jax.Array, positions: jax.Array, *, cfg: ModelConfig,
            start: int) -> tuple[jax.Array, tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    return llama.slice_inputs(params, inputs, positions, cfg, start)


@functools.partial(jax.jit, static_argnames=("window", "attn_len", "cfg"), donate_argnames=("kv",))
def _layer(p: Params, x: jax.Array, kv: KVCache, positions: jax.Array, lanes: jax.Array,
           rope: tuple[jax.Array, jax.Array], *, window: int, attn_len: int,
           cfg: ModelConfig) -> tuple[jax.Array, KVCache, jax.Array]:
    return llama.decoder_layer(p, x, kv, 0, window, positions, lanes, rope, attn_len, cfg)


@functools.partial(jax.jit, static_argnames=("cfg", "end", "output"))
def _output(params: Params, x: jax.Array, *, cfg: ModelConfig, end: int, output: str) -> jax.Array | None:
    return llama.slice_output(params, x, cfg, end, output)


def forward_layered(params: Params, kv: KVCache, inputs: jax.Array, positions: jax.Array,
                    lanes: jax.Array, *, cfg: ModelConfig, start: int, end: int, attn_len: int,
                    output: str = "hidden") -> tuple[jax.Array | None, KVCache, jax.Array]:
    """forward_jit's step, one compiled call per layer (see the module docstring). `kv` is
    consumed (its arrays are donated layer by layer), as forward_jit's is."""
    x, rope, local = _inputs(_subset(params, INPUT_KEYS if start == 0 else ()), inputs, positions,
                             cfg=cfg, start=start)
    ks, vs = list(kv.k), list(kv.v)
    routed = jnp.zeros((), jnp.int32)
    for i, p in enumerate(params["layers"]):
        window = llama.layer_window(cfg, start + i)
        one = KVCache(k=(ks[i],), v=(vs[i],), dtype=kv.dtype)
        x, one, n = _layer(p, x, one, positions, lanes, local if window else rope, window=window,
                           attn_len=attn_len, cfg=cfg)
        ks[i], vs[i] = one.k[0], one.v[0]
        if "router" in p:    # a dense layer routes nothing: no add to dispatch
            routed = routed + n
    kv = KVCache(k=tuple(ks), v=tuple(vs), dtype=kv.dtype)
    if output in ("none", "hidden"):
        return (None if output == "none" else x), kv, routed
    return _output(_subset(params, OUTPUT_KEYS), x, cfg=cfg, end=end, output=output), kv, routed


def _subset(params: Params, keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: params[k] for k in keys if k in params}

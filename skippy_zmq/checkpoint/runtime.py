"""A stage's stored checkpoint items -> its runtime params, in the format the stage runs.

    f32 / bf16   [in, out] float arrays (bf16 weights when the stage runs bf16)
    int8 / q4    quant.QTensor (the CPU kernel's packed levels; quant.QRows for the embedding)
    gguf         the file's own blocks: ggml.BlockTensor, dequantised inside the jitted step
                 (every backend, exact to gguf-py's values), except Q4_0 / Q4_1 / Q8_0
                 matrices, which become QTensors holding the very same levels and scales
                 (the CPU kernel reads them in place; elsewhere the QTensor's XLA path gives
                 the same float32 values: q * d and -8 * d are exact products). On a CPU
                 matrices of ggml.BLOCK_KERNEL_TYPES (K, IQ4, Q5) stay blocks the kernel reads in place
                 (ggml.kernel_block_types, impl "kernel"); with ggml.dequantise_at_load
                 a matrix of any other type is dequantised once here
                 to float32 [in, out], the very values the step would make (the same numpy /
                 XLA dequantiser, bit-equal), and logged once per stage with the bytes it adds

Items are converted one at a time as they are restored, so a load holds what it keeps plus one item.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import numpy as np
from loguru import logger

from skippy_zmq.config.model import ModelConfig
from skippy_zmq.model import ggml, quant, weights
from skippy_zmq.checkpoint.checkpoint import check_runnable, itemised, release_freed_memory, stage_items, stored_weights
from skippy_zmq.checkpoint.formats import KEEP, Encoded, dequantize_grid, grid, parse_blocks, stored_type, to_float


def to_runtime(items: Iterable[tuple[str | int, Any]], asked: str, dtype: Any, device: Any = None,
               first: bool = True) -> dict[str, Any]:
    """Stored stage items (stage_items) -> runtime params
    (as weights.to_runtime makes them), converting each item as it comes.

    Float formats: [in, out] arrays in `dtype`. int8 / q4: QTensors, built from the
    stored levels when their grid matches (an int8 head under q4, as weights.to_runtime
    does), else quantised (or requantised) from the dequantised tensor. A quantised
    embedding stays int8 rows (quant.QRows, widened per looked-up row); a float one stays
    float. A tied last stage's head is the embedding's levels (and, unless it is also
    first, int8 / q4 drop the embedding itself: only the float head reads it).
    gguf: the stored blocks as they are (module docstring); a tied head and the embedding are one
    runtime copy, the very same arrays (blocks, or a Q4_0 / Q4_1 / Q8_0 QTensor whose columns the
    lookup gathers).
    """
    put = _Put(asked, dtype, device)
    out: dict[str, Any] = {}
    layers: dict[int, dict[str, Any]] = {}
    for key, stored in items:
        _put_item(put, out, layers, key, stored, asked, first)
        del stored                # the stored arrays go as soon as their runtime copy exists
        release_freed_memory()    # and so the load's peak is what is held plus one item
    out["layers"] = tuple(layers[i] for i in sorted(layers))
    put.report_dequantised()
    return out


def _platform(device: Any) -> str:
    """The platform ("cpu", "gpu", "tpu") a stage's arrays land on: its device's, else JAX's default."""
    import jax

    return device.platform if device is not None else jax.default_backend()


def _put_item(put: Any, out: dict[str, Any], layers: dict[int, Any], key: str | int, stored: Any, asked: str,
              first: bool) -> None:
    """One stored item -> its runtime arrays in `out` (or `layers`)."""
    if isinstance(key, int):
        layers[key] = put.layer(stored)
    elif key == "embed":      # after norm and head: a last stage knows by now whether its head is tied
        tied = "norm" in out and "head" not in out and asked in ("int8", "q4", KEEP)
        if tied:
            out["head"] = put.matrix("head", stored)   # tied: the embedding's levels, packed
        if first or "head" not in out:                    # gguf blocks: the same arrays serve the lookup
            # gguf: the head's blocks or packed levels serve the lookup (not a head dequantised at load)
            same = tied and asked == KEEP and isinstance(out["head"], (ggml.BlockTensor, quant.QTensor))
            out["embed"] = out["head"] if same else put.embed(stored)
    else:
        out[key] = put.matrix(key, stored) if key == "head" else put.array(stored)


class _Put:
    """Stored arrays -> device arrays of one stage's runtime format and dtype."""

    def __init__(self, asked: str, dtype: Any, device: Any):
        self.asked, self.dtype, self.device = asked, dtype, device
        self.at_load = asked == KEEP and ggml.dequantise_at_load(_platform(device))
        self.in_place = ggml.kernel_block_types(_platform(device)) if asked == KEEP else ()
        self.blocks = ggml.int8_block_kinds() if self.in_place else ()   # (kept as blocks: never packed)
        self.dequantised: dict[str, list[int]] = {}     # type -> [matrices, bytes added over the blocks]

    def report_dequantised(self) -> None:
        """One log line for the stage: which types were dequantised at load and what that adds."""
        if not self.dequantised:
            return
        added = sum(b for _, b in self.dequantised.values())
        kinds = ", ".join(f"{n} {kind}" for kind, (n, _) in sorted(self.dequantised.items()))
        logger.info("gguf matrices without a CPU kernel dequantised to float32 at load ({}=step keeps the "
                    "blocks): {}; {:.1f} MiB more than their blocks", ggml.DEQUANTISE_ENV, kinds, added / 2**20)

    def dequantise(self, blocks: np.ndarray, kind: str) -> Any:
        """[out, in] blocks -> float32 [in, out], gguf-py's values (ggml.dequantize, as the step would)."""
        w = ggml.dequantize(blocks, kind)
        entry = self.dequantised.setdefault(kind, [0, 0])
        entry[0] += 1
        entry[1] += w.nbytes - blocks.nbytes
        return _Put("f32", np.float32, self.device).array(np.ascontiguousarray(w.T))

    def array(self, a: Any) -> Any:
        import jax
        import jax.numpy as jnp

        a = jnp.asarray(a, self.dtype)
        return jax.device_put(a, self.device) if self.device else a

    def tree(self, t: Any) -> Any:
        import jax
        import jax.numpy as jnp

        return jax.device_put(t, self.device) if self.device else jax.tree.map(jnp.asarray, t)

    def float_matrix(self, w: np.ndarray) -> Any:
        """A float matrix (or embedding) in the stage's dtype, or in bf16 when the stage runs bf16
        weights (half the bytes; each matmul widens them to the activations' dtype)."""
        import jax.numpy as jnp

        if self.asked != "bf16":
            return self.array(w)
        return _Put("bf16", jnp.bfloat16, self.device).array(w)

    def matrix(self, key: str, stored: dict[str, np.ndarray]) -> Any:
        """A stored [out, in] matrix -> the stage's runtime matrix. A gguf head tied to the embedding is
        the one runtime copy of both (_put_item); a Q4_0 / Q4_1 / Q8_0 one is packed, and the lookup
        gathers its columns (quant.qtensor_rows): SmolLM2's tied Q8_0 head read as blocks took 2.8x the
        packed int8 loops' time (4.7 ms a token against 1.7, measured). Under SKIPPY_KERNEL_ISA=avx2int8
        the types ggml.int8_block_kinds names stay blocks: its int8 loops read blocks, not panels."""
        if self.asked == KEEP:
            kind = stored_type(stored)
            if kind in ggml.KERNEL_TYPES and kind not in self.blocks:   # the same levels, packed
                return self.tree(runtime_qtensor(stored, ggml.KERNEL_TYPES[kind], keep=True))
            if kind in ggml.PANEL_TYPES and kind in self.in_place and kind not in self.blocks:   # in panels
                return self.tree(panel_qtensor(stored))
            if kind in self.in_place:          # the file's blocks, read in place by the kernel
                return self.tree(ggml.BlockTensor(np.asarray(stored["blocks"]), kind, impl="kernel"))
            if self.at_load:
                return self.dequantise(np.asarray(stored["blocks"]), kind)
            return self.tree(ggml.BlockTensor(np.asarray(stored["blocks"]), kind))
        if self.asked in ("f32", "bf16"):
            return self.float_matrix(np.ascontiguousarray(to_float(stored).T))
        return self.tree(runtime_qtensor(stored, 4 if self.asked == "q4" and key != "head" else 8))

    def embed(self, stored: dict[str, np.ndarray]) -> Any:
        if self.asked == KEEP:                 # blocks, dequantised per looked-up row
            return self.tree(ggml.BlockTensor(np.asarray(stored["blocks"]), stored_type(stored)))
        if self.asked in ("int8", "q4") and "q" in stored:
            e = grid(stored)   # int8 rows, widened per looked-up row
            return self.tree(quant.QRows(e.q.astype(np.int8, copy=False), e.d, e.m))
        return self.float_matrix(to_float(stored))

    def layer(self, item: dict[str, Any]) -> dict[str, Any]:
        """A layer item -> runtime arrays; an MoE layer's experts stacked per matrix under "experts"
        ([E, in, out] floats, or QTensors with a leading expert axis), its router and shared gate f32."""
        out, experts = {}, {}
        for k, v in item.items():
            if k in weights.ROUTER_KEYS:
                out[k] = _Put(self.asked, np.float32, self.device).array(np.ascontiguousarray(to_float(v).T))
            elif (which := weights.expert_of(k)) is not None:
                experts.setdefault(which[1], {})[which[0]] = self.matrix(k, v)
            else:
                out[k] = self.matrix(k, v) if isinstance(v, dict) else self.array(v)
        if experts:
            import jax
            import jax.numpy as jnp

            out["experts"] = {m: jax.tree.map(lambda *a: jnp.stack(a), *(per[j] for j in sorted(per)))
                              for m, per in experts.items()}
        return out


def runtime_qtensor(stored: dict[str, np.ndarray], bits: int, keep: bool = False) -> quant.QTensor:
    """A stored [out, in] matrix -> the kernel's packed [in, out] QTensor of `bits` (Q4_0 / Q4_1 / Q8_0
    blocks keep their levels when `bits` holds them)."""
    if "blocks" in stored and (kind := stored_type(stored)) in ggml.KERNEL_TYPES:
        e = parse_blocks(np.asarray(stored["blocks"]), kind)
    elif "q" not in stored:
        return quant.to_qtensor(np.ascontiguousarray(to_float(stored).T), bits=bits)
    else:
        e = grid(stored)
    if e.fmt == "q4" and bits == 8:
        e = Encoded("int8", e.q.astype(np.int8), e.d, e.m)        # 0..15 are int8 levels: exact
    if (e.fmt == "q4") != (bits == 4):
        return quant.to_qtensor(np.ascontiguousarray(dequantize_grid(e).T), bits=bits)
    # GGUF Q8_0's offsets are all 0: none stored, so its panels hold its own 8.5 bits a weight (a
    # stage running gguf, `keep`; int8 / q4 stages keep the offsets formats.runtime_nbytes counts)
    q8_0 = keep and "blocks" in stored and stored_type(stored) == "Q8_0"
    return quant.pack_rows(e.q, e.d, None if q8_0 and bits == 8 else e.m, bits=bits)


def panel_qtensor(stored: dict[str, np.ndarray]) -> quant.QTensor:
    """A stored Q5_0 matrix -> the kernel's 5-bit panels (ggml.PANEL_TYPES): levels 0..31, s = d (the
    offset -16 d is made from s, exactly, by the loops and quant.offsets)."""
    levels, d = ggml.q5_0_levels(np.asarray(stored["blocks"]))
    return quant.pack_rows(levels, d, None, bits=ggml.PANEL_TYPES["Q5_0"])


def load_stage(model_dir: Path, cfg: ModelConfig, start: int, end: int, asked: str, dtype: Any,
               device: Any = None) -> dict[str, Any]:
    """Runtime params of a stage [start, end) in format `asked`."""
    stored = stored_weights(model_dir)
    check_runnable(stored, asked)
    if not itemised(model_dir):     # older single f32 PyTree
        tree = weights.restore_params(Path(model_dir) / "params", cfg, start, end)
        params = weights.to_runtime(tree, dtype, device, None if asked in ("f32", "bf16") else asked)
        if asked == "bf16":       # as _Put.float_matrix: matrices and the embedding in bf16
            import jax
            import jax.numpy as jnp

            params = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.ndim == 2 else a, params)
        del tree
        release_freed_memory()
        return params
    return to_runtime(stage_items(model_dir, cfg, start, end), asked, dtype, device, first=start == 0)

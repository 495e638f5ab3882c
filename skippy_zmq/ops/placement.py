"""How many bytes a stage needs, and a layer split that fits memory budgets. Pure arithmetic: no JAX.

A stage process's peak resident set (VmHWM over restore, compile and serving; docs/models.md, "Memory-aware placement"):

    total    = max(serving, loading)
    serving  = weights + KV + cache + overhead
    loading  = weights + LOAD_BASE + load transient
    weights  = Σ its layers' tensors in their runtime format (below), the embedding on stage 0 (and
               on the last stage when tied), the final norm and the head on the last stage
    KV       = 2 · layers · kv_heads · head_dim · capacity · lanes · KV dtype bytes,
               capacity = min(driver.max_context, the model's max_seq_len)
    cache    = CACHE_RSS · the prefix store's budget, cache.max_bytes (0 when the cache is disabled)
    overhead = OVERHEAD_BASE + OVERHEAD_PER_LAYER · layers
               + shapes · (OVERHEAD_PER_SHAPE + OVERHEAD_PER_SHAPE_LAYER · layers):
               Python, JAX and XLA, running the layers, and every step shape the stage compiles
               (Buckets.step_shapes)
    load transient (what restoring holds beyond the weights for a moment):
               checkpoint levels packed as they are (int8 / q4 stored, run int8 / q4):
                   LOAD_ITEMS · one layer's runtime bytes, or on the last stage, where the head
                   is packed first with nothing else held, LOAD_HEAD · head bytes - weights
               a float checkpoint quantised at load (run int8 / q4):
                   the stage's float bytes (4 B a parameter) + LOAD_QUANTISE · the largest matrix in f32
               a float checkpoint run float: the stage's float bytes

Weight bytes per format come from model/checkpoint.py `stage_nbytes` (exact: the arrays a stage
holds, panel padding and scales included); everything else here is arithmetic and needs no JAX.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from skippy_zmq.config.model import KV_SPARE_SLOTS, Buckets, ModelConfig
from skippy_zmq.config.units import GiB, MiB, format_bytes, parse_bytes  # noqa: F401 (placement's callers name them here)


# Peak resident bytes of a stage beyond its weights and KV: Python, JAX and XLA's CPU client, what
# running a step holds, and each compiled step shape. A stage compiles every shape it can be sent:
# before READY, decode of 1 and 2 rows and every prefill chunk at every attention length; while idle
# after READY, every other (rows, tokens) a DECODE can bring, verify windows of several rows included
# (config.decode_shapes, stage/factory.idle_warmups); Buckets.step_shapes counts them, so lanes,
# max_draft, prefill_chunk and max_context all move it (SmolLM2 at 8 lanes and 2048 positions: 68
# shapes with max_draft 15, 28 without). The prefix store's RSS is CACHE_RSS times its budget once
# full (its entries' arrays plus what their churn leaves in the allocator: 1.59x on SmolLM2, 1.85x on
# the 1B shape, measured as the difference between a run with the store and one without).
# Fitted 2026-12-03 on this CPU to 13 stage processes after their idle warm-up and bench scale's
# requests (a 512-token prompt, one stream of 128 tokens, 8 streams of 128; VmHWM): the Llama-3.2-1B
# shape q4 at 656 positions on 1, 2 and 3 stages (bench scale --shapes llama-3.2-1b) and on 2 stages
# with max_draft 8, SmolLM2 f32 at 2048 on 1 stage (store on and off) and on 2 stages with max_draft
# 15, the 1B on 1 stage without the store: every peak within 0.94-1.06 of its prediction
# (tests/test_placement.py keeps the table). scripts/rss_shapes.py splits a stage in process: each
# idle-warmed shape added 3-28 MiB, more with more layers and for f32 than q4.
OVERHEAD_BASE = 100 * MiB
OVERHEAD_PER_LAYER = 42 * MiB
OVERHEAD_PER_SHAPE = 12 * MiB
OVERHEAD_PER_SHAPE_LAYER = int(0.15 * MiB)
CACHE_RSS = 1.75
# What a stage holds while restoring, beside the weights and the load transient (Python, JAX, orbax).
LOAD_BASE = 360 * MiB
# The load transient, measured by the same timeline (restore's VmHWM minus RSS at its end):
# q4 checkpoints of the 1B and 8B: 0.08-0.38 GiB, 2.2-2.7x one layer's runtime bytes (a layer's
# stored levels, unpacked levels, panels and the JAX copy at once; the embedding and head come
# first, while little else is held). SmolLM2's float checkpoint (the older single-tree layout,
# restored whole) run q4, last stage: the peak is the restore (1.09 GiB against 0.94 once serving):
# the f32 tree plus ~4x the f32 head being quantised (min/max grid candidates side by side).
# The last stage of the 1B on 3 stages (tied: the int8 head packed from the embedding's levels)
# peaked while loading at 1.08 GiB, its restore ending at 0.73: the stored rows, the zeroed panel
# rows, their transpose and JAX's copy of it, ~3x the head's 0.28 GiB over ~0.19 GiB of Python and
# JAX; counted over LOAD_BASE, LOAD_HEAD = 2.5 puts that stage at 1.04 of its prediction.
LOAD_ITEMS = 3
LOAD_HEAD = 2.5
LOAD_QUANTISE = 4

_DTYPE_BYTES = {"float32": 4, "f32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "f16": 2}

class PlacementError(ValueError):
    """The stages do not fit their memory budgets; the message has the numbers."""


def dtype_bytes(dtype: str) -> int:
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(_DTYPE_BYTES)})") from None


def rss_bytes() -> int:
    """This process's resident set (VmRSS), 0 where /proc is not there."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ---------------------------------------------------------------- weights


@functools.lru_cache(maxsize=65536)
def weight_bytes(cfg: ModelConfig, start: int, end: int, fmt: str, dtype: str = "float32",
                 stored: str | None = None, types: Any = None) -> int:
    """Exact runtime weight bytes of a stage [start, end) running `fmt` from a checkpoint stored in
    `stored` (default `fmt`): model/checkpoint.py's stage_nbytes, the one definition of the runtime
    layout; `types`: a gguf checkpoint's checkpoint.KeptTypes, which a stage running gguf needs.
    Imported here, not at the top: it brings JAX, and the rest of this module is arithmetic."""
    from skippy_zmq.checkpoint.checkpoint import stage_nbytes

    return stage_nbytes(cfg, start, end, fmt, stored, dtype, types)


def kv_position_bytes(cfg: ModelConfig, layers: int, lanes: int = 1, kv_dtype: str = "f32") -> int:
    """KV of one position: 2 (K and V) · layers · kv_heads · head_dim · lanes · bytes."""
    return 2 * layers * cfg.n_kv_heads * cfg.head_dim * lanes * dtype_bytes(kv_dtype)


def kv_bytes(cfg: ModelConfig, layers: int, context: int, lanes: int, kv_dtype: str = "f32") -> int:
    """The KV arenas: kv_position_bytes · (capacity + config.KV_SPARE_SLOTS), capacity = min(context, max_seq_len)."""
    return kv_position_bytes(cfg, layers, lanes, kv_dtype) * (min(context, cfg.max_seq_len) + KV_SPARE_SLOTS)


# ---------------------------------------------------------------- a stage's need


@dataclass(frozen=True)
class StageSettings:
    """What besides its layer range sizes a stage: weights format, dtypes, context, lanes, cache budget."""

    weights: str = "f32"
    dtype: str = "float32"
    kv_dtype: str = "f32"
    context: int = 2048
    lanes: int = 8
    cache_bytes: int = 256 * MiB     # cache.max_bytes; 0 when the prefix store is disabled
    stored: str | None = None        # the checkpoint's format (checkpoint.stored_weights); None: `weights`
    prefill_chunk: int = 256         # driver.prefill_chunk
    max_draft: int = 0               # driver.speculative.max_draft when it speculates, else 0
    types: Any = None                # a gguf checkpoint's matrix types (checkpoint.kept_types), for `weights` gguf

    def step_shapes(self, cfg: ModelConfig) -> int:
        """The step shapes this stage compiles by the end of its idle warm-up (config.Buckets)."""
        capacity = min(self.context, cfg.max_seq_len)
        return Buckets.for_stage(self.prefill_chunk, self.lanes, capacity).step_shapes(capacity, self.max_draft)


def overhead_bytes(layers: int, shapes: int) -> int:
    """Python, JAX and XLA, running `layers` layers, and `shapes` compiled steps of them (module docstring)."""
    return OVERHEAD_BASE + OVERHEAD_PER_LAYER * layers + shapes * (OVERHEAD_PER_SHAPE + OVERHEAD_PER_SHAPE_LAYER * layers)


def load_transient_bytes(cfg: ModelConfig, start: int, end: int, s: StageSettings) -> int:
    """What restoring a stage holds beyond its weights at its peak (module docstring, LOAD_*)."""
    from skippy_zmq.checkpoint import formats  # JAX, as weight_bytes
    from skippy_zmq.model import weights

    stored, last = s.stored or s.weights, end == cfg.n_layers
    shapes = weights.param_shapes(cfg, start, end)
    if s.weights == "gguf":       # blocks restored as they are: a few items at once, as int8 / q4
        from skippy_zmq.checkpoint.checkpoint import kept_layer_nbytes

        return LOAD_ITEMS * max(kept_layer_nbytes(cfg, i, s.types, s.dtype) for i in range(start, end))
    if stored in ("int8", "q4"):
        layer = sum(formats.runtime_nbytes(shape[::-1], s.weights, key, stored, s.dtype)
                    for key, shape in weights.layer_shapes(cfg).items() if len(shape) == 2)
        head = formats.runtime_nbytes((cfg.vocab_size, cfg.d_model), s.weights, "head", stored, s.dtype) if last else 0
        # the head comes first, while nothing else is held: its peak, less the weights loading adds
        return max(LOAD_ITEMS * layer, int(LOAD_HEAD * head) - weight_bytes(cfg, start, end, s.weights, s.dtype, s.stored,
                                                                             s.types))
    params = sum(_count(shape) for shape in shapes.values() if isinstance(shape, tuple))
    params += (end - start) * sum(_count(shape) for shape in weights.layer_shapes(cfg).values())
    if s.weights not in ("int8", "q4"):
        return 4 * params
    matrices = [_count(shape) for shape in weights.layer_shapes(cfg).values() if len(shape) == 2]
    largest = max(matrices + ([cfg.vocab_size * cfg.d_model] if last else []))
    return 4 * params + LOAD_QUANTISE * 4 * largest


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class StageNeed:
    start: int
    end: int
    weights: int
    kv: int
    cache: int
    overhead: int
    load: int = 0        # the load transient; it matters only where it exceeds KV + cache + the per-layer part

    @property
    def serving(self) -> int:
        return self.weights + self.kv + self.cache + self.overhead

    @property
    def loading(self) -> int:
        return self.weights + LOAD_BASE + self.load

    @property
    def total(self) -> int:
        return max(self.serving, self.loading)

    def breakdown(self) -> str:
        text = (f"weights {format_bytes(self.weights)} + KV {format_bytes(self.kv)} + cache "
                f"{format_bytes(self.cache)} + overhead {format_bytes(self.overhead)} = {format_bytes(self.serving)}")
        if self.loading > self.serving:
            text += (f"; loading it peaks higher: weights + base {format_bytes(LOAD_BASE)} + load transient "
                     f"{format_bytes(self.load)} = {format_bytes(self.loading)}")
        return text


def stage_need(cfg: ModelConfig, start: int, end: int, s: StageSettings) -> StageNeed:
    return StageNeed(start, end, weight_bytes(cfg, start, end, s.weights, s.dtype, s.stored, s.types),
                     kv_bytes(cfg, end - start, s.context, s.lanes, s.kv_dtype), int(CACHE_RSS * s.cache_bytes),
                     overhead_bytes(end - start, s.step_shapes(cfg)), load_transient_bytes(cfg, start, end, s))


def budget_error(stage_id: str, need: StageNeed, budget: int) -> str:
    return (f"stage {stage_id} needs {format_bytes(need.total)} for layers [{need.start}, {need.end}) "
            f"({need.breakdown()}) but its memory budget is {format_bytes(budget)}")


# ---------------------------------------------------------------- splitting to budgets


def fit_layers(cfg: ModelConfig, budgets: Sequence[int], settings: Sequence[StageSettings]) -> list[StageNeed]:
    """Contiguous layer ranges, one a budget, that minimise the largest need / budget ratio.

    Raises PlacementError naming every stage that cannot fit, with its bytes, when even the best
    split overflows. Dynamic programming over (stage, end layer): exact, and cheap for any real model.
    """
    n, layers = len(budgets), cfg.n_layers
    if not 1 <= n <= layers:
        raise PlacementError(f"cannot split {layers} layers over {n} memory budgets (need 1 to {layers})")
    # best[i][e]: (worst ratio, ranges) of stages 0..i covering layers [0, e)
    best: list[dict[int, tuple[float, list[StageNeed]]]] = [{0: (0.0, [])}]
    for i in range(n):
        row: dict[int, tuple[float, list[StageNeed]]] = {}
        for e in range(i + 1, layers - (n - 1 - i) + 1):
            for start, (ratio, needs) in best[i].items():
                if start >= e:
                    continue
                need = stage_need(cfg, start, e, settings[i])
                worst = max(ratio, need.total / budgets[i])
                if e not in row or worst < row[e][0]:
                    row[e] = (worst, needs + [need])
        best.append(row)
    ratio, needs = best[n][layers]
    if ratio > 1.0:
        raise PlacementError(_overflow_message(needs, budgets))
    return needs


def _overflow_message(needs: Sequence[StageNeed], budgets: Sequence[int]) -> str:
    over = [budget_error(f"s{i}", need, budgets[i]).replace(" needs ", " needs at least ", 1)
            for i, need in enumerate(needs) if need.total > budgets[i]]
    total, room = sum(n.total for n in needs), sum(budgets)
    summary = (f"total need {format_bytes(total)} > {format_bytes(room)} of budgets" if total > room else
               f"the budgets total {format_bytes(room)} >= the need of {format_bytes(total)}, but no contiguous "
               f"split fits each stage")
    return "; ".join(over) + f"; {summary} (best split shown)"


def check_fit(needs: Sequence[StageNeed], budgets: Sequence[int]) -> None:
    """Raise PlacementError unless every need fits its budget (for a split given by hand)."""
    if any(need.total > budget for need, budget in zip(needs, budgets)):
        raise PlacementError(_overflow_message(needs, budgets).replace(" (best split shown)", ""))

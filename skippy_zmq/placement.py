"""How many bytes a stage needs, and a layer split that fits memory budgets. Pure arithmetic: no JAX.

A stage process holds (README "Memory"):

    total = weights + KV + cache + overhead
    weights  = Σ its layers' tensors in their runtime format (below), the embedding on stage 0 (and
               on the last stage when tied), the final norm and the head on the last stage
    KV       = 2 · layers · kv_heads · head_dim · capacity · lanes · KV dtype bytes,
               capacity = min(driver.max_context, the model's max_seq_len)
    cache    = the prefix store's budget, cache.max_bytes (0 when the cache is disabled)
    overhead = OVERHEAD_BASE + OVERHEAD_PER_LAYER · layers: Python, JAX and XLA, compiled buckets

Weight bytes per format come from model/checkpoint.py `stage_nbytes` (exact: the arrays a stage
holds, panel padding and scales included); everything else here is arithmetic and needs no JAX.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from skippy_zmq.config import ModelConfig

MiB, GiB = 1 << 20, 1 << 30

# Resident bytes of a stage beyond its weights, KV and prefix store: Python, JAX and XLA, the
# compiled buckets (the jitted step unrolls its layers, so code grows with them) and allocator slack.
# Measured with scripts/stage_rss.py on SmolLM2-135M (CPU, 2026-12-01): real stage processes with a
# warm JAX compilation cache, prefix cache off, 3 greedy requests each, VmRSS - weight bytes - KV
# bytes, over 1/2/3 stages x f32/int8/q4 (18 stages): 389-732 MiB, least squares 307 MiB + 12.3
# MiB a layer. With the constants below RSS / predicted total was 0.94-1.05 for all 18. A stage
# that compiles cold (an empty cache) held ~30 MiB a layer more after startup (1-stage f32: 2.6 GiB
# against 1.8 GiB warm); MALLOC_ARENA_MAX=2 did not change that.
# Growth while serving (the soak's 1294 -> 1474 MB over 3 minutes, then flat) is the prefix store
# filling to cache.max_bytes (the `cache` term) plus first-use compiles of decode-row buckets the
# warmup skips: 2 stages, 16 lanes, 16 streams for 150 s rose ~340 MiB per stage, ~230 of it with
# cache_bytes (0 -> 256 MiB in 45 s), flat afterwards; RSS / predicted total was then 1.03 and 1.05.
OVERHEAD_BASE = 320 * MiB
OVERHEAD_PER_LAYER = 12 * MiB

_DTYPE_BYTES = {"float32": 4, "f32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "f16": 2}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


class PlacementError(ValueError):
    """The stages do not fit their memory budgets; the message has the numbers."""


# ---------------------------------------------------------------- byte sizes


def parse_bytes(value: int | str) -> int:
    """A byte count: an integer, or a string such as "6GiB", "512 MiB", "1.5GB" (KB/MB/GB: powers of 10)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"a byte count must be positive, got {value}")
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", value) if isinstance(value, str) else None
    if m is None or m[2].lower() not in _UNITS:
        raise ValueError(f"expected bytes such as 6GiB, 512MiB, 8GB or an integer, got {value!r}")
    n = int(float(m[1]) * _UNITS[m[2].lower()])
    if n < 1:
        raise ValueError(f"a byte count must be positive, got {value!r}")
    return n


def format_bytes(n: int) -> str:
    """1.5 GiB, 300.0 MiB, 12 KiB: binary units, one decimal above a KiB."""
    for unit, size in (("GiB", GiB), ("MiB", MiB)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 1024:.0f} KiB" if abs(n) >= 1024 else f"{n} B"


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
                 stored: str | None = None) -> int:
    """Exact runtime weight bytes of a stage [start, end) running `fmt` from a checkpoint stored in
    `stored` (default `fmt`): model/checkpoint.py's stage_nbytes, the one definition of the runtime
    layout. Imported here, not at the top: it brings JAX, and the rest of this module is arithmetic."""
    from skippy_zmq.model.checkpoint import stage_nbytes

    return stage_nbytes(cfg, start, end, fmt, stored, dtype)


def kv_bytes(cfg: ModelConfig, layers: int, context: int, lanes: int, kv_dtype: str = "f32") -> int:
    """2 (K and V) · layers · kv_heads · head_dim · capacity · lanes · bytes, capacity = min(context, max_seq_len)."""
    capacity = min(context, cfg.max_seq_len)
    return 2 * layers * cfg.n_kv_heads * cfg.head_dim * capacity * lanes * dtype_bytes(kv_dtype)


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


def overhead_bytes(layers: int) -> int:
    return OVERHEAD_BASE + OVERHEAD_PER_LAYER * layers


@dataclass(frozen=True)
class StageNeed:
    start: int
    end: int
    weights: int
    kv: int
    cache: int
    overhead: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.cache + self.overhead

    def breakdown(self) -> str:
        return (f"weights {format_bytes(self.weights)} + KV {format_bytes(self.kv)} + cache "
                f"{format_bytes(self.cache)} + overhead {format_bytes(self.overhead)} = {format_bytes(self.total)}")


def stage_need(cfg: ModelConfig, start: int, end: int, s: StageSettings) -> StageNeed:
    return StageNeed(start, end, weight_bytes(cfg, start, end, s.weights, s.dtype, s.stored),
                     kv_bytes(cfg, end - start, s.context, s.lanes, s.kv_dtype), s.cache_bytes,
                     overhead_bytes(end - start))


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

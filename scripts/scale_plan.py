#!/usr/bin/env python3
"""On paper: Llama-3.1-70B split by layers over 8 hosts (docs/scale.md).

Pure arithmetic, no JAX: layers and bytes per host (q4 and bf16), activation
bytes per token per hop for every wire dtype (skippy_zmq.protocol.wire.bytes_per_token),
KV per stage per 1k tokens, and the hop model's time per token at 1 ms and
20 ms RTT for a stated memory bandwidth, with micro-batch throughput.

    .venv/bin/python scripts/scale_plan.py            # the markdown tables of docs/scale.md
    .venv/bin/python scripts/scale_plan.py --json     # the same numbers as JSON

Every number in docs/scale.md comes from this script; change an assumption
here (bandwidths, RTTs, link speeds, the messaging overhead) and regenerate.
If skippy_zmq/ops/placement.py (the memory predictor) provides bytes per layer and
KV bytes, those are used; otherwise the same formulas are computed here.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skippy_zmq.protocol import wire  # noqa: E402

try:  # the memory predictor, when it has landed (another engineer's module)
    from skippy_zmq.ops import placement as _placement  # type: ignore[attr-defined]  # noqa: E402
except ImportError:  # pragma: no cover - depends on the tree
    _placement = None


@dataclass(frozen=True)
class Shape:
    name: str
    n_layers: int
    d_model: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    tied: bool

    @property
    def q_width(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim


# Llama-3.1-70B (config.json of meta-llama/Llama-3.1-70B; rope_scaling llama3, factor 8).
LLAMA_70B = Shape("Llama-3.1-70B", n_layers=80, d_model=8192, ffn_dim=28672, n_heads=64, n_kv_heads=8,
                  head_dim=128, vocab_size=128256, tied=False)
# Calibration models (docs/benchmarks.md and the brief).
SMOLLM2 = Shape("SmolLM2-135M", n_layers=30, d_model=576, ffn_dim=1536, n_heads=9, n_kv_heads=3,
                head_dim=64, vocab_size=49152, tied=True)
LLAMA_1B = Shape("Llama-3.2-1B-shaped", n_layers=16, d_model=2048, ffn_dim=8192, n_heads=32, n_kv_heads=8,
                 head_dim=64, vocab_size=128256, tied=True)

GROUP = 32   # inputs per scale (quant.GROUP_SIZE; GGUF blocks hold 32 weights)

# Bytes per weight, from the block layouts:
#   GGUF Q4_1 block of 32: f16 d + f16 m + 16 bytes of nibbles = 20 B        -> 0.625
#   runtime q4 (quant.py): 16 B of nibbles + f16 s + f16 z per 32 = 20 B     -> 0.625  (current, 654ee80)
#                          with f32 s and z (before 2026-12-01): 16 + 4 + 4 = 24 B -> 0.75
#   runtime int8 (the head under q4): 32 B + f16 s + f16 z = 36 B            -> 1.125  (current)
#                          with f32 s and z (before 2026-12-01): 32 + 4 + 4 = 40 B -> 1.25
BPW = {
    "gguf_q4_1": (16 + 2 + 2) / GROUP,
    "q4_f32_scales": (16 + 4 + 4) / GROUP,
    "q4_f16_scales": (16 + 2 + 2) / GROUP,
    "int8_f32_scales": (32 + 4 + 4) / GROUP,
    "int8_f16_scales": (32 + 2 + 2) / GROUP,
    "gguf_q8_0": (32 + 2) / GROUP,   # f16 d + 32 int8: the embedding/head of SmolLM2's Q4_1 file
    "bf16": 2.0,
    "f32": 4.0,
}

GB = 1e9
MSG_OVERHEAD_MS = 0.6   # docs/benchmarks.md per-hop breakdown: encode 0.28 + send->recv 0.19 + decode 0.14 (loopback)
# host memory bandwidth for decode (GB/s): DDR5 desktop, a slower host, and about what this repo's
# CPU decode reaches on its 2-core VM (the calibration table: 7.7-16.7 GB/s effective)
BANDWIDTHS_GBS = (50.0, 20.0, 10.0)
NETWORKS = ((1.0, 1000.0), (20.0, 100.0))            # (RTT ms, link Mbit/s)
CONTEXT = 1024                                       # tokens of context in the per-token KV read
# A deployment's per-host memory (placement.stage_need): driver max_context, kv_lanes, KV dtype, cache.max_bytes
DEPLOY_CONTEXT, DEPLOY_LANES, DEPLOY_KV, DEPLOY_CACHE = 8192, 8, "bf16", 256 * 2**20
# placement.py's overhead (its fallback here when the module is absent): 360 MiB + 28 MiB per layer
OVERHEAD_BASE, OVERHEAD_PER_LAYER = 360 * 2**20, 28 * 2**20

# Published single-stream figures for 70B-class models (see docs/scale.md for the sources).
PUBLISHED = [
    {"system": "Petals", "model": "Llama 2 70B", "setup": "public swarm of GPU servers, single batch",
     "ms_per_token": round(1000 / 6, 1), "tok_s": 6.0, "note": "\"up to 6 tokens/s\""},
    {"system": "prima.cpp", "model": "Llama 3 70B", "setup": "four home devices (pipeline + ring)",
     "ms_per_token": 674.0, "tok_s": round(1000 / 674, 2), "note": ""},
    {"system": "distributed-llama", "model": "Llama 2 70B", "setup": "4 cloud VMs, tensor parallel",
     "ms_per_token": 293.0, "tok_s": round(1000 / 293, 2), "note": ""},
]


# ------------------------------------------------------------------ parameter and byte counts


def layer_matrices(s: Shape) -> dict[str, int]:
    """Weights (elements) of one decoder layer's matrices."""
    d, q, kv, f = s.d_model, s.q_width, s.kv_width, s.ffn_dim
    return {"wq": d * q, "wk": d * kv, "wv": d * kv, "wo": q * d, "w_gate": d * f, "w_up": d * f, "w_down": f * d}


def layer_weights(s: Shape) -> int:
    return sum(layer_matrices(s).values())


def norm_weights_per_layer(s: Shape) -> int:
    return 2 * s.d_model   # attn_norm + ffn_norm (f32 in every mode)


def total_weights(s: Shape) -> int:
    """Every parameter: layers, norms, embedding, head (tied: counted once)."""
    emb = s.vocab_size * s.d_model
    return (s.n_layers * (layer_weights(s) + norm_weights_per_layer(s)) + s.d_model + emb
            + (0 if s.tied else emb))


def model_config(s: Shape) -> Any:
    """The shape as the runtime's ModelConfig (for skippy_zmq.ops.placement)."""
    from skippy_zmq.config.model import ModelConfig

    return ModelConfig(arch="llama", n_layers=s.n_layers, d_model=s.d_model, n_heads=s.n_heads,
                       n_kv_heads=s.n_kv_heads, head_dim=s.head_dim, ffn_dim=s.ffn_dim, vocab_size=s.vocab_size,
                       rope_theta=500000.0, norm_eps=1e-5, tied_embeddings=s.tied, max_seq_len=131072)


def kv_bytes_per_token_per_layer(s: Shape, kv_bytes: int) -> int:
    """K and V of one position in one layer: 2 * n_kv_heads * head_dim * bytes."""
    return 2 * s.kv_width * kv_bytes


def kv_bytes(s: Shape, layers: int, tokens: int, kv_bytes_per_value: int, own: bool = False) -> int:
    """KV of `tokens` positions over `layers` layers (placement.kv_position_bytes when it is there)."""
    if getattr(_placement, "kv_position_bytes", None) is not None and not own:
        dtype = {4: "f32", 2: "bf16"}[kv_bytes_per_value]
        return tokens * int(_placement.kv_position_bytes(model_config(s), layers, 1, dtype))
    return layers * tokens * kv_bytes_per_token_per_layer(s, kv_bytes_per_value)


@dataclass(frozen=True)
class Mode:
    """How a stage holds its weights: bytes per weight of the layers' matrices, the head, the embedding."""

    name: str
    layer_bpw: float
    head_bpw: float
    embed_bpw: float
    note: str
    runtime: tuple[str, str] | None = None   # (placement format, dtype) for a mode today's runtime runs


MODES = {
    "gguf_q4_1": Mode("Q4_1 GGUF on disk", BPW["gguf_q4_1"], BPW["gguf_q4_1"], BPW["gguf_q4_1"],
                      "every matrix in Q4_1 blocks (0.625 B/weight); norms f32"),
    "q4_ckpt": Mode("q4 checkpoint on disk (model/checkpoint.py v2)", BPW["q4_f16_scales"], BPW["int8_f16_scales"],
                    BPW["int8_f16_scales"], "layers q4 + f16 d, m (0.625 B/w); embedding and head int8 + f16 d, m "
                    "(1.125 B/w)"),
    "q4_f16": Mode("q4 runtime, f16 scales (current)", BPW["q4_f16_scales"], BPW["int8_f16_scales"],
                   BPW["int8_f16_scales"], "layers q4 and head int8 with f16 s and z; embedding int8 (f16 d, m)",
                   ("q4", "float32")),
    "q4_f32scales": Mode("q4 runtime, f32 scales (before 2026-12-01)", BPW["q4_f32_scales"],
                         BPW["int8_f32_scales"], BPW["int8_f16_scales"], "layers q4 and head int8 with f32 s and z; "
                         "embedding int8 as the q4 checkpoint stores it (f16 d, m)"),
    "bf16": Mode("bf16 runtime", BPW["bf16"], BPW["bf16"], BPW["bf16"], "every matrix bf16 (2 B/w); norms bf16",
                 ("f32", "bfloat16")),
}


def norm_bpw(mode: Mode) -> float:
    return 2.0 if mode.runtime == ("f32", "bfloat16") else 4.0   # norms take a bf16 stage's dtype


_PLACEMENT_NOTE: list[str] = []


@functools.lru_cache(maxsize=None)
def _placement_weights(s: Shape, fmt: str, dtype: str) -> tuple[float, float, float] | None:
    """(one layer, head + final norm, embedding) from placement.weight_bytes, or None when the module
    (another engineer's, still moving) is absent or answers differently than expected."""
    fn = getattr(_placement, "weight_bytes", None)
    if fn is None:
        return None
    try:
        cfg, n = model_config(s), s.n_layers
        layer = float(fn(cfg, 1, 2, fmt, dtype))
        return layer, float(fn(cfg, n - 1, n, fmt, dtype)) - layer, float(fn(cfg, 0, 1, fmt, dtype)) - layer
    except Exception as exc:   # noqa: BLE001 - any failure means: use this script's own formulas
        _PLACEMENT_NOTE.append(f"placement.weight_bytes failed ({type(exc).__name__}: {exc}); own formulas used")
        return None


def _from_placement(s: Shape, mode: Mode, own: bool) -> tuple[float, float, float] | None:
    if own or _placement is None or not mode.runtime:
        return None
    return _placement_weights(s, *mode.runtime)


def layer_bytes(s: Shape, mode: Mode, own: bool = False) -> float:
    got = _from_placement(s, mode, own)
    if got:
        return got[0]
    return layer_weights(s) * mode.layer_bpw + norm_weights_per_layer(s) * norm_bpw(mode)


def head_bytes(s: Shape, mode: Mode, own: bool = False) -> float:
    got = _from_placement(s, mode, own)
    if got:
        return got[1] - s.d_model * norm_bpw(mode)
    return s.vocab_size * s.d_model * mode.head_bpw


def embed_bytes(s: Shape, mode: Mode, own: bool = False) -> float:
    got = _from_placement(s, mode, own)
    if got:
        return got[2]
    return s.vocab_size * s.d_model * mode.embed_bpw


def bytes_per_weight(s: Shape, mode: Mode) -> tuple[float, float, float]:
    """(layer matrices, head, embedding) bytes per weight, from the bytes actually counted."""
    vd = s.vocab_size * s.d_model
    layer = (layer_bytes(s, mode) - norm_weights_per_layer(s) * norm_bpw(mode)) / layer_weights(s)
    return layer, head_bytes(s, mode) / vd, embed_bytes(s, mode) / vd


def model_bytes(s: Shape, mode: Mode) -> float:
    """Resident weight bytes of the whole model (a tied model's runtime head is a second, quantised copy
    under q4; on disk and in bf16 it is the embedding itself)."""
    head = head_bytes(s, mode) if (not s.tied or mode.head_bpw != mode.embed_bpw) else 0.0
    return s.n_layers * layer_bytes(s, mode) + s.d_model * norm_bpw(mode) + embed_bytes(s, mode) + head


# ------------------------------------------------------------------ the split


def stage_layout(s: Shape, mode: Mode, layers: list[int]) -> list[dict[str, Any]]:
    """Per stage: its layer range, resident bytes and the bytes one decode step reads.

    A step reads every weight of the stage's layers once, one embedding row (stage 0: negligible) and,
    on the last stage, the final norm and the whole head."""
    rows, start = [], 0
    n = len(layers)
    for i, count in enumerate(layers):
        end = start + count
        resident = count * layer_bytes(s, mode)
        read = resident
        if i == 0:
            resident += embed_bytes(s, mode)
        if i == n - 1:
            resident += head_bytes(s, mode) + s.d_model * norm_bpw(mode)
            read += head_bytes(s, mode) + s.d_model * norm_bpw(mode)
        rows.append({"stage": f"s{i}", "layers": f"[{start}, {end})", "n_layers": count,
                     "resident_bytes": resident, "read_bytes_per_token": read})
        start = end
    return rows


def even_split(n_layers: int, n_stages: int) -> list[int]:
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if i < extra else 0) for i in range(n_stages)]


def balanced_split(s: Shape, mode: Mode, n_stages: int) -> list[int]:
    """Layer counts minimising the largest per-token read (the last stage also reads the head):
    the busiest stage sets the pipeline's throughput once every stage is kept busy."""
    head_layers = head_bytes(s, mode) / layer_bytes(s, mode)
    candidates = []
    for last in range(1, s.n_layers - n_stages + 2):
        rest = even_split(s.n_layers - last, n_stages - 1)
        loads = rest + [last + head_layers]
        # smallest busiest stage first, then the most even loads
        candidates.append(((max(loads), sum(x * x for x in loads)), rest + [last]))
    return min(candidates)[1]


def host_needs(s: Shape, layers: list[int], context: int = DEPLOY_CONTEXT, lanes: int = DEPLOY_LANES,
               kv_dtype: str = DEPLOY_KV, cache: int = DEPLOY_CACHE, own: bool = False) -> list[dict[str, Any]]:
    """Per stage under q4 (f16 scales, a q4 checkpoint): weights + KV + cache + overhead = serving, and the
    peak max(serving, loading), from placement.stage_need (what `skippy-zmq plan --memory` fits to budgets);
    without the module, or with own=True, serving from this script's formulas (loading not modelled)."""
    rows, start = [], 0
    kvb = {"f32": 4, "bf16": 2}[kv_dtype]
    for i, count in enumerate(layers):
        end = start + count
        need = None
        if _placement is not None and not own and getattr(_placement, "stage_need", None) is not None:
            try:
                st = _placement.StageSettings(weights="q4", dtype="float32", kv_dtype=kv_dtype, context=context,
                                              lanes=lanes, cache_bytes=cache)
                need = _placement.stage_need(model_config(s), start, end, st)
            except Exception as exc:   # noqa: BLE001 - fall back to this script's formulas
                _PLACEMENT_NOTE.append(f"placement.stage_need failed ({type(exc).__name__}: {exc})")
        if need is not None:
            row = {"weights": need.weights, "kv": need.kv, "cache": need.cache, "overhead": need.overhead,
                   "serving": need.serving, "loading": need.loading, "peak": need.total}
        else:
            w = stage_layout(s, MODES["q4_f16"], layers)[i]["resident_bytes"]
            kv = count * min(context, 131072) * lanes * kv_bytes_per_token_per_layer(s, kvb)
            ov = OVERHEAD_BASE + OVERHEAD_PER_LAYER * count
            row = {"weights": w, "kv": kv, "cache": cache, "overhead": ov, "serving": w + kv + cache + ov,
                   "loading": None, "peak": w + kv + cache + ov}
        rows.append({"stage": f"s{i}", "layers": f"[{start}, {end})", "n_layers": count, **row})
        start = end
    return rows


# ------------------------------------------------------------------ the hop model


def hop_time_ms(n_stages: int, compute_ms: float, act_bytes: int, rtt_ms: float, link_mbit: float,
                overhead_ms: float = MSG_OVERHEAD_MS) -> dict[str, float]:
    """Direct return: a token's critical path = sum of stage compute + N forward hops + 1 return hop.

    The N forward hops are driver -> s0 (token ids: a few bytes) and the N - 1 activation hops
    s_k -> s_k+1; the last stage sends the token id straight back to the driver (1 hop). Each hop costs
    the one-way latency RTT / 2 and the messaging overhead; an activation hop also costs its bytes over
    the link."""
    one_way = rtt_ms / 2
    transfer = act_bytes * 8 / (link_mbit * 1e6) * 1000   # ms per activation hop
    hops = n_stages + 1
    network = hops * (one_way + overhead_ms) + (n_stages - 1) * transfer
    return {"compute_ms": compute_ms, "hops": hops, "transfer_ms_per_hop": transfer,
            "network_ms": network, "ms_per_token": compute_ms + network}


def micro_batch_tok_s(ms_per_token: float, max_stage_ms: float, micro_batches: int) -> float:
    """Aggregate tok/s with `micro_batches` one-row micro-batches in flight: each one yields a token
    every ms_per_token, until the busiest stage is busy all the time (1 / max_stage_ms)."""
    return min(micro_batches * 1000 / ms_per_token, 1000 / max_stage_ms)


def stage_compute_ms(read_bytes: float, bandwidth_gbs: float) -> float:
    return read_bytes / (bandwidth_gbs * GB) * 1000


def plan(s: Shape = LLAMA_70B, n_stages: int = 8) -> dict[str, Any]:
    out: dict[str, Any] = {"model": s.name, "stages": n_stages, "shape": s.__dict__,
                           "weights": {"per_layer": layer_weights(s), "per_layer_matrices": layer_matrices(s),
                                       "norms_per_layer": norm_weights_per_layer(s),
                                       "embed": s.vocab_size * s.d_model,
                                       "head": 0 if s.tied else s.vocab_size * s.d_model,
                                       "total": total_weights(s)},
                           "bytes_per_weight": BPW, "placement_module": _placement is not None}
    out["totals"] = [{"mode": m.name, "layer_bytes": layer_bytes(s, m), "model_bytes": model_bytes(s, m),
                      "note": m.note} for m in MODES.values()]
    even = even_split(s.n_layers, n_stages)
    out["split_even"] = even
    out["layouts"] = {key: stage_layout(s, m, even) for key, m in MODES.items()}
    out["split_balanced_q4"] = balanced_split(s, MODES["q4_f16"], n_stages)
    out["layout_balanced_q4"] = stage_layout(s, MODES["q4_f16"], out["split_balanced_q4"])
    out["split_balanced"] = {k: balanced_split(s, m, n_stages) for k, m in MODES.items()}
    out["wire"] = [{"wire_dtype": d.label, "bytes_per_token_per_hop": wire.bytes_per_token(d, s.d_model),
                    "bytes_per_token_all_hops": wire.bytes_per_token(d, s.d_model) * (n_stages - 1)}
                   for d in (wire.WireDType.F32, wire.WireDType.F16, wire.WireDType.BF16, wire.WireDType.Q8)]
    per_stage_layers = max(even)
    out["kv"] = [{"kv_dtype": name, "bytes_per_token_per_layer": kv_bytes_per_token_per_layer(s, b),
                  "per_stage_per_1k_tokens": kv_bytes(s, per_stage_layers, 1024, b),
                  "whole_model_per_1k_tokens": kv_bytes(s, s.n_layers, 1024, b)}
                 for name, b in (("f32", 4), ("bf16", 2))]
    out["kv_arenas"] = [{"kv_dtype": name, "lanes": lanes, "capacity": cap,
                         "per_stage_bytes": kv_bytes(s, per_stage_layers, lanes * cap, b)}
                        for lanes, cap in ((1, 8192), (8, 8192), (32, 2048), (1, 131072)) for name, b in
                        (("f32", 4), ("bf16", 2))]
    out["host_needs"] = {"context": DEPLOY_CONTEXT, "lanes": DEPLOY_LANES, "kv_dtype": DEPLOY_KV,
                         "cache_bytes": DEPLOY_CACHE, "split": out["split_balanced_q4"],
                         "stages": host_needs(s, out["split_balanced_q4"])}
    out["timing"] = timing(s, n_stages)
    return out


def timing(s: Shape, n_stages: int, context: int = CONTEXT) -> list[dict[str, Any]]:
    """ms/token and micro-batch throughput for each weight mode, bandwidth and network (bf16 wire)."""
    act = wire.bytes_per_token(wire.WireDType.BF16, s.d_model)
    rows = []
    for key in ("q4_f16", "q4_f32scales", "bf16"):
        m = MODES[key]
        kv_b = 2 if key == "bf16" else 4   # a bf16 stage keeps a bf16 KV, a float32 (q4) stage f32
        layout = stage_layout(s, m, balanced_split(s, m, n_stages))
        reads = [r["read_bytes_per_token"] + kv_bytes(s, r["n_layers"], context, kv_b) for r in layout]
        for bw in BANDWIDTHS_GBS:
            per_stage = [stage_compute_ms(b, bw) for b in reads]
            for rtt, link in NETWORKS:
                t = hop_time_ms(n_stages, sum(per_stage), act, rtt, link)
                busiest = max(per_stage) + MSG_OVERHEAD_MS
                rows.append({"weights": m.name, "kv": "bf16" if kv_b == 2 else "f32", "bandwidth_gbs": bw,
                             "rtt_ms": rtt, "link_mbit": link, "read_gb_per_token": sum(reads) / GB,
                             "compute_ms": t["compute_ms"], "network_ms": t["network_ms"],
                             "ms_per_token": t["ms_per_token"], "tok_s_1": 1000 / t["ms_per_token"],
                             "busiest_stage_ms": busiest,
                             "tok_s_n_micro_batches": micro_batch_tok_s(t["ms_per_token"], busiest, n_stages),
                             "tok_s_cap": 1000 / busiest,
                             "micro_batches_for_cap": math.ceil(t["ms_per_token"] / busiest)})
    return rows


def calibration() -> list[dict[str, Any]]:
    """Effective GB/s of this repo's measured CPU decode steps: bytes a step reads / step time."""
    # measured before 2026-12-01: the f32-scale kernel, so the f32-scale layouts
    q4, i8 = MODES["q4_f32scales"], Mode("int8 runtime", BPW["int8_f32_scales"], BPW["int8_f32_scales"], 4.0, "")
    gguf = Mode("Q4_1 GGUF, Q8_0 head", BPW["gguf_q4_1"], BPW["gguf_q8_0"], BPW["gguf_q8_0"], "")
    cases = [
        # (what, shape, mode, ms per step, context, kv bytes, source)
        ("ours, int8, 4-token context", SMOLLM2, i8, 10.1, 4, 4, "docs/benchmarks.md (side-by-side step timing)"),
        ("ours, q4, 512-token context", SMOLLM2, q4, 1000 / 55.6, 512, 4, "docs/benchmarks.md goals table (55.6 tok/s)"),
        ("llama.cpp Q4_1, 512-token context", SMOLLM2, gguf, 1000 / 109.4, 512, 2,
         "docs/benchmarks.md goals table (109.4 tok/s)"),
        ("ours, q4, 512-token context", LLAMA_1B, q4, 1000 / 7.05, 512, 4, "earlier side-by-side (7.05 tok/s)"),
        ("ours, q4, a second run", LLAMA_1B, q4, 1000 / 9.95, 512, 4,
         "earlier side-by-side (9.95 tok/s, labelled 'async dispatch off', but jax 0.10.2 ignores that "
         "variable: an A/A repeat)"),
        ("llama.cpp Q4_1, 512-token context", LLAMA_1B, gguf, 1000 / 17.0, 512, 2,
         "earlier side-by-side (17.0 tok/s)"),
    ]
    rows = []
    for what, s, m, ms, ctx, kvb, src in cases:
        read = s.n_layers * layer_bytes(s, m) + head_bytes(s, m) + kv_bytes(s, s.n_layers, ctx, kvb)
        rows.append({"model": s.name, "what": what, "ms_per_step": ms, "read_mb": read / 1e6,
                     "effective_gbs": read / (ms / 1000) / GB, "source": src})
    return rows


# ------------------------------------------------------------------ markdown


def _gb(x: float) -> str:
    return f"{x / GB:.2f}"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def markdown(p: dict[str, Any]) -> str:
    s = LLAMA_70B
    w = p["weights"]
    used = p["placement_module"] and not _PLACEMENT_NOTE
    out = [f"Generated by `scripts/scale_plan.py` (runtime bytes from skippy_zmq.ops.placement: {used}"
           + (f"; {_PLACEMENT_NOTE[0]}" if _PLACEMENT_NOTE else "") + ").", ""]
    out.append("### Parameters")
    out.append(_table(["matrix", "shape", "weights"],
                      [[k, {"wq": "8192×8192", "wk": "8192×1024", "wv": "8192×1024", "wo": "8192×8192",
                            "w_gate": "8192×28672", "w_up": "8192×28672", "w_down": "28672×8192"}[k], f"{v:,}"]
                       for k, v in w["per_layer_matrices"].items()]
                      + [["**one layer**", "", f"{w['per_layer']:,}"],
                         ["80 layers", "", f"{80 * w['per_layer']:,}"],
                         ["norms (2 per layer + final)", "", f"{80 * w['norms_per_layer'] + s.d_model:,}"],
                         ["embedding", "128256×8192", f"{w['embed']:,}"],
                         ["head (untied)", "8192×128256", f"{w['head']:,}"],
                         ["**total**", "", f"{w['total']:,}"]]))
    out.append("")
    out.append("### Whole-model bytes")
    out.append(_table(["weights", "B/weight (layers / head / embedding)", "one layer (GB)", "model (GB)", "note"],
                      [[t["mode"], " / ".join(f"{x:.4g}" for x in bytes_per_weight(s, m)), _gb(t["layer_bytes"]),
                        _gb(t["model_bytes"]), t["note"]] for t, m in zip(p["totals"], MODES.values())]))
    out.append("")
    out.append(f"### Per host, even split {p['split_even']}: GB held / GB read per decoded token")
    lay = p["layouts"]
    cols = ("gguf_q4_1", "q4_ckpt", "q4_f16", "q4_f32scales", "bf16")
    hdr = ["stage", "layers"] + [f"{MODES[k].name}" for k in cols]
    rows = []
    for i, r in enumerate(lay["q4_f16"]):
        rows.append([r["stage"], r["layers"]] + [f"{_gb(lay[k][i]['resident_bytes'])} / "
                                                 f"{_gb(lay[k][i]['read_bytes_per_token'])}" for k in cols])
    out.append(_table(hdr, rows))
    out.append("")
    bal = p["layout_balanced_q4"]
    out.append(f"Byte-balanced split for q4 (current, f16 scales): {p['split_balanced_q4']} layers (the head reads "
               f"{head_bytes(s, MODES['q4_f16']) / layer_bytes(s, MODES['q4_f16']):.2f} layers' worth); "
               "per-token reads "
               + ", ".join(f"{r['stage']} {_gb(r['read_bytes_per_token'])}" for r in bal) + " GB.")
    out.append("")
    hn = p["host_needs"]
    out.append(f"### Per host memory, q4 (current), split {hn['split']}: {hn['lanes']} lanes × {hn['context']:,} "
               f"tokens of {hn['kv_dtype']} KV, cache.max_bytes {hn['cache_bytes'] / 2**20:g} MiB (GiB)")
    out.append("")
    out.append("serving = weights + KV + cache + overhead (360 MiB + 28 MiB per layer); peak = max(serving, "
               "loading) (skippy_zmq.ops.placement.stage_need, what `skippy-zmq plan --memory` fits to budgets).")
    out.append("")

    def _gib(x: float | None) -> str:
        return "" if x is None else f"{x / 2**30:.2f}"

    out.append(_table(["stage", "layers", "weights", "KV", "cache", "overhead", "serving", "loading", "peak"],
                      [[r["stage"], r["layers"], _gib(r["weights"]), _gib(r["kv"]), _gib(r["cache"]),
                        _gib(r["overhead"]), _gib(r["serving"]), _gib(r["loading"]), _gib(r["peak"])]
                       for r in hn["stages"]]))
    out.append("")
    out.append("### Activation bytes per token per hop (width 8192)")
    out.append(_table(["wire dtype", "bytes / token / hop", f"bytes / token over {p['stages'] - 1} hops"],
                      [[r["wire_dtype"], f"{r['bytes_per_token_per_hop']:,}", f"{r['bytes_per_token_all_hops']:,}"]
                       for r in p["wire"]]))
    out.append("")
    out.append("### KV")
    out.append(_table(["kv dtype", "bytes / position / layer", "per stage (10 layers) per 1k tokens",
                       "whole model per 1k tokens"],
                      [[r["kv_dtype"], f"{r['bytes_per_token_per_layer']:,}",
                        f"{r['per_stage_per_1k_tokens']:,} ({r['per_stage_per_1k_tokens'] / 2**20:g} MiB)",
                        f"{r['whole_model_per_1k_tokens']:,} ({r['whole_model_per_1k_tokens'] / 2**30:g} GiB)"]
                       for r in p["kv"]]))
    out.append("")
    out.append("KV arena per stage (preallocated: lanes × capacity positions, 10 layers):")
    out.append("")
    out.append(_table(["lanes × capacity", "f32 (GiB)", "bf16 (GiB)"],
                      [[f"{a['lanes']} × {a['capacity']:,}", f"{a['per_stage_bytes'] / 2**30:g}",
                        f"{b['per_stage_bytes'] / 2**30:g}"]
                       for a, b in zip(p["kv_arenas"][::2], p["kv_arenas"][1::2])]))
    out.append("")
    out.append(f"### Time per token (hop model; bf16 wire; KV read at {CONTEXT} tokens of context; "
               "byte-balanced split)")
    out.append(_table(["weights", "GB/s per host", "RTT ms", "link Mbit/s", "GB read / token", "Σ compute ms",
                       "network ms", "ms / token", "tok/s (1 stream)", "busiest stage ms",
                       f"tok/s, {p['stages']} micro-batches", "tok/s cap (busiest stage)",
                       "micro-batches to reach the cap"],
                      [[r["weights"], f"{r['bandwidth_gbs']:g}", f"{r['rtt_ms']:g}", f"{r['link_mbit']:g}",
                        f"{r['read_gb_per_token']:.2f}", f"{r['compute_ms']:.0f}", f"{r['network_ms']:.1f}",
                        f"{r['ms_per_token']:.0f}", f"{r['tok_s_1']:.2f}", f"{r['busiest_stage_ms']:.0f}",
                        f"{r['tok_s_n_micro_batches']:.2f}", f"{r['tok_s_cap']:.2f}",
                        r["micro_batches_for_cap"]] for r in p["timing"]]))
    out.append("")
    out.append("### Calibration: effective bandwidth of measured CPU decode steps (this 2-core VM; measured "
               "before 2026-12-01 with the f32-scale q4/int8 kernel, so bytes read use the f32-scale layouts)")
    out.append(_table(["model", "what", "ms / step", "MB read / step", "effective GB/s", "source"],
                      [[r["model"], r["what"], f"{r['ms_per_step']:.1f}", f"{r['read_mb']:.0f}",
                        f"{r['effective_gbs']:.1f}", r["source"]] for r in p["calibration"]]))
    out.append("")
    out.append("### Published 70B figures (single stream)")
    out.append(_table(["system", "model", "setup", "ms / token", "tok/s", "note"],
                      [[r["system"], r["model"], r["setup"], f"{r['ms_per_token']:g}", f"{r['tok_s']:g}",
                        r["note"]] for r in PUBLISHED]))
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--json", action="store_true", help="print JSON instead of markdown tables")
    args = ap.parse_args(argv)
    p = plan(LLAMA_70B, args.stages)
    p["calibration"] = calibration()
    p["published"] = PUBLISHED
    print(json.dumps(p, indent=2, default=str) if args.json else markdown(p))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

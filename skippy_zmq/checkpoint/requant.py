"""What converting a GGUF keeps and what it changes.

By default (`gguf`) every tensor keeps its own type and blocks; a type we do not keep as it is
(model/ggml.py TYPES: e.g. IQ2_XXS, TQ1_0, MXFP4) is refused by name before any weight is
written. With `--weights f32|bf16|int8|q4` the user asks for a conversion, and is told which
tensors were requantised (a second rounding on top of llama.cpp's), which were only dequantised
(exact values, more bytes) and which kept their levels, and what the checkpoint costs against
the file's tensor bytes; source.json records the same.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from loguru import logger

from skippy_zmq.checkpoint.families import ConvertError
from skippy_zmq.checkpoint.formats import KEEP, stored_format
from skippy_zmq.model import ggml

EXAMPLES = 3     # tensor names quoted per refused type


def check_kept_types(src: Any, fmt: str) -> None:
    """Under `gguf`, every tensor of the file must be of a type we keep: else a ConvertError naming them."""
    if fmt != KEEP:
        return
    refused: dict[str, list[str]] = {}
    for name in src.tensors:
        kind = src.type_name(name)
        if kind not in ggml.TYPES:
            refused.setdefault(kind, []).append(name)
    if refused:
        lines = [f"{kind} ({', '.join(names[:EXAMPLES])}{f' and {len(names) - EXAMPLES} more' if len(names) > EXAMPLES else ''})"
                 for kind, names in sorted(refused.items())]
        raise ConvertError(f"tensors of GGUF types this runtime does not keep as they are: {'; '.join(lines)}. "
                           f"Kept types: {', '.join(ggml.TYPES)}. Convert with --weights q4, int8, bf16 or f32 "
                           "to requantise them (a second rounding: the model served is then not the file's)")


def fate(kind: str, stored: str) -> str:
    """"kept" (the file's bytes or levels), "dequantised" (exact values in f32) or "requantised"."""
    if stored == KEEP or kind == stored.upper() or (kind in ggml.KERNEL_TYPES and stored in ("int8", "q4")
                                                    and (stored == "int8" or ggml.KERNEL_TYPES[kind] == 4)):
        return "kept"
    return "dequantised" if stored == "f32" else "requantised"


def _stored_as(name: str, shape: tuple[int, ...], fmt: str, top_names: dict[str, tuple[str, str]]) -> str:
    if len(shape) < 2:
        return "f32"                      # vectors stay f32 in every format
    key = next((k for k, (gguf_name, _) in top_names.items() if gguf_name == name), "layer")
    return stored_format(fmt, "router" if "ffn_gate_inp" in name else key)


def report_gguf(src: Any, fmt: str, work: Path, top_names: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """Log and return what the conversion of `src` into `fmt` (written under `work`) kept and changed."""
    fates: dict[str, Counter] = {"kept": Counter(), "dequantised": Counter(), "requantised": Counter()}
    changed: list[str] = []
    for name, t in src.tensors.items():
        kind = src.type_name(name)
        what = fate(kind, _stored_as(name, src.shape(name), fmt, top_names))
        fates[what][kind] += 1
        if what == "requantised":
            changed.append(name)
    file_bytes = sum(int(t.n_bytes) for t in src.tensors.values())
    ckpt_bytes = sum(p.stat().st_size for p in (Path(work) / "params").rglob("*") if p.is_file())
    ratio = ckpt_bytes / max(file_bytes, 1)
    logger.info("{} weights: checkpoint {:.1f} MiB for the file's {:.1f} MiB of tensors ({:.3f}x); kept {}, "
                "dequantised {}, requantised {}", fmt, ckpt_bytes / 2**20, file_bytes / 2**20, ratio,
                dict(fates["kept"]) or "none", dict(fates["dequantised"]) or "none", dict(fates["requantised"]) or "none")
    if changed:
        logger.warning("--weights {} requantised {} tensors (a second rounding on llama.cpp's: the values served "
                       "differ from the file's): {}{}", fmt, len(changed), ", ".join(changed[:8]),
                       f" and {len(changed) - 8} more" if len(changed) > 8 else "")
    return {"gguf_tensor_bytes": file_bytes, "checkpoint_bytes": ckpt_bytes, "bytes_ratio": round(ratio, 4),
            **{what: dict(c) for what, c in fates.items()}, "requantised_tensors": changed}

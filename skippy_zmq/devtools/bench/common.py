"""What every benchmark suite shares: the synthetic prompt, the machine record,
Markdown tables, and the stage settings a run's `--device`/`--dtype` imply."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

FILLER = ("The quick brown fox jumps over the lazy dog while the river runs past the old mill. "
          "Numbers like 12345 and names like Ada Lovelace appear in this benchmark text. ")


def synthetic_prompt(tokenizer: Any, n_tokens: int) -> list[int]:
    """Exactly n_tokens ids of ordinary English text."""
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids.extend(tokenizer.encode(FILLER, add_bos=False))
    return ids[:n_tokens]


def machine() -> dict[str, Any]:
    import jax

    from skippy_zmq.model import quant

    return {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_avg_1m": round(os.getloadavg()[0], 2),
            "kernel_isa": quant.kernel_isa() or "xla", "kernel_isas_here": quant.supported_isas()}


def stage_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """write_topology overrides that put every stage on the run's device, dtype and weights."""
    return {"device": args.device, "dtype": args.dtype, "weights": args.weights or "f32"}


def device_label(args: argparse.Namespace) -> str:
    """'JAX on cpu, float32' and the like, for table titles."""
    return f"JAX on {args.device}, {args.dtype}"


def format_table(title: str, rows: list[dict[str, Any]], note: str = "") -> str:
    """A Markdown table (columns = the first row's keys), with an optional note under it."""
    if not rows:
        return ""
    keys = list(rows[0])
    lines = [f"### {title}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_cell(r.get(k, "")) for k in keys) + " |" for r in rows]
    if note:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    return str(value).replace("|", "\\|")


def print_table(title: str, rows: list[dict[str, Any]], note: str = "") -> str:
    text = format_table(title, rows, note)
    if text:
        print(text, flush=True)
    return text


def int_list(text: str) -> tuple[int, ...]:
    """'1,2,3' -> (1, 2, 3); an argparse type."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def write_report(out_dir: str | Path, name: str, title: str, result: dict[str, Any], text: list[str]) -> None:
    """A suite's own report beside bench.json: NAME.json (the result) and NAME.md (its tables)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{name}.md").write_text(f"# {title}\n\n" + "\n".join(text))


def llama_cpp_available() -> bool:
    """llama-cpp-python, where a Python API is the point (bench scale and spec still use it)."""
    return importlib.util.find_spec("llama_cpp") is not None


def find_gguf(model: Path) -> Path | None:
    """The GGUF a converted model came from (source.json), next to or inside the model directory."""
    try:
        name = json.loads((model / "source.json").read_text()).get("file", "")
    except (OSError, ValueError):
        return None
    for candidate in (model / name, model.parent / name):
        if name.endswith(".gguf") and candidate.is_file():
            return candidate
    return None

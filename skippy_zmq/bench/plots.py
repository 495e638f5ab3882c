"""PNG plots of a benchmark result (matplotlib, Agg backend; the `bench` extra).

Each plot is drawn only when its suite ran; without matplotlib the plots are
skipped with a note and the tables are still written.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Callable


def matplotlib_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")   # files only; never a display
    import matplotlib.pyplot as plt

    return plt


def plot_concurrency(rows: list[dict[str, Any]], path: Path) -> Path:
    """Aggregate decode tok/s against concurrent streams, one line per stage count."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for stages in sorted({r["stages"] for r in rows}):
        pts = sorted((r["streams"], r["agg_tok_s"]) for r in rows if r["stages"] == stages)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{stages} stage{'s' * (stages > 1)}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["streams"] for r in rows}), labels=[str(s) for s in sorted({r["streams"] for r in rows})])
    ax.set(xlabel="concurrent streams", ylabel="aggregate decode tok/s",
           title="Aggregate decode tok/s vs concurrent streams")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, plt, path)


def plot_prefix(rows: list[dict[str, Any]], path: Path) -> Path:
    """TTFT with a cold and a warm prefix cache, by shared-prefix length."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r["prefix_tokens"] for r in rows]
    ax.plot(x, [r["cold_ttft_ms"] for r in rows], marker="o", label="cold (prefill)")
    ax.plot(x, [r["warm_ttft_ms"] for r in rows], marker="s", label="warm (restored)")
    ax.set(xlabel="shared prefix tokens", ylabel="TTFT (ms)", title="Prefix cache: TTFT cold vs warm")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, plt, path)


def plot_hops(rows: list[dict[str, Any]], path: Path) -> Path:
    """Measured ms/token against the direct-return and relay-back models, per stage count."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, stages in enumerate(sorted({r["stages"] for r in rows})):
        pts = sorted((r for r in rows if r["stages"] == stages), key=lambda r: r["delay_ms"])
        d = [0.0] + [r["delay_ms"] for r in pts]
        compute = pts[0]["base_ms"]   # no delay: both models and the measurement start at the base
        color = f"C{i}"
        ax.plot(d, [compute] + [r["measured_ms"] for r in pts], marker="o", color=color,
                label=f"{stages} stages: measured")
        ax.plot(d, [compute] + [r["model_direct_ms"] for r in pts], ls="--", color=color,
                label=f"{stages} stages: direct model")
        ax.plot(d, [compute] + [r["model_relay_ms"] for r in pts], ls=":", color=color,
                label=f"{stages} stages: relay model")
    ax.set(xlabel="simulated delay per hop (ms)", ylabel="decode ms/token", title="Hop delay: measured vs model")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(result: dict[str, Any], out: Path) -> list[Path]:
    """Every plot whose suite is in `result`; returns the files written."""
    if not matplotlib_available():
        print("[bench] plots skipped: matplotlib is not installed (pip install -e '.[bench]')", flush=True)
        return []
    jobs: list[tuple[Callable[[list[dict[str, Any]], Path], Path], list[dict[str, Any]], str]] = [
        (plot_concurrency, (result.get("pipeline") or {}).get("rows", []), "concurrency.png"),
        (plot_prefix, (result.get("prefix") or {}).get("ttft", []), "prefix_ttft.png"),
        (plot_hops, (result.get("hops") or {}).get("rows", []), "hops.png"),
    ]
    return [plot(rows, out / name) for plot, rows, name in jobs if rows]

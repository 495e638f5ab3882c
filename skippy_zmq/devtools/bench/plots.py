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


def _bars(ax: Any, groups: list[str], series: dict[str, list[float | None]]) -> None:
    """Grouped bars: one group per label in `groups`, one bar per series (None: no bar)."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar([x for x, v in zip(xs, values) if v is not None], [v for v in values if v is not None],
               width=width, label=name)
    ax.set_xticks(range(len(groups)), labels=groups)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)


def plot_peers_single(rows: list[dict[str, Any]], path: Path) -> Path:
    """Single-stream decode tok/s per model, ours beside llama.cpp (the ratio rows left out)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    models = list(dict.fromkeys(r["model"] for r in rows))
    engines = list(dict.fromkeys(r["engine"] for r in rows if not r["engine"].startswith("ratio")))
    value = {(r["model"], r["engine"]): r["decode_tok_s"] for r in rows}
    _bars(ax, models, {e: [value.get((m, e)) for m in models] for e in engines})
    ax.set(ylabel="decode tok/s", title="Single stream: decode tok/s")
    return _save(fig, plt, path)


def plot_peers_speculation(rows: list[dict[str, Any]], path: Path) -> Path:
    """Speculation on ÷ off per engine and method, copy and chat workloads."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    methods = list(dict.fromkeys(f"{r['speculation']}" for r in rows))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    value = {(r["speculation"], r["workload"]): r["speedup"] for r in rows}
    _bars(ax, methods, {w: [value.get((m, w)) for m in methods] for w in workloads})
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax.set(ylabel="tok/s with ÷ without", title="Speculation: speed-up over plain decoding, 1 stream")
    return _save(fig, plt, path)


def plot_peers_concurrency(rows: list[dict[str, Any]], path: Path) -> Path:
    """Aggregate tok/s against streams: ours per stage count, llama-server with -np = streams."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    lines: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        name = "llama-server -np N" if r["engine"].startswith("llama-server") else r["engine"]
        lines.setdefault(name, []).append((r["streams"], r["agg_tok_s"]))
    for name, pts in lines.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    streams = sorted({r["streams"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(streams, labels=[str(s) for s in streams])
    ax.set(xlabel="concurrent streams", ylabel="aggregate decode tok/s", title="Concurrency: ours beside llama-server")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def plot_peers_rpc(rows: list[dict[str, Any]], path: Path) -> Path:
    """One stream through N stages at each per-hop delay: ours beside llama-server over N rpc-servers
    (log scale: 20 ms rows are an order of magnitude below 0 ms ones)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    stages = [f"{r['stages']} stages, {r.get('hop_ms', 0):g} ms" for r in rows]
    _bars(ax, stages, {"skippy_zmq": [r["ours_tok_s"] for r in rows],
                       "llama-server + rpc-server": [r.get("llama_rpc_tok_s") for r in rows]})
    ax.set_yscale("log")
    ax.set(ylabel="tok/s (log)", title="Pipeline, 1 stream, per-hop delay each way")
    return _save(fig, plt, path)


def plot_cluster_splits(rows: list[dict[str, Any]], path: Path) -> Path:
    """bench cluster: each split's 1-stream ms/token and 8-stream tok/s, predicted beside measured."""
    plt = _pyplot()
    fig, (one, many) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [r["split"].split(" ")[0] if r["split"].startswith("grid") else r["split"] for r in rows]
    labels = [f"{name}\n{r['layers'].replace(' / ', '/')}" for name, r in zip(labels, rows)]
    _bars(one, labels, {"measured": [r.get("ms_per_token_1") for r in rows],
                        "predicted": [r.get("predicted_ms_1") for r in rows]})
    one.set(ylabel="ms per token", title="1 stream: time per token")
    _bars(many, labels, {"measured": [r.get("tok_s_8") for r in rows],
                         "predicted": [r.get("predicted_tok_s_8") for r in rows]})
    many.set(ylabel="aggregate tok/s", title="8 streams: tok/s")
    for ax in (one, many):
        ax.tick_params(axis="x", labelsize=6, labelrotation=60)
    return _save(fig, plt, path)


def plot_cluster_recut(rows: list[dict[str, Any]], path: Path) -> Path:
    """bench cluster's re-cut row: tokens every 2 s of the 8 streams from host b's slowdown, with
    the re-cut's marks (let go, switched, ready, ...; the drop after them is b killed for good)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    recut = rows[0]
    counts = recut.get("timeline_2s") or []
    ax.plot([2 * i for i in range(len(counts))], counts, drawstyle="steps-post")
    for i, (mark, t) in enumerate(sorted((recut.get("marks_s") or {}).items(), key=lambda kv: kv[1])):
        ax.axvline(t, color=f"C{1 + i % 9}", linestyle="--", label=mark)
    ax.set(xlabel="seconds after host b slowed", ylabel="tokens in 2 s (8 streams)",
           title=f"Re-cut while serving: {recut.get('split_before')} -> {recut.get('split_after')}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, plt, path)


PEERS_PLOTS = [("single", plot_peers_single, "peers_single.png"),
               ("speculation", plot_peers_speculation, "peers_speculation.png"),
               ("concurrency", plot_peers_concurrency, "peers_concurrency.png"),
               ("rpc", plot_peers_rpc, "peers_rpc.png")]


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
        *[(plot, (result.get("peers") or {}).get(table) or [], name) for table, plot, name in PEERS_PLOTS],
        (plot_cluster_splits, (result.get("cluster") or {}).get("splits", []), "cluster_splits.png"),
        (plot_cluster_recut, [r for r in [(result.get("cluster") or {}).get("recut")] if r], "cluster_recut.png"),
    ]
    return [plot(rows, out / name) for plot, rows, name in jobs if rows]

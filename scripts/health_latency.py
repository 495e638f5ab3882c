"""/health latency while the worst request of each kind runs (issue 38's goal: p99 <= 100 ms).

Serves the OpenAI app in a child process (so the clients here do not share its GIL) over a scripted
engine (tests/fake_engine.py: the HTTP layer is what is measured, not the model) with the real
SmolLM2 tokenizer, then for each kind of
skippy_zmq/devtools/worst_requests.py sends it `--repeat` times in a row while a prober polls /health every
`--interval-ms` (and on until `--min-seconds` have passed); an idle row first. The prober runs
in a third process, so only the server's own work can delay it. Prints a table and writes bench-out/health_latency.json.

    .venv/bin/python scripts/health_latency.py [--repeat 3] [--interval-ms 10] [--min-seconds 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from fake_engine import FakeEngine  # noqa: E402

from skippy_zmq.api.server import create_app, start_in_thread  # noqa: E402
from skippy_zmq.text.tokenizer import TextTokenizer  # noqa: E402
from skippy_zmq.devtools.worst_requests import HealthProbe, send, worst_requests  # noqa: E402

TOKENIZER_DIR = REPO / "models" / "smollm2-135m-instruct"
MAX_CONTEXT = 65536


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} CPUs)"
    except OSError:
        pass
    return platform.processor() or "unknown"


def _serve(port_out: multiprocessing.Queue, stop: multiprocessing.Event) -> None:
    """The child: the app on a free port, until `stop` is set."""
    from loguru import logger

    logger.remove()   # the server's debug lines would swamp the table
    tok = TextTokenizer.load(TOKENIZER_DIR)
    engine = FakeEngine([*tok.encode("Hello there!"), tok.eos_ids[0]], tok.eos_ids, max_context=MAX_CONTEXT)
    handle = start_in_thread(create_app(engine, tok, model_name="m"))
    port_out.put(handle.port)
    stop.wait()
    handle.stop()


def _probe(url: str, interval_s: float, ready: multiprocessing.Event, stop: multiprocessing.Event,
           out: multiprocessing.Queue) -> None:
    """The prober's child: polls until `stop`, then hands back its summary."""
    import httpx

    httpx.get(url + "/health", timeout=30).raise_for_status()   # imports done, server reached
    with HealthProbe(url, interval_s) as probe:
        ready.set()
        stop.wait()
    out.put(probe.summary())


def probed(spawn: multiprocessing.context.BaseContext, url: str, interval_s: float, work) -> dict:
    """/health latencies (a summary) while `work()` runs, polled from a third process so neither
    the server's nor the senders' GIL is the prober's."""
    ready, stop, out = spawn.Event(), spawn.Event(), spawn.Queue()
    prober = spawn.Process(target=_probe, args=(url, interval_s, ready, stop, out), daemon=True)
    prober.start()
    if not ready.wait(120):
        raise RuntimeError("the /health prober did not start")
    try:
        work()
    finally:
        stop.set()
    summary = out.get(timeout=60)
    prober.join(30)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--interval-ms", type=float, default=10.0)
    parser.add_argument("--min-seconds", type=float, default=2.0, help="shortest window per kind")
    parser.add_argument("--out", type=Path, default=REPO / "bench-out" / "health_latency.json")
    args = parser.parse_args()
    spawn = multiprocessing.get_context("spawn")
    port_out, stop = spawn.Queue(), spawn.Event()
    server = spawn.Process(target=_serve, args=(port_out, stop), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port_out.get(timeout=120)}"
    vocab_size = TextTokenizer.load(TOKENIZER_DIR).vocab_size
    interval_s, rows = args.interval_ms / 1000, []
    try:
        window = args.min_seconds
        idle = probed(spawn, url, interval_s, lambda: time.sleep(window))   # a measuring window, not a sync
        rows.append({"kind": "idle", "statuses": [], "seconds": window, **idle})
        for kind in worst_requests(vocab_size):
            body = kind.body()   # built before the window opens
            statuses: list[int] = []

            def attack() -> None:   # `repeat` times, and on until the window is `min_seconds` long
                until = time.perf_counter() + window
                while len(statuses) < args.repeat or time.perf_counter() < until:
                    statuses.append(send(url, kind, body)[0])

            start = time.perf_counter()
            summary = probed(spawn, url, interval_s, attack)
            rows.append({"kind": kind.name, "statuses": statuses, "seconds": time.perf_counter() - start,
                         **summary})
    finally:
        stop.set()
        server.join(30)
    print(f"/health every {args.interval_ms:g} ms while each request runs {args.repeat}x; CPU: {_cpu()}")
    print(f"{'kind':<18}{'status':>8}{'time s':>9}{'polls':>7}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    for row in rows:
        status = ",".join(sorted({str(s) for s in row["statuses"]})) or "-"
        print(f"{row['kind']:<18}{status:>8}{row['seconds']:>9.2f}{row['polls']:>7}{row['p50_ms']:>9.1f}"
              f"{row['p99_ms']:>9.1f}{row['max_ms']:>9.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpu": _cpu(), "interval_ms": args.interval_ms, "repeat": args.repeat,
                                    "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

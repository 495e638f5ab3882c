"""Peers: the llama.cpp a user deploys, `llama-server` (built by `make peers`), beside ours, in one run.

Both engines are driven through their OpenAI-compatible `/v1/completions` with the same client code
(`stream_completion`): the same prompt ids (the GGUF's vocabulary is ours), greedy, `ignore_eos`,
streamed, on the same GGUF (ours runs its Q4_1 levels as q4) and the same cores (2 threads for
llama.cpp). Every prompt is used once per engine, so neither engine's prompt cache can serve it.

- single stream: prefill tok/s (prompt ÷ time to first token) and decode tok/s (tokens after the
  first ÷ the time they took), SmolLM2 and the random 1B / 8B shapes (their GGUFs carry no
  vocabulary, on which llama-server aborts detokenizing: llama.cpp's rows come from llama-bench);
- speculation: copy and chat workloads, ours on vs off, `llama-server --spec-type T` for every
  n-gram type it has vs plain, tokens over request time; greedy text compared with plain for both;
- concurrency: 1, 8, 16, 32 streams at once, plain decoding, ours on 1/2/3 stages vs
  `llama-server -np N` (continuous batching): aggregate tok/s and p50/p99 time between tokens;
- pipeline: one stream through 2 and 3 processes, ours vs llama-server over as many rpc-servers
  with the same even layer split, at 0 ms and at 20 ms per hop: at 20 ms every connection between
  two processes of either engine (our driver and stages; llama-server and its rpc-servers) passes
  through a relay that holds each byte 20 ms each way (bench/relay.py: this kernel has no netem).

Without a build (`make peers`, or `bench peers --build`) the llama.cpp side says so and is skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from skippy_zmq.devtools.bench.common import find_gguf, print_table, synthetic_prompt, write_report
from skippy_zmq.devtools.bench.pipeline import percentile

NOT_BUILT = "not built (make peers)"
SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
STREAM_COUNTS = (1, 8, 16, 32)
THREADS = 2
START_S = 600.0
HOP_DELAYS_MS = (0.0, 20.0)


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return round(ours / theirs, 3) if ours and theirs else None


# ---------------------------------------------------------------- the client, the same for both engines


@dataclass
class Streamed:
    start: float
    first: float | None = None       # first token's arrival
    end: float = 0.0
    tokens: int = 0                  # completion tokens (the usage, else the chunks)
    text: str = ""
    arrivals: list[float] = field(default_factory=list)   # one per chunk that carried text
    error: str | None = None

    @property
    def decode_tok_s(self) -> float | None:
        if self.first is None or self.tokens < 2 or self.end <= self.first:
            return None
        return (self.tokens - 1) / (self.end - self.first)


def stream_completion(base: str, prompt: list[int], max_tokens: int, extra: dict[str, Any] | None = None,
                      timeout: float = 600.0) -> Streamed:
    """One streamed greedy /v1/completions request over token ids; arrival times on the client."""
    import httpx

    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}, **(extra or {})}
    got = Streamed(start=time.perf_counter())
    usage = None
    try:
        with httpx.stream("POST", base + "/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                got.error = f"HTTP {r.status_code}: {r.read()[:300]!r}"
                return got
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                piece = "".join(c.get("text") or "" for c in event.get("choices") or [])
                if piece:
                    now = time.perf_counter()
                    got.first = got.first or now
                    got.arrivals.append(now)
                    got.text += piece
    except (httpx.HTTPError, ValueError) as exc:
        got.error = f"{type(exc).__name__}: {exc}"
    got.end = got.arrivals[-1] if got.arrivals else time.perf_counter()
    got.tokens = int((usage or {}).get("completion_tokens") or len(got.arrivals))
    return got


def run_together(base: str, prompts: list[list[int]], max_tokens: int, extra: dict[str, Any] | None = None
                 ) -> tuple[list[Streamed], float]:
    """All prompts at once, one thread each; (results, wall seconds)."""
    out: list[Streamed | None] = [None] * len(prompts)

    def one(i: int) -> None:
        out[i] = stream_completion(base, prompts[i], max_tokens, extra)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [o for o in out if o is not None], time.perf_counter() - t0


def _check(results: list[Streamed], what: str) -> None:
    bad = [r.error for r in results if r.error]
    if bad:
        raise RuntimeError(f"{what}: {len(bad)} request(s) failed, first: {bad[0]}")


def single_stream(base: str, prompts: list[list[int]], new_tokens: int, extra: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    """Each prompt alone, one after another: medians of prefill and decode tok/s, and the texts."""
    runs = [stream_completion(base, p, new_tokens, extra) for p in prompts]
    _check(runs, "single stream")
    return {"prefill_tok_s": round(statistics.median(len(p) / (r.first - r.start) for p, r in zip(prompts, runs)), 1),
            "decode_tok_s": round(statistics.median(r.decode_tok_s or 0.0 for r in runs), 2),
            "e2e_tok_s": round(sum(r.tokens for r in runs) / sum(r.end - r.start for r in runs), 2),
            "texts": [r.text for r in runs], "tokens": [r.tokens for r in runs]}


def concurrent(base: str, prompts: list[list[int]], new_tokens: int, extra: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    """All at once: aggregate tok/s (every completion token over the wall time) and the time between
    a stream's tokens (p50/p99 over every stream)."""
    runs, wall = run_together(base, prompts, new_tokens, extra)
    _check(runs, f"{len(prompts)} streams")
    gaps = sorted(b - a for r in runs for a, b in zip(r.arrivals, r.arrivals[1:])) or [0.0]
    return {"streams": len(prompts), "agg_tok_s": round(sum(r.tokens for r in runs) / wall, 1),
            "itl_p50_ms": round(1000 * percentile(gaps, 0.5), 1), "itl_p99_ms": round(1000 * percentile(gaps, 0.99), 1)}


# ---------------------------------------------------------------- the engines


def _http_ok(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _port_open(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
        return True
    except OSError:
        return False


def _wait(ready: Any, what: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Until `ready()` (a server answering), failing at once if its process exits, or at the deadline."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(f"{log.stem} exited with {proc.returncode}; see {log}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout:g} s; see {log}")
        time.sleep(0.2)    # the server is loading; nothing to block on


def llama_server_command(binary: str, gguf: Path, port: int, slots: int, context: int,
                         spec_type: str | None = None) -> list[str]:
    """llama-server as a user runs it on this CPU: THREADS threads, `slots` parallel slots with
    `context` positions each (the total is divided among slots), continuous batching (its default)."""
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(THREADS),
           "-tb", str(THREADS), "-np", str(slots), "-c", str(context * slots), "-ngl", "0", "--no-webui"]
    return cmd + (["--spec-type", spec_type] if spec_type else [])


@contextmanager
def llama_server(binary: str, gguf: Path, port: int, run_dir: Path, slots: int = 1, context: int = 1024,
                 spec_type: str | None = None) -> Iterator[str]:
    """A llama-server process; yields its API base URL; always stopped."""
    from skippy_zmq.ops.launch import stop_processes

    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / f"llama-server-np{slots}{'-' + spec_type if spec_type else ''}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(llama_server_command(binary, gguf, port, slots, context, spec_type),
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: _http_ok(f"http://127.0.0.1:{port}/health"), f"llama-server on port {port}", proc, log, START_S)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop_processes([proc])


@contextmanager
def llama_rpc(binaries: dict[str, str], gguf: Path, hosts: int, run_dir: Path, context: int,
              hop_ms: float = 0.0) -> Iterator[str]:
    """llama.cpp's pipeline across processes: `hosts` rpc-servers on localhost (THREADS threads each)
    and a llama-server that puts every layer on them, split evenly (`-ts 1,1,...`), as a user splits
    a model across machines; with `hop_ms`, llama-server dials each rpc-server through a relay that
    holds every byte that long each way. Yields the API base URL."""
    from skippy_zmq.ops.launch import stop_processes

    run_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    with ExitStack() as stack:
        stack.callback(lambda: stop_processes(procs[::-1]))
        ports = []
        for i in range(hosts):
            port, log = _port(), run_dir / f"rpc-server-{hosts}-{i}.log"
            with open(log, "w") as f:
                procs.append(subprocess.Popen([binaries["rpc-server"], "-H", "127.0.0.1", "-p", str(port), "-t",
                                               str(THREADS)], stdout=f, stderr=subprocess.STDOUT))
            _wait(lambda p=port: _port_open(p), f"rpc-server on port {port}", procs[-1], log, START_S)
            ports.append(port)
        ports = stack.enter_context(_delayed(ports, hop_ms))
        port, log = _port(), run_dir / f"llama-server-rpc{hosts}.log"
        cmd = llama_server_command(binaries["llama-server"], gguf, port, 1, context)
        cmd[cmd.index("-ngl") + 1] = "999"
        cmd += ["--rpc", ",".join(f"127.0.0.1:{p}" for p in ports), "-ts", ",".join(["1"] * hosts)]
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT))
        _wait(lambda: _http_ok(f"http://127.0.0.1:{port}/health"), f"llama-server on port {port}", procs[-1], log,
              START_S)
        yield f"http://127.0.0.1:{port}/v1"


@contextmanager
def _delayed(ports: list[int], hop_ms: float) -> Iterator[list[int]]:
    """The ports to dial for `ports` on localhost: themselves at 0 ms, else one relay each that holds
    every byte `hop_ms` each way (bench/relay.py)."""
    from skippy_zmq.devtools.bench.relay import relays

    if not hop_ms:
        yield ports
        return
    from skippy_zmq.devtools.harness import free_base_port

    base = free_base_port(len(ports))
    fronts = list(range(base, base + len(ports)))
    with relays([(front, "127.0.0.1", port) for front, port in zip(fronts, ports)], hop_ms):
        yield fronts


@contextmanager
def our_server(model: Path, stages: int, run_dir: Path, lanes: int, context: int,
               hop_ms: float = 0.0) -> Iterator[str]:
    """Our stages and driver (speculation available per request), warmed; with `hop_ms`, every stage
    and the driver's return endpoint are dialled through a relay that holds every byte that long each
    way (the topology's `advertise` keys). Yields the API base URL."""
    import yaml

    from skippy_zmq.devtools.harness import write_topology
    from skippy_zmq.ops.launch import spawn_driver, spawn_stages, stop_processes, wait_http_ready
    from skippy_zmq.devtools.soak import wait_warmed
    from skippy_zmq.config.topology import load_topology

    run_dir.mkdir(parents=True, exist_ok=True)
    path = write_topology(run_dir, model.absolute(), stages, name=f"peers-{stages}", weights="q4",
                          kv_lanes=lanes, driver__max_sessions=lanes, driver__max_context=context,
                          driver__speculative={"method": "ngram"}, driver__request_timeout_s=900.0,
                          driver__reply_timeout_s=300.0, driver__dead_after_s=60.0)
    topology = load_topology(path)
    endpoints = [topology.driver.return_endpoint] + [s.listen for s in topology.stages]
    with _delayed([int(e.rsplit(":", 1)[1]) for e in endpoints], hop_ms) as fronts:
        if hop_ms:
            data = yaml.safe_load(path.read_text())
            data["driver"]["return_advertise"] = f"tcp://127.0.0.1:{fronts[0]}"
            for stage, front in zip(data["stages"], fronts[1:]):
                stage["advertise"] = f"tcp://127.0.0.1:{front}"
            path.write_text(yaml.safe_dump(data, sort_keys=False))
            topology = load_topology(path)
        procs = spawn_stages(topology, path, run_dir, ["--log-level", "INFO"])
        try:
            procs.append(spawn_driver(path, run_dir, ["--log-level", "INFO"]))
            url = f"http://{topology.driver.http_host}:{topology.driver.http_port}"
            wait_http_ready(url, procs, run_dir, START_S)
            wait_warmed(url + "/v1", START_S)
            yield url + "/v1"
        finally:
            stop_processes(procs)


# ---------------------------------------------------------------- the models and prompts


@dataclass(frozen=True)
class PeerModel:
    name: str
    ours: Path           # q4 checkpoint holding the GGUF's levels
    gguf: Path
    vocab_ids: Any       # callable(n, seed) -> prompt ids


def peer_models(args: argparse.Namespace, names: list[str]) -> list[PeerModel]:
    from skippy_zmq.devtools.bench.spec import q4_model
    from skippy_zmq.text.tokenizer import TextTokenizer

    out = []
    for name in names:
        if name == "smollm2":
            model = Path(args.model)
            gguf = find_gguf(model)
            if gguf is None:
                print(f"[peers] no GGUF found for {model}; SmolLM2 skipped", flush=True)
                continue
            tok = TextTokenizer.load(model)
            filler = synthetic_prompt(tok, 4096)
            out.append(PeerModel(name, q4_model(model, gguf), gguf,
                                 lambda n, seed, f=filler: [f[(seed * 37) % 512]] + f[1 + seed:n + seed]))
        else:
            from skippy_zmq.devtools.bench.scale import ScaleCase, _vocab, ensure_model, prompt_ids

            model, _made = ensure_model(ScaleCase(name, (1,), 256, 32))
            vocab = _vocab(model)
            out.append(PeerModel(name, model, model / "model.gguf",
                                 lambda n, seed, v=vocab: prompt_ids(v, n, seed=seed + 10)))
    return out


# ---------------------------------------------------------------- the bench


def _port() -> int:
    from skippy_zmq.devtools.harness import free_base_port

    return free_base_port(1)


def llama_bench(binary: str, gguf: Path, prompt_tokens: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    """llama-bench on THREADS threads: prefill of `prompt_tokens` from an empty context, and decode of
    `new_tokens` after that many (-d), as ours is measured; tokens/s averaged over `repeats`."""
    def avg_ts(*flags: str) -> float:
        out = subprocess.run([binary, "-m", str(gguf), "-t", str(THREADS), "-r", str(repeats), "-o", "json", *flags],
                             capture_output=True, text=True, check=True)
        return round(float(json.loads(out.stdout)[0]["avg_ts"]), 2)

    return {"prefill_tok_s": avg_ts("-p", str(prompt_tokens), "-n", "0"),
            "decode_tok_s": avg_ts("-p", "0", "-n", str(new_tokens), "-d", str(prompt_tokens))}


def single_rows(m: PeerModel, binaries: dict[str, str] | None, args: argparse.Namespace, tmp: Path
                ) -> list[dict[str, Any]]:
    prompts = [m.vocab_ids(args.prompt_tokens, seed) for seed in range(1, 1 + args.repeats)]
    warm = m.vocab_ids(args.prompt_tokens, 99)
    context = args.prompt_tokens + args.new_tokens + 64
    rows = []
    with our_server(m.ours, 1, tmp / f"ours-{m.name}", 1, context) as base:
        stream_completion(base, warm, 8)
        ours = single_stream(base, prompts, args.new_tokens, {"speculative": False})
    rows.append({"model": m.name, "engine": "skippy_zmq q4, 1 stage", **_speeds(ours)})
    if binaries and m.name == "smollm2":
        with llama_server(binaries["llama-server"], m.gguf, _port(), tmp / f"llama-{m.name}", 1, context) as base:
            stream_completion(base, warm, 8)
            theirs = single_stream(base, prompts, args.new_tokens)
        engine = "llama-server"
    elif binaries:   # a random model's GGUF has no vocabulary: llama-server aborts detokenizing its output
        theirs = llama_bench(binaries["llama-bench"], m.gguf, args.prompt_tokens, args.new_tokens, args.repeats)
        engine = "llama-bench (in process; no vocabulary for llama-server)"
    if binaries:
        rows.append({"model": m.name, "engine": engine, **_speeds(theirs)})
        rows.append({"model": m.name, "engine": "ratio ours ÷ llama.cpp",
                     "prefill_tok_s": ratio(ours["prefill_tok_s"], theirs["prefill_tok_s"]),
                     "decode_tok_s": ratio(ours["decode_tok_s"], theirs["decode_tok_s"])})
    return rows


def _speeds(run: dict[str, Any]) -> dict[str, Any]:
    return {"prefill_tok_s": run["prefill_tok_s"], "decode_tok_s": run["decode_tok_s"]}


def spec_rows(m: PeerModel, binary: str | None, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """Copy and chat, one stream: decode tok/s with speculation and without, and whether greedy text
    with it equals the text without it, for both engines."""
    from skippy_zmq.devtools.bench.spec import workloads
    from skippy_zmq.text.tokenizer import TextTokenizer

    work = workloads(TextTokenizer.load(m.ours), 2 if args.quick else None)
    new = args.new_tokens
    context = max(len(p) for ps in work.values() for p in ps) + new + 64
    rows = []
    with our_server(m.ours, 1, tmp / f"ours-spec-{m.name}", 1, context) as base:
        stream_completion(base, work["chat"][0], 8)
        for workload, prompts in work.items():
            off = single_stream(base, prompts, new, {"speculative": False})
            on = single_stream(base, prompts, new, {"speculative": True})
            rows.append(_spec_row("skippy_zmq q4, 1 stage", "ngram (ours)", workload, off, on))
    if binary:
        plain: dict[str, dict[str, Any]] = {}
        with llama_server(binary, m.gguf, _port(), tmp / "llama-spec", 1, context) as base:
            stream_completion(base, work["chat"][0], 8)
            for workload, prompts in work.items():
                plain[workload] = single_stream(base, prompts, new)
        for spec_type in SPEC_TYPES[:2] if args.quick else SPEC_TYPES:   # quick: two types, the path is the same
            with llama_server(binary, m.gguf, _port(), tmp / "llama-spec", 1, context, spec_type) as base:
                stream_completion(base, work["chat"][0], 8)
                for workload, prompts in work.items():
                    on = single_stream(base, prompts, new)
                    rows.append(_spec_row("llama-server", spec_type, workload, plain[workload], on))
    return rows


def _spec_row(engine: str, method: str, workload: str, off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    same = sum(a == b for a, b in zip(off["texts"], on["texts"]))
    return {"engine": engine, "speculation": method, "workload": workload, "off_tok_s": off["e2e_tok_s"],
            "on_tok_s": on["e2e_tok_s"], "speedup": ratio(on["e2e_tok_s"], off["e2e_tok_s"]),
            "greedy_same": f"{same}/{len(off['texts'])}"}


def concurrency_rows(m: PeerModel, binary: str | None, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    counts = (1, 4) if args.quick else STREAM_COUNTS
    new, prompt_len = (16, 32) if args.quick else (64, 64)
    context = prompt_len + new + 64
    rows = []
    salt = iter(range(1000, 100000))
    for stages in args.stages:
        with our_server(m.ours, stages, tmp / f"ours-conc-{stages}", max(counts), context) as base:
            run_together(base, [m.vocab_ids(prompt_len, next(salt)) for _ in range(max(counts))], 8)
            for n in counts:   # plain decoding, as llama-server's
                got = concurrent(base, [m.vocab_ids(prompt_len, next(salt)) for _ in range(n)], new,
                                 {"speculative": False})
                rows.append({"engine": f"skippy_zmq q4, {stages} stage(s)", **got})
    if binary:
        for n in counts:
            with llama_server(binary, m.gguf, _port(), tmp / "llama-conc", n, context) as base:
                run_together(base, [m.vocab_ids(prompt_len, next(salt)) for _ in range(n)], 8)
                got = concurrent(base, [m.vocab_ids(prompt_len, next(salt)) for _ in range(n)], new)
            rows.append({"engine": f"llama-server -np {n}", **got})
    return rows


def rpc_rows(m: PeerModel, record: dict[str, Any] | None, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """One stream through 2 and 3 processes, plain decoding, at each per-hop delay: ours with one KV lane
    beside llama-server (one slot) over 2 and 3 rpc-servers with the same even layer split; at 20 ms
    both engines behind relays."""
    new, prompt_len = (16, 32) if args.quick else (64, 64)
    context = prompt_len + new + 64
    rows = []
    for hop_ms in getattr(args, "hop_delays", HOP_DELAYS_MS):
        for stages in (s for s in args.stages if s > 1):
            row: dict[str, Any] = {"stages": stages, "hop_ms": hop_ms}
            with our_server(m.ours, stages, tmp / f"ours-hop-{stages}", 1, context, hop_ms) as base:
                run_together(base, [m.vocab_ids(prompt_len, 7000 + stages)], 8)
                got = concurrent(base, [m.vocab_ids(prompt_len, 6000 + stages)], new, {"speculative": False})
            row["ours_tok_s"] = got["agg_tok_s"]
            if record:
                with llama_rpc(record["binaries"], m.gguf, stages, tmp / "llama-rpc", context, hop_ms) as base:
                    run_together(base, [m.vocab_ids(prompt_len, 5000 + stages)], 8)
                    got = concurrent(base, [m.vocab_ids(prompt_len, 6000 + stages)], new)
                row["llama_rpc_tok_s"] = got["agg_tok_s"]
                row["ratio"] = ratio(row["ours_tok_s"], got["agg_tok_s"])
            rows.append(row)
    return rows


def ratio_rows(conc: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ours ÷ llama-server at each stream count, per stage count."""
    theirs = {r["streams"]: r["agg_tok_s"] for r in conc if r["engine"].startswith("llama-server")}
    return [{"engine": r["engine"], "streams": r["streams"], "ratio": ratio(r["agg_tok_s"], theirs.get(r["streams"]))}
            for r in conc if r["engine"].startswith("skippy_zmq") and r["streams"] in theirs]


def peers_plots(result: dict[str, Any], out: Path) -> list[Path]:
    """A PNG per table of this run (`bench peers` alone; `bench all` draws them with the others)."""
    from skippy_zmq.devtools.bench.plots import PEERS_PLOTS, matplotlib_available

    if not matplotlib_available():
        print("[peers] plots skipped: matplotlib is not installed (pip install -e '.[bench]')", flush=True)
        return []
    out.mkdir(parents=True, exist_ok=True)
    return [plot(result[table], out / name) for table, plot, name in PEERS_PLOTS if result.get(table)]


def bench_peers(args: argparse.Namespace, tables: list[str], _prior: dict[str, Any] | None = None) -> dict[str, Any]:
    import tempfile

    from skippy_zmq.devtools.bench import llama_build

    if getattr(args, "build", False):
        llama_build.build()
    record = llama_build.built()
    binary = record["binaries"]["llama-server"] if record else None
    if binary is None:
        print(f"[peers] llama-server {NOT_BUILT}: only our rows", flush=True)
    everything = args.suite == "peers" and not args.quick
    names = [n for n in (getattr(args, "peer_models", "") or ("smollm2,llama-3.2-1b,llama-3.1-8b" if everything
             else "smollm2")).split(",") if n]
    models = peer_models(args, names)
    result: dict[str, Any] = {"llama_server": record or NOT_BUILT, "threads": THREADS}
    with tempfile.TemporaryDirectory(prefix="skippy-peers-") as t:
        tmp = Path(t)
        single = [row for m in models for row in single_rows(m, record["binaries"] if record else None, args, tmp)]
        result["single"] = single
        tables.append(print_table(f"single stream, {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, "
                                  "greedy", single))
        if models and models[0].name == "smollm2":
            spec = spec_rows(models[0], binary, args, tmp)
            result["speculation"] = spec
            tables.append(print_table("speculation, SmolLM2, 1 stream, greedy", spec,
                                      "tok/s = completion tokens ÷ request time (prompt included), over the prompts: a "
                                      "stream that sends a verify window's tokens in one chunk cannot inflate it; "
                                      "greedy_same: prompts whose text with speculation equals the text without"))
            conc = concurrency_rows(models[0], binary, args, tmp)
            result["concurrency"] = conc
            tables.append(print_table("concurrency, SmolLM2 (64-token prompts, 64 new tokens each, plain decoding)", conc))
            tables.append(print_table("aggregate ÷ llama-server -np N", ratio_rows(conc)))
            rpc = rpc_rows(models[0], record, args, tmp)
            result["rpc"] = rpc
            tables.append(print_table("pipeline, 1 stream, plain: ours on N stages ÷ llama-server over N rpc-servers "
                                      "(same even layer split); hop_ms: each way between any two processes, through "
                                      "relays (bench/relay.py)", rpc))
    smol = [r for r in single if r["model"] == "smollm2"]
    if binary and len(smol) >= 2:
        result["llama_cpp"] = {"engine": "llama-server", "decode_tok_s": smol[1]["decode_tok_s"],
                               "prefill_tok_s": smol[1]["prefill_tok_s"]}
    if args.suite == "peers":
        from skippy_zmq.devtools.bench.common import machine

        result["machine"] = machine()
        plots = peers_plots(result, Path(args.out))
        result["plots"] = [p.name for p in plots]
        write_report(args.out, "peers", "skippy_zmq beside llama-server (same GGUF, same cores, one run)",
                     result, tables + [f"\n![{p.stem}]({p.name})\n" for p in plots])
    return result

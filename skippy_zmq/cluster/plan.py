"""`skippy-zmq plan --measure` / `--hosts`: this host measured (measure.py) beside the hosts of a
hosts JSON, split by measured speed under memory caps (ops/planner.py, ops/speed.py)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger

from skippy_zmq.ops.planner import PlanRequest, SpeedRequest, plan_speed_text, read_hosts


@dataclass(frozen=True)
class SpeedArgs:
    measure: bool = False            # measure this host too
    hosts: str | None = None         # a hosts JSON (planner.read_hosts)
    measure_out: str | None = None   # write this host's measurement here
    name: str | None = None          # this host's name (default: its hostname)
    device: str = "cpu"
    objective: str = "latency"
    streams: int = 8
    rtt_ms: float | None = None      # every link's round trip not given in the hosts JSON
    stages: int | None = None        # exactly this many hosts (default: any number)
    position: int | None = None      # decode position measured (default: measure.POSITION)


def measure_and_plan(req: PlanRequest, args: SpeedArgs, memory: tuple[int, ...] | None = None) -> str:
    """The plan's text (predictions and bytes as comments, then the topology YAML). `memory[0]`,
    when given, is this host's budget (else the memory it has available)."""
    hosts, default_rtt, rtt = read_hosts(Path(args.hosts)) if args.hosts else ((), 0.0, ())
    if args.measure:
        here = measure_here(req, args, memory)
        hosts += (here,)
    rtt_ms = args.rtt_ms if args.rtt_ms is not None else default_rtt
    return plan_speed_text(req, SpeedRequest(hosts, rtt_ms, rtt, args.objective, args.streams, args.stages))


def measure_here(req: PlanRequest, args: SpeedArgs, memory: tuple[int, ...] | None) -> dict[str, Any]:
    from skippy_zmq.cluster.measure import measure_host

    here = measure_host(req.model, req.weights, req.dtype, args.device, name=args.name or "",
                        **({"position": args.position} if args.position is not None else {}))
    if memory:
        here["memory"] = memory[0]
    if args.measure_out:
        Path(args.measure_out).write_text(json.dumps(here, indent=2) + "\n")
        logger.info("plan: this host's measurement written to {}", args.measure_out)
    return here


def add_speed_flags(p: argparse.ArgumentParser) -> None:
    """`plan`'s flags for a split by measured speed."""
    p.add_argument("--measure", action="store_true", help="measure this host's speed for the model (a few seconds) "
                                                           "and split by measured speed (with --hosts: beside them)")
    p.add_argument("--hosts", default=None, metavar="HOSTS.json",
                   help="hosts' measurements (`plan --measure --measure-out`), memory budgets and link round "
                        "trips: split by measured speed under memory caps")
    p.add_argument("--measure-out", default=None, metavar="FILE.json", help="write this host's measurement here")
    p.add_argument("--name", default=None, help="this host's name in its measurement (default: its hostname)")
    p.add_argument("--measure-position", dest="position", type=int, default=None,
                   help="--measure decode steps at this position: the workload's typical one (default 128)")
    p.add_argument("--device", default="cpu", help="--measure on this device: cpu | gpu:N | tpu:N")
    p.add_argument("--objective", default="latency", choices=["latency", "throughput"],
                   help="by speed: least time per token at 1 stream, or most tok/s at --streams streams")
    p.add_argument("--streams", type=int, default=8, help="streams the throughput prediction (and objective) is for")
    p.add_argument("--rtt-ms", type=float, default=None, help="round trip of every link not given in --hosts (ms)")


def plan_from_args(args: argparse.Namespace, req: PlanRequest, memory: tuple[int, ...] | None) -> str:
    """`plan --measure` / `--hosts` (with --stages: exactly that many hosts)."""
    if args.split:
        raise ValueError("--split does not go with --measure / --hosts (the measurements split it)")
    return measure_and_plan(req, SpeedArgs(args.measure, args.hosts, args.measure_out, args.name, args.device,
                                           args.objective, args.streams, args.rtt_ms, args.stages, args.position), memory)

"""The `cluster:` section of a topology: where the driver meets workers that join with a token.

    cluster:
      listen: tcp://0.0.0.0:5590     # the driver's cluster ROUTER (CURVE; workers connect to it)
      advertise: null                # the endpoint join tokens carry, when workers cannot dial `listen`
                                     # (default: listen, a wildcard host as this machine's name)
      token_ttl_s: 86400             # a join token admits new workers for this long
      max_chunk_bytes: 1048576       # the most weight bytes one fetch request may ask for
      split: topology                # topology: the stages' own layer ranges, to workers in join order;
                                     # measured: wait for as many workers as stages, plan host order and
                                     # cut points from their measured speed and memory (ops/speed.py)
      objective: latency             # split: measured plans for latency (1 stream) or throughput
      streams: 8                     # the streams a throughput plan (and the logged prediction) is for
      recut: true                    # re-cut while serving (docs/cluster.md): on `skippy-zmq rebalance`,
                                     # a worker gone for good or joined, or measured drift
      recut_threshold: 1.3           # re-cut when a stage's measured step time ÷ its planned time exceeds
                                     # the others' by this factor (0: never on drift) ...
      recut_window_s: 20             # ... sustained over this long
      recut_payback_s: 120           # a drift re-cut only when the time it saves over this much serving
                                     # (predicted from the measured speeds) beats the last re-cut's measured cost
      gone_after_s: 15               # a worker silent this long is gone for good: plan around it

With the section (or `skippy-zmq driver --cluster`) the driver serves the checkpoint's items to
workers (skippy_zmq/cluster/) and each stage runs on the worker it is given to.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass


SPLITS = ("topology", "measured")
OBJECTIVES = ("latency", "throughput")   # ops/speed.OBJECTIVES (config cannot import ops)


@dataclass(frozen=True)
class ClusterConfig:
    listen: str = "tcp://0.0.0.0:5590"
    advertise: str | None = None
    token_ttl_s: float = 86400.0
    max_chunk_bytes: int = 1 << 20
    split: str = "topology"
    objective: str = "latency"
    streams: int = 8
    recut: bool = True
    recut_threshold: float = 1.3
    recut_window_s: float = 20.0
    recut_payback_s: float = 120.0
    gone_after_s: float = 15.0

    @property
    def connect(self) -> str:
        """The endpoint a worker dials (and a token carries)."""
        if self.advertise is not None:
            return self.advertise
        return re.sub(r"^tcp://(\*|0\.0\.0\.0):", f"tcp://{socket.gethostname()}:", self.listen)

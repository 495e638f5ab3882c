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

    @property
    def connect(self) -> str:
        """The endpoint a worker dials (and a token carries)."""
        if self.advertise is not None:
            return self.advertise
        return re.sub(r"^tcp://(\*|0\.0\.0\.0):", f"tcp://{socket.gethostname()}:", self.listen)

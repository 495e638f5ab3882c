"""The driver scheduler's settings (built from the topology's driver section)."""

from __future__ import annotations

from dataclasses import dataclass

from skippy_zmq.config.model import BATCH_TOKENS
from skippy_zmq.config.speculative import SpeculativeConfig


@dataclass(frozen=True)
class SchedulerConfig:
    n_stages: int
    micro_batches: int = 0           # decode micro-batches in flight; 0 = n_stages
    max_sessions: int = 8
    max_queue: int = 64
    prefill_chunk: int = 256
    prefill_credit: int = 2          # prefill chunks in flight at once
    max_context: int = 2048
    reply_timeout_s: float = 30.0
    request_timeout_s: float = 120.0
    resume_timeout_s: float = 60.0   # how long paused requests wait for a replacement stage
    speculative: SpeculativeConfig = SpeculativeConfig()
    window_lens: tuple[int, ...] = (1, 2, 4, 8, 16)   # the stages' row buckets (config.Buckets.window_lens)
    run_on: int = 0                  # the chain decodes up to this many steps from its own samples
    batch_tokens: int = BATCH_TOKENS  # a DECODE with several rows pads them all to its longest window: cap rows x window

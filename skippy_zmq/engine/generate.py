"""Single-process generation: the Scheduler over an in-process chain of one stage that
holds every layer (engine/inproc.py), so one loop accepts and stops tokens everywhere.

Follows the pipeline's protocol, so results compare one to one: prefill covers
prompt[:-1]; the first decode carries the last prompt token.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from skippy_zmq.config.model import KVConfig
from skippy_zmq.config.speculative import SpeculativeConfig
from skippy_zmq.checkpoint.loader import load_slice
from skippy_zmq.engine.inproc import InprocChain, finished, run_until
from skippy_zmq.engine.request import EngineError, GenRequest, TokenEvent
from skippy_zmq.engine.scheduler import Scheduler, SchedulerConfig
from skippy_zmq.model import fuse
from skippy_zmq.model.runner import SliceRunner, resolve_device
from skippy_zmq.protocol.wire import Kind
from skippy_zmq.sampling import SamplingParams
from skippy_zmq.stage.sessions import SessionTable
from skippy_zmq.stage.worker import StageInfo, StageWorker
from skippy_zmq.text.tokenizer import TextTokenizer


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0
    warmup_s: float = 0.0   # compiling the shapes this request needed, before its clock started
    speculative: dict = field(default_factory=dict)   # windows, drafted, accepted (when drafting ran)

    @property
    def prefill_tokens_per_s(self) -> float:
        n = max(len(self.prompt_ids) - 1, 0)
        return n / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # The first generated token comes with the last prompt token; count
        # the steady-state steps after it.
        n = len(self.token_ids) - 1
        return n / self.decode_s if self.decode_s > 0 and n > 0 else 0.0

    def to_json(self) -> dict:
        out = asdict(self)
        if self.speculative.get("windows"):
            # Accepted drafts per verify step (as bench spec reports it); each step also yields the
            # target's own next token.
            spec = out["speculative"]
            spec["accepted_per_step"] = round(spec["accepted"] / spec["windows"], 3)
            spec["acceptance"] = round(spec["accepted"] / spec["drafted"], 3) if spec["drafted"] else 0.0
        out.update(prefill_tokens_per_s=round(self.prefill_tokens_per_s, 2),
                   decode_tokens_per_s=round(self.decode_tokens_per_s, 2))
        return out


WEIGHT_FORMATS = ("auto", "gguf", "f32", "bf16", "int8", "q4")   # LocalEngine(weights=...) -> load_slice(fmt=...)


class LocalEngine:
    """The whole model in this process, one lane: the Scheduler over an in-process chain of one
    stage worker that holds every layer (the pipeline's engine, without sockets)."""

    def __init__(self, model_dir: Path, dtype: str = "float32", device: str = "cpu", capacity: int = 2048,
                 weights: str = "f32", lanes: int = 1):
        """weights: "gguf", "f32", "bf16", "int8" or "q4" (the checkpoint's format or a coarser one; see
        checkpoint/checkpoint.py), or "auto": the checkpoint's own. lanes: sessions at once
        (`generate_many`; `generate` uses one)."""
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
        self.tokenizer = TextTokenizer.load(model_dir)
        dev = resolve_device(device)
        self.cfg, params = load_slice(model_dir, dtype=dtype, device=dev, fmt=weights)
        if dev.platform == "cpu":   # fused layer by layer, one copy held (model/fuse.py)
            params = fuse.fuse_params(params, consume=True)
        capacity = min(capacity, self.cfg.max_seq_len)
        self.runner = SliceRunner(self.cfg, params, 0, self.cfg.n_layers,
                                  KVConfig(lanes=lanes, capacity=capacity, dtype=dtype), device=dev)
        info = StageInfo("local", first=True, last=True, width=self.cfg.d_model)
        self.lanes = lanes
        self.chain = InprocChain([StageWorker(info, self.runner, SessionTable(lanes))])

    def warmup(self, prompt_tokens: int | None = None, max_tokens: int = 0, everything: bool = False,
               windows: tuple[int, ...] = ()) -> float:
        """Compile ahead of requests; returns the seconds spent (about 0 when nothing was left to compile).

        No arguments: every prefill chunk and the one-row decode step at the first attention bucket
        (sequences up to 256 positions). `everything=True`: those at every attention bucket up to
        the capacity, so no request compiles (a server calls this once at start; it costs about 4x
        the default). With `prompt_tokens`: only what a request of that many prompt tokens and up
        to `max_tokens` new ones will use; `generate` does this itself before its clock starts, so
        a fresh process's first request runs no compile inside its prefill or decode timing and
        reports the compile time apart (`GenerationResult.warmup_s`).
        """
        if prompt_tokens is None:
            return self.runner.warmup(rows=(1,), attn_lens=self.runner.attn_buckets() if everything else None)
        pairs, decode = self.runner.request_shapes(0, max(prompt_tokens - 1, 0), max_tokens)
        return self.runner.warmup(rows=(1,), attn_lens=tuple(sorted(decode)), pairs=pairs, windows=windows)

    def generate(self, prompt_ids: list[int], sampling: SamplingParams = SamplingParams(),
                 max_tokens: int = 64, ignore_eos: bool = False,
                 on_token: Callable[[int], None] | None = None,
                 speculative: SpeculativeConfig = SpeculativeConfig()) -> GenerationResult:
        """Greedy or sampled generation; `speculative` drafts from the prompt and output and verifies
        each window in one step, giving the same tokens as without it (sampling is keyed by position)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        room = self.runner.capacity - len(prompt_ids)
        if room <= 0:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in a "
                             f"{self.runner.capacity}-token context")
        max_tokens = min(max_tokens, room)
        result = GenerationResult(prompt_ids=list(prompt_ids))
        windows = self.runner.buckets.spec_windows(speculative.max_draft if speculative.enabled else 0)
        result.warmup_s = self.warmup(len(prompt_ids), max_tokens, windows=windows)
        scheduler = Scheduler(SchedulerConfig(
            n_stages=1, max_sessions=1, max_queue=0, prefill_chunk=self.runner.capacity, prefill_credit=1,
            max_context=self.runner.capacity, speculative=speculative, window_lens=self.runner.buckets.window_lens,
            reply_timeout_s=float("inf"), request_timeout_s=float("inf")),   # one caller, who waits
            frozenset(self.tokenizer.eos_ids))
        request = GenRequest("local", tuple(prompt_ids), sampling, max_tokens, ignore_eos)
        events = _Timed(on_token)
        prefill_before = self.chain.busy_s[Kind.PREFILL]
        scheduler.submit(request, events.append)
        run_until(scheduler, self.chain, lambda: finished(events.items))
        result.prefill_s = self.chain.busy_s[Kind.PREFILL] - prefill_before
        events.fill(result)
        result.text = self.tokenizer.decode(result.token_ids, skip_special=True)
        return result


    def generate_many(self, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = False
                      ) -> list[list[int]]:
        """Each prompt's greedy tokens, the prompts decoded together as rows of one step (one lane
        each, as a pipeline batches streams): a reference for many streams at the cost of about one."""
        if not prompts or len(prompts) > self.lanes:
            raise ValueError(f"{len(prompts)} prompts for an engine of {self.lanes} lane(s)")
        if not all(prompts):
            raise ValueError("a prompt is empty")
        max_tokens = min(max_tokens, self.runner.capacity - max(map(len, prompts)))
        if max_tokens <= 0:
            raise ValueError(f"the longest prompt leaves no room in a {self.runner.capacity}-token context")
        scheduler = Scheduler(SchedulerConfig(
            n_stages=1, max_sessions=len(prompts), max_queue=len(prompts), prefill_chunk=self.runner.capacity,
            prefill_credit=1, max_context=self.runner.capacity, window_lens=self.runner.buckets.window_lens,
            reply_timeout_s=float("inf"), request_timeout_s=float("inf")), frozenset(self.tokenizer.eos_ids))
        events: list[list[Any]] = [[] for _ in prompts]
        for i, prompt in enumerate(prompts):
            scheduler.submit(GenRequest(f"local{i}", tuple(prompt), SamplingParams(), max_tokens, ignore_eos),
                             events[i].append)
        run_until(scheduler, self.chain, lambda: all(finished(e) for e in events))
        for e in events:
            if e and isinstance(e[-1], EngineError):
                raise e[-1]
        return [[x.token_id for x in e if x.token_id is not None] for e in events]


class _Timed:
    """A request's events as they come, with the time of its first and last token."""

    def __init__(self, on_token: Callable[[int], None] | None):
        self.on_token, self.items = on_token, []
        self.t0 = time.perf_counter()
        self.t_first = self.t_last = self.t0

    def append(self, event: Any) -> None:
        self.items.append(event)
        if isinstance(event, TokenEvent) and event.token_id is not None:
            self.t_last = time.perf_counter()
            if len(self.items) == 1:
                self.t_first = self.t_last
            if self.on_token:
                self.on_token(event.token_id)

    def fill(self, result: GenerationResult) -> None:
        if self.items and isinstance(self.items[-1], EngineError):
            raise self.items[-1]
        result.token_ids = [e.token_id for e in self.items]
        result.finish_reason = self.items[-1].finish_reason
        result.speculative = dict(self.items[-1].stats.get("speculative", {}))
        result.ttft_s = self.t_first - self.t0
        result.decode_s = self.t_last - self.t_first

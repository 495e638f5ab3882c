"""Single-process generation: tokenizer + one SliceRunner over every layer + sampler.

Follows the pipeline's protocol so results compare one to one: prefill
covers prompt[:-1]; the first decode carries the last prompt token.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from skippy_zmq.config.model import KVConfig
from skippy_zmq.engine.speculative import Drafter, judge_window
from skippy_zmq.config.speculative import SpeculativeConfig
from skippy_zmq.checkpoint.loader import load_slice
from skippy_zmq.model.runner import SliceRunner, resolve_device
from skippy_zmq.text.tokenizer import TextTokenizer
from skippy_zmq.sampling import Sampler, SamplingParams


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


def stop_reason(token: int, n_generated: int, max_tokens: int, eos_ids: set[int], ignore_eos: bool) -> str | None:
    if not ignore_eos and token in eos_ids:
        return "stop"
    if n_generated >= max_tokens:
        return "length"
    return None


WEIGHT_FORMATS = ("f32", "bf16", "int8", "q4")   # LocalEngine(weights=...) -> load_slice(fmt=...)


class LocalEngine:
    """The whole model in this process; one lane."""

    def __init__(self, model_dir: Path, dtype: str = "float32", device: str = "cpu", capacity: int = 2048,
                 weights: str = "f32"):
        """weights: "f32", "bf16", "int8" or "q4" (the checkpoint's format or a coarser one; see model/checkpoint.py)."""
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
        self.tokenizer = TextTokenizer.load(model_dir)
        dev = resolve_device(device)
        self.cfg, params = load_slice(model_dir, dtype=dtype, device=dev, fmt=weights)
        capacity = min(capacity, self.cfg.max_seq_len)
        self.runner = SliceRunner(self.cfg, params, 0, self.cfg.n_layers,
                                  KVConfig(lanes=1, capacity=capacity, dtype=dtype), device=dev)

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
        sampler = Sampler(sampling, prompt_ids)
        eos = set(self.tokenizer.eos_ids)
        windows = self.runner.buckets.spec_windows(speculative.max_draft if speculative.enabled else 0)
        result.warmup_s = self.warmup(len(prompt_ids), max_tokens, windows=windows)
        t0 = time.perf_counter()
        if len(prompt_ids) > 1:
            self.runner.prefill(0, np.asarray(prompt_ids[:-1], np.int32), 0, output="none")
        result.prefill_s = time.perf_counter() - t0
        token, pos = prompt_ids[-1], len(prompt_ids) - 1
        spec = Drafter(speculative, prompt_ids) if speculative.enabled else None
        t1 = time.perf_counter()
        reason = None
        while reason is None:
            room = min(max_tokens - len(result.token_ids), self.runner.capacity - 1 - pos)
            drafts = spec.drafts(room, windows, max(windows, default=1)) if spec is not None else []
            row = [token] + drafts
            logits = self.runner.step(np.array([0]), np.array(row), np.array([pos]), np.array([len(row)]))
            targets = sampler.sample_window(logits, pos, row)
            run, _ = judge_window(None, drafts, targets) if spec is None else spec.judge(drafts, targets)
            for token in run:
                result.token_ids.append(token)
                if spec is not None:
                    spec.accepted((token,))
                if len(result.token_ids) == 1:
                    result.ttft_s = time.perf_counter() - t0
                    t1 = time.perf_counter()
                if on_token:
                    on_token(token)
                pos += 1
                reason = stop_reason(token, len(result.token_ids), max_tokens, eos, ignore_eos)
                if reason:
                    result.finish_reason = reason
                    break
        if spec is not None:
            result.speculative = spec.stats()
        result.decode_s = time.perf_counter() - t1
        result.text = self.tokenizer.decode(result.token_ids, skip_special=True)
        return result

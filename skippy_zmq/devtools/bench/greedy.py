"""Greedy tokens of a pipeline against the single-process engine on the CPU in
fp32, on the same chat prompts: the check that a stage on another device or
dtype still computes the same model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from skippy_zmq.engine.request import GenRequest

QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.",
             "Explain in one sentence why the sky is blue.")
N_TOKENS = 32


def first_mismatch(got: list[int], want: list[int]) -> int:
    """Leading tokens that agree (the common length when none differs)."""
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def cpu_reference(model: Path, n_tokens: int = N_TOKENS) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy tokens) from one process on the CPU in fp32."""
    from skippy_zmq.engine.generate import LocalEngine

    engine = LocalEngine(model)
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    return prompts, [engine.generate(p, max_tokens=n_tokens, ignore_eos=True).token_ids for p in prompts]


def pipeline_tokens(engine: Any, prompts: list[list[int]], n_tokens: int = N_TOKENS) -> list[list[int]]:
    """Greedy tokens through a running pipeline, one request at a time."""
    return [[e.token_id for e in engine.generate_blocking(GenRequest("greedy", tuple(p), max_tokens=n_tokens,
                                                                     ignore_eos=True))
             if e.token_id is not None] for p in prompts]


def agreement_row(stages: int, got: list[list[int]], want: list[list[int]]) -> dict[str, Any]:
    """How far each prompt's tokens follow the CPU's before the first difference."""
    leading = [first_mismatch(g, w) for g, w in zip(got, want)]
    return {"stages": stages, "prompts": len(want), "identical": sum(g == w for g, w in zip(got, want)),
            "agree": f"{sum(leading)}/{sum(len(w) for w in want)}", "first_mismatch": leading}

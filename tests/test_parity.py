"""Real SmolLM2-135M: tokenizer ids and 32 greedy fp32 tokens equal HF transformers'."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import first_mismatch
from skippy_zmq.generate import LocalEngine


@pytest.fixture(scope="module")
def engine(model_dir):
    return LocalEngine(model_dir)


def test_prompt_ids_and_greedy_tokens_match_transformers(engine, parity):
    for case in parity["prompts"]:
        ids = engine.tokenizer.encode(case["prompt_text"], add_bos=False)
        assert ids == case["prompt_ids"]
        result = engine.generate(ids, max_tokens=32, ignore_eos=True)
        want = case["transformers_fp32_ids"]
        assert first_mismatch(result.token_ids, want) == 32, (result.token_ids, want)


def test_stops_at_eos_unless_ignored(engine, parity):
    case = parity["prompts"][0]   # greedy reaches <|im_end|> (id 2) at token 8
    result = engine.generate(case["prompt_ids"], max_tokens=32)
    assert result.finish_reason == "stop"
    assert result.token_ids == case["transformers_fp32_ids"][:8]
    assert result.text == "The capital of France is Paris."


def test_generate_cli_json(model_dir, parity):
    case = parity["prompts"][1]
    out = subprocess.run([sys.executable, "-m", "skippy_zmq.cli", "--log-level", "WARNING", "generate",
                          "--model", str(model_dir), "--raw", "--json", "--ignore-eos", "--max-tokens", "8",
                          case["prompt_text"]], capture_output=True, text=True, timeout=300, check=True)
    data = json.loads(out.stdout)
    assert data["prompt_ids"] == case["prompt_ids"]
    assert data["token_ids"] == case["transformers_fp32_ids"][:8]
    assert data["decode_tokens_per_s"] > 0 and data["prefill_tokens_per_s"] > 0
    assert data["text"]

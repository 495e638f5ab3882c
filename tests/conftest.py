"""Shared fixtures: a tiny random model for fast tests, the real model when converted."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from skippy_zmq.config import ModelConfig
from skippy_zmq.model import weights

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "models" / "smollm2-135m-instruct"
PARITY = REPO.parent / "shared" / "parity" / "smollm2_reference.json"

TINY = ModelConfig(arch="llama", n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                   vocab_size=97, rope_theta=10000.0, norm_eps=1e-5, tied_embeddings=True, max_seq_len=512,
                   eos_ids=(2,), bos_id=1, name="tiny")


@pytest.fixture(scope="session")
def tiny_cfg() -> ModelConfig:
    return TINY


@pytest.fixture(scope="session")
def tiny_tree() -> dict:
    return weights.random_params(TINY, seed=0)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    if not (MODEL_DIR / "model.json").is_file():
        pytest.skip(f"real model not converted at {MODEL_DIR} (run `make model`)")
    return MODEL_DIR


@pytest.fixture(scope="session")
def parity() -> dict:
    if not PARITY.is_file():
        pytest.skip(f"parity reference not found at {PARITY}")
    return json.loads(PARITY.read_text())


def first_mismatch(a: list[int], b: list[int]) -> int:
    """Index of the first differing token, or the common length if none."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def random_ids(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, vocab, size=n).astype(np.int32)

"""A live server over a scripted engine and SmolLM2's real tokenizer and template: the fixtures the
API adapters' tests share. A module that imports them sets REPLY, the answer the engine scripts."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from fake_engine import FakeEngine

from skippy_zmq.api.server import create_app, start_in_thread
from skippy_zmq.text.tokenizer import TextTokenizer

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        pytest.skip(f"no tokenizer at {TOKENIZER_DIR}")
    return TextTokenizer.load(TOKENIZER_DIR)


def scripted(tok: TextTokenizer, text: str) -> list[int]:
    return [*tok.encode(text, add_bos=False), tok.eos_ids[0]]


@pytest.fixture(scope="module")
def engine(request, tok) -> FakeEngine:
    return FakeEngine(scripted(tok, request.module.REPLY), tok.eos_ids, model_name="engine-name", max_context=512)


@pytest.fixture(scope="module")
def server(engine, tok):
    handle = start_in_thread(create_app(engine, tok, model_name="smol"))
    yield handle
    handle.stop()


@pytest.fixture(autouse=True)
def fresh_engine(request, tok):
    """Every test that uses the engine starts it afresh on the module's REPLY."""
    if "engine" not in request.fixturenames:
        yield None
        return
    engine = request.getfixturevalue("engine")
    engine.reset()
    engine.script = scripted(tok, request.module.REPLY)
    yield engine


def sse_events(url: str, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event of a streamed POST to `url`."""
    with httpx.stream("POST", url, json={"stream": True, **body}, timeout=20) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        text = resp.read().decode()
    events = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events

"""/v1/embeddings: the final stage pools its final-norm hidden states over the same pipeline.

In process (fast): the scheduler and a chain of StageWorkers over the tiny model through the wire
encoding, against the model computed directly. Over HTTP (slow): the unmodified `openai` SDK
against the session's shared pipelines of the real model (2 and 3 stage processes): alone and
inside a batch of 32, through both, against the directly computed reference, float and base64;
every refusal with its status and message over a scripted engine.
"""

from __future__ import annotations

import base64

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY, lanes_in_use, random_ids
from pipeline_helpers import make_chain, make_scheduler

from skippy_zmq.protocol import wire
from skippy_zmq.engine.request import GenRequest, TokenEvent
from skippy_zmq.engine.inproc import run_requests
from skippy_zmq.model import llama, weights
from skippy_zmq.stage.worker import DRIVER
from model_helpers import random_params


def normed_hidden(cfg, params, ids) -> np.ndarray:
    """The final norm's output at every position of `ids`, computed in one pass without chunks."""
    t = len(ids)
    kv = llama.KVCache.create(cfg, cfg.n_layers, 1, t, jnp.float32)
    out, _, _ = llama.forward_slice(params, kv, jnp.asarray([ids], jnp.int32), jnp.arange(t, dtype=jnp.int32)[None],
                                    jnp.zeros(1, jnp.int32), cfg=cfg, start=0, end=cfg.n_layers, attn_len=t,
                                    output="normed")
    return np.asarray(out[0], np.float64)


def reference(cfg, params, ids, pooling: str = "mean", normalize: bool = True) -> np.ndarray:
    hidden = normed_hidden(cfg, params, ids)
    vector = hidden.mean(axis=0) if pooling == "mean" else hidden[-1]
    return vector / np.linalg.norm(vector) if normalize else vector


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


# ---------------------------------------------------------------- in process


@pytest.fixture(scope="module")
def tiny():
    tree = random_params(TINY, seed=0)
    return tree, weights.to_runtime(tree, jnp.float32)


def embed_inproc(tree, cuts: list[int], prompts: list[list[int]], pooling: str = "mean") -> list[np.ndarray]:
    chain = make_chain(TINY, tree, cuts)
    scheduler = make_scheduler(len(cuts) + 1)   # prefill_chunk 64: a 150-token prompt is three chunks
    requests = [GenRequest(f"r{i}", tuple(int(t) for t in p), pooling=pooling) for i, p in enumerate(prompts)]
    events = run_requests(scheduler, chain, requests)
    assert all(len(w.sessions) == 0 for w in chain.workers), "every lane is freed after the embeddings"
    out = []
    for r in requests:
        (event,) = events[r.request_id]
        assert isinstance(event, TokenEvent) and event.finish_reason == "stop" and event.token_id is None
        assert event.stats["pooled"] == len(r.prompt_ids)
        out.append(event.embedding)
    return out


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_inproc_pooling_matches_the_model_through_1_2_3_stages(tiny, pooling):
    tree, params = tiny
    prompts = [random_ids(150, TINY.vocab_size, seed=1).tolist(), random_ids(5, TINY.vocab_size, seed=2).tolist()]
    by_stages = [embed_inproc(tree, cuts, prompts, pooling) for cuts in ([], [2], [1, 3])]
    for vectors in by_stages[1:]:
        for a, b in zip(by_stages[0], vectors):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    for prompt, vector in zip(prompts, by_stages[0]):
        want = reference(TINY, params, prompt, pooling, normalize=False)
        np.testing.assert_allclose(vector, want, atol=1e-4, rtol=1e-4)
        assert cosine(vector, want) >= 0.9999


def test_a_stage_refuses_a_bad_pooling_ask(tiny):
    tree, _ = tiny
    chain = make_chain(TINY, tree, [])
    worker = chain.workers[0]
    msg = wire.Message(wire.Kind.PREFILL, 7, 1, tokens=np.array([5, 6], np.int32), extras={"pool": "max"})
    (out,) = worker.handle(msg)
    assert out.to == DRIVER and out.message.kind == wire.Kind.ERROR
    assert out.message.extras["code"] == "bad_pooling"
    assert "pool must be one of mean, last" in out.message.extras["error"]


def test_embedding_reply_on_the_wire_is_checked():
    vector = np.arange(8, dtype=np.float32)
    msg = wire.decode(wire.encode(wire.Message.embedding(3, 4, vector, 11, {"trace": []})))
    assert msg.kind == wire.Kind.EMBEDDING and msg.session_id == 4 and msg.tokens.tolist() == [11]
    np.testing.assert_array_equal(msg.activation[0], vector)
    with pytest.raises(wire.WireError, match="as f32, got wire dtype bf16"):
        wire.decode(wire.encode(wire.Message.embedding(3, 4, vector, 11), wire.WireDType.BF16))
    two = wire.Message(wire.Kind.EMBEDDING, 3, 4, tokens=np.array([1, 2], np.int32),
                       activation=np.zeros((2, 8), np.float32))
    with pytest.raises(wire.WireError, match="one session's vector and its pooled token count"):
        wire.decode(wire.encode(two))


# ---------------------------------------------------------------- over HTTP, real stage processes


TEXT = "Pipelines pass activations from stage to stage until the last one pools them."


@pytest.fixture(scope="module")
def fake():
    """The HTTP server over a scripted engine (tests/fake_engine.py): the request layer alone."""
    from fake_engine import FakeEngine
    from test_server import _load_tokenizer

    from skippy_zmq.api.server import create_app, start_in_thread

    tok = _load_tokenizer()
    handle = start_in_thread(create_app(FakeEngine([5], tok.eos_ids, max_context=512), tok, model_name="fake-embed"))
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def served(shared_pipelines):
    """The HTTP server over the session's 2- and 3-stage pipelines of the real model (started once
    for every module that serves from them). One stage holding every layer is the reference below:
    the model computed directly, in one pass (the in-process tests run 1, 2 and 3 stages)."""
    return {n: shared_pipelines(n) for n in (2, 3)}


@pytest.fixture(scope="module")
def real_reference(model_dir):
    """The real model's config and f32 params, as the shared pipelines' stages run them."""
    from skippy_zmq.checkpoint.loader import load_slice

    return load_slice(model_dir)


def client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def batch_of_32() -> list[str]:
    texts = [f"filler text number {i} about {'stages ' * (i % 7)}and lanes" for i in range(32)]
    texts[7] = TEXT
    return texts


def test_embeddings_alone_in_a_batch_and_through_2_and_3_stages_agree_with_the_model(served, real_reference):
    """SmolLM2-135M on 2 and 3 stages: the same text alone and as one of 32 gives the same vector,
    the same on both, which is the directly computed mean of its final-norm hidden states."""
    cfg, params = real_reference
    alone = {}
    for n, s in served.items():
        api = client(s.url)
        one = api.embeddings.create(model="m", input=TEXT)
        assert one.object == "list" and len(one.data) == 1 and one.data[0].index == 0
        ids = s.tokenizer.encode(TEXT)
        assert one.usage.prompt_tokens == len(ids) == one.usage.total_tokens
        alone[n] = np.array(one.data[0].embedding, np.float32)
        many = api.embeddings.create(model="m", input=batch_of_32())
        assert [d.index for d in many.data] == list(range(32))
        np.testing.assert_allclose(np.array(many.data[7].embedding), alone[n], atol=1e-5, rtol=0)
        assert many.usage.prompt_tokens == sum(len(s.tokenizer.encode(t)) for t in batch_of_32())
        assert not lanes_in_use(s.url) or _lanes_freed(s.url)
    np.testing.assert_allclose(alone[2], alone[3], atol=1e-5, rtol=0)
    want = reference(cfg, params, served[2].tokenizer.encode(TEXT))
    assert abs(np.linalg.norm(alone[2]) - 1.0) < 1e-5   # L2-normalised, as llama-server answers
    assert cosine(alone[2], want) >= 0.9999 and cosine(alone[3], want) >= 0.9999


def _lanes_freed(url: str) -> bool:
    """Lanes are reported by heartbeats: wait (bounded) for the STOPs to show."""
    import time

    deadline = time.monotonic() + 30
    while lanes_in_use(url):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_last_pooling_token_ids_and_raw_vectors(served, real_reference):
    cfg, params = real_reference
    s = served[2]
    ids = s.tokenizer.encode(TEXT)
    body = {"model": "m", "input": ids, "pooling": "last", "normalize": False}
    got = httpx.post(s.url + "/v1/embeddings", json=body, timeout=120).json()
    vector = np.array(got["data"][0]["embedding"])
    want = reference(cfg, params, ids, "last", normalize=False)
    assert cosine(vector, want) >= 0.9999
    np.testing.assert_allclose(vector, want, atol=1e-4, rtol=1e-4)


def _decoded(item: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")


def test_base64_is_the_float_answer_bit_for_bit(fake):
    """Over the scripted engine, whose vectors never vary: base64 is the little-endian float32 bytes
    of the very floats the float answer gives, for every input; the SDK decodes it to them."""
    body = {"input": [[3, 4], [5, 7, 11]]}
    plain = httpx.post(fake.url + "/v1/embeddings", json=body, timeout=60).json()
    packed = httpx.post(fake.url + "/v1/embeddings", json={**body, "encoding_format": "base64"}, timeout=60).json()
    assert [d["index"] for d in packed["data"]] == [0, 1]
    for a, b in zip(plain["data"], packed["data"], strict=True):
        np.testing.assert_array_equal(_decoded(b), np.array(a["embedding"], np.float32))
    sdk = client(fake.url).embeddings.create(model="m", input=[[3, 4]])   # the SDK asks for base64 itself
    np.testing.assert_array_equal(np.array(sdk.data[0].embedding, np.float32), _decoded(packed["data"][0]))
    raw = client(fake.url).embeddings.create(model="m", input=[[3, 4]], encoding_format="base64")
    assert raw.data[0].embedding == packed["data"][0]["embedding"]   # handed back as it came


def test_base64_over_the_real_pipeline_decodes_to_the_float_answer(served):
    """The same through 3 stage processes. Two requests are compared, so the bound is the stop-gap's
    (tests/test_stopgap.py): a stage may run a shape layer by layer for one request and whole-slice
    for the next, once its compile behind finished (on a loaded machine, later), and the two
    compiled forms may differ in the last bits (seen: 500 of 576 floats, by at most 6e-8)."""
    s = served[3]
    plain = httpx.post(s.url + "/v1/embeddings", json={"input": [TEXT, "two"]}, timeout=120).json()
    packed = httpx.post(s.url + "/v1/embeddings", json={"input": [TEXT, "two"], "encoding_format": "base64"},
                        timeout=120).json()
    for a, b in zip(plain["data"], packed["data"], strict=True):
        assert _decoded(b).shape == (576,)   # SmolLM2's width, as float32: not float16, not float64
        np.testing.assert_allclose(_decoded(b), np.array(a["embedding"], np.float32), atol=2e-5, rtol=0)
    sdk = client(s.url).embeddings.create(model="m", input=TEXT)
    np.testing.assert_allclose(np.array(sdk.data[0].embedding, np.float32), _decoded(packed["data"][0]),
                               atol=2e-5, rtol=0)


@pytest.mark.parametrize("body, param, text", [
    ({"input": TEXT, "dimensions": 16}, "dimensions", "does not support choosing the embedding's dimensions"),
    ({"input": ""}, "input", "input[0]: is empty"),
    ({"input": []}, "input", "must be a non-empty string"),
    ({"input": [1] * 600}, "input", "has 600 tokens but this model's maximum context length is 512"),
    ({"input": 5}, "input", "must be a non-empty string"),
    ({"input": ["a", 1]}, "input", "only strings, only token ids or only token-id arrays"),
    ({"input": [[1, 2], [-1]]}, "input", "input[1]: token ids must be integers"),
    ({"input": ["a"] * 257}, "input", "257 inputs; at most 256"),
    ({"input": TEXT, "encoding_format": "hex"}, "encoding_format", "must be one of float, base64"),
    ({"input": TEXT, "pooling": "max"}, "pooling", "must be one of mean, last"),
    ({"input": TEXT, "normalize": "yes"}, "normalize", "must be a boolean"),
    ({}, "input", "input: is required"),
])
def test_refusals_are_400_naming_the_field(fake, body, param, text):
    r = httpx.post(fake.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and text in error["message"], error


def test_the_sdk_sees_a_bad_request(fake):
    import openai

    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client(fake.url).embeddings.create(model="m", input=TEXT, dimensions=8)


def test_answer_shape_and_normalisation_over_a_fake_engine(fake):
    """The HTTP layer alone: one engine request per input, in order, each L2-normalised (or raw)."""
    got = client(fake.url).embeddings.create(model="m", input=[[3, 4], [5]], encoding_format="float")
    assert [d.index for d in got.data] == [0, 1] and got.usage.prompt_tokens == 3 == got.usage.total_tokens
    np.testing.assert_allclose(got.data[0].embedding, np.resize([3, 4], 8) / np.linalg.norm(np.resize([3, 4], 8)),
                               rtol=1e-6)
    raw = httpx.post(fake.url + "/v1/embeddings", json={"input": [5], "normalize": False}, timeout=60).json()
    assert raw["data"][0]["embedding"] == [5.0] * 8 and raw["model"] == "fake-embed"

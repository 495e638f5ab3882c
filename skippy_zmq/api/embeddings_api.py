"""`POST /v1/embeddings` (OpenAI's shape) over the generation pipeline: each input is an ordinary
prompt prefilled through every stage, and the final stage pools its final-norm hidden states
(GenRequest.pooling, stage/pooling.py) instead of sampling. No second model is loaded.

Pooling: the model's own when it declares one (none of the families here do), else "mean"; the
extension field `pooling` ("mean" | "last") chooses. Vectors are L2-normalised as llama-server's
/v1/embeddings does (its embd_normalize 2); the extension `normalize: false` returns them raw.
`encoding_format` "float" or "base64" (little-endian float32, as the OpenAI SDK decodes it).
`dimensions` is refused: no model here is trained for truncated (Matryoshka) vectors.

Parsing, tokenising and assembling run in ctx.work (off the event loop), as chat does.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Mapping
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response

from skippy_zmq.api.context import ServerContext
from skippy_zmq.api.streaming import ClientDisconnected, client_gone, unless_disconnected
from skippy_zmq.engine.request import EngineError, GenRequest
from skippy_zmq.api.openai_schema import RequestError, read_body
from skippy_zmq.api.request_prep import parse_body
from skippy_zmq.protocol.wire import POOLINGS


EMBEDDINGS_ENDPOINT = "/v1/embeddings"
MAX_INPUTS = 256          # inputs in one request (each is its own session through the pipeline)
IN_FLIGHT = 32            # of one request's inputs submitted at once: enough to keep every lane busy
DEFAULT_POOLING = "mean"  # for a model that declares none (llama-server: --pooling mean)
ENCODINGS = ("float", "base64")


def install_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post(EMBEDDINGS_ENDPOINT)
    async def embeddings(request: Request) -> Response:
        return await _embeddings(ctx, request)


# ---------------------------------------------------------------- the request


def _texts_or_ids(value: Any) -> list[str | list[int]]:
    """`input` as a list of strings and token-id lists, its type checked (not its size)."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise RequestError("input: must be a non-empty string, array of strings, array of token ids or array of "
                           "token-id arrays", "input")
    if all(_is_id(v) for v in value):
        return [list(value)]
    if all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value):
        return list(value)
    raise RequestError("input: an array must hold only strings, only token ids or only token-id arrays", "input")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _options(body: Mapping[str, Any]) -> tuple[str, str, bool]:
    """(pooling, encoding_format, normalize), each checked."""
    if body.get("dimensions") is not None:
        raise RequestError("dimensions: this model does not support choosing the embedding's dimensions "
                           "(it is not trained for truncated vectors)", "dimensions")
    encoding = body.get("encoding_format", "float")
    if encoding not in ENCODINGS:
        raise RequestError(f"encoding_format: must be one of {', '.join(ENCODINGS)}, got {encoding!r:.40}",
                           "encoding_format")
    pooling = body.get("pooling", DEFAULT_POOLING)
    if pooling not in POOLINGS:
        raise RequestError(f"pooling: must be one of {', '.join(POOLINGS)}, got {pooling!r:.40}", "pooling")
    normalize = body.get("normalize", True)
    if not isinstance(normalize, bool):
        raise RequestError("normalize: must be a boolean", "normalize")
    for key in ("model", "user"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise RequestError(f"{key}: must be a string", key)
    return pooling, encoding, normalize


def _token_ids(ctx: ServerContext, i: int, item: str | list[int]) -> list[int]:
    """One input's token ids, checked against the vocabulary and the context."""
    where, limit = f"input[{i}]", ctx.engine.max_context
    if isinstance(item, str):
        most = ctx.tokenizer.max_token_chars
        if most is not None and len(item) > limit * most:
            raise RequestError(f"{where}: has at least {len(item) // most} tokens but this model's maximum "
                               f"context length is {limit} tokens", "input", code="context_length_exceeded")
        try:
            ids = ctx.tokenizer.encode(item)
        except (TypeError, ValueError) as err:
            raise RequestError(f"{where}: cannot be tokenized: {err}", "input") from None
    else:
        vocab = ctx.tokenizer.vocab_size
        if not all(_is_id(t) and 0 <= t < vocab for t in item):
            raise RequestError(f"{where}: token ids must be integers in [0, {vocab})", "input")
        ids = item
    if not ids:
        raise RequestError(f"{where}: is empty (an embedding needs at least one token)", "input")
    if len(ids) > limit:
        raise RequestError(f"{where}: has {len(ids)} tokens but this model's maximum context length is {limit} "
                           "tokens", "input", code="context_length_exceeded")
    return list(ids)


def parse_embeddings(ctx: ServerContext, raw: bytes, request_id: str) -> tuple[list[GenRequest], str, bool]:
    """The body as the engine's requests (one per input), the encoding and whether to normalise."""
    body = parse_body(raw)
    if "input" not in body:
        raise RequestError("input: is required", "input")
    pooling, encoding, normalize = _options(body)
    items = _texts_or_ids(body["input"])
    if len(items) > MAX_INPUTS:
        raise RequestError(f"input: {len(items)} inputs; at most {MAX_INPUTS} in one request", "input")
    requests = [GenRequest(f"{request_id}-{i}", tuple(_token_ids(ctx, i, item)), max_tokens=1, pooling=pooling)
                for i, item in enumerate(items)]
    return requests, encoding, normalize


# ---------------------------------------------------------------- the answer


def _vector(vector: np.ndarray, normalize: bool, encoding: str) -> list[float] | str:
    vector = np.asarray(vector, np.float32)
    if normalize:   # L2, as llama.cpp's common_embd_normalize(.., 2): a zero vector stays zero
        norm = float(np.sqrt(np.sum(vector.astype(np.float64) ** 2)))
        vector = (vector / norm if norm > 0 else vector).astype(np.float32)
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def assemble(ctx: ServerContext, requests: list[GenRequest], vectors: list[np.ndarray], encoding: str,
             normalize: bool) -> bytes:
    data = [{"object": "embedding", "index": i, "embedding": _vector(v, normalize, encoding)}
            for i, v in enumerate(vectors)]
    tokens = sum(len(r.prompt_ids) for r in requests)
    body = {"object": "list", "data": data, "model": ctx.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return json.dumps(body, separators=(",", ":")).encode()


async def _one(ctx: ServerContext, request: GenRequest, slots: asyncio.Semaphore) -> np.ndarray:
    """One input through the pipeline: its pooled vector (closing the events cancels it)."""
    async with slots:
        events = ctx.engine.generate(request)
        try:
            async for event in events:
                if event.embedding is not None:
                    return np.asarray(event.embedding, np.float32)
        finally:
            await events.aclose()
    raise EngineError(f"the pipeline ended {request.request_id} without its embedding", 500, "no_embedding")


async def _all(ctx: ServerContext, requests: list[GenRequest]) -> list[np.ndarray]:
    """Every input's vector; the first failure cancels the others."""
    slots = asyncio.Semaphore(IN_FLIGHT)
    tasks = [asyncio.ensure_future(_one(ctx, r, slots)) for r in requests]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _embeddings(ctx: ServerContext, request: Request) -> Response:
    raw = await read_body(request, ctx.max_body_bytes)
    requests, encoding, normalize = await ctx.work.run(parse_embeddings, ctx, raw, request.state.request_id)
    ctx.require_ready()
    try:
        vectors = await unless_disconnected(request, _all(ctx, requests))
    except ClientDisconnected:
        return client_gone(ctx)
    body = await ctx.work.run(assemble, ctx, requests, vectors, encoding, normalize)
    return Response(body, media_type="application/json")

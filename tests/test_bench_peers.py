"""bench peers' client (skippy_zmq/devtools/bench/peers_client.py), the same code for both engines, against our real
server (the session's shared pipeline)."""

from __future__ import annotations

import pytest

from skippy_zmq.devtools.bench.peers_client import concurrent, single_stream, stream_completion

pytestmark = pytest.mark.slow


def test_the_client_times_every_token_of_a_greedy_stream(shared_pipelines, model_dir):
    from skippy_zmq.text.tokenizer import TextTokenizer

    base = shared_pipelines(2).url + "/v1"
    ids = TextTokenizer.load(model_dir).encode("The capital of France is", add_bos=False)
    got = stream_completion(base, ids, 12, {"speculative": False})
    assert got.error is None and got.tokens == 12 and len(got.arrivals) == 12     # ignore_eos: all 12
    assert got.start < got.first <= got.end and got.decode_tok_s > 0 and got.text
    again = single_stream(base, [ids, ids], 12, {"speculative": False})
    assert again["texts"] == [got.text, got.text] and again["tokens"] == [12, 12]   # greedy: the same text
    # without speculation: an accepted draft window's tokens reach the client together (gaps of 0 ms),
    # which made the p50 below 0.0 in a cold run where the drafter's windows were accepted
    both = concurrent(base, [ids, ids[1:]], 6, {"speculative": False})
    assert both["streams"] == 2 and both["agg_tok_s"] > 0 and both["itl_p99_ms"] >= both["itl_p50_ms"] > 0
    bad = stream_completion(base, [], 4)
    assert bad.error and bad.error.startswith("HTTP 400")

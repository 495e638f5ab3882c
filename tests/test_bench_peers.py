"""bench peers' client (skippy_zmq/bench/peers.py), the same code for both engines, against our real
server; and, where `make peers` has built llama-server here, the whole quick run beside it."""

from __future__ import annotations

import argparse
import json

import pytest

from skippy_zmq.bench import llama_build
from skippy_zmq.bench.peers import concurrent, single_stream, stream_completion

pytestmark = pytest.mark.slow


def test_the_client_times_every_token_of_a_greedy_stream(shared_pipelines, model_dir):
    from skippy_zmq.model.tokenizer import TextTokenizer

    base = shared_pipelines(2).url + "/v1"
    ids = TextTokenizer.load(model_dir).encode("The capital of France is", add_bos=False)
    got = stream_completion(base, ids, 12, {"speculative": False})
    assert got.error is None and got.tokens == 12 and len(got.arrivals) == 12     # ignore_eos: all 12
    assert got.start < got.first <= got.end and got.decode_tok_s > 0 and got.text
    again = single_stream(base, [ids, ids], 12, {"speculative": False})
    assert again["texts"] == [got.text, got.text] and again["tokens"] == [12, 12]   # greedy: the same text
    both = concurrent(base, [ids, ids[1:]], 6)
    assert both["streams"] == 2 and both["agg_tok_s"] > 0 and both["itl_p99_ms"] >= both["itl_p50_ms"] > 0
    bad = stream_completion(base, [], 4)
    assert bad.error and bad.error.startswith("HTTP 400")


@pytest.mark.skipif(llama_build.built() is None, reason="llama-server not built here (make peers)")
def test_bench_peers_quick_beside_llama_server(tmp_path, model_dir):
    from skippy_zmq.bench.peers import bench_peers

    args = argparse.Namespace(suite="peers", model=str(model_dir), out=str(tmp_path), quick=True, repeats=2,
                              prompt_tokens=64, new_tokens=16, stages=(1,), peer_models="smollm2", build=False)
    tables: list[str] = []
    result = bench_peers(args, tables)
    engines = [r["engine"] for r in result["single"]]
    assert engines == ["skippy_zmq q4, 1 stage", "llama-server", "ratio ours ÷ llama.cpp"]
    assert all(r["decode_tok_s"] > 0 for r in result["single"])
    spec = result["speculation"]
    assert {r["speculation"] for r in spec if r["engine"] == "llama-server"} == set(__import__(
        "skippy_zmq.bench.peers", fromlist=["SPEC_TYPES"]).SPEC_TYPES)
    ours = [r for r in spec if r["engine"].startswith("skippy_zmq")]
    assert all(r["greedy_same"] == "2/2" for r in ours), ours        # speculation never changes greedy text
    assert [r["streams"] for r in result["concurrency"]] == [1, 4, 1, 4]
    saved = json.loads((tmp_path / "peers.json").read_text())
    assert saved["llama_cpp"]["decode_tok_s"] > 0 and (tmp_path / "peers.md").read_text().count("|") > 20

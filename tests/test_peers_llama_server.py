"""The whole quick `bench peers` beside llama-server, where `make peers` has built it here (CI does
not: it skips). Its own module, so it runs beside the shared pipelines' unit, not after it."""

from __future__ import annotations

import argparse
import json

import pytest

from skippy_zmq.devtools.bench import llama_build, peers_engines
from skippy_zmq.devtools.bench.peers import SPEC_TYPES, bench_peers
from skippy_zmq.devtools.bench.recipes import file_types

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def one_llama_thread(monkeypatch):
    """llama.cpp on 1 thread here: these tests prove the bench's paths and rows, not llama.cpp's speed, and
    its 2 threads meet at a spinning barrier that a shared, loaded 2-core machine (the suite's other
    worker) stalls: 16 tokens ran at 4-11 tok/s on 2 threads and 22-47 on 1, interleaved, load 6-7."""
    monkeypatch.setattr(peers_engines, "THREADS", 1)


@pytest.mark.skipif(llama_build.built() is None, reason="llama-server not built here (make peers)")
def test_bench_peers_quick_beside_llama_server(tmp_path, model_dir):
    """Every table's row kinds once, narrower than --quick: one prompt per single-stream engine and per
    speculation workload, one llama-server n-gram type (the others take the same path) and one stream
    count (2: batched on both engines); llama-server's starts and generations were its slow part."""
    args = argparse.Namespace(suite="peers", model=str(model_dir), out=str(tmp_path), quick=True, repeats=1,
                              prompt_tokens=64, new_tokens=16, stages=(1,), peer_models="smollm2", build=False,
                              spec_prompts=1, spec_types=SPEC_TYPES[:1], stream_counts=(2,))
    tables: list[str] = []
    result = bench_peers(args, tables)
    engines = [r["engine"] for r in result["single"]]
    assert engines == ["skippy_zmq q4, 1 stage", "llama-server", "ratio ours ÷ llama.cpp"]
    assert all(r["decode_tok_s"] > 0 for r in result["single"])
    spec = result["speculation"]
    assert {(r["speculation"], r["workload"]) for r in spec if r["engine"] == "llama-server"} == {
        (SPEC_TYPES[0], "copy"), (SPEC_TYPES[0], "chat")}
    ours = [r for r in spec if r["engine"].startswith("skippy_zmq")]
    assert [r["workload"] for r in ours] == ["copy", "chat"]
    assert all(r["greedy_same"] == "1/1" for r in ours), ours        # speculation never changes greedy text
    assert [(r["engine"], r["streams"]) for r in result["concurrency"]] == [
        ("skippy_zmq q4, 1 stage(s)", 2), ("llama-server -np 2", 2)]
    assert all(r["agg_tok_s"] > 0 for r in result["concurrency"])
    saved = json.loads((tmp_path / "peers.json").read_text())
    assert saved["llama_cpp"]["decode_tok_s"] > 0 and (tmp_path / "peers.md").read_text().count("|") > 20


@pytest.mark.skipif(llama_build.built() is None, reason="llama-server not built here (make peers)")
def test_bench_peers_runs_smollm2_q4_k_m_beside_llama_server_on_the_same_file(tmp_path, model_dir):
    """`--peer-models smollm2:Q4_K_M`: SmolLM2's GGUF requantised by llama-quantize (vocabulary kept), our
    gguf checkpoint of it running the file's own types, llama-server serving the very same file, taking
    turns prompt by prompt; the files are made once, beside a copy of the model's GGUF."""
    (tmp_path / "m").mkdir()
    gguf = model_dir.parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.is_file():
        pytest.skip(f"needs {gguf}")
    (tmp_path / "m" / gguf.name).symlink_to(gguf)
    (tmp_path / "m" / model_dir.name).symlink_to(model_dir)
    args = argparse.Namespace(suite="peers", model=str(tmp_path / "m" / model_dir.name), out=str(tmp_path),
                              quick=True, repeats=1, prompt_tokens=64, new_tokens=16, stages=(1,),
                              peer_models="smollm2:Q4_K_M", build=False)
    result = bench_peers(args, [])
    assert [r["engine"] for r in result["single"]] == ["skippy_zmq gguf, 1 stage", "llama-server",
                                                      "ratio ours ÷ llama.cpp"]
    assert {r["model"] for r in result["single"]} == {"smollm2:Q4_K_M"}
    assert all(r["decode_tok_s"] > 0 for r in result["single"])
    made = tmp_path / "m" / "recipes" / "SmolLM2-135M-Instruct.Q4_1-Q4_K_M.gguf"
    assert {"Q4_K", "Q6_K", "Q5_0"} <= set(file_types(made))
    assert json.loads((made.with_suffix("") / "source.json").read_text())["requantised"] == {}

"""The whole quick `bench peers` beside llama-server, where `make peers` has built it here (CI does
not: it skips). Its own module, so it runs beside the shared pipelines' unit, not after it."""

from __future__ import annotations

import argparse
import json

import pytest

from skippy_zmq.devtools.bench import llama_build
from skippy_zmq.devtools.bench.peers import SPEC_TYPES, bench_peers
from skippy_zmq.devtools.bench.recipes import file_types

pytestmark = pytest.mark.slow


@pytest.mark.skipif(llama_build.built() is None, reason="llama-server not built here (make peers)")
def test_bench_peers_quick_beside_llama_server(tmp_path, model_dir):
    args = argparse.Namespace(suite="peers", model=str(model_dir), out=str(tmp_path), quick=True, repeats=2,
                              prompt_tokens=64, new_tokens=16, stages=(1,), peer_models="smollm2", build=False)
    tables: list[str] = []
    result = bench_peers(args, tables)
    engines = [r["engine"] for r in result["single"]]
    assert engines == ["skippy_zmq q4, 1 stage", "llama-server", "ratio ours ÷ llama.cpp"]
    assert all(r["decode_tok_s"] > 0 for r in result["single"])
    spec = result["speculation"]
    assert {r["speculation"] for r in spec if r["engine"] == "llama-server"} == set(SPEC_TYPES[:2])
    ours = [r for r in spec if r["engine"].startswith("skippy_zmq")]
    assert all(r["greedy_same"] == "2/2" for r in ours), ours        # speculation never changes greedy text
    assert [r["streams"] for r in result["concurrency"]] == [1, 4, 1, 4]
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
                              quick=True, repeats=2, prompt_tokens=64, new_tokens=16, stages=(1,),
                              peer_models="smollm2:Q4_K_M", build=False)
    result = bench_peers(args, [])
    assert [r["engine"] for r in result["single"]] == ["skippy_zmq gguf, 1 stage", "llama-server",
                                                      "ratio ours ÷ llama.cpp"]
    assert {r["model"] for r in result["single"]} == {"smollm2:Q4_K_M"}
    assert all(r["decode_tok_s"] > 0 for r in result["single"])
    made = tmp_path / "m" / "recipes" / "SmolLM2-135M-Instruct.Q4_1-Q4_K_M.gguf"
    assert {"Q4_K", "Q6_K", "Q5_0"} <= set(file_types(made))
    assert json.loads((made.with_suffix("") / "source.json").read_text())["requantised"] == {}
